"""`Lru` ("lru"): the field's LRU hot buffer, inside the decode step.

Every block a step reads from host is admitted to HBM from the copy the read fetched (an HBM
write, no second link read), evicting the least recently read resident block when the pool is
full, blocks read at this step included: what SGLang's HiSparse hot buffer and vLLM's CPU
offload with LRU eviction do. Run as written (Denning; any OS textbook) by the sequential
executor, one access at a time: a step's hits in block order, then its misses in block order
(`jaxkv.placement.admission`). When the pool is smaller than a step's read set it thrashes:
the step's last misses evict the blocks its earlier reads brought in.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.placement import lists, registry
from jaxkv.placement.admission import SequentialRule
from jaxkv.placement.policies.base import KeepsPlacement

RES = 1  # the one list: resident blocks by recency


@dataclasses.dataclass(frozen=True)
class LruRule(SequentialRule):
    """LRU, one row (`SequentialRule`'s hooks)."""

    def init_row(self, n: int):
        return lists.empty(n)

    def sync(self, st, resident, valid, step, cap):
        return lists.sync(st, resident, valid, (RES,), RES)

    def touch(self, st, hits, reads, cap):
        return lists.restamp(st, hits)

    def miss(self, st, b, cap):
        n = st.where.shape[0]
        full = lists.size(st, RES) >= cap
        st = lists.drop(st, jnp.where(full, lists.oldest(st, RES), n))
        return lists.push(st, jnp.where(cap > 0, b, n), RES)

    def resident(self, st):
        return st.where == RES


@dataclasses.dataclass(frozen=True)
class Lru(KeepsPlacement):
    """The LRU hot buffer: admit every host read, evict the least recently read."""

    name: str = "lru"

    @property
    def rule(self):
        return LruRule()


registry.register_class(
    Lru,
    kind="field",
    doc="the LRU hot buffer: admit every host read, evict the least recently read (SGLang "
    "HiSparse, vLLM offload)",
)
