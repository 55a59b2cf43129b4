"""Placement policies: one interface for the decode loop and the trace-driven simulator.

A policy looks at an `Observation` of one window boundary (per layer, per block: where it lives,
whether it is written, when it was last read, its decayed read statistics, and optionally a
forecast of the next steps' reads) and returns the target set of blocks that should live in HBM.
`jaxkv.cache.plan_moves` turns the difference between the current placement and the target into a
bounded list of migrations. Policies are frozen dataclasses (hashable, usable as static jit
arguments); any state they keep between windows is a pytree returned by `init` and threaded
through `plan`. The environment a plan is priced in (hardware profile, block and weight bytes,
demotion cost) is one static `jaxkv.cost.CostModel` given to `plan`, never a policy field.

The online policies live here: `Static` (write order, never moves), `Reactive` (LRU) and
`Anneal`, simulated annealing over block placements composed from parts in optax's manner:
  a forecaster   (`jaxkv.placement.forecasts`: EMA, Reuse, Now; the oracles in `jaxkv.sim.oracles`),
  pricing terms  (`jaxkv.placement.pricing`: LinkReserve, Unforeseen, Ride, Spread), each adding to
                 the annealing problem,
  terminal values (the oracles' Belady tail, overflow and LP-dual values: `jaxkv.sim.oracles`),
  controllers    (`jaxkv.placement.pricing`: AdaptiveWindow, Compensate),
  the annealer   (`jaxkv.placement.anneal`), and optionally a per-step rule (`Follow`).
Named presets ("anneal+reuse+follow", ...) are resolved in one place: `jaxkv.placement.presets`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, static_field
from jaxkv.config import PROMPT_QUERIES, STEADY_QUERIES, AnnealConfig, check_number
from jaxkv.cost import CostModel
from jaxkv.placement import anneal
from jaxkv.placement import statistics as imp
from jaxkv.placement.forecasts import EMA, Forecaster, Reuse, require_forecast
from jaxkv.placement.pricing import AdaptiveWindow, Compensate, LinkReserve, PlanContext, Pricing

NEVER = 1 << 30  # steps until the next plan of a policy that never plans


@pytree_dataclass
class Observation:
    """What a policy sees at a window boundary. N = blocks per layer (batch x logical blocks)."""

    in_hbm: jax.Array  # [layers, N] bool: block currently in the HBM pool
    valid: jax.Array  # [layers, N] bool: block sealed (written and placeable)
    last_read: jax.Array  # [layers, N] int32: step of the last read, -1 if never
    read_ema: jax.Array  # [layers, N] float32: decayed read frequency
    mass_ema: jax.Array  # [layers, N] float32: decayed attention mass
    step: jax.Array  # [] int32: current decode step
    forecast: jax.Array | None = None  # [W, layers, N] float32: P(block read at step t), if known
    window_reads: jax.Array | None = None  # [layers, N] float32: reads since the last plan, if kept
    # [W, layers, N] float32: the future attention mass, if known
    forecast_mass: jax.Array | None = None
    # [layers, K] float32: the reuse law's counts (`importance.Stats.since_seen / since_read`)
    since_seen: jax.Array | None = None
    since_read: jax.Array | None = None
    streak: jax.Array | None = None  # [layers, N] int32: run lengths (`importance.Stats.streak`)
    # [W, layers, N] float32 seconds: what leaving each block on host after each of the next
    # steps costs later, priced by the LP's dual (`jaxkv.sim.lp.dual.dual_values`), if known
    value_to_go: jax.Array | None = None
    capacity: int = static_field(default=0)  # HBM pool slots per layer

    @classmethod
    def of(cls, in_hbm, valid, stats, step, capacity: int, **future) -> Observation:
        """The one constructor (`observation.observe`, `jaxkv.sim.loop`, `.replay`, `.timing`):
        masks, read statistics, and the known future (forecast, forecast_mass, value_to_go)."""
        return cls(
            in_hbm=in_hbm,
            valid=valid,
            last_read=stats.last_read,
            read_ema=stats.read_ema,
            mass_ema=stats.mass_ema,
            step=step,
            window_reads=stats.window_reads,
            since_seen=stats.since_seen,
            since_read=stats.since_read,
            streak=stats.streak,
            capacity=capacity,
            **future,
        )


class Policy(Protocol):
    """What the decode loop and the simulator use of a policy.

    name: its name (a preset's, `jaxkv.placement.presets`).
    horizon: rows of obs.forecast (future reads) a plan reads; 1 when it needs none.
    needs_forecast: obs.forecast must be given (an oracle, or a plan that knows its step).
    needs_values: obs.value_to_go must be given (the LP dual's values: `jaxkv.sim.lp.bound`).
    follow: a per-step rule (`Follow`) the caller applies between plans, or None.
    budget: blocks a plan (or a follow step) may move per layer; None = unbounded.
    adapts_window: the policy sets its own steps between plans (`next_window` varies).
    plans (optional, True when absent): False when `plan` keeps the placement as it is
      (static, lrfu). prompt_prior, lookahead (optional, False when absent): `Lrfu`'s.
    """

    name: str
    horizon: int
    needs_forecast: bool
    needs_values: bool
    follow: Follow | None
    budget: int | None
    adapts_window: bool

    def init(self, num_layers: int, num_blocks: int) -> Any:
        """The policy's state before the first plan (a pytree)."""
        ...

    def plan(self, state: Any, obs: Observation, env: CostModel) -> tuple[Any, jax.Array]:
        """Returns (new state, target [layers, N] bool) with target <= valid, sum <= capacity."""
        ...

    def next_window(self, state: Any) -> jax.Array:
        """[] int32: steps from this plan to the next."""
        ...


class PolicyBase:
    """The defaults of the `Policy` attributes, for policies without state or forecast."""

    horizon = 1
    needs_forecast = False
    needs_values = False
    follow = None
    budget = None
    adapts_window = False
    plans = True  # False: `plan` keeps the placement as it is (no target, nothing to time)
    prompt_prior = False  # True: start from the prompt's prior (`jaxkv.decode.prompt`)
    lookahead = False  # True: layer 0's next reads join its value (`Lrfu.lookahead`)

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def next_window(self, state) -> jax.Array:
        return jnp.int32(getattr(self, "window", 1))


def plans(policy) -> bool:
    """Whether `policy`'s plan can change the placement (`Policy.plans`; True when absent)."""
    return getattr(policy, "plans", True)


def looks_ahead(policy) -> bool:
    """Whether `policy`'s follow rule values layer 0's next reads (`Lrfu.lookahead`)."""
    return bool(getattr(policy, "lookahead", False)) and policy.follow is not None


def top_capacity(score: jax.Array, valid: jax.Array, capacity: int) -> jax.Array:
    """Marks the `capacity` highest-scoring valid blocks of each layer (vectorized, no loop).

    Args:
      score: [layers, N] float; ties are broken by lower index.
      valid: [layers, N] bool.
      capacity: blocks per layer to select.
    Returns:
      [layers, N] bool.
    """
    n = score.shape[-1]
    k = min(capacity, n)
    if k == 0:
        return jnp.zeros_like(valid)
    s = jnp.where(valid, score.astype(jnp.float32), -jnp.inf)
    _, idx = jax.lax.top_k(s, k)  # [layers, k]
    picked = jnp.zeros(score.shape, bool).at[jnp.arange(score.shape[0])[:, None], idx].set(True)
    return picked & valid


FOLLOW_ADMITS = ("read", "ranked", "target", "value")


def follow_value(read_ema, reads, decay: float = imp.READ_DECAY):
    """[rows, N] float32: each block's value to the `admit="value"` rule, its decayed read
    frequency with this step's reads folded in: `Stats.read_ema` one step on, decay x read_ema
    + (1 - decay) x read (the order of LRFU's combined recency and frequency, 2^-lambda =
    decay). Mixing in the window plan's expected reads was measured and gains nothing
    (bench/notebook/2026-12-06-lrfu.md)."""
    return imp.ema_after(read_ema, reads, decay)


def follow_moves(
    in_hbm,
    valid,
    reads,
    target,
    priority,
    room,
    budget: int,
    admit: str = "read",
    value=None,
):
    """The per-step rule of a `follow` policy (`Follow`), vectorized over rows (layers).

    Candidates are blocks this step reads from host. Under "read", "ranked" and "target" the
    victims are resident blocks this step does not read, and both are ranked by (in the
    window's target, `priority`): candidates best first, victims worst first (blocks outside
    the target go first, the least expected first). Under "value" both are ranked by `value`
    alone (`follow_value`: the read frequency after this step) and every resident block is a
    victim, read at this step or not. The i-th candidate is promoted into a free slot while
    `room` lasts, beyond it by displacing the next victim, at most `budget` per row; the
    promoted blocks are a leading run of the candidates. `admit` says which candidates may be
    promoted:
      "read": every candidate (promote on read, as LRU does; the plan chooses the victims);
      "ranked": a candidate displaces a victim only when it ranks higher (its read counts as
        one expected read more);
      "target": only target blocks, and only over victims outside the target (the window's
        target followed literally);
      "value": a candidate displaces a victim only when its value is strictly higher (no plan
        needed: the online read frequency is the forecast).

    Args:
      in_hbm, valid, reads, target: [rows, N] bool: resident (sealed, in HBM), placeable, read
        at this step, in the window's target.
      priority: [rows, N] float32: expected reads over the window (`AnnealPolicyState.priority`).
      room: [rows] int: free HBM slots.
      budget: static bound on the promotions (and so demotions) per row.
      admit: "read" | "ranked" | "target" | "value".
      value: [rows, N] float32, each block's value (`follow_value`); "value" only.
    Returns:
      (promote, num_promote, demote, num_demote): [rows, K] int32 block indices, the first
      num_* [rows] int32 of each valid (K = min(budget, N)); num_demote = max(num_promote -
      room, 0).
    """
    if admit not in FOLLOW_ADMITS:
        raise ValueError(f"follow_moves admit must be one of {FOLLOW_ADMITS}, got {admit!r}")
    if (admit == "value") != (value is not None):
        raise ValueError(
            f"follow_moves admit={admit!r} with value {'None' if value is None else 'given'}: "
            'expected a value array exactly when admit="value"'
        )
    rows, n = in_hbm.shape
    k = max(0, min(int(budget), n))
    i32 = jnp.int32
    if k == 0:
        z = jnp.zeros((rows, 0), i32)
        zn = jnp.zeros((rows,), i32)
        return z, zn, z, zn
    cand = reads & valid & ~in_hbm
    victim = in_hbm & valid
    if admit == "value":
        rank = c_rank_of = value.astype(jnp.float32)
    else:
        big = 1e6  # target membership outranks any priority (expected reads <= window steps)
        rank = jnp.where(target, big, 0.0) + priority.astype(jnp.float32)
        c_rank_of = rank + 1.0
        victim &= ~reads
    if admit == "target":
        cand &= target
        victim &= ~target
    c_rank, pro = jax.lax.top_k(jnp.where(cand, c_rank_of, -jnp.inf), k)  # best first
    v_neg, dem = jax.lax.top_k(jnp.where(victim, -rank, -jnp.inf), k)  # worst first
    room = jnp.maximum(jnp.asarray(room, i32), 0)
    j = jnp.arange(k)[None] - room[:, None]  # the victim the i-th candidate would displace
    v_rank = -jnp.take_along_axis(v_neg, jnp.clip(j, 0, k - 1), axis=1)
    has_victim = (j < k) & jnp.isfinite(v_rank)
    better = (c_rank > v_rank) if admit in ("ranked", "value") else True
    ok = jnp.isfinite(c_rank) & ((j < 0) | (has_victim & better))
    n_p = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)  # the leading run that qualifies
    n_d = jnp.maximum(n_p - room, 0)
    return pro.astype(i32), n_p.astype(i32), dem.astype(i32), n_d.astype(i32)


def moves_mask(idx, count, n: int):
    """[rows, n] bool of the first `count` [rows] entries of the index lists `idx` [rows, K]."""
    rows, k = idx.shape
    ok = jnp.arange(k)[None] < count[:, None]
    r = jnp.arange(rows)[:, None]
    return jnp.zeros((rows, n), bool).at[r, jnp.where(ok, idx, n)].set(True, mode="drop")


@dataclasses.dataclass(frozen=True)
class Static(PolicyBase):
    """Fill HBM in write order, spill the rest to host, never migrate."""

    name: str = "static"
    plans = False

    def plan(self, state, obs: Observation, env: CostModel | None = None):
        return state, obs.in_hbm & obs.valid

    def next_window(self, state) -> jax.Array:
        return jnp.int32(NEVER)


@dataclasses.dataclass(frozen=True)
class Reactive(PolicyBase):
    """LRU: blocks read most recently belong in HBM; promote on read, evict least recently used.

    Ties (same last-read step) keep blocks where they are, so nothing moves without a reason.
    """

    name: str = "lru"

    def plan(self, state, obs: Observation, env: CostModel | None = None):
        score = obs.last_read.astype(jnp.float32) + 0.5 * obs.in_hbm
        return state, top_capacity(score, obs.valid, obs.capacity)


FOLLOW_ADMITS_DEFAULT = "ranked"  # against "read" and "target", measured: bench/RESULTS.md


@dataclasses.dataclass(frozen=True)
class Follow:
    """The plan is a target, not a migration: every W steps the annealer plans all layers
    together, between steps, and the caller keeps its target (state.target) and each block's
    expected reads over the window (state.priority); at every step, per layer, `follow_moves`
    promotes the host blocks the step reads that `admit` takes (the read carries the block over
    the link: the HBM write is the only extra cost) and demotes, only to make room, the resident
    blocks the target leaves out, least expected first. What runs on a layer's critical path is
    that vector rule alone. With admit="value" the rule reads no plan (`Lrfu`, the live policy,
    is that rule with no plan; an anneal policy with it still plans, and is charged for, a
    target the rule ignores)."""

    admit: str = FOLLOW_ADMITS_DEFAULT

    def __post_init__(self):
        if self.admit not in FOLLOW_ADMITS:
            raise ValueError(f"Follow admit must be one of {FOLLOW_ADMITS}, got {self.admit!r}")

    def inputs(self, pstate, read_ema, reads, decay: float, layer=None, steady=None, ahead=None):
        """(target, priority, value) for `follow_moves` ([rows, N] each, or None): the plan's
        target and expected reads (`pstate`'s, [layers, N]; row `layer` as [1, N] if given), or
        under admit="value" the values alone: `follow_value`, or a row's steady read frequency
        where `steady` (`jaxkv.placement.statistics.steady_choice`'s (rows, [rows] bool)) picks
        it, plus 1 on `ahead` ([N] bool: layer 0's next reads, row 0's; `Lrfu.lookahead`)."""
        if self.admit == "value":
            value = follow_value(read_ema, reads, decay)
            if steady is not None:
                rows, pick = steady
                value = jnp.where(pick[:, None], rows, value)
            if ahead is not None:
                value = value.at[0].add(ahead.astype(value.dtype))
            return None, None, value
        if layer is None:
            return pstate.target, pstate.priority, None
        return pstate.target[layer][None], pstate.priority[layer][None], None


@dataclasses.dataclass(frozen=True)
class Lrfu(PolicyBase):
    """LRFU inside the decode step, the live policy: no plan, no forecast beyond the blocks'
    decayed read frequency. At every step, per layer, `follow_moves` with admit="value"
    promotes a host block the step reads (from the copy the read fetched: an HBM write, no
    second link read) into a free slot, or over the least valuable resident block, read at
    this step or not, when its value (`follow_value`: `Stats.read_ema` with the step's reads
    folded in) is strictly higher. Under exact attention every block is read every step, all
    values tie and nothing moves. With `prompt_prior` (the default) the read frequency starts
    at the prompt's prior and the sealed blocks fill HBM in its order at prefill: the share of
    the prompt's last queries that would read each block (`jaxkv.decode.prompt`). Measured
    against LRU, the annealer's plans and the bounds: bench/RESULTS.md section 5.

    steady_queries: n, a multiple of `PROMPT_QUERIES` (32), or 0 (off): the adaptive
      estimator (needs `prompt_prior`; None, the default: `STEADY_QUERIES`, 128, with it, else
      0). Each layer also keeps the prior of the prompt's last n queries, held constant, and per
      step values blocks by whichever estimator's top blocks (a layer's HBM slots) held more
      of the recent reads (`jaxkv.placement.statistics.steady_choice`): a trained model's
      drifting reads keep the decayed frequency, a stationary trace's the steady one.
    lookahead: True (the default): layer 0's next reads, known once the next token is sampled
      (the model's `first_query`), add 1 to their value in layer 0's admission
      (`jaxkv.decode.follow`); a model without `first_query` decodes without."""

    name: str = "lrfu"
    follow: Follow = Follow("value")
    prompt_prior: bool = True
    steady_queries: int | None = None
    lookahead: bool = True
    plans = False

    def __post_init__(self):
        if not isinstance(self.follow, Follow) or self.follow.admit != "value":
            raise ValueError(f"Lrfu follow must be Follow('value'), got {self.follow!r}")
        for name in ("prompt_prior", "lookahead"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Lrfu {name} must be a bool, got {getattr(self, name)!r}")
        if self.steady_queries is None:
            object.__setattr__(self, "steady_queries", STEADY_QUERIES if self.prompt_prior else 0)
        n = self.steady_queries
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n % PROMPT_QUERIES:
            raise ValueError(
                f"Lrfu steady_queries={n!r}: expected 0 (off) or a positive multiple of "
                f"{PROMPT_QUERIES} (the prompt's last queries whose prior is held steady)"
            )
        if n and not self.prompt_prior:
            raise ValueError(
                f"Lrfu steady_queries={n} needs prompt_prior=True (its steady estimator is the "
                "prompt's prior)"
            )

    def plan(self, state, obs: Observation, env: CostModel | None = None):
        return state, obs.in_hbm & obs.valid

    def next_window(self, state) -> jax.Array:
        return jnp.int32(NEVER)


@pytree_dataclass
class AnnealPolicyState:
    key: jax.Array  # [2] uint32: PRNG key data
    window: jax.Array  # [] int32: W for the coming window
    prev_hit: jax.Array  # [] float32: HBM hit rate of the last window
    prev_expected: jax.Array  # [layers, N] float32: forecast reads per block until this plan
    last_promoted: jax.Array  # [layers, N] bool: blocks promoted at the last plan
    plans: jax.Array  # [] int32
    compensations: jax.Array  # [] int32: windows whose forecast error exceeded the threshold
    # the last plan's target and each block's expected reads over its window (`Follow`: what
    # the per-step rule `follow_moves` promotes and the order it demotes in)
    target: jax.Array  # [layers, N] bool
    priority: jax.Array  # [layers, N] float32
    forecast: Any = ()  # the forecaster's own state (`Forecaster.init`)
    # the last plan's annealing: start and result energies, moves made, certified layers
    metrics: anneal.AnnealMetrics | None = None


@dataclasses.dataclass(frozen=True)
class Anneal(PolicyBase):
    """Simulated annealing over block placements against a forecast of the next W steps.

    forecast: the forecaster (`jaxkv.placement.forecasts`: EMA, Reuse, Now; `jaxkv.sim.oracles`: the
      true future and the visits in progress; `jaxkv.sim.learned`).
    terms: pricing terms (`jaxkv.placement.pricing`), applied in the order of their stage.
    values: terminal values (parts with `__call__(value, obs, env, forecast, steps)`, each given
      the value so far; `jaxkv.sim.oracles`): what leaving a block out of HBM at the window's
      end costs later.
    adaptive, compensate: the controllers (`jaxkv.placement.pricing.AdaptiveWindow`, `Compensate`),
      or None.
    window: W, the steps the energy looks ahead (and, when interval = 0, between plans).
    interval: > 0 re-plans every `interval` steps over the next W (receding horizon; the
      simulator's option).
    discount: step t of the window weighs discount^t in the energy.
    hysteresis: extra demotion cost the planner charges itself (x block bytes, both sides), so
      blocks at the balance margin do not flip tier at every re-plan.
    budget: blocks moved per layer per plan (and per follow step); None = unbounded.
    config: the annealing schedule. follow: the per-step rule, or None. seed: the PRNG seed.
    """

    name: str = "anneal"
    forecast: Forecaster = EMA()
    terms: tuple = (LinkReserve(),)
    values: tuple = ()
    adaptive: AdaptiveWindow | None = None
    compensate: Compensate | None = None
    window: int = 50
    interval: int = 0
    discount: float = 1.0
    hysteresis: float = 0.0
    budget: int | None = None
    config: AnnealConfig = AnnealConfig()
    follow: Follow | None = None
    seed: int = 0

    def __post_init__(self):
        check_number("Anneal window", self.window, integer=True, low=1)
        check_number("Anneal interval", self.interval, integer=True, low=0)
        check_number("Anneal discount", self.discount, low=0.0, high=1.0, low_open=True)
        check_number("Anneal hysteresis", self.hysteresis, low=0.0)
        if self.budget is not None:
            check_number("Anneal budget", self.budget, integer=True, low=0)
        f = self.forecast
        for v in self.values:
            v.check(self)
        if self.follow is not None and not isinstance(f, (EMA, Reuse)):
            raise ValueError(
                "Anneal follow plans a target from an online forecast (EMA or Reuse) between "
                f"steps and cannot know the step's reads (Now); got forecast {f!r}"
            )
        object.__setattr__(self, "terms", tuple(sorted(self.terms, key=lambda t: t.stage)))

    @property
    def needs_forecast(self) -> bool:
        """obs.forecast is needed: the oracles' future reads, or the planned step's reads."""
        return self.forecast.needs_forecast

    @property
    def needs_values(self) -> bool:
        """obs.value_to_go is needed (a terminal value from the LP dual)."""
        return any(getattr(v, "needs_values", False) for v in self.values)

    @property
    def adapts_window(self) -> bool:
        return self.adaptive is not None

    @property
    def energy_steps(self) -> int:
        """Rows of the energy: the largest W."""
        return self.adaptive.high if self.adaptive is not None else self.window

    @property
    def horizon(self) -> int:
        """Steps the plan needs obs.forecast for: the (largest) window, then the steps the
        terminal values look past it (oracles); the current step otherwise."""
        extra = max([getattr(v, "steps", 0) for v in self.values] + [0])
        return self.energy_steps + extra if self.forecast.oracle else 1

    def init(self, num_layers: int, num_blocks: int):
        key = jax.random.key_data(jax.random.key(self.seed)).astype(jnp.uint32)
        return AnnealPolicyState(
            key=key,
            window=jnp.int32(self.window),
            prev_hit=jnp.float32(0.0),
            prev_expected=jnp.zeros((num_layers, num_blocks), jnp.float32),
            last_promoted=jnp.zeros((num_layers, num_blocks), bool),
            plans=jnp.int32(0),
            compensations=jnp.int32(0),
            target=jnp.zeros((num_layers, num_blocks), bool),
            priority=jnp.zeros((num_layers, num_blocks), jnp.float32),
            forecast=self.forecast.init(num_layers, num_blocks),
            metrics=anneal.AnnealMetrics.empty(num_layers),
        )

    def next_window(self, state: AnnealPolicyState):
        """Steps until the next plan: `interval` when set, else the current W."""
        return jnp.int32(self.interval) if self.interval > 0 else state.window

    def _forecast(self, state, obs: Observation, env: CostModel, h: int, window):
        """(forecaster state, Forecast with the steps from `window` on zeroed, compensations
        this plan (0 / 1), active steps [h])."""
        fstate, fc = self.forecast.update(state.forecast, obs, env, h)
        a, bad = fc.reads, jnp.int32(0)
        if self.compensate is not None:
            a, bad = self.compensate(a, state, obs, self.next_window(state))
        active = (jnp.arange(h) < window).astype(jnp.float32)
        return fstate, dataclasses.replace(fc, reads=a * active[:, None, None]), bad, active

    def _window(self, state, obs):
        if self.adaptive is None:
            return state.window, state.prev_hit
        return self.adaptive(state.window, state.prev_hit, obs)

    def problem(self, state, obs: Observation, env: CostModel, window=None):
        """The annealing problem of this plan and what the new state needs:
        (AnnealProblem, forecaster state, forecast [W, layers, N], compensations). `window`:
        this plan's W (default: the adaptive controller's, else the state's)."""
        h = self.energy_steps
        if window is None:
            window, _ = self._window(state, obs)
        fstate, fc, bad, active = self._forecast(state, obs, env, h, window)
        a = fc.reads
        a0 = jnp.clip(a[0], 0.0, 1.0)
        fixed = None if fc.unplaced is None else fc.unplaced * active[None]
        p = Pricing(profile=env.priced_profile, fixed_link=fixed)
        ctx = PlanContext(obs, env, self.forecast, a, active, self.next_window(state))
        for term in self.terms:
            p = term(p, ctx)
        kept = jnp.zeros_like(a0)
        if env.keep_fetched:
            kept = (imp.read_last_step(obs.last_read, obs.step) & ~obs.in_hbm).astype(jnp.float32)
        value = None
        for v in self.values:
            value = v(value, obs, env, fc, h)
        problem = anneal.AnnealProblem(
            **p.host,
            forecast=jnp.swapaxes(a, 0, 1),
            x0=obs.in_hbm & obs.valid,
            valid=obs.valid,
            fixed=jnp.full((h,), env.fixed_bytes, jnp.float32),
            weight=active * self.discount ** jnp.arange(h, dtype=jnp.float32),
            # a block promoted while this step reads it crosses the link once, as its read (a
            # host read), and is written to HBM; any other promotion is a link read + HBM write
            promote_hbm=jnp.where(kept > 0, 1.0, 1.0 - a0),
            promote_link=1.0 - kept,
            profile=p.profile,
            block_bytes=float(env.block_bytes),
            capacity=obs.capacity,
            budget=self.budget if self.budget is not None else 1 << 30,
            demote_cost=float(env.demote_cost + self.hysteresis),
            value=value,
            fixed_link=p.fixed_link,
            spread=p.spread,
        )
        return problem, fstate, a, bad

    def plan(self, state: AnnealPolicyState, obs: Observation, env: CostModel):
        if self.forecast.needs_forecast:
            require_forecast(self.name, obs)
        window, prev_hit = self._window(state, obs)
        problem, fstate, a, bad = self.problem(state, obs, env, window)
        key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
        res = anneal.run(problem, sub, self.config)
        target = res.x & obs.valid
        new_state = dataclasses.replace(state, window=window)
        # the reads expected until the next plan: what the next plan's window_reads will count
        until_next = jnp.arange(a.shape[0]) < self.next_window(new_state)
        return (
            AnnealPolicyState(
                key=jax.random.key_data(key),
                window=window,
                prev_hit=prev_hit,
                prev_expected=jnp.sum(a * until_next[:, None, None], axis=0),
                last_promoted=target & ~obs.in_hbm,
                plans=state.plans + 1,
                compensations=state.compensations + bad,
                target=target,
                priority=jnp.sum(a, axis=0) * obs.valid,
                forecast=fstate,
                metrics=res.metrics,
            ),
            target,
        )
