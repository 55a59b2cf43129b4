"""`Anneal` ("anneal" and its modifiers): simulated annealing over block placements against a
forecast of the next W steps, composed from parts in optax's manner:
  a forecaster    (`jaxkv.placement.forecasts`: EMA, Reuse, Now; the simulator registers the
                  oracles' and the learned one),
  pricing terms   (`jaxkv.placement.pricing`: LinkReserve, Unforeseen, Ride, Spread), each
                  adding to the annealing problem,
  terminal values (the simulator's Belady tail, overflow and LP-dual values),
  controllers     (`jaxkv.placement.pricing`: AdaptiveWindow, Compensate),
  the annealer    (`jaxkv.placement.anneal`), and optionally an in-step rule (`Follow`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass
from jaxkv.config import AnnealConfig, check_number
from jaxkv.cost import CostModel
from jaxkv.placement import anneal
from jaxkv.placement import statistics as imp
from jaxkv.placement.forecasts import EMA, Forecaster, Reuse, require_forecast
from jaxkv.placement.policies.base import Observation, PolicyBase
from jaxkv.placement.policies.follow import Follow
from jaxkv.placement.pricing import AdaptiveWindow, Compensate, LinkReserve, PlanContext, Pricing


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
