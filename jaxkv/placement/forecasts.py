"""Forecasters: the first part of an annealing policy (`jaxkv.placement.policies.Anneal`).

A forecaster turns an `Observation` into a `Forecast` of the next `steps` steps' reads, in
optax's manner: `init(num_layers, num_blocks)` gives its state (a pytree; () for the stateless
ones here) and `update(state, obs, env, steps)` returns (new state, Forecast). `env` is the
`jaxkv.cost.CostModel` the plan is priced in.

The online forecasters live here (they see the past reads alone, as the decode loop does):
  EMA    decayed read frequency, sharpened by recency (`importance.ema_forecast`);
  Reuse  the re-read law learned online from the trace's own reads (`importance.reuse_forecast`);
  Now    row 0 is the read set of the step planned for (obs.forecast[0], what a Quest-sparse
         step knows before it reads the KV), rows 1 .. are an online forecast with that step
         folded in. The decode loop plans between steps and refuses it.
The oracles (the true future, the visits in progress) and the learned forecaster are research
code: `jaxkv.sim.oracles`, `jaxkv.sim.learned`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass
from jaxkv.placement import statistics as imp


@pytree_dataclass
class Forecast:
    """What a forecaster says about the coming window (h steps, N blocks per layer)."""

    reads: jax.Array  # [h, layers, N] float32: P(block read at window step t)
    # [layers, h] float32 bytes: link reads the forecast knows of but does not place (a
    # diagnostic oracle's unforeseen visits), charged as `anneal.AnnealProblem.fixed_link`
    unplaced: jax.Array | None = None
    # [>= h, layers, N] float32: the future reads the terminal values see (an oracle's), if any
    future: jax.Array | None = None


class Forecaster(Protocol):
    """A policy's forecast of the next steps' reads. Attributes:
    oracle: it reads the true future (obs.forecast over the whole window): simulator only.
    knows_now: row 0 is the planned step's true read set (obs.forecast[0]).
    needs_forecast: obs.forecast must be given (oracle or knows_now)."""

    oracle: bool
    knows_now: bool
    needs_forecast: bool

    def init(self, num_layers: int, num_blocks: int) -> Any: ...

    def update(self, state: Any, obs, env, steps: int) -> tuple[Any, Forecast]: ...


def require_forecast(name: str, obs) -> None:
    """Raises ValueError unless obs.forecast (the future reads) is given."""
    if obs.forecast is None:
        raise ValueError(
            f"policy {name!r} needs obs.forecast (future reads, shape [W, layers, N]); "
            "got None: it is an oracle for the simulator"
        )


class _Online:
    """Shared by the online forecasters: stateless, predicts from the statistics in obs."""

    oracle = False
    knows_now = False
    needs_forecast = False

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def update(self, state, obs, env, steps: int):
        return state, Forecast(self.predict(obs, obs.step, steps))

    def predict(self, obs, step, steps: int, last_read=None, read_ema=None, streak=None):
        """[steps, layers, N] P(read) for the window that starts at `step`; the statistics
        default to obs's (`Now` passes them with the planned step folded in)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class EMA(_Online):
    """Decayed read frequency (`Stats.read_ema`), flat over the window, sharpened by recency
    (a block read at the last step is likely read again soon): `importance.ema_forecast`."""

    name = "ema"

    def predict(self, obs, step, steps: int, last_read=None, read_ema=None, streak=None):
        last_read = obs.last_read if last_read is None else last_read
        read_ema = obs.read_ema if read_ema is None else read_ema
        return imp.ema_forecast(read_ema, last_read, step, obs.valid, steps)


@dataclasses.dataclass(frozen=True)
class Reuse(_Online):
    """The re-read law learned online (`importance.reuse_forecast`): how often a block of
    read-frequency bin e, last read k steps ago (and read r steps running) is read, rolled
    forward over the window. Needs obs.since_seen / since_read (`importance.Stats`)."""

    name = "reuse"

    def predict(self, obs, step, steps: int, last_read=None, read_ema=None, streak=None):
        if obs.since_seen is None or obs.since_read is None:
            raise ValueError(
                "the reuse forecast needs obs.since_seen and obs.since_read (the reuse counts "
                "of importance.Stats), got None"
            )
        return imp.reuse_forecast(
            obs.since_seen,
            obs.since_read,
            obs.last_read if last_read is None else last_read,
            step,
            obs.valid,
            steps,
            read_ema=obs.read_ema if read_ema is None else read_ema,
            streak=obs.streak if streak is None else streak,
        )


@dataclasses.dataclass(frozen=True)
class Now:
    """Row 0 is the read set of the step planned for (obs.forecast[0]); rows 1 .. steps - 1 are
    `base`'s online forecast from the statistics with that step folded in, so a visit that
    starts now counts as begun. What a Quest-sparse step computes from its query before it reads
    the KV, and what the paper grants Page."""

    base: EMA | Reuse = EMA()
    oracle = False
    knows_now = True
    needs_forecast = True

    def __post_init__(self):
        if not isinstance(self.base, _Online):
            raise ValueError(
                f"Now refines an online forecast (EMA or Reuse), got {type(self.base).__name__}"
            )

    @property
    def name(self) -> str:
        return self.base.name

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def update(self, state, obs, env, steps: int):
        require_forecast("now", obs)
        r0 = (obs.forecast[0] > 0) & obs.valid
        a0 = r0.astype(jnp.float32)[None]
        if steps == 1:
            return state, Forecast(a0)
        last_read, read_ema, streak = imp.fold_reads(
            obs.last_read, obs.read_ema, obs.streak, r0, obs.step
        )
        rest = self.base.predict(obs, obs.step + 1, steps - 1, last_read, read_ema, streak)
        return state, Forecast(jnp.concatenate([a0, rest], axis=0))
