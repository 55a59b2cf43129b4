"""Recency lists of blocks, the state of the field's cache algorithms (`SequentialRule`s in
`jaxkv.placement.policies`: LRU, ARC, SLRU, LFU, W-TinyLFU), for one row (one layer's blocks).

A list is the blocks whose `where` equals its code (0: in no list); order within a list is by
`stamp`, a per-row clock value taken when the block last moved to the list's most recent end
(its MRU end): the least recent block of a list is the one with the smallest stamp. Every
operation is a vector op over the row's N blocks (no loop over blocks); one that names a block
takes its index, or N for none (the update is then dropped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, replace

INT_MAX = jnp.iinfo(jnp.int32).max
# the clock is pulled back by RENORM_SHIFT once it passes RENORM_AT (stamps older than that
# many accesses tie at 0, the least recent end): no int32 overflow in any decode
RENORM_AT = 1 << 30
RENORM_SHIFT = 1 << 29


@pytree_dataclass
class ListState:
    """One row's lists (leaves [N] per block, [] per row; the executor adds a [rows] axis)."""

    where: jax.Array  # [N] int32: the list each block is in (0: none)
    stamp: jax.Array  # [N] int32: when it last moved to its list's MRU end (larger: more recent)
    clock: jax.Array  # [] int32: the next stamp
    count: jax.Array | None = None  # [N] float32: access counts (LFU, W-TinyLFU), aged
    p: jax.Array | None = None  # [] float32: ARC's target size of its recency list T1


def empty(n: int, counts: bool = False, p: bool = False) -> ListState:
    """No block in any list."""
    return ListState(
        where=jnp.zeros((n,), jnp.int32),
        stamp=jnp.zeros((n,), jnp.int32),
        clock=jnp.int32(0),
        count=jnp.zeros((n,), jnp.float32) if counts else None,
        p=jnp.float32(0.0) if p else None,
    )


def size(st: ListState, lst: int):
    """[] int32: blocks in list `lst`."""
    return jnp.sum(st.where == lst).astype(jnp.int32)


def oldest(st: ListState, lst: int, among=None):
    """[] int32: the least recent block of list `lst` (of those also in `among` [N] bool, if
    given); N when there is none. Ties (equal stamps) go to the lower index."""
    n = st.where.shape[0]
    inside = st.where == lst
    if among is not None:
        inside &= among
    key = jnp.where(inside, st.stamp, INT_MAX)
    i = jnp.argmin(key).astype(jnp.int32)
    return jnp.where(jnp.any(inside), i, n)


def push(st: ListState, i, lst: int) -> ListState:
    """Block i (N: none) to the MRU end of list `lst`."""
    return replace(
        st,
        where=st.where.at[i].set(lst, mode="drop"),
        stamp=st.stamp.at[i].set(st.clock, mode="drop"),
        clock=st.clock + 1,
    )


def drop(st: ListState, i) -> ListState:
    """Block i (N: none) out of every list."""
    return replace(st, where=st.where.at[i].set(0, mode="drop"))


def restamp(st: ListState, mask, lst=None) -> ListState:
    """The blocks of `mask` [N] to the MRU end of their list (of `lst` if given: [] or [N]
    int32 codes), one after another in block order."""
    rank = jnp.cumsum(mask) - 1
    where = st.where if lst is None else jnp.where(mask, lst, st.where)
    return replace(
        st,
        where=where,
        stamp=jnp.where(mask, st.clock + rank, st.stamp).astype(jnp.int32),
        clock=(st.clock + jnp.sum(mask)).astype(jnp.int32),
    )


def rank_by_stamp(mask, stamp):
    """[N] int32: each block of `mask` ranked 0, 1, ... from the least recent (stamps, ties by
    index); -1 outside `mask`."""
    key = jnp.where(mask, stamp, INT_MAX)
    order = jnp.argsort(key, stable=True)
    rank = jnp.zeros(key.shape, jnp.int32).at[order].set(jnp.arange(key.shape[0], dtype=jnp.int32))
    return jnp.where(mask, rank, -1)


def demote_overflow(st: ListState, top: int, bottom: int, keep) -> ListState:
    """List `top` keeps its `keep` ([] int) most recent blocks; the rest move, least recent
    first, to the MRU end of list `bottom` (SLRU's protected segment spilling into its
    probationary one: one after another, each the least recent of `top` when it spilled)."""
    inside = st.where == top
    rank = rank_by_stamp(inside, st.stamp)
    out = inside & (rank < jnp.sum(inside) - jnp.maximum(keep, 0))
    return replace(
        st,
        where=jnp.where(out, bottom, st.where),
        stamp=jnp.where(out, st.clock + rank, st.stamp).astype(jnp.int32),
        clock=(st.clock + jnp.sum(out)).astype(jnp.int32),
    )


def sync(st: ListState, resident, valid, held, entry: int) -> ListState:
    """The lists after HBM changed outside the rule: blocks `resident` [N] bool but in none of
    the `held` list codes (the resident lists) join list `entry` at its MRU end in block order;
    blocks in a held list but no longer resident leave every list; blocks no longer `valid`
    leave every list (a freed sequence's ghosts too). Pulls the clock back when it runs far
    (RENORM_AT)."""
    in_held = jnp.isin(st.where, jnp.asarray(held, jnp.int32))
    where = jnp.where((in_held & ~resident) | ~valid, 0, st.where)
    st = replace(st, where=where)
    st = restamp(st, resident & ~in_held, entry)
    far = st.clock > RENORM_AT
    return replace(
        st,
        stamp=jnp.where(far, jnp.maximum(st.stamp - RENORM_SHIFT, 0), st.stamp),
        clock=jnp.where(far, st.clock - RENORM_SHIFT, st.clock).astype(jnp.int32),
    )


def age(st: ListState, step, period: int) -> ListState:
    """Counts halved at every `period`-th step (step > 0): LFU's aging."""
    due = (step > 0) & (step % period == 0)
    return replace(st, count=jnp.where(due, 0.5 * st.count, st.count))


def resident_in(st: ListState, held) -> jax.Array:
    """[N] bool: the blocks in any of the `held` list codes."""
    return jnp.isin(st.where, jnp.asarray(held, jnp.int32))


def where_any(cond, a, b):
    """`a` where the scalar `cond`, else `b`, leaf by leaf (a branch without lax.cond)."""
    return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)
