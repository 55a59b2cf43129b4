"""Placement policies: one interface for the decode loop and the trace-driven simulator.

A policy looks at an `Observation` of one window boundary (per layer, per block: where it lives,
whether it is written, when it was last read, its decayed read statistics, and optionally a
forecast of the next steps' reads) and returns the target set of blocks that should live in HBM.
`jaxkv.cache.plan_moves` turns the difference between the current placement and the target into a
bounded list of migrations. Policies are frozen dataclasses (hashable, usable as static jit
arguments); any state they keep between windows is a pytree returned by `init` and threaded
through `plan`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxkv import anneal
from jaxkv import importance as imp
from jaxkv._pytree import pytree_dataclass, static_field
from jaxkv.config import PROFILES, AnnealConfig, HardwareProfile, check_number


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
    # steps costs later, priced by the LP's dual (`jaxkv.sim.lp_bound.dual_values`), if known
    value_to_go: jax.Array | None = None
    capacity: int = static_field(default=0)  # HBM pool slots per layer


class Policy(Protocol):
    name: str

    def init(self, num_layers: int, num_blocks: int) -> Any: ...

    def plan(self, state: Any, obs: Observation) -> tuple[Any, jax.Array]:
        """Returns (new state, target [layers, N] bool) with target <= valid, sum <= capacity."""
        ...


def adapt_window(window, hit, prev_hit, min_window: int, max_window: int, step: int):
    """The seed article's adaptive window: a falling HBM hit rate plans more often (W - step),
    a steady or rising one less often (W + step), within [min_window, max_window].

    Args:
      window: [] int32 current W; hit, prev_hit: [] float32 hit rates of the last two windows.
    Returns:
      [] int32 the next W.
    """
    delta = jnp.where(hit < prev_hit, -step, step)
    return jnp.clip(window + delta, min_window, max_window).astype(jnp.int32)


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


FOLLOW_ADMITS = ("read", "ranked", "target")


def follow_moves(in_hbm, valid, reads, target, priority, room, budget: int, admit: str = "read"):
    """The per-step rule of a `follow` policy (`Anneal.follow`), vectorized over rows (layers).

    Candidates are blocks this step reads from host, victims resident blocks it does not read.
    Both are ranked by (in the window's target, `priority`): candidates best first, victims
    worst first (blocks outside the target go first, the least expected first). The i-th
    candidate is promoted into a free slot while `room` lasts, beyond it by displacing the next
    victim, at most `budget` per row; the promoted blocks are a leading run of the candidates.
    `admit` says which candidates may be promoted:
      "read": every candidate (promote on read, as LRU does; the plan chooses the victims);
      "ranked": a candidate displaces a victim only when it ranks higher (its read counts as
        one expected read more);
      "target": only target blocks, and only over victims outside the target (the window's
        target followed literally).

    Args:
      in_hbm, valid, reads, target: [rows, N] bool: resident (sealed, in HBM), placeable, read
        at this step, in the window's target.
      priority: [rows, N] float32: expected reads over the window (`AnnealPolicyState.priority`).
      room: [rows] int: free HBM slots.
      budget: static bound on the promotions (and so demotions) per row.
      admit: "read" | "ranked" | "target".
    Returns:
      (promote, num_promote, demote, num_demote): [rows, K] int32 block indices, the first
      num_* [rows] int32 of each valid (K = min(budget, N)); num_demote = max(num_promote -
      room, 0).
    """
    if admit not in FOLLOW_ADMITS:
        raise ValueError(f"follow_moves admit must be one of {FOLLOW_ADMITS}, got {admit!r}")
    rows, n = in_hbm.shape
    k = max(0, min(int(budget), n))
    i32 = jnp.int32
    if k == 0:
        z = jnp.zeros((rows, 0), i32)
        zn = jnp.zeros((rows,), i32)
        return z, zn, z, zn
    big = 1e6  # target membership outranks any priority (expected reads <= window steps)
    rank = jnp.where(target, big, 0.0) + priority.astype(jnp.float32)
    cand = reads & valid & ~in_hbm
    if admit == "target":
        cand &= target
    victim = in_hbm & valid & ~reads
    if admit == "target":
        victim &= ~target
    c_rank, pro = jax.lax.top_k(jnp.where(cand, rank + 1.0, -jnp.inf), k)  # best first
    v_neg, dem = jax.lax.top_k(jnp.where(victim, -rank, -jnp.inf), k)  # worst first
    room = jnp.maximum(jnp.asarray(room, i32), 0)
    j = jnp.arange(k)[None] - room[:, None]  # the victim the i-th candidate would displace
    v_rank = -jnp.take_along_axis(v_neg, jnp.clip(j, 0, k - 1), axis=1)
    has_victim = (j < k) & jnp.isfinite(v_rank)
    better = (c_rank > v_rank) if admit == "ranked" else True
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
class Static:
    """Fill HBM in write order, spill the rest to host, never migrate."""

    name: str = "static"

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def plan(self, state, obs: Observation):
        return state, obs.in_hbm & obs.valid


@dataclasses.dataclass(frozen=True)
class Reactive:
    """LRU: blocks read most recently belong in HBM; promote on read, evict least recently used.

    Ties (same last-read step) keep blocks where they are, so nothing moves without a reason.
    """

    name: str = "lru"

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def plan(self, state, obs: Observation):
        score = obs.last_read.astype(jnp.float32) + 0.5 * obs.in_hbm
        return state, top_capacity(score, obs.valid, obs.capacity)


def _pages(x, g: int, reduce):
    """[layers, N] -> [layers, ceil(N / g)] by `reduce` over groups of g blocks (zero padded)."""
    n = x.shape[-1]
    pad = -n % g
    xp = jnp.pad(x, ((0, 0), (0, pad)))
    return reduce(xp.reshape(x.shape[0], -1, g), axis=-1)


def _unpage(p, g: int, n: int):
    """[layers, P] -> [layers, N]: each page's value on its blocks."""
    return jnp.repeat(p, g, axis=-1)[:, :n]


@dataclasses.dataclass(frozen=True)
class Page:
    """The paper's Quest-like baseline: pages of `page_blocks` blocks (16 tokens), perfect
    one-step lookahead, re-planned every step: the pages the next step reads go to HBM (promoted
    as that step reads them), then resident pages ranked by that step's attention mass
    (`obs.forecast_mass`; by recency without it); a page the step does not read is never
    promoted.

    Needs `obs.forecast` (the true reads of the next step, row 0).
    """

    name: str = "page"
    page_blocks: int = 1
    window: int = 1
    horizon: int = 1
    needs_forecast: bool = True

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def plan(self, state, obs: Observation):
        _require_forecast(self, obs)
        g, n = self.page_blocks, obs.valid.shape[-1]
        nxt = _pages(obs.forecast[0] * obs.valid, g, jnp.sum) > 0
        res = _pages(obs.in_hbm.astype(jnp.float32), g, jnp.mean)
        if obs.forecast_mass is not None:
            heat = _pages(obs.forecast_mass[0] * obs.valid, g, jnp.sum)
        else:
            heat = _pages(obs.last_read.astype(jnp.float32), g, jnp.max)
        heat = heat / (1.0 + jnp.max(heat, axis=-1, keepdims=True))
        score = jnp.where(nxt, 4.0, 0.0) + 2.0 * res + heat
        any_valid = _pages(obs.valid, g, jnp.any) & (nxt | (res > 0))
        pages = top_capacity(score, any_valid, obs.capacity // g)
        return state, _unpage(pages, g, n) & obs.valid


@dataclasses.dataclass(frozen=True)
class PaperSA:
    """The paper's SA-guided heuristic with perfect future knowledge.

    Every `window` steps: score each block by sum over the next `lookahead` steps of
    read / offset; promote the top `fraction` (R) of the host blocks that will be read, evict HBM
    blocks not read within the lookahead; when HBM is short, the highest scores win. The paper
    tunes (W, R) by annealing over whole runs with perfect knowledge; `jaxkv.sim.simulate` tunes them
    by exhaustive search over a small grid (see `simulate.PAPER_SA_GRID`).
    """

    name: str = "paper-sa"
    lookahead: int = 10
    fraction: float = 0.5
    window: int = 1
    needs_forecast: bool = True

    @property
    def horizon(self) -> int:
        return self.lookahead

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def plan(self, state, obs: Observation):
        _require_forecast(self, obs)
        f = obs.forecast[: self.lookahead]
        offset = jnp.arange(1, f.shape[0] + 1, dtype=jnp.float32)[:, None, None]
        score = jnp.sum(f / offset, axis=0) * obs.valid  # [layers, N]
        read_soon = score > 0
        cand = read_soon & ~obs.in_hbm & obs.valid
        ncand = jnp.sum(cand, axis=-1, keepdims=True)
        rank = jnp.argsort(jnp.argsort(jnp.where(cand, -score, jnp.inf), axis=-1), axis=-1)
        promote = cand & (rank < jnp.ceil(self.fraction * ncand))
        keep = obs.in_hbm & read_soon & obs.valid
        # keep every resident block read soon, then the promotions by score, within capacity
        pri = jnp.where(keep, 1e6 + score, jnp.where(promote, score, -jnp.inf))
        return state, top_capacity(pri, keep | promote, obs.capacity)


@pytree_dataclass
class AnnealPolicyState:
    key: jax.Array  # [2] uint32: PRNG key data
    window: jax.Array  # [] int32: W for the coming window
    prev_hit: jax.Array  # [] float32: HBM hit rate of the last window
    prev_expected: jax.Array  # [layers, N] float32: forecast reads per block until this plan
    last_promoted: jax.Array  # [layers, N] bool: blocks promoted at the last plan
    plans: jax.Array  # [] int32
    compensations: jax.Array  # [] int32: windows whose forecast error exceeded the threshold
    # the last plan's target and each block's expected reads over its window (`follow`: what
    # the per-step rule `follow_moves` promotes and the order it demotes in)
    target: jax.Array  # [layers, N] bool
    priority: jax.Array  # [layers, N] float32


FORECASTS = ("ema", "reuse", "learned", "oracle", "visits")


@dataclasses.dataclass(frozen=True)
class Anneal:
    """Ours: simulated annealing over block placements against a forecast of the next W steps.

    forecast: "ema" (online, from obs.read_ema / last_read), "reuse" (online, the re-read law
      learned from past reads: `importance.reuse_forecast`; needs obs.since_seen / since_read),
      "learned" (online, the logistic model in `learned`), "oracle" (obs.forecast, the true
      future reads), or "visits" (a diagnostic oracle: obs.forecast cut to the visits in
      progress by `importance.visits_forecast`, with the true count of the other reads that
      fall on host charged to the link as `anneal.AnnealProblem.fixed_link`: what an online
      forecaster that knows how long every visit lasts, but not when one starts, could do).
    window: W, the steps the energy looks ahead (and, when interval = 0, between plans).
    interval: > 0 re-plans every `interval` steps over the next W (receding horizon); used by
      the simulator (`next_window`); the decode loop plans every PlacementConfig.window steps.
    discount: step t of the window weighs discount^t in the energy (near steps count more).
    hysteresis: extra demotion cost the planner charges itself (x block bytes, both sides), so
      blocks at the balance margin do not flip tier at every re-plan.
    adaptive: adapt W by +-window_step within [min_window, max_window] from the hit rate (falling
      -> plan more often), the seed article's rule; needs obs.window_reads.
    compensate: when a window's reads deviate from the forecast by more than error_threshold
      (relative L1 over blocks), recalibrate (blend the last window's measured read frequency into
      the forecast), and roll back up to `rollback` of the last plan's promotions that went unread
      (their forecast is zeroed); needs obs.window_reads.
    link_reserve: with an online forecast, the share of the link bandwidth the energy keeps free
      for reads the forecast misses (blocks entering the read set cross the link at least once
      whatever the plan; planning them at the full link rate overloads it, since the expected
      loads' max underestimates the expected max). Not applied to the oracle forecast. 0.5:
      on the synthetic traces (256 steps) it cut recency-low 0.8 from 1.22 to 1.09 x Unlimited
      against 0.3, and moved the other cells by -0.6% to +1.1% (bench/RESULTS.md).
    unforeseen: with an online forecast, charge each step of the window the reads the forecast
      cannot place as a link load no placement changes (`anneal.AnnealProblem.fixed_link`): the
      blocks read per step (measured over the steps since the last plan) minus the forecast's
      expected reads, times the share of unforecast blocks that live on host. Without it the
      energy sees only the forecast's reads, underestimates the link's load whenever the read
      set churns, and leaves HBM slots empty to balance a link it thinks idle.
    keep_fetched: price promoting a block read from host at the last step as the HBM write alone
      (the simulator's `keep_fetched`; the decode loop re-reads the host pool, so False there).
    ride: the share of later re-plans the energy credits (receding-horizon pricing). 0 prices
      the plan as one placement held over the window: a block left on host is read over the
      link at every forecast read. With ride r, a block left on host is, with weight r, promoted
      at its first read after step 0 (that read crosses the link and carries the block to HBM:
      one HBM write; its later reads hit), as the re-plan at that step can do when it knows the
      read. So a prefetch is worth only the link timing it buys, not every read of the window.
      The first-read probabilities treat steps as independent (exact for the 0/1 oracle).
    tail, tail_value, tail_decay: with the oracle forecast, the steps after the window whose
      reads give the plan a terminal value (`anneal.AnnealProblem.value`): a block resident in
      HBM whose next read falls at window step W + k costs, if the plan demotes it, tail_value x
      tail_decay^k x one block's link transfer (it will have to cross again). So when the pool
      is full and a promotion needs a slot, the plan evicts the blocks needed latest, Belady's
      rule, instead of any block the short window sees unread. Only resident blocks get the
      value: valuing host blocks too buys prefetches for reads beyond the window, which pushed
      the HBM hit rate past the balance point in every cell measured (bench/RESULTS.md). A layer
      whose pool holds every valid block gets none: nothing is ever evicted for another block
      there, and the value only kept the plan from demoting blocks to feed an idle link (the
      CLI's llama3-8b default, recency-low 0.6, 256 steps: 1.085 x Unlimited, 1.000 without).
      0 = off; the simulator's anneal-oracle uses 30 steps (`jaxkv.sim.simulate`'s `oracle_tail`).
    overflow_value: with a tail, the terminal value of a layer whose pool the window's first
      step overflows (it reads more blocks than the pool holds), or whose first step the current
      placement leaves link-bound by `overflow_link_ratio` (its host reads take that many times
      as long as its HBM side; the pool cannot hold every block): every block that step reads,
      on host or not, and every resident block is worth overflow_value x sum_k tail_decay^k x
      [read at window step W + k] link transfers: its reads after the window, not only the
      next one. Then every slot is contested and a block's worth is how long it keeps being
      read: the plan fills the pool with the visits that last, as Page does by attention mass,
      instead of any block the window reads (measured at s = 0.4, 256 steps: 11% / 10% faster
      on patterns / recency-low, where Page beat the oracle). The link-bound gate at 2,048 steps:
      ratio 1.0 takes recency-high 0.8 / 0.6 from 1.116 / 1.924 to 1.078 / 1.883 but costs
      patterns 0.6 / 0.8 0.3% / 0.8% and recency-low 0.6 0.1%, where the step hovers at the
      balance point; 1.2 keeps half the gain on recency-high 0.8 (1.098) and those cells as they
      were; 2.0 fires almost never (bench/RESULTS.md). Host blocks not read at the first
      step get no value (no prefetch for reads beyond the window). Where the pool holds the
      step's reads, a whole-visit value pushes the hit rate past the balance point (patterns
      0.6: 1.024 -> 1.068), so the Belady value above applies there. 0 = off.
    now: the plan knows the read set of the step it plans for (obs.forecast[0], horizon 1): what
      a Quest-sparse decode loop computes from the current query before it reads the KV (the
      top-k blocks by the Quest bound), and what the paper grants Page. Row 0 of the forecast is
      that read set; rows 1 .. W - 1 are the online forecast ("ema" or "reuse") from the
      statistics with the step folded in, so a visit that starts now counts as begun. Without
      it every visit's first read comes from host unforeseen, and its promotion rides on its
      second read, also a host read: two link reads per visit instead of one. Our decode loop
      plans between steps and refuses it (`jaxkv.decode`).
    spread: price each step at its expected time under the forecast's uncertainty, not at the
      max of its expected loads (`anneal.AnnealProblem.spread`): the link reads of the blocks
      on host are Bernoulli draws of their link loads (with `ride`, the first-read
      probabilities), the reads the forecast cannot place (`unforeseen`) a Poisson count, and
      the step's link time minus its HBM time is Gaussian with `spread` x that deviation. The
      max of the expected loads puts the plan at the balance point, where half the steps
      overrun on the link at about 11x the HBM's cost per byte; the expectation keeps the link
      about 1.4 deviations below it (fewer blocks left on host to feed the link, so fewer
      demoted and promoted back). With the 0/1 oracle forecast and a known step (`now`,
      row 0) the deviation is 0. 1.5 (the `+now` policies' value: the Bernoulli deviation at
      1.0 does most of it, 1.5 and 2.0 are level) takes anneal+reuse+now at 512 steps from
      1.052 / 1.072 / 1.042 / 1.034 to 1.039 / 1.058 / 1.027 / 1.020 x Unlimited on patterns
      0.5, recency-low 0.6, patterns 0.6 and 0.8, and leaves the cells no placement balances
      (s = 0.4, recency-high) as they were (bench/RESULTS.md). 0 = off.
    dual: with the oracle forecast, the terminal value of every block is obs.value_to_go at the
      window's last step (`jaxkv.sim.lp_bound.dual_values`: the block's cost after the window on host
      over in HBM, from the LP relaxation of the whole run priced by its Lagrangian dual) in
      place of `tail` / `overflow_value`. The window's energy sets the balance of the steps the
      plan sees; the dual's prices say which blocks are worth their slot after it: how often a
      block is read later, at steps the LP finds link-bound (a read there is worth the link
      time it saves) or HBM-bound (worth little), less the slot's price while it waits. The
      Belady value sees the next read only, and the whole-visit value weighs every later read
      alike; on recency-high 0.8 the LP keeps 321 of a step's 393 reads in HBM where the Belady
      oracle kept 302 (bench/RESULTS.md). With `tail` and `overflow_value`, a layer the gate
      finds overflowing or link-bound still takes the whole-visit value (there the dual's
      values, from a relaxation that can split a block, did worse: recency-high 0.6, 512
      steps, 1.948 against 1.798 x Unlimited).
    follow: the plan is a target, not a migration: every `window` steps the annealer plans all
      layers together, between steps, and the caller keeps its target (state.target) and each
      block's expected reads over the window (state.priority); at every step, per layer,
      `follow_moves` then promotes the host blocks the step reads that the target marks for HBM
      (the read carries the block over the link: the HBM write is the only extra cost) and
      demotes, only to make room for them, the resident blocks the target leaves out, least
      expected first. What runs on a layer's critical path is that vector rule alone; the
      plan is priced as `now`'s later steps are (`ride` 1, `spread`). Online forecasts only.
    The energy model (profile, block bytes, weights, demotion cost) should match the cost model
    the policy is judged by; the simulator passes its own.
    """

    name: str = "anneal"
    forecast: str = "ema"
    window: int = 50
    interval: int = 0
    discount: float = 1.0
    hysteresis: float = 0.0
    profile: HardwareProfile = PROFILES["gh200"]
    block_bytes: float = 16 * 4096.0
    fixed_bytes: float = 436e6
    demote_cost: float = 0.0
    keep_fetched: bool = False  # promotions of blocks read at the last step need no link read
    link_reserve: float = 0.5
    unforeseen: bool = False
    ride: float = 0.0
    tail: int = 0
    tail_value: float = 0.1
    tail_decay: float = 0.9
    overflow_value: float = 0.03
    overflow_link_ratio: float = 1.2
    budget: int | None = None
    config: AnnealConfig = AnnealConfig()
    adaptive: bool = False
    min_window: int = 20
    max_window: int = 100
    window_step: int = 10
    compensate: bool = False
    error_threshold: float = 0.15
    rollback: int = 5
    learned: tuple | None = None  # (w_0 .. w_5, b) of importance.learned_forecast
    now: bool = False
    spread: float = 0.0
    dual: bool = False
    follow: bool = False
    follow_admit: str = "ranked"  # `follow_moves`'s admit rule (measured: bench/RESULTS.md)
    prompt_len: int = 0
    block_size: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.forecast not in FORECASTS:
            raise ValueError(f"Anneal forecast must be one of {FORECASTS}, got {self.forecast!r}")
        check_number("Anneal window", self.window, integer=True, low=1)
        check_number("Anneal interval", self.interval, integer=True, low=0)
        check_number("Anneal discount", self.discount, low=0.0, high=1.0, low_open=True)
        check_number("Anneal demote_cost", self.demote_cost, low=0.0)
        if not 0.0 <= self.link_reserve < 1.0:
            raise ValueError(f"Anneal link_reserve must lie in [0, 1), got {self.link_reserve!r}")
        if not 0.0 <= self.ride <= 1.0:
            raise ValueError(f"Anneal ride must lie in [0, 1], got {self.ride!r}")
        if (
            self.tail < 0
            or not 0.0 < self.tail_decay <= 1.0
            or self.tail_value < 0.0
            or self.overflow_value < 0.0
            or not self.overflow_link_ratio > 0.0
        ):
            raise ValueError(
                f"Anneal tail must be >= 0, tail_decay in (0, 1], tail_value and overflow_value "
                f">= 0, overflow_link_ratio > 0; got {self.tail!r}, {self.tail_decay!r}, "
                f"{self.tail_value!r}, {self.overflow_value!r}, {self.overflow_link_ratio!r}"
            )
        if self.tail and not self._oracle:
            raise ValueError(
                f"Anneal tail needs forecast='oracle' or 'visits', got {self.forecast!r}"
            )
        if self.now and self.forecast not in ("ema", "reuse"):
            raise ValueError(
                f"Anneal now=True refines an online forecast ('ema' or 'reuse'), got "
                f"{self.forecast!r}"
            )
        if self.follow and (self.now or self.forecast not in ("ema", "reuse")):
            raise ValueError(
                "Anneal follow=True plans a target from an online forecast ('ema' or 'reuse') "
                f"and cannot be combined with now=True; got forecast={self.forecast!r}, "
                f"now={self.now!r}"
            )
        if self.follow_admit not in FOLLOW_ADMITS:
            raise ValueError(
                f"Anneal follow_admit must be one of {FOLLOW_ADMITS}, got {self.follow_admit!r}"
            )
        if not 0.0 <= self.spread < float("inf"):
            raise ValueError(f"Anneal spread must be finite and >= 0, got {self.spread!r}")
        if self.dual and (self.forecast != "oracle" or self.adaptive):
            raise ValueError(
                "Anneal dual=True values blocks from the LP dual of the true future: it needs "
                f"forecast='oracle' and adaptive=False; got {self.forecast!r}, {self.adaptive!r}"
            )
        if self.forecast == "learned" and self.learned is None:
            raise ValueError("Anneal forecast='learned' needs learned=(w_0, ..., w_5, b), got None")

    @property
    def _oracle(self) -> bool:
        return self.forecast in ("oracle", "visits")

    @property
    def needs_forecast(self) -> bool:
        """obs.forecast is needed: the oracles' future reads, or with `now` the current step's."""
        return self._oracle or self.now

    def _planning_profile(self) -> HardwareProfile:
        if self._oracle or self.link_reserve == 0.0:
            return self.profile
        bw = self.profile.link_bandwidth * (1.0 - self.link_reserve)
        return dataclasses.replace(self.profile, link_bandwidth=bw)

    @property
    def needs_values(self) -> bool:
        """obs.value_to_go is needed (`dual`)."""
        return self.dual

    @property
    def horizon(self) -> int:
        """Steps the plan needs obs.forecast for: the (largest) window, then the tail (oracles);
        the current step (`now`)."""
        return self._energy_steps + self.tail if self._oracle else 1

    @property
    def _energy_steps(self) -> int:
        return self.max_window if self.adaptive else self.window

    def _tail_value(self, obs: Observation, h: int):
        """[layers, N] seconds: the terminal value of each block from its reads after the
        window's first `h` steps, or None: the LP dual's value-to-go (`dual`), Belady's (the
        next read; resident blocks only: see `tail`), or, in a layer whose pool the first step
        overflows or whose first step is link-bound, every read (resident blocks and the first
        step's reads: see `overflow_value`)."""
        dual = None
        if self.dual:
            if obs.value_to_go is None or obs.value_to_go.shape[0] < h:
                got = None if obs.value_to_go is None else tuple(obs.value_to_go.shape)
                raise ValueError(
                    f"policy {self.name!r} (dual=True) needs obs.value_to_go of shape "
                    f"[>= {h}, layers, N] (`jaxkv.sim.lp_bound.dual_values`); got {got}"
                )
            dual = jnp.where(obs.valid, obs.value_to_go[h - 1], 0.0)
        if not self.tail:
            return dual
        f = obs.forecast[h : h + self.tail] > 0  # [tail, layers, N]
        if f.shape[0] == 0:
            return None
        k = jnp.arange(f.shape[0], dtype=jnp.float32)[:, None, None]
        first = jnp.min(jnp.where(f, k, jnp.inf), axis=0)  # steps after the window to the read
        unit = self.block_bytes / self.profile.link_bandwidth
        # a pool with room for every block never evicts one for another: there the Belady value
        # would only keep the plan from demoting blocks to feed an idle link
        full = jnp.sum(obs.valid, axis=-1, keepdims=True) > obs.capacity  # [layers, 1]
        resident = obs.valid & obs.in_hbm & full
        belady = jnp.where(resident, self.tail_value * unit * self.tail_decay**first, 0.0)
        if dual is not None:
            belady = dual
        if not self.overflow_value:
            return belady
        now = obs.valid & (obs.forecast[0] > 0)
        over = jnp.sum(now, axis=-1, keepdims=True) > obs.capacity  # [layers, 1]
        # or whose first step the current placement leaves link-bound (by overflow_link_ratio):
        # the link, not a slot, is then what every read contends for, and a visit that lasts is
        # worth its whole length
        b = self.block_bytes
        link0 = b * jnp.sum(now & ~obs.in_hbm, -1) / self.profile.link_bandwidth
        hbm0 = (self.fixed_bytes + b * jnp.sum(now & obs.in_hbm, -1)) / self.profile.hbm_bandwidth
        over = over | ((link0 > self.overflow_link_ratio * hbm0)[:, None] & full)
        reads = jnp.sum(jnp.where(f, self.tail_decay**k, 0.0), axis=0)
        whole = jnp.where(resident | now, self.overflow_value * unit * reads, 0.0)
        return jnp.where(over, whole, belady)

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
        )

    def next_window(self, state: AnnealPolicyState):
        """Steps until the next plan: `interval` when set, else the current W."""
        return jnp.int32(self.interval) if self.interval > 0 else state.window

    def _unforeseen_link(self, a, a0, obs: Observation, state: AnnealPolicyState):
        """[layers, W] bytes: per step, the reads the forecast `a` [W, layers, N] does not place
        (blocks read per step since the last plan minus the forecast's sum), times the share of
        the blocks the forecast deems cold ((1 - a0)-weighted) that live on host."""
        elapsed = jnp.maximum(self.next_window(state).astype(jnp.float32), 1.0)
        per_step = jnp.sum(obs.window_reads, axis=-1) / elapsed  # [layers]
        missing = jnp.maximum(per_step[None] - jnp.sum(a, axis=-1), 0.0)  # [W, layers]
        if self.now:  # the current step's reads are known
            missing = missing.at[0].set(0.0)
        cold = (1.0 - a0) * obs.valid
        host = jnp.sum(cold * ~obs.in_hbm, -1) / jnp.maximum(jnp.sum(cold, -1), 1e-9)  # [layers]
        return self.block_bytes * jnp.swapaxes(missing * host[None], 0, 1)

    def _host_loads(self, a, full=None):
        """host_hbm / host_link [layers, W, N] of `anneal.AnnealProblem` for forecast a [W,
        layers, N] under `ride`: steps >= 1 mix the held placement (reads on the link) with the
        promotion at the first read after step 0 (that read on the link, an HBM write, then
        HBM reads). In a layer whose pool is `full` ([layers] bool, default none) that promotion
        displaces a resident block, which costs `demote_cost` on both sides: without it, an
        exclusive cache (the decode loop's demote_cost 1) prices leaving a block on host for the
        re-plan to promote below promoting it now, and every re-plan defers again."""
        p = jnp.clip(a, 0.0, 1.0)
        later = (jnp.arange(a.shape[0]) >= 1)[:, None, None]
        miss = jnp.where(later, 1.0 - p, 1.0)  # steps 1 .. t - 1 without a read
        # product over steps 1 .. t - 1 (exclusive cumulative product; step 0's factor is 1)
        before = jnp.concatenate([jnp.ones_like(miss[:1]), jnp.cumprod(miss, axis=0)[:-1]], 0)
        first = jnp.where(later, p * before, 0.0)  # P(first read after step 0 is at step t)
        r = self.ride
        cost = 0.0 if full is None else jnp.where(full, self.demote_cost, 0.0)[None, :, None]
        displace = r * first * cost
        hh = jnp.where(later, r * a + displace, 0.0)
        hl = jnp.where(later, (1.0 - r) * a + r * first + displace, a)
        return dict(host_hbm=jnp.swapaxes(hh, 0, 1), host_link=jnp.swapaxes(hl, 0, 1))

    def _online_forecast(
        self, obs: Observation, step, h: int, last_read=None, read_ema=None, streak=None
    ):
        """[h, layers, N] P(read) from the past reads alone ("ema" or "reuse") for the window
        that starts at `step`; last_read / read_ema / streak default to obs's."""
        last_read = obs.last_read if last_read is None else last_read
        read_ema = obs.read_ema if read_ema is None else read_ema
        streak = obs.streak if streak is None else streak
        if self.forecast == "ema":
            return imp.ema_forecast(read_ema, last_read, step, obs.valid, h)
        if obs.since_seen is None or obs.since_read is None:
            raise ValueError(
                "Anneal forecast='reuse' needs obs.since_seen and obs.since_read (the reuse "
                "counts of importance.Stats), got None"
            )
        return imp.reuse_forecast(
            obs.since_seen,
            obs.since_read,
            last_read,
            step,
            obs.valid,
            h,
            read_ema=read_ema,
            streak=streak,
        )

    def _now_forecast(self, obs: Observation, h: int):
        """`now`: row 0 is the current step's reads (obs.forecast[0]); rows 1 .. h - 1 are the
        online forecast from the statistics with that step folded in (a visit that starts now is
        known to have started)."""
        r0 = (obs.forecast[0] > 0) & obs.valid
        a0 = r0.astype(jnp.float32)[None]
        if h == 1:
            return a0
        last_read, read_ema, streak = imp.fold_reads(
            obs.last_read, obs.read_ema, obs.streak, r0, obs.step
        )
        rest = self._online_forecast(obs, obs.step + 1, h - 1, last_read, read_ema, streak)
        return jnp.concatenate([a0, rest], axis=0)

    def _link_variance(self, a, host, fixed_link, off):
        """[W, layers]: the variance (blocks^2) of each step's link reads from the blocks `off`
        [layers, N] leaves on host, each read a Bernoulli of its host-side link load
        (`_host_loads`, or the forecast `a` [W, layers, N]), plus the reads the forecast cannot
        place (`fixed_link` [layers, W] bytes) as a Poisson count."""
        hl = jnp.swapaxes(host["host_link"], 0, 1) if host else a  # [W, L, N]
        hl = jnp.clip(hl, 0.0, 1.0) * off[None]
        var = jnp.sum(hl * (1.0 - hl), -1)
        if fixed_link is not None:
            var = var + jnp.swapaxes(fixed_link, 0, 1) / self.block_bytes
        return var

    def plan(self, state: AnnealPolicyState, obs: Observation):
        h = self._energy_steps
        window, prev_hit = state.window, state.prev_hit
        wr = obs.window_reads
        if wr is not None and self.adaptive:
            hit = jnp.sum(wr * obs.in_hbm) / jnp.maximum(jnp.sum(wr), 1.0)
            window = adapt_window(
                window, hit, state.prev_hit, self.min_window, self.max_window, self.window_step
            )
            prev_hit = hit
        active = (jnp.arange(h) < window).astype(jnp.float32)  # [h]
        unforeseen = None
        if self._oracle:
            _require_forecast(self, obs)
            reads = obs.forecast * obs.valid[None]
            reads = jnp.pad(reads, ((0, max(h - reads.shape[0], 0)), (0, 0), (0, 0)))
            if self.forecast == "visits":  # the reads of visits that have not begun: unplaced
                going = imp.visits_forecast(reads, obs.last_read, obs.step)
                host = (~obs.in_hbm & obs.valid).astype(jnp.float32)
                unforeseen = self.block_bytes * jnp.sum((reads - going)[:h] * host, -1).T
                reads = going
                obs = dataclasses.replace(obs, forecast=going)  # the tail value sees visits only
            a = reads[:h]
        elif self.now:
            _require_forecast(self, obs)
            a = self._now_forecast(obs, h)
        elif self.forecast in ("ema", "reuse"):
            a = self._online_forecast(obs, obs.step, h)
        else:
            from jaxkv.sim import learned as lrn  # research code, off the runtime's imports

            stats = imp.Stats(obs.last_read, obs.read_ema, obs.mass_ema, obs.read_ema)
            feats = lrn.features(stats, obs.step, obs.valid, self.prompt_len, self.block_size)
            params = {
                "w": jnp.asarray(self.learned[:-1], jnp.float32),
                "b": jnp.float32(self.learned[-1]),
            }
            a = lrn.learned_forecast(params, feats, obs.valid, h)
        compensations = state.compensations
        if wr is not None and self.compensate:
            err = jnp.sum(jnp.abs(wr - state.prev_expected)) / jnp.maximum(jnp.sum(wr), 1.0)
            bad = (err > self.error_threshold) & (state.plans > 0)
            elapsed = self.next_window(state).astype(jnp.float32)  # steps since the last plan
            freq = jnp.clip(wr / jnp.maximum(elapsed, 1.0), 0.0, 1.0)
            unread = state.last_promoted & (wr == 0)
            undo = unread & (jnp.cumsum(unread, axis=-1) <= self.rollback)
            recal = jnp.where(undo[None], 0.0, 0.5 * a + 0.5 * freq[None])
            a = jnp.where(bad, recal, a)
            compensations = compensations + bad
        a = a * active[:, None, None]
        a0 = jnp.clip(a[0], 0.0, 1.0)
        fixed_link = None
        if unforeseen is not None:
            fixed_link = unforeseen * active[None]
        elif self.unforeseen and not self._oracle and wr is not None:
            fixed_link = self._unforeseen_link(a, a0, obs, state) * active[None]
        kept = jnp.zeros_like(a0)
        if self.keep_fetched:
            kept = (imp.read_last_step(obs.last_read, obs.step) & ~obs.in_hbm).astype(jnp.float32)
        host = {}
        if self.ride > 0.0:
            full = jnp.sum(obs.valid, axis=-1) > obs.capacity  # [layers]
            host = self._host_loads(a, full)
        spread = None
        if self.spread:  # each step's expected time under the forecast's uncertainty
            var = self._link_variance(a, host, fixed_link, ~obs.in_hbm & obs.valid)
            unit = self.block_bytes / self.profile.link_bandwidth
            spread = self.spread * unit * jnp.sqrt(var).T * active[None]  # [layers, W] seconds
        problem = anneal.AnnealProblem(
            **host,
            forecast=jnp.swapaxes(a, 0, 1),
            x0=obs.in_hbm & obs.valid,
            valid=obs.valid,
            fixed=jnp.full((h,), self.fixed_bytes, jnp.float32),
            weight=active * self.discount ** jnp.arange(h, dtype=jnp.float32),
            # a block promoted while this step reads it crosses the link once, as its read (a
            # host read), and is written to HBM; any other promotion is a link read + HBM write
            promote_hbm=jnp.where(kept > 0, 1.0, 1.0 - a0),
            promote_link=1.0 - kept,
            profile=self._planning_profile(),
            block_bytes=float(self.block_bytes),
            capacity=obs.capacity,
            budget=self.budget if self.budget is not None else 1 << 30,
            demote_cost=float(self.demote_cost + self.hysteresis),
            value=self._tail_value(obs, h),
            fixed_link=fixed_link,
            spread=spread,
        )
        key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
        x, _, _ = anneal.run(problem, sub, self.config)
        target = x & obs.valid
        new_state = dataclasses.replace(state, window=window)
        # the reads expected until the next plan: what the next plan's window_reads will count
        until_next = jnp.arange(h) < self.next_window(new_state)
        return (
            AnnealPolicyState(
                key=jax.random.key_data(key),
                window=window,
                prev_hit=prev_hit,
                prev_expected=jnp.sum(a * until_next[:, None, None], axis=0),
                last_promoted=target & ~obs.in_hbm,
                plans=state.plans + 1,
                compensations=compensations,
                target=target,
                priority=jnp.sum(a, axis=0) * obs.valid,
            ),
            target,
        )


@dataclasses.dataclass(frozen=True)
class Unlimited:
    """The Unlimited-HBM bound. It is not a placement: `jaxkv.sim.simulate` computes it with
    `jaxkv.cost.unlimited_step_time`; planning with it raises ValueError."""

    name: str = "unlimited"
    needs_forecast: bool = False

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def plan(self, state, obs: Observation):
        raise ValueError(
            "policy 'unlimited' is a bound computed by jaxkv.cost.unlimited_step_time, not a "
            "placement: expected a placing policy, e.g. 'anneal+reuse+follow' in the decode "
            "loop (the simulator reports unlimited as a bound)"
        )


def _require_forecast(policy, obs: Observation) -> None:
    if obs.forecast is None:
        raise ValueError(
            f"policy {policy.name!r} needs obs.forecast (future reads, shape [W, layers, N]); "
            "got None: it is an oracle for the simulator"
        )


POLICIES: dict[str, Callable[..., Policy]] = {
    "static": Static,
    "lru": Reactive,
    "reactive": Reactive,
    "page": Page,
    "paper-sa": PaperSA,
    "anneal": Anneal,
    "anneal-oracle": functools.partial(Anneal, name="anneal-oracle", forecast="oracle"),
    "unlimited": Unlimited,
}


# `+now` (a plan that knows the read set of the step it plans for): its lookahead W (3 steps
# beat 10 by 0-1.5% at 512 steps) and its `Anneal.spread` (1.0, 1.5, 2.0 measured at 512 steps;
# 1.5 is best or within 0.3% of it in every cell): bench/RESULTS.md
NOW_WINDOW = 3
NOW_SPREAD = 1.5
# the modifiers of `anneal` and `anneal-oracle` names, as in "anneal+reuse+now"
MODIFIERS = ("aw", "ec", "reuse", "now", "follow", "visits", "dual")


def split_name(name: str) -> tuple[str, tuple[str, ...]]:
    """(base, modifiers) of a policy name such as "anneal+reuse+now", validated.

    `anneal` and `anneal-oracle` take +aw (the seed's adaptive window) and +ec (forecast-error
    compensation); `anneal` also +reuse (the re-read law), +now (the step's own read set) or
    +follow (a target planned between steps, followed by a per-step rule: `Anneal.follow`);
    `anneal-oracle` also +visits and +dual. Raises ValueError naming the valid choices.
    """
    base, *mods = name.split("+")
    if base not in POLICIES:
        raise ValueError(
            f"unknown policy {name!r}; expected one of {sorted(POLICIES)} "
            "(anneal / anneal-oracle take +aw, +ec; anneal also +reuse, +now, +follow; "
            "anneal-oracle +visits, +dual)"
        )
    if mods and base not in ("anneal", "anneal-oracle"):
        raise ValueError(
            f"policy {name!r}: modifiers (+{', +'.join(mods)}) apply to anneal and "
            f"anneal-oracle only, not {base!r} (anneal / anneal-oracle take +aw, +ec; anneal "
            "also +reuse, +now, +follow; anneal-oracle +visits, +dual)"
        )
    bad = [m for m in mods if m not in MODIFIERS]
    if bad:
        raise ValueError(
            f"policy {name!r}: unknown modifier {bad[0]!r}; expected 'aw', 'ec', 'reuse', 'now', "
            "'follow', 'visits' or 'dual'"
        )
    if {"now", "follow"} <= set(mods):
        raise ValueError(
            f"policy {name!r}: +now plans each step, +follow plans a target between steps and "
            "follows it: choose one"
        )
    for m in ("reuse", "now", "follow"):
        if m in mods and base != "anneal":
            raise ValueError(f"policy {name!r}: +{m} refines the online forecast, for anneal only")
    if "visits" in mods and base != "anneal-oracle":
        raise ValueError(f"policy {name!r}: +visits cuts the oracle, for anneal-oracle only")
    if "dual" in mods and (base != "anneal-oracle" or {"visits", "aw"} & set(mods)):
        raise ValueError(
            f"policy {name!r}: +dual values blocks from the LP dual of the true future, for "
            "anneal-oracle only, without +visits or +aw"
        )
    return base, tuple(mods)


def modifier_kwargs(mods) -> dict:
    """The `Anneal` keyword arguments that a name's modifiers (`split_name`) stand for."""
    kw = dict(adaptive="aw" in mods, compensate="ec" in mods)
    if "reuse" in mods:
        # the re-read law learned online, with the reads it cannot place charged to the link
        # (`unforeseen`) in place of the fixed link reserve
        kw.update(forecast="reuse", unforeseen=True, link_reserve=0.0)
    if "visits" in mods:
        kw.update(forecast="visits")
    if "dual" in mods:  # the LP dual's value-to-go as the terminal value, in place of Belady's
        kw.update(dual=True)
    if "now" in mods:
        # the plan knows each step's reads, so a host block is promoted at its first read (the
        # pricing of ride = 1), and it prices the later steps at their expected time under the
        # forecast's spread
        kw.update(now=True, ride=1.0, spread=NOW_SPREAD)
    if "follow" in mods:
        # the per-step rule promotes a target block at its first read: the same pricing
        kw.update(follow=True, ride=1.0, spread=NOW_SPREAD)
    return kw


def get_policy(name: str, **kwargs) -> Policy:
    """Builds a policy by name; unknown names raise ValueError listing the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
