"""Pricing terms and controllers: the parts of an annealing policy between its forecast and the
annealer (`jaxkv.placement.policies.Anneal`).

A pricing term adds to the annealing problem (`jaxkv.placement.anneal.AnnealProblem`) of one plan:
it takes the problem's fields built so far (`Pricing`) and the plan's context (`PlanContext`) and
returns the fields with its own part added. Terms run in the order of their `stage`:
  0 LinkReserve   plan against a share of the link, leaving the rest for unforecast reads;
  1 Unforeseen    charge each step the reads the forecast cannot place, as a fixed link load;
  2 Ride          receding-horizon pricing: a block left on host may be promoted by a later
                  re-plan at its first read;
  3 Spread        price each step at its expected time under the forecast's uncertainty.
A controller acts on the plan's bookkeeping: `AdaptiveWindow` (the seed's adaptive W) and
`Compensate` (recalibrate the forecast and roll back unread promotions after a bad window).
Every part is a frozen dataclass that checks its own fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.config import HardwareProfile, check_number


@dataclasses.dataclass
class Pricing:
    """The annealing problem's fields that pricing terms set (None / {} = the term is off)."""

    profile: HardwareProfile  # the bandwidths the energy uses
    fixed_link: Any = None  # [layers, W] float32 bytes no placement changes
    host: dict = dataclasses.field(default_factory=dict)  # host_hbm / host_link [layers, W, N]
    spread: Any = None  # [layers, W] float32 seconds


@dataclasses.dataclass
class PlanContext:
    """What a pricing term sees of one plan (built inside `Anneal.plan`)."""

    obs: Any  # the Observation
    env: Any  # the jaxkv.cost.CostModel
    forecast: Any  # the Forecaster
    a: jax.Array  # [W, layers, N] float32: the window's forecast, inactive steps zeroed
    active: jax.Array  # [W] float32: steps of the window in use
    elapsed: jax.Array  # [] int32: steps since the last plan


@dataclasses.dataclass(frozen=True)
class LinkReserve:
    """With an online forecast, plan against (1 - share) of the link bandwidth, keeping the
    share free for the reads the forecast misses (blocks entering the read set cross the link at
    least once whatever the plan; planning them at the full rate overloads it). Not applied to
    an oracle forecast. Default of `anneal` 0.5 (measured: bench/RESULTS.md)."""

    share: float = 0.5
    stage = 0

    def __post_init__(self):
        check_number("LinkReserve share", self.share, low=0.0, high=1.0, high_open=True)

    def __call__(self, p: Pricing, ctx: PlanContext) -> Pricing:
        if ctx.forecast.oracle or self.share == 0.0:
            return p
        bw = p.profile.link_bandwidth * (1.0 - self.share)
        return dataclasses.replace(p, profile=dataclasses.replace(p.profile, link_bandwidth=bw))


@dataclasses.dataclass(frozen=True)
class Unforeseen:
    """With an online forecast, charge each step of the window the reads the forecast cannot
    place as a link load no placement changes: the blocks read per step since the last plan
    (obs.window_reads) minus the forecast's expected reads, times the share of the blocks the
    forecast deems cold that live on host. Without it the energy sees only the forecast's reads
    and leaves HBM slots empty to balance a link it thinks idle."""

    stage = 1

    def __call__(self, p: Pricing, ctx: PlanContext) -> Pricing:
        obs = ctx.obs
        if p.fixed_link is not None or ctx.forecast.oracle or obs.window_reads is None:
            return p
        a, b = ctx.a, ctx.env.block_bytes
        a0 = jnp.clip(a[0], 0.0, 1.0)
        elapsed = jnp.maximum(ctx.elapsed.astype(jnp.float32), 1.0)
        per_step = jnp.sum(obs.window_reads, axis=-1) / elapsed  # [layers]
        missing = jnp.maximum(per_step[None] - jnp.sum(a, axis=-1), 0.0)  # [W, layers]
        if ctx.forecast.knows_now:  # the current step's reads are known
            missing = missing.at[0].set(0.0)
        cold = (1.0 - a0) * obs.valid
        host = jnp.sum(cold * ~obs.in_hbm, -1) / jnp.maximum(jnp.sum(cold, -1), 1e-9)  # [layers]
        fixed = b * jnp.swapaxes(missing * host[None], 0, 1)
        return dataclasses.replace(p, fixed_link=fixed * ctx.active[None])


def host_loads(a, ride: float, demote_cost, full=None):
    """host_hbm / host_link [layers, W, N] of `anneal.AnnealProblem` for forecast a [W, layers,
    N] under `ride`: steps >= 1 mix the held placement (reads on the link) with the promotion at
    the first read after step 0 (that read on the link, an HBM write, then HBM reads). In a
    layer whose pool is `full` ([layers] bool, default none) that promotion displaces a resident
    block, which costs `demote_cost` on both sides: without it, an exclusive cache prices leaving
    a block on host for the re-plan to promote below promoting it now, and every re-plan defers
    again."""
    p = jnp.clip(a, 0.0, 1.0)
    later = (jnp.arange(a.shape[0]) >= 1)[:, None, None]
    miss = jnp.where(later, 1.0 - p, 1.0)  # steps 1 .. t - 1 without a read
    # product over steps 1 .. t - 1 (exclusive cumulative product; step 0's factor is 1)
    before = jnp.concatenate([jnp.ones_like(miss[:1]), jnp.cumprod(miss, axis=0)[:-1]], 0)
    first = jnp.where(later, p * before, 0.0)  # P(first read after step 0 is at step t)
    cost = 0.0 if full is None else jnp.where(full, demote_cost, 0.0)[None, :, None]
    displace = ride * first * cost
    hh = jnp.where(later, ride * a + displace, 0.0)
    hl = jnp.where(later, (1.0 - ride) * a + ride * first + displace, a)
    return dict(host_hbm=jnp.swapaxes(hh, 0, 1), host_link=jnp.swapaxes(hl, 0, 1))


