"""`Arc` ("arc"): Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), inside the step.

The cache holds T1 (blocks seen once recently) and T2 (seen at least twice), c blocks in all;
ghost lists B1 and B2 remember blocks recently evicted from T1 and T2 (their ids only; here,
blocks on host). A hit moves the block to T2's MRU end. A miss on a ghost of B1 (B2) grows
(shrinks) the target size p of T1 by max(|B2| / |B1|, 1) (max(|B1| / |B2|, 1)), calls
REPLACE and admits the block to T2; any other miss trims the directory (case IV of the paper's
Fig. 4) and admits it to T1. REPLACE evicts T1's LRU block to B1 when |T1| > p (or |T1| = p
and the miss is a B2 ghost), else T2's to B2. Every miss is admitted (ARC does not bypass):
the promotion rides the step's read, as in vLLM's CPU offload with ARC eviction.

Two adaptations, because a layer's pool here changes size (a tail takes a slot, a finished
sequence frees its blocks) where the paper's cache is fixed: c is the row's residents plus free
slots at this step (`SequentialRule`), and REPLACE runs only when T1 and T2 fill c (the paper's
invariants guarantee it there); REPLACE takes T1's block when T2 is empty. A step's hits, then
its misses, arrive in block order (`jaxkv.placement.admission`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv._pytree import replace
from jaxkv.placement import lists, registry
from jaxkv.placement.admission import SequentialRule
from jaxkv.placement.policies.base import KeepsPlacement

T1, T2, B1, B2 = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class ArcRule(SequentialRule):
    """ARC, one row (`SequentialRule`'s hooks)."""

    def init_row(self, n: int):
        return lists.empty(n, p=True)

    def sync(self, st, resident, valid, step, cap):
        return lists.sync(st, resident, valid, (T1, T2), T1)

    def touch(self, st, hits, reads, cap):
        return lists.restamp(st, hits, T2)  # case I, for every hit

    def miss(self, st, b, cap):
        n = st.where.shape[0]
        c = cap.astype(jnp.float32)
        t1, t2, b1, b2 = (lists.size(st, x) for x in (T1, T2, B1, B2))
        in_b1, in_b2 = st.where[b] == B1, st.where[b] == B2
        new = ~in_b1 & ~in_b2
        full = t1 + t2 >= cap
        p = st.p  # cases II and III: adapt p
        p = jnp.where(in_b1, jnp.minimum(c, p + jnp.maximum(b2 / jnp.maximum(b1, 1), 1.0)), p)
        p = jnp.where(in_b2, jnp.maximum(0.0, p - jnp.maximum(b1 / jnp.maximum(b2, 1), 1.0)), p)
        st = replace(st, p=p)
        l1 = t1 + b1  # case IV: trim the directory
        case_a = new & (l1 >= cap)
        case_b = new & (l1 < cap) & (l1 + t2 + b2 >= cap)
        a_ghost, a_evict = case_a & (t1 < cap), case_a & (t1 >= cap)
        st = lists.drop(st, jnp.where(a_ghost, lists.oldest(st, B1), n))
        st = lists.drop(st, jnp.where(a_evict, lists.oldest(st, T1), n))
        st = lists.drop(st, jnp.where(case_b & (l1 + t2 + b2 >= 2 * cap), lists.oldest(st, B2), n))
        # REPLACE(x, p), where the cache is full
        rep = (in_b1 | in_b2 | a_ghost | case_b) & full
        from_t1 = ((t1 >= 1) & ((in_b2 & (t1 == p)) | (t1 > p))) | (t2 == 0)
        st = lists.push(st, jnp.where(rep & from_t1, lists.oldest(st, T1), n), B1)
        st = lists.push(st, jnp.where(rep & ~from_t1, lists.oldest(st, T2), n), B2)
        return lists.push(st, jnp.where(cap > 0, b, n), jnp.where(new, T1, T2))

    def resident(self, st):
        return (st.where == T1) | (st.where == T2)


@dataclasses.dataclass(frozen=True)
class Arc(KeepsPlacement):
    """ARC: recency and frequency lists balanced by ghost hits."""

    name: str = "arc"

    @property
    def rule(self):
        return ArcRule()


registry.register_class(
    Arc,
    kind="field",
    doc="Adaptive Replacement Cache: recency and frequency lists balanced by ghost hits",
)
