"""Block migrations between the tiers of a TieredKVCache (re-exported by `jaxkv.cache`).

`plan_moves` turns a target placement into at most `max_moves` promotions per layer, paired with
the demotions that make room for them; `migrate` applies such a `Moves`: every read first (host
-> device for the promotions, HBM -> device for the demotions), then one bulk write per pool and
direction (`jaxkv.cache.transfer`), then the block table and free masks. Under a write-through host
tier (`CacheConfig.host_tier`) a demotion copies nothing: the block already has its host copy, so
it only frees its HBM slot; a promotion copies the host block into HBM and keeps the copy.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, replace
from jaxkv.cache.layout import (
    TieredKVCache,
    read_hbm,
    read_host,
    run_in_kinds,
    write_hbm,
    write_host,
)
from jaxkv.cache.slots import compacted, first_free, nth, take
from jaxkv.cache.transfer import rows_of
from jaxkv.config import TIER_HBM, TIER_HOST


@pytree_dataclass
class Moves:
    """Migrations per layer, flattened block index n = sequence * max_blocks + logical block."""

    demote: jax.Array  # [layers, max_moves] int32: HBM -> host
    promote: jax.Array  # [layers, max_moves] int32: host -> HBM
    num_demote: jax.Array  # [layers] int32: leading valid entries of `demote`
    num_promote: jax.Array  # [layers] int32: leading valid entries of `promote`


def plan_moves(
    cache: TieredKVCache, target: jax.Array, max_moves: int, *, demote_first=None
) -> Moves:
    """Turns a target placement into at most `max_moves` promotions per layer, paired with the
    demotions that make room for them (HBM capacity is never exceeded).

    Promotions are taken in block order; demotions of blocks outside the target are taken only as
    needed to free room, plus any surplus when the target asks for fewer HBM blocks.

    Args:
      target: [layers, batch * max_blocks] or [layers, batch, max_blocks] bool, the sealed blocks
        that should live in HBM. Entries for unsealed blocks are ignored.
      max_moves: static migration budget per layer (promotions; demotions bounded the same way).
      demote_first: optional [layers, N] bool, blocks to demote before any other (e.g. those a
        sliding window has passed, which are never read again); block order otherwise.
    """
    c = cache.config
    L, N = c.num_layers, c.batch * c.max_blocks
    return plan_moves_masks(
        cache.in_hbm.reshape(L, N),
        cache.sealed.reshape(L, N),
        jnp.sum(cache.hbm_free, axis=1),
        target.reshape(L, N),
        max_moves,
        demote_first=demote_first,
    )


def plan_moves_masks(in_hbm, sealed, n_free, target, max_moves: int, *, demote_first=None) -> Moves:
    """`plan_moves` on placement masks: in_hbm, sealed, target [layers, N] bool and n_free
    [layers] free HBM slots (the simulator's replay of the decode loop, `jaxkv.sim.loop`, plans
    its moves with this same function)."""
    L, N = in_hbm.shape
    want_in = target & sealed & ~in_hbm
    want_out = in_hbm & ~target
    k = max(0, min(max_moves, N))

    def first_k(mask, first=None):  # the first k set entries per layer (vectorized, top_k)
        if k == 0:
            return jnp.zeros((L, 0), jnp.int32), jnp.zeros((L,), jnp.int32)
        score = -jnp.arange(N)[None]
        if first is not None:  # `first` entries ahead of all others, each group in block order
            score = jnp.where(first.reshape(L, N), score + N, score)
        score = jnp.where(mask, score, -N - 1)
        _, idx = jax.lax.top_k(score, k)
        return idx.astype(jnp.int32), jnp.minimum(jnp.sum(mask, axis=1), k).astype(jnp.int32)

    promote, n_in = first_k(want_in)
    demote, n_out = first_k(want_out, demote_first)
    # demote what is needed for the promotions (beyond free slots), at least; all surplus if room
    n_out = jnp.minimum(n_out, jnp.maximum(n_in - n_free, 0) + jnp.maximum(n_out - n_in, 0))
    n_in = jnp.minimum(n_in, n_free + n_out)
    return Moves(demote=demote, promote=promote, num_demote=n_out, num_promote=n_in)


def _moves_applying(idx, count, sealed, tier, src_tier):
    """(clamped indices, [rows, K] bool): entries i < count of flat block indices `idx`
    [rows, K] that are sealed, in `src_tier` and the first occurrence of their block."""
    rows, K = idx.shape
    N = sealed.shape[1]
    i = jnp.arange(K)[None]
    safe = jnp.clip(idx, 0, N - 1)
    ok = (i < count[:, None]) & (idx >= 0) & (idx < N)
    ok &= take(sealed, safe) & (take(tier, safe) == src_tier)
    r = jnp.arange(rows)[:, None]
    first = (
        jnp.full((rows, N), K, jnp.int32)
        .at[r, jnp.where(ok, safe, N)]
        .min(jnp.broadcast_to(i, (rows, K)).astype(jnp.int32), mode="drop")
    )
    return safe, ok & (take(first, safe) == i)


def migrate(
    cache: TieredKVCache, moves: Moves, layers=None, *, after_reads=None, fetched=None
) -> tuple[TieredKVCache, jax.Array]:
    """Applies `moves`: per layer its demotions (HBM -> host), then its promotions
    (host -> HBM), all of them in one bulk read and one bulk write per pool and direction.

    Contents are copied bit for bit (an FP8 block's values and scale: re-quantizing them
    is exact); table and free masks are updated. Entries that do not
    apply (past the count, a block not sealed, already in the destination tier, or listed
    twice) are skipped. Every read happens before any write, so a promotion may take the HBM
    slot a demotion frees and a demotion the host slot a promotion frees. Demotions beyond the
    host pool's room are dropped (exclusive host tier; under write-through a demotion writes
    nothing and frees its HBM slot, a promotion keeps the host copy). When HBM has too few
    free slots for the promotions, the resident sealed blocks of the lowest flat index that
    are not being demoted make room
    (use `plan_moves` to control which blocks leave); a block promoted here is never evicted
    here.

    Args:
      layers: python ints, the layers whose moves to apply (default: all); the others' moves
        are not traced at all (the decode loop's in-step plans move one layer at a time).
      after_reads: results of the caller's earlier reads of the host pools (e.g. the
        attention outputs of the layers already read this step), which the in-place host
        writes must follow (`jaxkv.cache.transfer.after`); None if there are none.
      fetched: (k, v), each [layers, P, block_size, kv_heads, head_dim] on the device: the
        contents of the blocks `moves.promote` lists (entry by entry, P its width), already
        read from host by the caller (the decode loop's host read of this step); the
        promotions then write them to HBM without reading the host pool again. None: read.
    Returns:
      (new cache, [layers] int32 number of blocks copied between the tiers (exclusive: every
      block moved; write-through: the promotions); 0 outside `layers`).
    """
    L = cache.config.num_layers
    chosen = tuple(range(L)) if layers is None else tuple(layers)
    bad = [x for x in chosen if not (isinstance(x, int) and 0 <= x < L)]
    if bad:
        raise ValueError(f"migrate layers {bad} out of range: expected ints in [0, {L})")
    if not chosen:
        raise ValueError("migrate layers=() names no layer: pass None for all layers")
    if moves.demote.shape[1] + moves.promote.shape[1] == 0:  # a zero migration budget
        return cache, jnp.zeros((L,), jnp.int32)
    return run_in_kinds(_migrate, cache, moves, after_reads, fetched, pair=True, layers=chosen)


class _Transfers(NamedTuple):
    """The applying moves of the chosen layers, per chosen layer (nl of them)."""

    out_blk: jax.Array  # [nl, Kd + Kp] flat blocks leaving HBM: the demotions, then victims
    out_src: jax.Array  # [nl, Kd + Kp] their HBM slots
    out_dst: jax.Array  # [nl, Kd + Kp] their host slots
    out_ok: jax.Array  # [nl, Kd + Kp] bool: the entries that move
    p_blk: jax.Array  # [nl, Kp] flat blocks promoted
    p_src: jax.Array  # [nl, Kp] their host slots
    p_dst: jax.Array  # [nl, Kp] their HBM slots
    p_ok: jax.Array  # [nl, Kp] bool: the entries that move
    p_from: jax.Array | None  # [nl, Kp]: the `moves.promote` entry of each (None: not needed)
    moved: jax.Array  # [nl] int32: blocks moved


def _migrate(cache: TieredKVCache, moves: Moves, after_reads, fetched, *, layers: tuple):
    ls = jnp.asarray(layers, jnp.int32)
    nl, N = len(layers), cache.config.batch * cache.config.max_blocks
    tier, slot, sealed = (a[ls].reshape(nl, N) for a in (cache.tier, cache.slot, cache.sealed))
    hbm_free, host_free = cache.hbm_free[ls], cache.host_free[ls]
    wt = cache.config.write_through
    pages = jnp.broadcast_to(cache.host_page.reshape(1, N), (nl, N)) if wt else None
    t = _plan_transfers(
        moves, ls, tier, slot, sealed, hbm_free, host_free, fetched is not None, pages
    )
    pk, pv = _promoted_blocks(cache, moves, ls, t, fetched)
    pools = _write_pools(cache, ls, t, pk, pv, after_reads)
    return _with_tables(cache, ls, t, pools, (tier, slot, hbm_free, host_free))


def _applying_entries(moves: Moves, ls, tier, sealed, with_from: bool):
    """The entries of `moves` for layers `ls` that apply, moved to the front: demotions
    [nl, Kd] and their counts [nl], promotions [nl, Kp] and their counts, and (`with_from`)
    the listed entry each promotion came from, else None."""
    d_blk, d_ok = _moves_applying(moves.demote[ls], moves.num_demote[ls], sealed, tier, TIER_HBM)
    p_blk, p_ok = _moves_applying(moves.promote[ls], moves.num_promote[ls], sealed, tier, TIER_HOST)
    d_blk, n_d = compacted(d_ok, d_blk)
    p_from = None
    if with_from:  # which listed entry each compacted promotion came from
        entry = jnp.broadcast_to(jnp.arange(moves.promote.shape[1], dtype=jnp.int32), p_ok.shape)
        p_from = compacted(p_ok, entry)[0]
    p_blk, n_p = compacted(p_ok, p_blk)
    return d_blk, n_d, p_blk, n_p, p_from


def _victims(tier, sealed, d_blk, n_d, n_p, n_hbm_free, Kp: int):
    """The resident sealed blocks that leave HBM for the promotions beyond its free slots and
    those the demotions free: not being demoted, lowest flat index first.
    Returns (blocks [nl, Kp], count [nl])."""
    nl, N = tier.shape
    Kd = d_blk.shape[1]
    demoted = (
        jnp.zeros((nl, N), bool)
        .at[jnp.arange(nl)[:, None], jnp.where(jnp.arange(Kd)[None] < n_d[:, None], d_blk, N)]
        .set(True, mode="drop")
    )
    resident = sealed & (tier == TIER_HBM) & ~demoted
    v_blk, n_res = first_free(resident, Kp)
    return v_blk, jnp.clip(n_p - n_hbm_free - n_d, 0, n_res)


def _plan_transfers(moves: Moves, ls, tier, slot, sealed, hbm_free, host_free, with_from, pages):
    """Which blocks move and between which slots ([nl, N] tables of the chosen layers). Under a
    write-through host tier (`pages` [nl, N]: each block's host page, `host_page`; None for
    an exclusive one) a block leaving HBM goes back to its host copy."""
    write_through = pages is not None
    d_blk, n_d, p_blk, n_p, p_from = _applying_entries(moves, ls, tier, sealed, with_from)
    Kd, Kp = d_blk.shape[1], p_blk.shape[1]
    hbm_list, n_hbm_free = first_free(hbm_free, Kp)
    if not write_through:  # host room: free slots and those the promotions free
        host_list, n_host_free = first_free(host_free, Kd + Kp)
        n_d = jnp.minimum(n_d, n_host_free + n_p)
    v_blk, n_v = _victims(tier, sealed, d_blk, n_d, n_p, n_hbm_free, Kp)
    n_p = jnp.minimum(n_p, n_hbm_free + n_d + n_v)

    # slots: HBM -> host writes (demotions, then victims) take the free host slots, then those
    # the promotions vacate; promotions take the free HBM slots, then those vacated
    d_src = take(slot, d_blk)  # [nl, Kd] HBM slots
    v_src = take(slot, v_blk)  # [nl, Kp]
    p_src = take(slot, p_blk)  # [nl, Kp] host slots
    out_blk = jnp.concatenate([d_blk, v_blk], axis=1)  # [nl, Kd + Kp]
    out_src = jnp.concatenate([d_src, v_src], axis=1)
    j = jnp.arange(Kd + Kp)[None]
    out_ok = jnp.where(j < Kd, j < n_d[:, None], j - Kd < n_v[:, None])
    if write_through:  # a block's host copy is at its page: nothing is written
        out_dst = take(pages, out_blk)
    else:
        out_rank = jnp.where(j < Kd, j, n_d[:, None] + j - Kd)
        out_dst = nth(out_rank, host_list, n_host_free, p_src)
    vacated = compacted(out_ok, out_src)[0]  # HBM slots of demotions then victims
    r = jnp.arange(Kp)[None]
    p_dst = nth(r, hbm_list, n_hbm_free, vacated)
    return _Transfers(
        out_blk=out_blk,
        out_src=out_src,
        out_dst=out_dst,
        out_ok=out_ok,
        p_blk=p_blk,
        p_src=p_src,
        p_dst=p_dst,
        p_ok=r < n_p[:, None],
        p_from=p_from,
        moved=n_p if write_through else n_d + n_v + n_p,
    )


def _promoted_blocks(cache: TieredKVCache, moves: Moves, ls, t: _Transfers, fetched):
    """The promoted blocks' contents, (k, v) each [nl * Kp, block, kv_heads, head_dim] on the
    device: read from the host pools, or (given `fetched`) picked from the caller's read."""
    c = cache.config
    blk = cache.hbm_k.shape[2:]
    if fetched is None:
        p_rows = rows_of(ls[:, None], t.p_src, t.p_ok, c.host_slots).reshape(-1)
        return read_host(cache, p_rows)
    fk, fv = fetched
    want = (c.num_layers, moves.promote.shape[1], *blk)
    if tuple(fk.shape) != want or tuple(fv.shape) != want:
        raise ValueError(
            f"migrate fetched blocks have shapes {tuple(fk.shape)}, {tuple(fv.shape)}: "
            f"expected {want} (layers, promote entries, block)"
        )
    pick = jnp.arange(ls.shape[0])[:, None]
    pk = fk[ls][pick, t.p_from].reshape(-1, *blk).astype(c.jnp_dtype)
    pv = fv[ls][pick, t.p_from].reshape(-1, *blk).astype(c.jnp_dtype)
    return pk, pv


def _write_pools(cache: TieredKVCache, ls, t: _Transfers, pk, pv, after_reads):
    """The blocks leaving HBM written to host (after every read: the promotions' `pk`, `pv` and
    the caller's `after_reads`), the promoted ones to HBM: the changed pool fields (FP8 blocks
    are dequantized and re-quantized on the device, which gives back their bytes)."""
    c = cache.config
    lay = ls[:, None]
    nl, Kp = t.p_blk.shape
    blk = cache.hbm_k.shape[2:]
    both_fp8 = c.fp8_in("hbm") and c.fp8_in("host")  # fp8="age": copy FP8 bytes exactly
    host = {}
    if not c.write_through:  # write-through: the blocks leaving HBM have their host copies
        ok_k, ok_v = read_hbm(cache, lay, t.out_src)
        reads = (pk, pv, after_reads)
        o_rows = rows_of(lay, t.out_dst, t.out_ok, c.host_slots).reshape(-1)
        o_scales = None
        if both_fp8:
            o_scales = tuple(
                x[lay, t.out_src].reshape(-1, c.kv_heads) for x in (cache.hbm_ks, cache.hbm_vs)
            )
        host = write_host(
            cache,
            o_rows,
            ok_k.reshape(-1, *blk),
            ok_v.reshape(-1, *blk),
            after_reads=reads,
            scales=o_scales,
        )
    p_at = jnp.where(t.p_ok, t.p_dst, c.hbm_slots)
    p_scales = None
    if both_fp8:  # the promoted blocks' host scales (device-resident)
        at = jnp.clip(ls[:, None] * c.host_slots + t.p_src, 0, c.num_layers * c.host_slots - 1)
        p_scales = tuple(x.reshape(-1, c.kv_heads)[at] for x in (cache.host_ks, cache.host_vs))
    hbm = write_hbm(
        cache, lay, p_at, pk.reshape(nl, Kp, *blk), pv.reshape(nl, Kp, *blk), scales=p_scales
    )
    return {**hbm, **host}


def _with_tables(cache: TieredKVCache, ls, t: _Transfers, pools, tables):
    """The cache with the new `pools` and its block table and free masks updated for the moves
    (`tables`: the chosen layers' [nl, N] tier and slot and their free masks, before them).
    Returns (cache, [layers] int32 blocks moved)."""
    c = cache.config
    L, B, M = c.num_layers, c.batch, c.max_blocks
    S_h, S_x = c.hbm_slots, c.host_slots
    tier, slot, hbm_free, host_free = tables
    nl, N = tier.shape
    rr = jnp.arange(nl)[:, None]
    p_at = jnp.where(t.p_ok, t.p_dst, S_h)
    blocks = jnp.concatenate(
        [jnp.where(t.out_ok, t.out_blk, N), jnp.where(t.p_ok, t.p_blk, N)], axis=1
    )
    new_tier = jnp.concatenate(
        [jnp.full(t.out_blk.shape, TIER_HOST), jnp.full(t.p_blk.shape, TIER_HBM)], axis=1
    )
    new_slot = jnp.concatenate([t.out_dst, t.p_dst], axis=1)
    tier = tier.at[rr, blocks].set(new_tier.astype(jnp.int32), mode="drop")
    slot = slot.at[rr, blocks].set(new_slot.astype(jnp.int32), mode="drop")
    hbm_free = hbm_free.at[rr, jnp.where(t.out_ok, t.out_src, S_h)].set(True, mode="drop")
    hbm_free = hbm_free.at[rr, p_at].set(False, mode="drop")
    if not c.write_through:  # write-through: host copies stay where they are
        host_free = host_free.at[rr, jnp.where(t.p_ok, t.p_src, S_x)].set(True, mode="drop")
        host_free = host_free.at[rr, jnp.where(t.out_ok, t.out_dst, S_x)].set(False, mode="drop")
    cache = replace(
        cache,
        **pools,
        tier=cache.tier.at[ls].set(tier.reshape(nl, B, M)),
        slot=cache.slot.at[ls].set(slot.reshape(nl, B, M)),
        hbm_free=cache.hbm_free.at[ls].set(hbm_free),
        host_free=cache.host_free.at[ls].set(host_free),
    )
    return cache, jnp.zeros((L,), jnp.int32).at[ls].set(t.moved)