@dataclasses.dataclass(frozen=True)
class Ride:
    """Receding-horizon pricing: the share r of later re-plans the energy credits. With r = 0
    the plan is one placement held over the window (a block left on host is read over the link
    at every forecast read); with r, a block left on host is, with weight r, promoted at its
    first read after step 0 (that read crosses the link and carries it to HBM). So a prefetch is
    worth only the link timing it buys. First-read probabilities treat steps as independent."""

    share: float = 1.0
    stage = 2

    def __post_init__(self):
        check_number("Ride share", self.share, low=0.0, high=1.0)

    def __call__(self, p: Pricing, ctx: PlanContext) -> Pricing:
        if self.share == 0.0:
            return p
        obs = ctx.obs
        full = jnp.sum(obs.valid, axis=-1) > obs.capacity  # [layers]
        return dataclasses.replace(p, host=host_loads(ctx.a, self.share, ctx.env.demote_cost, full))


def link_variance(a, host, fixed_link, off, block_bytes: float):
    """[W, layers]: the variance (blocks^2) of each step's link reads from the blocks `off`
    [layers, N] leaves on host, each read a Bernoulli of its host-side link load (`host_loads`,
    or the forecast `a` [W, layers, N]), plus the reads the forecast cannot place (`fixed_link`
    [layers, W] bytes) as a Poisson count."""
    hl = jnp.swapaxes(host["host_link"], 0, 1) if host else a  # [W, L, N]
    hl = jnp.clip(hl, 0.0, 1.0) * off[None]
    var = jnp.sum(hl * (1.0 - hl), -1)
    if fixed_link is not None:
        var = var + jnp.swapaxes(fixed_link, 0, 1) / block_bytes
    return var


@dataclasses.dataclass(frozen=True)
class Spread:
    """Price each step at its expected time under the forecast's uncertainty, not at the max of
    its expected loads (`anneal.AnnealProblem.spread`): the step's link time minus its HBM time
    is Gaussian with `k` x the deviation of its link reads (`link_variance`). The max of the
    expected loads puts the plan at the balance point, where half the steps overrun on the link;
    the expectation keeps the link about k deviations below it. The `+now` / `+follow` presets
    use 1.5 (measured: bench/RESULTS.md)."""

    k: float = 1.5
    stage = 3

    def __post_init__(self):
        check_number("Spread k", self.k, low=0.0)

    def __call__(self, p: Pricing, ctx: PlanContext) -> Pricing:
        if not self.k:
            return p
        obs, env = ctx.obs, ctx.env
        var = link_variance(ctx.a, p.host, p.fixed_link, ~obs.in_hbm & obs.valid, env.block_bytes)
        spread = self.k * env.link_seconds * jnp.sqrt(var).T * ctx.active[None]
        return dataclasses.replace(p, spread=spread)


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


@dataclasses.dataclass(frozen=True)
class AdaptiveWindow:
    """The seed's adaptive window (`adapt_window`): W moves by +-step within [low, high] from
    the hit rate of the last window (falling -> plan more often). Needs obs.window_reads. The
    energy then looks `high` steps ahead, of which the current W are active."""

    low: int = 20
    high: int = 100
    step: int = 10

    def __post_init__(self):
        check_number("AdaptiveWindow low", self.low, integer=True, low=1)
        check_number("AdaptiveWindow high", self.high, integer=True, low=self.low)
        check_number("AdaptiveWindow step", self.step, integer=True, low=0)

    def __call__(self, window, prev_hit, obs):
        """(next W, this window's hit rate) from obs.window_reads; unchanged without them."""
        wr = obs.window_reads
        if wr is None:
            return window, prev_hit
        hit = jnp.sum(wr * obs.in_hbm) / jnp.maximum(jnp.sum(wr), 1.0)
        return adapt_window(window, hit, prev_hit, self.low, self.high, self.step), hit


@dataclasses.dataclass(frozen=True)
class Compensate:
    """Forecast-error compensation: when a window's reads deviate from what the last plan
    expected by more than `threshold` (relative L1 over blocks), blend the window's measured
    read frequency into the forecast and roll back up to `rollback` of the last plan's
    promotions that went unread (their forecast is zeroed). The seed's rule: 15%, 5. Needs
    obs.window_reads."""

    threshold: float = 0.15
    rollback: int = 5

    def __post_init__(self):
        check_number("Compensate threshold", self.threshold, low=0.0)
        check_number("Compensate rollback", self.rollback, integer=True, low=0)

    def __call__(self, a, state, obs, elapsed):
        """(forecast, 1 when it compensated else 0) for forecast a [W, layers, N]."""
        wr = obs.window_reads
        if wr is None:
            return a, jnp.int32(0)
        err = jnp.sum(jnp.abs(wr - state.prev_expected)) / jnp.maximum(jnp.sum(wr), 1.0)
        bad = (err > self.threshold) & (state.plans > 0)
        freq = jnp.clip(wr / jnp.maximum(elapsed.astype(jnp.float32), 1.0), 0.0, 1.0)
        unread = state.last_promoted & (wr == 0)
        undo = unread & (jnp.cumsum(unread, axis=-1) <= self.rollback)
        recal = jnp.where(undo[None], 0.0, 0.5 * a + 0.5 * freq[None])
        return jnp.where(bad, recal, a), bad.astype(jnp.int32)
