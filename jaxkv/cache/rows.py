"""One sequence's row of a TieredKVCache: taken by a prompt (`insert`), given back (`release`).

The serving engine (`jaxkv.serve`) decodes a fixed number of rows (the cache's batch) and runs
requests through them: a finished or cancelled request's row is released, and the next
request's prompt is inserted into it, while the other rows go on decoding. Both are pure
functions of the cache with the row a traced int32, so one compiled program serves every row
(MaxText's PageManager reserves and releases pages the same way).

Every row always owns one HBM slot per layer, its tail's: a released row keeps it as the tail
of its empty block 0, and `insert` moves it to the prompt's tail block. So the HBM slots a
row's other blocks use, and (under `paged_host`) the host pages of its sealed blocks, are all
that enters and leaves the free masks. When every layer of the model slides, the blocks that
have passed every layer's window leave both tiers while their row decodes (`drop_passed`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._pytree import replace
from jaxkv.cache.layout import TieredKVCache, run_in_kinds, write_hbm, write_host
from jaxkv.cache.quant import host_rounded
from jaxkv.cache.slots import first_free, take
from jaxkv.cache.transfer import rows_of
from jaxkv.config import TIER_HBM, TIER_HOST, TIER_NONE


def release(cache: TieredKVCache, row) -> TieredKVCache:
    """The cache with sequence `row` (int or traced int32) emptied: its blocks' HBM slots and
    host copies go back to the free masks in every layer at once, but for one HBM slot per
    layer kept as the empty row's tail (block 0); its length, block table and key summaries
    are reset. The other rows are untouched."""
    return run_in_kinds(_release, cache, jnp.asarray(row, jnp.int32))


def _release(cache: TieredKVCache, row) -> TieredKVCache:
    c = cache.config
    L, M, S_h, S_x = c.num_layers, c.max_blocks, c.hbm_slots, c.host_slots
    lay = jnp.arange(L)[:, None]
    tier, slot = cache.tier[:, row], cache.slot[:, row]  # [L, M]
    in_hbm = tier == TIER_HBM
    n = cache.lengths[row]
    j = jnp.arange(M)
    tail_j = n // c.block_size
    has_tail = tail_j < M
    tail_slot = take(slot, jnp.full((L, 1), jnp.minimum(tail_j, M - 1)))[:, 0]  # [L]
    hbm_free = cache.hbm_free.at[lay, jnp.where(in_hbm, slot, S_h)].set(True, mode="drop")
    spare, _ = first_free(hbm_free, 1)  # a row that filled max_len has no tail: take a slot
    keep = jnp.where(has_tail, tail_slot, spare[:, 0])  # [L]
    hbm_free = hbm_free.at[jnp.arange(L), keep].set(False)
    sealed = j < n // c.block_size  # [M]
    if c.write_through:  # the copies of the sealed blocks (-1: dropped, `drop_passed`)
        page = cache.host_page[row]
        pages = jnp.where(sealed & (page >= 0), page, S_x)
        host_free = cache.host_free.at[:, pages].set(True, mode="drop")
    else:  # the blocks living on host
        on_host = tier == TIER_HOST
        host_free = cache.host_free.at[lay, jnp.where(on_host, slot, S_x)].set(True, mode="drop")
    host_page = cache.host_page
    if c.paged_host:
        host_page = host_page.at[row].set(-1)
    new_tier = jnp.full((L, M), TIER_NONE, jnp.int32).at[:, 0].set(TIER_HBM)
    new_slot = jnp.zeros((L, M), jnp.int32).at[:, 0].set(keep)
    zero = jnp.zeros_like(cache.kmin[:, row])
    return replace(
        cache,
        tier=cache.tier.at[:, row].set(new_tier),
        slot=cache.slot.at[:, row].set(new_slot),
        host_page=host_page,
        hbm_free=hbm_free,
        host_free=host_free,
        lengths=cache.lengths.at[row].set(0),
        kmin=cache.kmin.at[:, row].set(zero),
        kmax=cache.kmax.at[:, row].set(zero),
    )


def insert(cache: TieredKVCache, row, k, v, length, priority=None, hbm_cap=None) -> TieredKVCache:
    """The cache with a prompt written into the empty sequence `row` (one `release`d, or never
    written): its sealed blocks' host copies (under `paged_host` in the first free pages, in
    block order), HBM copies of some of them, and its tail in the row's tail slot.

    Per layer the sealed blocks take free HBM slots highest `priority` first (ties and
    `priority` None: write order), at most `hbm_cap` of them (None: every free slot); the rest
    live on host. Under fp8="host" an HBM copy holds what its FP8 host copy reads back.

    Args:
      cache: a cache whose sequence `row` has length 0 (not checked under jit; the caller
        keeps enough free pages for the sealed blocks: `length // block_size` of them).
      row: int or traced int32.
      k, v: [layers, T, kv_heads, head_dim] the prompt's keys (after RoPE) and values in the
        cache dtype; positions at and past `length` are ignored (T <= max_len).
      length: [] int32, 1 <= length < max_len (the tail block exists).
      priority: [layers, max_blocks] float, or None.
      hbm_cap: [] or [layers] int32, at most that many sealed blocks in HBM per layer, or None.
    """
    c = cache.config
    if c.fp8 == "age":
        raise ValueError(
            "rows.insert: fp8='age' keeps each sequence's recent blocks in a ring that a row "
            "insert does not fill yet: use fp8='off' or 'host'"
        )
    T = k.shape[1]
    want = (c.num_layers, T, c.kv_heads, c.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want or T > c.max_len:
        raise ValueError(
            f"rows.insert: k {tuple(k.shape)}, v {tuple(v.shape)}: expected (layers, T, "
            f"kv_heads, head_dim) = {want} with T <= max_len={c.max_len}"
        )
    args = (jnp.asarray(row, jnp.int32), k, v, jnp.asarray(length, jnp.int32), priority, hbm_cap)
    return run_in_kinds(_insert, cache, *args)


def _insert(cache: TieredKVCache, row, k, v, length, priority, hbm_cap) -> TieredKVCache:
    c = cache.config
    L, M, bs, S_h, S_x = c.num_layers, c.max_blocks, c.block_size, c.hbm_slots, c.host_slots
    T = k.shape[1]
    pad = ((0, 0), (0, M * bs - T), (0, 0), (0, 0))
    tok = jnp.arange(M * bs).reshape(M, bs)
    live = tok < length  # [M, bs]
    blk = (L, M, bs, c.kv_heads, c.head_dim)
    kb = jnp.where(live[None, ..., None, None], jnp.pad(k, pad).reshape(blk), 0).astype(k.dtype)
    vb = jnp.where(live[None, ..., None, None], jnp.pad(v, pad).reshape(blk), 0).astype(v.dtype)
    j = jnp.arange(M)
    n_sealed = length // bs
    sealed = j < n_sealed  # [M]
    tail_j = jnp.minimum(n_sealed, M - 1)
    lay = jnp.arange(L)[:, None]

    # host copies of the sealed blocks, one bulk write per pool
    if c.paged_host:
        free_pages, _ = first_free(cache.host_free[:1], M)  # every layer's pages are alike
        page = jnp.where(sealed, free_pages[0, jnp.minimum(j, free_pages.shape[1] - 1)], -1)
        host_page = cache.host_page.at[row].set(page.astype(jnp.int32))
    else:
        page = jnp.where(sealed, row * M + j, -1)
        host_page = cache.host_page
    rows = rows_of(lay, jnp.broadcast_to(page, (L, M)), sealed[None], S_x).reshape(-1)
    flat = (L * M, bs, c.kv_heads, c.head_dim)
    host = write_host(cache, rows, kb.reshape(flat), vb.reshape(flat))
    host_free = cache.host_free.at[:, jnp.where(sealed, page, S_x)].set(False, mode="drop")

    # HBM copies: per layer the best `cap` sealed blocks take the first free slots
    score = -j.astype(jnp.float32)[None] if priority is None else priority.astype(jnp.float32)
    score = jnp.broadcast_to(jnp.where(sealed, score, -jnp.inf), (L, M))
    order = jnp.lexsort((jnp.broadcast_to(j, (L, M)), -score))
    rank = jnp.argsort(order, axis=1)  # [L, M]: each block's place, best first
    slots, n_free = first_free(cache.hbm_free, M)  # [L, min(M, S_h)]
    cap = n_free if hbm_cap is None else jnp.minimum(n_free, jnp.broadcast_to(hbm_cap, (L,)))
    to_hbm = sealed[None] & (rank < cap[:, None])  # [L, M]
    hbm_slot = take(slots, rank)
    src = cache.slot[:, row, 0]  # [L] the empty row's tail slot (block 0)
    kh = host_rounded(c, kb.reshape(flat)).reshape(blk) if c.fp8 == "host" else kb
    vh = host_rounded(c, vb.reshape(flat)).reshape(blk) if c.fp8 == "host" else vb
    at = jnp.where(to_hbm, hbm_slot, S_h)  # -> dropped
    tail = j[None] == tail_j  # [1, M]
    at = jnp.where(tail, src[:, None], at)
    kh = jnp.where(tail[..., None, None, None], kb, kh)  # the tail stays in the cache dtype
    vh = jnp.where(tail[..., None, None, None], vb, vh)
    hbm = write_hbm(cache, lay, at, kh, vh)
    hbm_free = cache.hbm_free.at[lay, jnp.where(to_hbm, hbm_slot, S_h)].set(False, mode="drop")

    tier = jnp.where(sealed[None], jnp.where(to_hbm, TIER_HBM, TIER_HOST), TIER_NONE)
    tier = jnp.where(tail, TIER_HBM, tier).astype(jnp.int32)
    slot = jnp.where(to_hbm, hbm_slot, jnp.where(sealed[None], page[None], 0))
    slot = jnp.where(tail, src[:, None], slot).astype(jnp.int32)
    kf = kb.astype(jnp.float32)
    has = jnp.any(live, axis=-1)[None, :, None, None]  # [1, M, 1, 1]
    mask = live[None, ..., None, None]
    kmin = jnp.where(has, jnp.where(mask, kf, jnp.inf).min(axis=2), 0.0)
    kmax = jnp.where(has, jnp.where(mask, kf, -jnp.inf).max(axis=2), 0.0)
    return replace(
        cache,
        **hbm,
        **host,
        tier=cache.tier.at[:, row].set(tier),
        slot=cache.slot.at[:, row].set(slot),
        host_page=host_page,
        hbm_free=hbm_free,
        host_free=host_free,
        lengths=cache.lengths.at[row].set(length),
        kmin=cache.kmin.at[:, row].set(kmin),
        kmax=cache.kmax.at[:, row].set(kmax),
    )


def passed_window(windows) -> int | None:
    """The widest sliding window of a model whose every layer slides (`windows`: each layer's
    window in tokens, 0 for full attention, or None), or None: then no block ever passes every
    layer's window."""
    if windows is None or not len(windows) or min(int(w) for w in windows) <= 0:
        return None
    return max(int(w) for w in windows)


