"""TieredKVCache: a paged KV cache split over HBM (memory kind `device`) and host memory
(memory kind `config.host_memory_kind`: `pinned_host`, or `unpinned_host` / `device`).

A block is `block_size` consecutive tokens of one sequence in one layer (all KV heads, K and V).
The block table maps (layer, sequence, logical block) -> (tier, slot): where attention reads
the block. The block a sequence is filling (its *tail*, logical index `lengths[b] //
block_size`) always lives in HBM and is allocated before its first token arrives; when it fills
up it is *sealed*: it stays in HBM when a free HBM slot is left for the next tail, otherwise it
spills to host (so with no migration the cache fills HBM in write order and spills the rest:
the Static policy of `jaxkv.placement.policies`).

The host tier (`CacheConfig.host_tier`) is write-through by default: every sealed block has
exactly one host copy, at host slot `sequence * max_blocks + block`, written when it is sealed
(in the step's one bulk host write), and at most one HBM copy, bit-identical to it (FP8 values
and scales included); a block whose tier is HBM has both, one on host only the copy. Demoting
frees the HBM slot and moves no data. With host_tier="exclusive" every written block lives in
exactly one slot of one tier, and a demotion writes it back over the link.

Where things are: the pytree, its shardings and the host-pool size check in `jaxkv.cache.layout`,
migrations (`plan_moves`, `migrate`) in `jaxkv.cache.migration`, the debug views (`to_dense`,
`check_invariants`) in `jaxkv.cache.views`, a sequence's row (`insert`, `release`: the serving
engine's) in `jaxkv.cache.rows`, the writes and compaction here; the package `jaxkv.cache`
exports their public names.

Host pools are only touched by the bulk transfers of `jaxkv.cache.transfer` (one read or write per
pool and direction). All operations are pure functions returning a new cache and run inside or
outside jit. Memory kinds: called outside jit, every operation runs as one jit whose
`out_shardings` name the configured kinds (`cache_shardings`), so the pools come back in them.
Traced inside a caller's jit, "device" and "pinned_host" pools keep their kind by themselves, but
jax types a traced "unpinned_host" value as "device" (`jaxkv.cache.transfer.to_kind`), so a jit that
returns an "unpinned_host" cache must name `cache_shardings(config)` for it in `out_shardings`;
without them it returns "device" pools, and if it donates the cache the runtime aborts (jax
aliases the donated unpinned_host buffer to an output it calls "device").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._pytree import replace
from jaxkv.cache.layout import (
    TieredKVCache,
    pool_fields,
    ring_ids,
    ring_window,
    run_in_kinds,
    write_hbm,
    write_host,
)
from jaxkv.cache.quant import host_rounded
from jaxkv.cache.slots import first_free, seal_keeps, take
from jaxkv.cache.transfer import rows_of, traced
from jaxkv.config import TIER_HBM, TIER_HOST, TIER_NONE
from pallas_kernels.compaction import compaction, compaction_moves


def _check_kv(name: str, x, shape, dtype) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if x.dtype != dtype:
        raise ValueError(f"{name} has dtype {x.dtype}, expected {jnp.dtype(dtype)}")


def prefill(cache: TieredKVCache, k: jax.Array, v: jax.Array, lengths) -> TieredKVCache:
    """Writes each sequence's prompt into an empty cache, filling HBM in write order.

    Sealed blocks are ranked by (logical block, sequence); the first ones fill the HBM slots not
    reserved for tails, the rest go to host. Each sequence's tail (its next, possibly partial,
    block) is placed in HBM.

    Args:
      cache: an empty cache (from `TieredKVCache.create`). A cache holding tokens is refused
        (ValueError) when its lengths are concrete; under jit they are not checked, and the
        result is the prompts alone, as if written into a new cache (whatever the cache held is
        discarded: every array is rebuilt from k, v and lengths).
      k, v: [layers, batch, T, kv_heads, head_dim] prompt keys (after RoPE) and values; positions
        at or beyond a sequence's length are ignored.
      lengths: [batch] int prompt lengths, 1 <= length <= min(T, max_len). Checked eagerly when
        concrete.
    Returns:
      The cache holding the prompts.
    """
    c = cache.config
    L, B = c.num_layers, c.batch
    T = k.shape[2]
    _check_kv("k", k, (L, B, T, c.kv_heads, c.head_dim), c.jnp_dtype)
    _check_kv("v", v, (L, B, T, c.kv_heads, c.head_dim), c.jnp_dtype)
    if T > c.max_len:
        raise ValueError(f"prompt length T={T} exceeds max_len={c.max_len}")
    if not isinstance(lengths, jax.core.Tracer) and not np.array_equal(lengths, np.round(lengths)):
        raise ValueError(
            f"lengths={np.asarray(lengths).tolist()}: expected whole numbers of tokens"
        )
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (B,):
        raise ValueError(f"lengths has shape {lengths.shape}, expected ({B},)")
    if not isinstance(lengths, jax.core.Tracer):
        bad = [int(x) for x in lengths if not 1 <= int(x) <= T]
        if bad:
            raise ValueError(f"prompt lengths {bad} out of range: expected 1 <= length <= T={T}")
    if not traced(cache.lengths):
        held = np.asarray(cache.lengths)
        seqs = np.flatnonzero(held > 0).tolist()
        if seqs:
            raise ValueError(
                f"prefill: the cache already holds tokens: sequence(s) {seqs} have length(s) "
                f"{held[seqs].tolist()}; prefill writes into an empty cache "
                "(TieredKVCache.create), it does not append"
            )
    return run_in_kinds(_prefill, cache, k, v, lengths)


@jax.jit
def _prefill(cache: TieredKVCache, k, v, lengths, priority=None) -> TieredKVCache:
    """`prefill`'s body. `priority` ([layers, batch, max_blocks] float, or None: write order):
    per layer, the sealed blocks fill HBM highest first, ties in write order
    (`jaxkv.decode.prompt.start_cache`)."""
    c = cache.config
    if c.paged_host:
        raise ValueError(
            "prefill: a paged_host cache is filled one sequence at a time by the serving engine "
            "(jaxkv.cache.rows.insert, jaxkv.serve.Engine), not by a batch prefill"
        )
    L, B, M, bs = c.num_layers, c.batch, c.max_blocks, c.block_size
    S_h, S_x = c.hbm_slots, c.host_slots
    kb, vb, live = _prompt_blocks(k, v, lengths, M, bs)
    table = functools.partial(
        _prefill_table, write_through=c.write_through, B=B, M=M, bs=bs, S_h=S_h
    )
    if priority is None:  # one table for every layer
        tier, slot, to_hbm, to_host, written = table(lengths)
        pool = _pool_for
    else:  # one table per layer
        tier, slot, to_hbm, to_host, written = jax.vmap(table, (None, 0))(lengths, priority)
        pool = _pool_per_layer
    # pools: gather each slot's source block (device side), then place host pools in one copy
    flat_k = kb.reshape(L, B * M, bs, *k.shape[3:])
    flat_v = vb.reshape(L, B * M, bs, *v.shape[3:])
    if c.write_through:  # every sealed block's host copy at its flat index
        sealed = (jnp.arange(M)[None] < (lengths // bs)[:, None]).reshape(-1)  # [B * M]
        xk, xv, host_used = _pool_for(sealed, jnp.arange(B * M), S_x, flat_k, flat_v)
        if c.fp8 == "host":  # sealed HBM copies hold what their FP8 host copies read back
            flat = (L * B * M, bs, *k.shape[3:])
            keep = sealed[None, :, None, None, None]
            flat_k = jnp.where(
                keep, host_rounded(c, flat_k.reshape(flat)).reshape(flat_k.shape), flat_k
            )
            flat_v = jnp.where(
                keep, host_rounded(c, flat_v.reshape(flat)).reshape(flat_v.shape), flat_v
            )
    else:
        xk, xv, host_used = pool(to_host, slot, S_x, flat_k, flat_v)
    hk, hv, hbm_used = pool(to_hbm, slot, S_h, flat_k, flat_v)
    kmin, kmax = _key_bounds(kb, live)
    return replace(
        cache,
        **pool_fields(c, "hbm", hk, hv),
        **pool_fields(c, "host", xk, xv),
        **_prompt_ring(c, kb, vb, lengths),
        tier=jnp.broadcast_to(jnp.where(written, tier, TIER_NONE), (L, B, M)).astype(jnp.int32),
        slot=jnp.broadcast_to(slot, (L, B, M)),
        hbm_free=jnp.broadcast_to(~hbm_used, (L, S_h)),
        host_free=jnp.broadcast_to(~host_used, (L, S_x)),
        lengths=lengths,
        kmin=kmin,
        kmax=kmax,
    )


def _prompt_blocks(k, v, lengths, M: int, bs: int):
    """The prompts cut into `M` blocks of `bs` tokens, zeros at and past each length:
    (kb, vb [layers, batch, M, bs, kv_heads, head_dim], live [batch, M, bs] bool)."""
    L, B, T = k.shape[:3]
    pad = M * bs - T
    kb = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))).reshape(L, B, M, bs, *k.shape[3:])
    vb = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))).reshape(L, B, M, bs, *v.shape[3:])
    tok = jnp.arange(M * bs).reshape(M, bs)
    live = tok[None] < lengths[:, None, None]  # [B, M, bs]
    kb = jnp.where(live[None, ..., None, None], kb, 0)
    vb = jnp.where(live[None, ..., None, None], vb, 0)
    return kb, vb, live


def _prompt_ring(c, kb, vb, lengths) -> dict:
    """The full-precision ring after prefill (fp8="age"): each sequence's tail and the sealed
    blocks before it inside `ring_window`, from the prompt blocks kb, vb [L, B, M, bs, ...]."""
    if not c.ring_blocks:
        return {}
    ids = ring_ids(c, lengths, ring_window(c, lengths))  # [B, W]
    b = jnp.arange(c.batch)[:, None]
    at = jnp.maximum(ids, 0)
    keep = (ids >= 0)[None, :, :, None, None, None]
    return dict(
        ring_k=jnp.where(keep, kb[:, b, at], 0).astype(c.jnp_dtype),
        ring_v=jnp.where(keep, vb[:, b, at], 0).astype(c.jnp_dtype),
    )


def _prefill_table(
    lengths, priority=None, *, write_through: bool, B: int, M: int, bs: int, S_h: int
):
    """Every layer's placement after prefill, [batch, max_blocks] each: (tier, slot, the blocks
    in HBM (sealed ones and tails), those on host, those written).

    Sealed blocks are ranked in write order, (logical block, sequence), or by `priority`
    ([batch, max_blocks], highest first, ties in write order) when given; the first fill the
    HBM slots not reserved for tails, the rest live on host: at their flat index b * M + j
    (`write_through`), else in host slots in that order; the tails take the HBM slots after the
    sealed blocks, in sequence order."""
    j = jnp.arange(M)
    n_sealed = lengths // bs  # [B]
    sealed = j[None] < n_sealed[:, None]  # [B, M]
    has_tail = n_sealed < M
    tail = (j[None] == n_sealed[:, None]) & has_tail[:, None]  # [B, M]
    # write order: (logical block, sequence); sealed blocks first fill HBM minus the tails
    order_key = jnp.where(sealed, j[None] * B + jnp.arange(B)[:, None], M * B)  # [B, M]
    if priority is None:
        rank = jnp.argsort(jnp.argsort(order_key.reshape(-1))).reshape(B, M)
    else:  # by priority, then write order; unsealed blocks last
        first = jnp.where(sealed, -priority.astype(jnp.float32), jnp.inf).reshape(-1)
        rank = jnp.argsort(jnp.lexsort((order_key.reshape(-1), first))).reshape(B, M)
    hbm_for_sealed = S_h - jnp.sum(has_tail)
    to_hbm = sealed & (rank < hbm_for_sealed)
    to_host = sealed & ~to_hbm
    n_hbm_sealed = jnp.sum(to_hbm)
    tail_rank = jnp.cumsum(has_tail) - 1  # [B]
    hbm_slot = jnp.where(to_hbm, rank, n_hbm_sealed + tail_rank[:, None])
    host_slot = rank - hbm_for_sealed
    if write_through:
        host_slot = (jnp.arange(B)[:, None] * M + j[None]).astype(rank.dtype)
    tier = jnp.where(to_hbm | tail, TIER_HBM, jnp.where(to_host, TIER_HOST, TIER_NONE))
    slot = jnp.where(to_hbm | tail, hbm_slot, jnp.where(to_host, host_slot, 0)).astype(jnp.int32)
    return tier, slot, to_hbm | tail, to_host, sealed | tail


def _pool_for(mask, slot, n_slots: int, flat_k, flat_v):
    """A pool of `n_slots` slots holding the blocks `mask` [B, M] places at `slot` [B, M]:
    (k, v [layers, n_slots, ...] gathered from flat_k, flat_v [layers, B * M, ...], zeros in
    unused slots; used [n_slots] bool)."""
    BM = flat_k.shape[1]
    src = jnp.arange(BM)
    m = mask.reshape(-1)
    s = jnp.where(m, slot.reshape(-1), n_slots)  # out of range -> dropped
    owner = jnp.full((n_slots,), BM, jnp.int32).at[s].set(src, mode="drop")
    used = owner < BM
    pk = jnp.where(used[None, :, None, None, None], flat_k[:, jnp.minimum(owner, BM - 1)], 0)
    pv = jnp.where(used[None, :, None, None, None], flat_v[:, jnp.minimum(owner, BM - 1)], 0)
    return pk, pv, used


def _pool_per_layer(mask, slot, n_slots: int, flat_k, flat_v):
    """`_pool_for` with a table per layer (mask, slot [layers, B, M]): (k, v [layers, n_slots,
    ...], used [layers, n_slots] bool)."""

    def one(m, s, fk, fv):
        k, v, used = _pool_for(m, s, n_slots, fk[None], fv[None])
        return k[0], v[0], used

    return jax.vmap(one)(mask, slot, flat_k, flat_v)


def _key_bounds(kb, live):
    """Per-block, per-channel key min and max over the live tokens of kb [L, B, M, bs, ...]
    (float32 [L, B, M, kv_heads, head_dim]; 0 for a block without tokens)."""
    kf = kb.astype(jnp.float32)
    kmin = jnp.where(live[None, ..., None, None], kf, jnp.inf).min(axis=3)
    kmax = jnp.where(live[None, ..., None, None], kf, -jnp.inf).max(axis=3)
    has_tok = jnp.any(live, axis=-1)[None, ..., None, None]
    return jnp.where(has_tok, kmin, 0.0), jnp.where(has_tok, kmax, 0.0)


def write_token(cache: TieredKVCache, layer, k, v, active) -> TieredKVCache:
    """Writes one token's K and V per sequence into `layer`'s tail block at position `lengths`.

    Lengths do not change: call `advance` once after all layers are written.

    Args:
      layer: int or int scalar array, 0 <= layer < num_layers: checked (ValueError) when
        concrete; a traced layer out of range (e.g. -1) writes nothing.
      k, v: [batch, kv_heads, head_dim] in the cache dtype.
      active: [batch] bool; inactive sequences (finished or full) are not written.
    """
    L = cache.config.num_layers
    if not traced(layer):
        if np.ndim(layer) or not np.issubdtype(np.asarray(layer).dtype, np.integer):
            raise ValueError(f"write_token: layer={layer!r}: expected an int scalar")
        if not 0 <= int(layer) < L:
            raise ValueError(f"write_token: layer={int(layer)}: expected 0 <= layer < {L}")
        if not traced(cache, k, v, active):  # outside jit: one compile for every layer
            layer = jnp.int32(layer)
    else:  # out of range -> L: reads clamp, writes drop
        layer = jnp.where((layer >= 0) & (layer < L), layer, L)
    return run_in_kinds(_write_token, cache, layer, k, v, active)


def _write_token(cache: TieredKVCache, layer, k, v, active) -> TieredKVCache:
    c = cache.config
    b = jnp.arange(c.batch)
    pos = cache.lengths
    j = jnp.minimum(pos // c.block_size, c.max_blocks - 1)
    off = pos % c.block_size
    ok = active & (pos < c.max_len)
    if c.ring_blocks:  # fp8="age": the tail lives in the ring until it is sealed
        e = jnp.where(ok, j % c.ring_blocks, c.ring_blocks)  # out of range -> dropped
        at = (layer, b, e, off)
        pools = dict(
            ring_k=cache.ring_k.at[at].set(k.astype(c.jnp_dtype), mode="drop"),
            ring_v=cache.ring_v.at[at].set(v.astype(c.jnp_dtype), mode="drop"),
        )
    else:
        s = jnp.where(ok, cache.slot[layer, b, j], c.hbm_slots)  # out of range -> dropped
        pools = dict(
            hbm_k=cache.hbm_k.at[layer, s, off].set(k.astype(c.jnp_dtype), mode="drop"),
            hbm_v=cache.hbm_v.at[layer, s, off].set(v.astype(c.jnp_dtype), mode="drop"),
        )
    kf = k.astype(jnp.float32)
    first = (off == 0)[:, None, None]
    old_min, old_max = cache.kmin[layer, b, j], cache.kmax[layer, b, j]
    new_min = jnp.where(first, kf, jnp.minimum(old_min, kf))
    new_max = jnp.where(first, kf, jnp.maximum(old_max, kf))
    okx = ok[:, None, None]
    kmin = cache.kmin.at[layer, b, j].set(jnp.where(okx, new_min, old_min))
    kmax = cache.kmax.at[layer, b, j].set(jnp.where(okx, new_max, old_max))
    return replace(cache, **pools, kmin=kmin, kmax=kmax)


def advance(cache: TieredKVCache, active, *, after_reads=None) -> TieredKVCache:
    """Advances lengths of active sequences by one token and seals tails that filled up.

    A sealed tail keeps its HBM slot when another free HBM slot exists for the new tail;
    otherwise it spills to host and its HBM slot becomes the new tail's. Per layer the sealing
    sequences take the free HBM slots in sequence order. The host writes of all layers (every
    sealed block's host copy under a write-through host tier, the spills under an exclusive
    one) go in one bulk transfer per pool (`jaxkv.cache.transfer.write_blocks`), every step (entries
    that write nothing are marked unused), so no loop or branch depends on the data.

    Args:
      active: [batch] bool.
      after_reads: results of the step's reads of the host pools (e.g. the logits), which the
        in-place spill must follow (`jaxkv.cache.transfer.after`); None if there are none.
    """
    return run_in_kinds(_advance, cache, active, after_reads)


def _advance(cache: TieredKVCache, active, after_reads) -> TieredKVCache:
    c = cache.config
    L, B, M, bs = c.num_layers, c.batch, c.max_blocks, c.block_size
    ok = active & (cache.lengths < c.max_len)
    lengths = cache.lengths + ok.astype(jnp.int32)
    seal = ok & (lengths % bs == 0) & (lengths // bs < M)  # [B]: needs a new tail
    new_j = jnp.minimum(lengths // bs, M - 1)
    old_j = jnp.maximum(new_j - 1, 0)
    b = jnp.arange(B)
    old_slot = cache.slot[:, b, old_j]  # [L, B]: HBM slot of the block being sealed
    hbm_list, n_hbm_free = first_free(cache.hbm_free, B)
    keep, seal_rank = seal_keeps(seal, n_hbm_free)  # [L, B], [B]
    spill = seal[None] & ~keep
    tail_slot = jnp.where(keep, take(hbm_list, jnp.broadcast_to(seal_rank, (L, B))), old_slot)
    # the block that seals: old_j where `seal`; the last block of a sequence that fills max_len
    # seals in place, without a new tail (`at_end`)
    at_end = ok & (lengths % bs == 0) & ~seal
    sj = jnp.clip(lengths // bs - 1, 0, M - 1)
    sj_slot = cache.slot[:, b, sj]  # [L, B]: its HBM slot
    stays = (seal[None] & keep) | at_end[None]  # [L, B]: sealed blocks that stay in HBM
    host_page = cache.host_page
    if c.paged_host:  # the sealed blocks take the first free pages, in sequence order
        seals = seal | at_end
        rank = jnp.maximum(jnp.cumsum(seals) - 1, 0)
        pages, n_free = first_free(cache.host_free[:1], B)  # every layer's pages are alike
        got = seals & (rank < n_free[0])  # the engine keeps a page for each: all of them
        page = jnp.where(got, take(pages, rank[None])[0], -1)
        host_page = host_page.at[b, sj].set(jnp.where(got, page, host_page[b, sj]))
        host_slot = jnp.broadcast_to(page, (L, B))
        copied = jnp.broadcast_to(got, (L, B))
    elif c.write_through:  # every sealed block gets its host copy, at its flat index
        host_slot = jnp.broadcast_to(b * M + sj, (L, B))
        copied = jnp.broadcast_to(seal | at_end, (L, B))
    else:  # only the spills, in free host slots
        host_list, _ = first_free(cache.host_free, B)
        host_slot = take(host_list, jnp.maximum(jnp.cumsum(spill, axis=1) - 1, 0))  # [L, B]
        copied = spill

    lay = jnp.arange(L)[:, None]
    rows = rows_of(lay, host_slot, copied, c.host_slots).reshape(-1)
    blk = (L * B, c.block_size, c.kv_heads, c.head_dim)
    if c.ring_blocks:  # fp8="age": the sealed block is quantized from the ring into its slot
        e = sj % c.ring_blocks
        sealed_k, sealed_v = cache.ring_k[:, b, e], cache.ring_v[:, b, e]  # [L, B, ...]
        at = jnp.where(stays, sj_slot, c.hbm_slots)  # -> dropped
        hbm = write_hbm(cache, lay, at, sealed_k, sealed_v)
    else:
        sealed_k, sealed_v = cache.hbm_k[lay, sj_slot], cache.hbm_v[lay, sj_slot]
        hbm = {}
        if c.write_through and c.fp8 == "host":  # the HBM copy: what the FP8 copy reads back
            at = jnp.where(stays, sj_slot, c.hbm_slots)  # -> dropped
            rk = host_rounded(c, sealed_k.reshape(blk)).reshape(sealed_k.shape)
            rv = host_rounded(c, sealed_v.reshape(blk)).reshape(sealed_v.shape)
            hbm = write_hbm(cache, lay, at, rk, rv)
    host = write_host(cache, rows, sealed_k.reshape(blk), sealed_v.reshape(blk), after_reads)
    tier = cache.tier.at[:, b, old_j].set(jnp.where(spill, TIER_HOST, cache.tier[:, b, old_j]))
    tier = tier.at[:, b, new_j].set(jnp.where(seal[None], TIER_HBM, tier[:, b, new_j]))
    slot = cache.slot.at[:, b, old_j].set(jnp.where(spill, host_slot, cache.slot[:, b, old_j]))
    slot = slot.at[:, b, new_j].set(jnp.where(seal[None], tail_slot, slot[:, b, new_j]))
    S_h, S_x = c.hbm_slots, c.host_slots
    hbm_free = cache.hbm_free.at[lay, jnp.where(keep, tail_slot, S_h)].set(False, mode="drop")
    host_free = cache.host_free.at[lay, jnp.where(copied, host_slot, S_x)].set(False, mode="drop")
    return replace(
        cache,
        **hbm,
        **host,
        tier=tier,
        slot=slot,
        host_page=host_page,
        hbm_free=hbm_free,
        host_free=host_free,
        lengths=lengths,
    )


def compact(cache: TieredKVCache, impl: str = "xla") -> TieredKVCache:
    """Renumbers occupied HBM slots into a dense prefix (stable order), per layer.

    Blocks move in place: for impl="pallas" with the Mosaic GPU kernel
    (`pallas_kernels.compaction`, one launch per pool), for "xla" as one bulk gather and one
    scatter per pool (exact for this move list: every destination was free or already
    vacated, and no destination is a later source, so reading all sources first changes
    nothing); only slots that change are written. Jitted without
    donation, so an eager call leaves its input intact; inside a jitted step whose state is
    donated (the decode loop) the pool is updated in place.

    Args:
      impl: "xla" | "pallas" ("auto" means "xla" until the kernel is measured on a GPU).
    Returns:
      A cache with identical logical contents whose HBM pool holds its blocks in slots
      [0, occupied) and whose free slots form the suffix.
    """
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"unknown compaction impl {impl!r}; expected 'auto', 'xla' or 'pallas'")
    return run_in_kinds(_compact, cache, impl=impl)


def _compact(cache: TieredKVCache, *, impl: str) -> TieredKVCache:
    used = ~cache.hbm_free  # [L, S]
    src, dst, num_moves, new_of_old = compaction_moves(used)
    S = cache.config.hbm_slots
    lay = jnp.arange(cache.config.num_layers)[:, None]
    at = jnp.where(jnp.arange(src.shape[1])[None] < num_moves[:, None], dst, S)  # -> dropped

    def moved(x):  # one bulk gather and scatter of x's slots
        return x.at[lay, at].set(x[lay, src], mode="drop")

    if impl == "pallas":
        hbm_k = compaction(cache.hbm_k, src, dst, num_moves)
        hbm_v = compaction(cache.hbm_v, src, dst, num_moves)
    else:
        hbm_k, hbm_v = moved(cache.hbm_k), moved(cache.hbm_v)
    scales = {}
    if cache.config.fp8_in("hbm"):  # the FP8 scales move with their blocks (tiny: XLA)
        scales = dict(hbm_ks=moved(cache.hbm_ks), hbm_vs=moved(cache.hbm_vs))
    in_hbm = cache.tier == TIER_HBM
    renum = jnp.take_along_axis(new_of_old, cache.slot.reshape(cache.config.num_layers, -1), 1)
    slot = jnp.where(in_hbm, renum.reshape(cache.slot.shape), cache.slot)
    n_used = jnp.sum(used, axis=1, keepdims=True)
    hbm_free = jnp.arange(cache.config.hbm_slots)[None] >= n_used
    return replace(cache, hbm_k=hbm_k, hbm_v=hbm_v, **scales, slot=slot, hbm_free=hbm_free)
