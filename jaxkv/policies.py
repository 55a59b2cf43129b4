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
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, static_field


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
    capacity: int = static_field(default=0)  # HBM pool slots per layer


class Policy(Protocol):
    name: str

    def init(self, num_layers: int, num_blocks: int) -> Any: ...

    def plan(self, state: Any, obs: Observation) -> tuple[Any, jax.Array]:
        """Returns (new state, target [layers, N] bool) with target <= valid, sum <= capacity."""
        ...


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


POLICIES: dict[str, type] = {"static": Static, "lru": Reactive, "reactive": Reactive}


def get_policy(name: str, **kwargs) -> Policy:
    """Builds a policy by name; unknown names raise ValueError listing the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)