def passed_blocks(lengths, block_size: int, window: int):
    """How many leading blocks of sequences `lengths` tokens long (int or array) no later step
    reads: the next query, at position `lengths`, attends from lengths + 1 - window (HF's rule,
    `jaxkv.attention.select.window_starts`), so block j has passed when (j + 1) x block_size <=
    lengths + 1 - window. Always sealed blocks (the tail is inside every window)."""
    return jnp.maximum(jnp.asarray(lengths) + 1 - window, 0) // block_size


def drop_passed(cache: TieredKVCache, windows) -> TieredKVCache:
    """The cache with the blocks no later step of any layer reads freed in both tiers at once:
    when every layer slides (`windows`, a static tuple: each layer's window, 0 for full
    attention; `passed_window`), each row's blocks wholly before the widest window at the next
    step (`passed_blocks`) give their HBM slots and their host page back to the free masks,
    their tier becomes TIER_NONE in every layer and their page -1. Without such windows the
    cache is returned as it is. Blocks dropped earlier stay dropped (the window only moves
    forward); the serving engine calls this after every step and insert."""
    w = passed_window(windows)
    if w is None:
        return cache
    if not cache.config.paged_host:
        raise ValueError(
            "drop_passed frees host pages: expected a cache with paged_host=True (the serving "
            "engine's), got paged_host=False"
        )
    return run_in_kinds(_drop_passed, cache, window=w)


