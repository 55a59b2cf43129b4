"""The policy protocol: what the decode loop and the simulators use of a placement policy.

A policy has up to two parts. Its plan looks at an `Observation` of one window boundary (per
layer, per block: where it lives, whether it is sealed, when it was last read, its decayed read
statistics, and optionally a forecast of the next steps' reads) and returns the target set of
blocks that should live in HBM; `jaxkv.cache.plan_moves` turns the difference between the
current placement and the target into a bounded list of migrations. Its in-step rule
(`Policy.rule`, a `jaxkv.placement.admission.Rule`) runs inside every step after the step's
reads and promotes host blocks the step read, from the copies the read fetched. Policies are
frozen dataclasses (hashable, usable as static jit arguments); the state a plan keeps between
windows is a pytree returned by `init` and threaded through `plan`; a rule's state is its own
(`Rule.init`). The environment a plan is priced in (hardware profile, block and weight bytes,
demotion cost) is one static `jaxkv.cost.CostModel` given to `plan`, never a policy field.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, static_field

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
    """What the decode loop and the simulators use of a policy.

    name: its name (the one it is registered under, `jaxkv.placement.registry`).
    horizon: rows of obs.forecast (future reads) a plan reads; 1 when it needs none.
    needs_forecast: obs.forecast must be given (an oracle, or a plan that knows its step); the
      decode loop refuses such a policy.
    needs_values: obs.value_to_go must be given (the LP dual's values: `jaxkv.sim.lp.bound`).
    rule: the in-step rule the caller runs at every step (`jaxkv.placement.admission.Rule`),
      or None.
    budget: blocks a plan (or a step's rule) may move per layer; None = the caller's
      (`PlacementConfig.max_moves` in the decode loop, unbounded in the trace simulator).
    adapts_window: the policy sets its own steps between plans (`next_window` varies).
    plans (optional, True when absent): False when `plan` keeps the placement as it is
      (static, lrfu, the field's rules). prompt_prior, lookahead (optional, False when
      absent): `Lrfu`'s.
    """

    name: str
    horizon: int
    needs_forecast: bool
    needs_values: bool
    rule: Any
    budget: int | None
    adapts_window: bool

    def init(self, num_layers: int, num_blocks: int) -> Any:
        """The policy's state before the first plan (a pytree)."""
        ...

    def plan(self, state: Any, obs: Observation, env) -> tuple[Any, jax.Array]:
        """Returns (new state, target [layers, N] bool) with target <= valid, sum <= capacity."""
        ...

    def next_window(self, state: Any) -> jax.Array:
        """[] int32: steps from this plan to the next."""
        ...


class PolicyBase:
    """The defaults of the `Policy` attributes, for policies without state or forecast. A
    policy with a `follow` field (`Anneal`, `Lrfu`) has that rule as its `rule`."""

    horizon = 1
    needs_forecast = False
    needs_values = False
    budget = None
    adapts_window = False
    plans = True  # False: `plan` keeps the placement as it is (no target, nothing to time)
    prompt_prior = False  # True: start from the prompt's prior (`jaxkv.decode.prompt`)
    lookahead = False  # True: layer 0's next reads join its value (`Lrfu.lookahead`)

    @property
    def rule(self):
        """The in-step rule (`jaxkv.placement.admission.Rule`), or None."""
        return getattr(self, "follow", None)

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def next_window(self, state) -> jax.Array:
        return jnp.int32(getattr(self, "window", 1))


class KeepsPlacement(PolicyBase):
    """A policy whose plan keeps the placement as it is: all its work is its in-step rule (or
    none: `Static`). It never plans (`plans` False, the next window never comes)."""

    plans = False

    def plan(self, state, obs: Observation, env=None):
        return state, obs.in_hbm & obs.valid

    def next_window(self, state) -> jax.Array:
        return jnp.int32(NEVER)


def plans(policy) -> bool:
    """Whether `policy`'s plan can change the placement (`Policy.plans`; True when absent)."""
    return getattr(policy, "plans", True)


def rule_of(policy):
    """`policy`'s in-step rule, or None."""
    return getattr(policy, "rule", None)


def looks_ahead(policy) -> bool:
    """Whether `policy`'s rule values layer 0's next reads (`Lrfu.lookahead`)."""
    return bool(getattr(policy, "lookahead", False)) and rule_of(policy) is not None


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
