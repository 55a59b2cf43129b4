"""`TinyLfu` ("tinylfu"): W-TinyLFU (Einziger, Friedman and Manes, ACM TOS 2017; Caffeine's
eviction policy), inside the step.

A small admission window (LRU, `window` x c blocks, at least one) in front of a main cache
(SLRU: a probationary and a protected segment, `protected` of the main cache). A miss enters
the window's MRU end; when the window overflows, its LRU block is the candidate: it joins the
main cache's probationary MRU end if the cache has room, else it competes with the main
cache's victim (the probationary LRU block, the protected one's when the probationary segment
is empty) and wins only with a strictly higher frequency (TinyLFU's admission filter); the
loser leaves HBM. Frequencies are exact per-block read counts halved every `period` steps (the
paper's sketch approximates such counts, and its reset halves them). Hits move a window block
to the window's MRU end and a main block to the protected MRU end (SLRU). A miss's promotion
rides the step's read; a step's reads are counted first, then its hits and its misses arrive
in block order (`jaxkv.placement.admission`); c is the row's residents plus free slots.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv._pytree import replace
from jaxkv.config import check_number
from jaxkv.placement import lists, registry
from jaxkv.placement.admission import SequentialRule
from jaxkv.placement.policies.base import KeepsPlacement
from jaxkv.placement.policies.lfu import AGING_PERIOD, aged
from jaxkv.placement.policies.slru import PROTECTED, protected_size, slru_hits

WIN, PROB, PROT = 1, 2, 3
WINDOW = 0.01  # the admission window's share of the blocks (Caffeine's default)


def window_size(share: float, cap):
    """[] int32: the window's blocks, round(share x cap) but at least 1 (0 when cap is 0)."""
    w = jnp.round(share * cap.astype(jnp.float32)).astype(jnp.int32)
    return jnp.minimum(jnp.maximum(w, 1), cap)


@dataclasses.dataclass(frozen=True)
class TinyLfuRule(SequentialRule):
    """W-TinyLFU, one row (`SequentialRule`'s hooks)."""

    window: float = WINDOW
    protected: float = PROTECTED
    period: int = AGING_PERIOD

    def init_row(self, n: int):
        return lists.empty(n, counts=True)

    def sync(self, st, resident, valid, step, cap):
        st = aged(lists.sync(st, resident, valid, (WIN, PROB, PROT), WIN), valid, step, self.period)
        # blocks that entered HBM outside the rule took free slots: the window's overflow
        # moves to the main cache, which has room for it
        return lists.demote_overflow(st, WIN, PROB, window_size(self.window, cap))

    def touch(self, st, hits, reads, cap):
        st = replace(st, count=st.count + reads)
        main = cap - window_size(self.window, cap)
        win_hits = hits & (st.where == WIN)
        st = lists.restamp(st, win_hits)
        return slru_hits(st, hits & ~win_hits, (PROB, PROT), protected_size(self.protected, main))

    def miss(self, st, b, cap):
        n = st.where.shape[0]
        st = lists.push(st, jnp.where(cap > 0, b, n), WIN)
        total = lists.size(st, WIN) + lists.size(st, PROB) + lists.size(st, PROT)
        over = lists.size(st, WIN) > window_size(self.window, cap)
        cand = lists.oldest(st, WIN)
        victim = jnp.where(lists.size(st, PROB) > 0, lists.oldest(st, PROB), lists.oldest(st, PROT))
        room = total <= cap
        wins = (victim < n) & (
            st.count[jnp.minimum(cand, n - 1)] > st.count[jnp.minimum(victim, n - 1)]
        )
        admitted = over & (room | wins)
        st = lists.drop(st, jnp.where(admitted & ~room, victim, n))
        st = lists.push(st, jnp.where(admitted, cand, n), PROB)
        st = lists.drop(st, jnp.where(over & ~admitted, cand, n))
        # a pool that shrank below its blocks (the window within its size): the main victim goes
        return lists.drop(st, jnp.where(~over & ~room, victim, n))

    def resident(self, st):
        return (st.where == WIN) | (st.where == PROB) | (st.where == PROT)


@dataclasses.dataclass(frozen=True)
class TinyLfu(KeepsPlacement):
    """W-TinyLFU: a small LRU window, then a frequency filter in front of an SLRU main cache.

    window: the window's share of a layer's blocks (at least one block), in [0, 1].
    protected: the protected segment's share of the main cache, in [0, 1].
    period: steps between halvings of every block's read count (an int >= 1)."""

    name: str = "tinylfu"
    window: float = WINDOW
    protected: float = PROTECTED
    period: int = AGING_PERIOD

    def __post_init__(self):
        check_number("TinyLfu window", self.window, low=0.0, high=1.0)
        check_number("TinyLfu protected", self.protected, low=0.0, high=1.0)
        check_number("TinyLfu period", self.period, integer=True, low=1)

    @property
    def rule(self):
        return TinyLfuRule(self.window, self.protected, self.period)


registry.register_class(
    TinyLfu,
    kind="field",
    doc="W-TinyLFU: an LRU window, then a frequency filter in front of an SLRU (Caffeine)",
)
