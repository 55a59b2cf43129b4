"""`LruPlan` ("lru-plan"): LRU as a plan every W steps, each promotion a link read of its own.

Not the field's LRU: the field's hot buffer (`jaxkv.placement.policies.lru.Lru`, "lru") admits
a block the step read from the copy the read fetched, at every step. This one plans between
steps (every `PlacementConfig.window` steps) a target of the blocks read most recently and
migrates to it, reading each promoted block over the link again; it is the paper's Reactive
policy in the trace simulator, where a promotion of a block read at the planned step rides
that read.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.placement import registry
from jaxkv.placement.policies.base import Observation, PolicyBase, top_capacity


@dataclasses.dataclass(frozen=True)
class LruPlan(PolicyBase):
    """LRU planned every W steps: blocks read most recently belong in HBM.

    Ties (same last-read step) keep blocks where they are, so nothing moves without a reason.
    """

    name: str = "lru-plan"

    def plan(self, state, obs: Observation, env=None):
        score = obs.last_read.astype(jnp.float32) + 0.5 * obs.in_hbm
        return state, top_capacity(score, obs.valid, obs.capacity)


registry.register_class(
    LruPlan,
    kind="online",
    doc="LRU planned every W steps, each promotion read over the link again (the paper's Reactive)",
    aliases=("reactive",),
)
