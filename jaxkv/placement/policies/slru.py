"""`Slru` ("slru"): Segmented LRU (Karedla, Love and Wherry, IEEE Computer 1994), in the step.

The cache is a probationary segment and a protected one of at most `protected` x c blocks.
A miss enters the probationary segment's MRU end, evicting the probationary segment's LRU
block when the cache is full (the protected segment's when the probationary one is empty); a
hit moves the block to the protected segment's MRU end, and when the protected segment
overflows its LRU block drops back to the probationary MRU end (still resident). Every miss
is admitted; the promotion rides the step's read. A step's hits, then its misses, arrive in
block order (`jaxkv.placement.admission`); c is the row's residents plus free slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.config import check_number
from jaxkv.placement import lists, registry
from jaxkv.placement.admission import SequentialRule
from jaxkv.placement.policies.base import KeepsPlacement

PROB, PROT = 1, 2
PROTECTED = 0.8  # the protected segment's share (Caffeine's main cache uses 80%)


def protected_size(share: float, cap):
    """[] int32: the protected segment's size, floor(share x cap)."""
    return jnp.floor(share * cap.astype(jnp.float32)).astype(jnp.int32)


def slru_hits(st, hits, lst, keep):
    """The hits of `hits` [N] to the MRU end of the protected list, one after another in block
    order, each overflow of the protected list (beyond `keep` blocks) dropping its LRU block to
    the probationary list's MRU end: the lists after all of them (their order follows from the
    stamps; `lists.demote_overflow`). `lst`: (probationary, protected) codes."""
    prob, prot = lst
    st = lists.restamp(st, hits, prot)
    return lists.demote_overflow(st, prot, prob, keep)


@dataclasses.dataclass(frozen=True)
class SlruRule(SequentialRule):
    """SLRU, one row (`SequentialRule`'s hooks)."""

    protected: float = PROTECTED

    def init_row(self, n: int):
        return lists.empty(n)

    def sync(self, st, resident, valid, step, cap):
        return lists.sync(st, resident, valid, (PROB, PROT), PROB)

    def touch(self, st, hits, reads, cap):
        return slru_hits(st, hits, (PROB, PROT), protected_size(self.protected, cap))

    def miss(self, st, b, cap):
        n = st.where.shape[0]
        full = lists.size(st, PROB) + lists.size(st, PROT) >= cap
        victim = jnp.where(lists.size(st, PROB) > 0, lists.oldest(st, PROB), lists.oldest(st, PROT))
        st = lists.drop(st, jnp.where(full, victim, n))
        return lists.push(st, jnp.where(cap > 0, b, n), PROB)

    def resident(self, st):
        return (st.where == PROB) | (st.where == PROT)


@dataclasses.dataclass(frozen=True)
class Slru(KeepsPlacement):
    """SLRU: a probationary and a protected segment; a hit protects, a miss is on probation.

    protected: the protected segment's share of the blocks a layer holds, in [0, 1]."""

    name: str = "slru"
    protected: float = PROTECTED

    def __post_init__(self):
        check_number("Slru protected", self.protected, low=0.0, high=1.0)

    @property
    def rule(self):
        return SlruRule(self.protected)


registry.register_class(
    Slru,
    kind="field",
    doc="segmented LRU: a miss is on probation, a hit protects",
)
