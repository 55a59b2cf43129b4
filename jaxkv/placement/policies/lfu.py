"""`Lfu` ("lfu"): LFU with aging, inside the step.

Every block keeps a count of the steps that read it, resident or not (perfect LFU), halved
every `period` steps (aging, so a block hot long ago does not stay forever). Every miss is
admitted (the promotion rides the step's read), evicting the resident block with the lowest
count when the pool is full, the least recently read among equal counts. A step's reads are
counted first, then its hits set recency and its misses arrive in block order
(`jaxkv.placement.admission`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv._pytree import replace
from jaxkv.config import check_number
from jaxkv.placement import lists, registry
from jaxkv.placement.admission import SequentialRule
from jaxkv.placement.policies.base import KeepsPlacement

RES = 1
AGING_PERIOD = 16  # steps between halvings of the counts


def aged(st, valid, step, period: int):
    """The counts at the start of a step: halved at every `period`-th step (`lists.age`); a
    block no longer `valid` [N] bool (a freed sequence's) starts again from zero."""
    return lists.age(replace(st, count=jnp.where(valid, st.count, 0.0)), step, period)


def least_frequent(st, lst, among):
    """[] int32: of list `lst`'s blocks (also in `among` [N] bool), the one with the lowest
    count, the least recent among equal counts; N for none."""
    inside = (st.where == lst) & among
    low = jnp.min(jnp.where(inside, st.count, jnp.inf))
    return lists.oldest(st, lst, among=inside & (st.count == low))


@dataclasses.dataclass(frozen=True)
class LfuRule(SequentialRule):
    """LFU with aging, one row (`SequentialRule`'s hooks)."""

    period: int = AGING_PERIOD

    def init_row(self, n: int):
        return lists.empty(n, counts=True)

    def sync(self, st, resident, valid, step, cap):
        return aged(lists.sync(st, resident, valid, (RES,), RES), valid, step, self.period)

    def touch(self, st, hits, reads, cap):
        return lists.restamp(replace(st, count=st.count + reads), hits)

    def miss(self, st, b, cap):
        n = st.where.shape[0]
        full = lists.size(st, RES) >= cap
        victim = least_frequent(st, RES, jnp.ones_like(st.where, bool))
        st = lists.drop(st, jnp.where(full, victim, n))
        return lists.push(st, jnp.where(cap > 0, b, n), RES)

    def resident(self, st):
        return st.where == RES


@dataclasses.dataclass(frozen=True)
class Lfu(KeepsPlacement):
    """LFU with aging: admit every host read, evict the least frequently read.

    period: steps between halvings of every block's read count (an int >= 1)."""

    name: str = "lfu"
    period: int = AGING_PERIOD

    def __post_init__(self):
        check_number("Lfu period", self.period, integer=True, low=1)

    @property
    def rule(self):
        return LfuRule(self.period)


registry.register_class(
    Lfu,
    kind="field",
    doc="LFU with aging: admit every host read, evict the least frequently read",
)