def _drop_passed(cache: TieredKVCache, window: int) -> TieredKVCache:
    c = cache.config
    L, M, S_h, S_x = c.num_layers, c.max_blocks, c.hbm_slots, c.host_slots
    n = passed_blocks(cache.lengths, c.block_size, window)  # [B]
    dead = (jnp.arange(M)[None] < n[:, None]) & (cache.host_page >= 0)  # [B, M]: still held
    in_hbm = (cache.tier == TIER_HBM) & dead[None]  # [L, B, M]
    lay = jnp.arange(L)[:, None, None]
    hbm_free = cache.hbm_free.at[lay, jnp.where(in_hbm, cache.slot, S_h)].set(True, mode="drop")
    host_free = cache.host_free.at[:, jnp.where(dead, cache.host_page, S_x)].set(True, mode="drop")
    return replace(
        cache,
        tier=jnp.where(dead[None], TIER_NONE, cache.tier).astype(jnp.int32),
        slot=jnp.where(dead[None], 0, cache.slot).astype(jnp.int32),
        host_page=jnp.where(dead, -1, cache.host_page).astype(jnp.int32),
        hbm_free=hbm_free,
        host_free=host_free,
    )


def free_pages(cache: TieredKVCache) -> jax.Array:
    """[] int32: free host pages (layer 0's; under `paged_host` every layer's are alike)."""
    return jnp.sum(cache.host_free[0]).astype(jnp.int32)
