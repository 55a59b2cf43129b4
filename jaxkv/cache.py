"""TieredKVCache: a paged KV cache split over HBM (memory kind `device`) and host memory
(memory kind `config.host_memory_kind`: `pinned_host`, or `unpinned_host` / `device`).

A block is `block_size` consecutive tokens of one sequence in one layer (all KV heads, K and V).
Every written logical block lives in exactly one slot of one tier; the block table maps
(layer, sequence, logical block) -> (tier, slot). The block a sequence is filling (its *tail*,
logical index `lengths[b] // block_size`) always lives in HBM and is allocated before its first
token arrives; when it fills up it is *sealed*: it stays in HBM when a free HBM slot is left for
the next tail, otherwise it spills to host (so with no migration the cache fills HBM in write
order and spills the rest, the paper's Static policy).

Host pools are only touched by the bulk transfers of `jaxkv.transfer` (one read or write per
pool and direction). All operations are pure functions returning a new cache and run inside or
outside jit. Memory kinds: called outside jit, every operation runs as one jit whose
`out_shardings` name the configured kinds (`cache_shardings`), so the pools come back in them.
Traced inside a caller's jit, "device" and "pinned_host" pools keep their kind by themselves, but
jax types a traced "unpinned_host" value as "device" (`jaxkv.transfer.to_kind`), so a jit that
returns an "unpinned_host" cache must name `cache_shardings(config)` for it in `out_shardings`;
without them it returns "device" pools, and if it donates the cache the runtime aborts (jax
aliases the donated unpinned_host buffer to an output it calls "device").
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._pytree import pytree_dataclass, replace, static_field
from jaxkv.config import HBM_KIND, TIER_HBM, TIER_HOST, TIER_NONE, CacheConfig
from jaxkv.transfer import kind_sharding, read_blocks, rows_of, to_kind, traced, write_blocks


@pytree_dataclass
class TieredKVCache:
    hbm_k: jax.Array  # [layers, hbm_slots, block, kv_heads, head_dim]  memory kind "device"
    hbm_v: jax.Array  # [layers, hbm_slots, block, kv_heads, head_dim]  memory kind "device"
    host_k: jax.Array  # [layers, host_slots, block, kv_heads, head_dim]  config.host_memory_kind
    host_v: jax.Array  # [layers, host_slots, block, kv_heads, head_dim]  config.host_memory_kind
    tier: jax.Array  # [layers, batch, max_blocks] int32: TIER_HBM / TIER_HOST / TIER_NONE
    slot: jax.Array  # [layers, batch, max_blocks] int32: slot in that tier's pool (0 if none)
    hbm_free: jax.Array  # [layers, hbm_slots] bool
    host_free: jax.Array  # [layers, host_slots] bool
    lengths: jax.Array  # [batch] int32: tokens written per sequence
    kmin: jax.Array  # [layers, batch, max_blocks, kv_heads, head_dim] f32: per-channel key min
    kmax: jax.Array  # [layers, batch, max_blocks, kv_heads, head_dim] f32: per-channel key max
    config: CacheConfig = static_field()

    # ---- construction -------------------------------------------------------------------------

    @staticmethod
    def create(config: CacheConfig) -> TieredKVCache:
        """An empty cache: every sequence has length 0 and its tail block allocated in HBM."""
        c = config
        check_host_pool(c)
        L, B, M = c.num_layers, c.batch, c.max_blocks
        blk = (c.block_size, c.kv_heads, c.head_dim)
        hbm = jnp.zeros((L, c.hbm_blocks, *blk), c.jnp_dtype)
        host = jnp.zeros((L, c.host_blocks, *blk), c.jnp_dtype)
        tier = jnp.full((L, B, M), TIER_NONE, jnp.int32).at[:, :, 0].set(TIER_HBM)
        slot = jnp.zeros((L, B, M), jnp.int32).at[:, :, 0].set(jnp.arange(B, dtype=jnp.int32))
        hbm_free = jnp.ones((L, c.hbm_blocks), bool).at[:, :B].set(False)
        summary = jnp.zeros((L, B, M, c.kv_heads, c.head_dim), jnp.float32)
        return TieredKVCache(
            hbm_k=to_kind(hbm, HBM_KIND),
            hbm_v=to_kind(hbm, HBM_KIND),
            host_k=to_kind(host, c.host_memory_kind),
            host_v=to_kind(jnp.zeros_like(host), c.host_memory_kind),
            tier=tier,
            slot=slot,
            hbm_free=hbm_free,
            host_free=jnp.ones((L, c.host_blocks), bool),
            lengths=jnp.zeros((B,), jnp.int32),
            kmin=summary,
            kmax=summary,
            config=c,
        )

    # ---- derived views ------------------------------------------------------------------------

    @property
    def sealed(self) -> jax.Array:
        """[layers, batch, max_blocks] bool: full blocks, placeable by policies."""
        c = self.config
        j = jnp.arange(c.max_blocks)
        full = j[None, :] < (self.lengths // c.block_size)[:, None]  # [batch, max_blocks]
        return jnp.broadcast_to(full[None], self.tier.shape)

    @property
    def in_hbm(self) -> jax.Array:
        """[layers, batch, max_blocks] bool: sealed blocks resident in HBM."""
        return self.sealed & (self.tier == TIER_HBM)


def cache_shardings(config: CacheConfig) -> TieredKVCache:
    """A TieredKVCache of shardings: the host pools in `config.host_memory_kind`, every other
    array in "device". Pass it for a cache in a jit's `out_shardings` (e.g. the `cache` field of
    a state's out_shardings prefix, None elsewhere): only a jit boundary gives a traced
    "unpinned_host" pool its kind back (see the module docstring)."""
    dev, host = kind_sharding(HBM_KIND), kind_sharding(config.host_memory_kind)
    arrays = [f.name for f in dataclasses.fields(TieredKVCache) if f.name != "config"]
    fields = {name: dev for name in arrays}
    return TieredKVCache(**{**fields, "host_k": host, "host_v": host, "config": config})


@functools.cache
def _kinds_jit(op, config: CacheConfig, pair: bool, static: tuple):
    """`op` jitted with out_shardings naming the cache's kinds (for (cache, [layers] array) when
    `pair`) and `static` ((name, value) pairs) bound as keywords."""
    out = cache_shardings(config)
    out = (out, kind_sharding(HBM_KIND)) if pair else out
    return jax.jit(functools.partial(op, **dict(static)), out_shardings=out)


def _run(op, cache: TieredKVCache, *args, pair: bool = False, **static):
    """`op(cache, *args, **static)`: as is when traced; outside jit as one jit that returns the
    pools in their configured memory kinds (`cache_shardings`)."""
    if traced(cache, args):
        return op(cache, *args, **static)
    return _kinds_jit(op, cache.config, pair, tuple(sorted(static.items())))(cache, *args)


GPU_HOST_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
GPU_HOST_LIMIT_DEFAULT_GB = 64.0  # XLA's pinned-host allocator on GPUs, unless the variable says


def gpu_host_limit_bytes() -> float:
    """The GPU runtime's pinned-host pool: `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB, else 64."""
    raw = os.environ.get(GPU_HOST_LIMIT_VAR)
    try:
        gb = GPU_HOST_LIMIT_DEFAULT_GB if raw in (None, "") else float(raw)
    except ValueError:
        raise ValueError(f"{GPU_HOST_LIMIT_VAR}={raw!r} is not a number of GiB") from None
    return gb * 2**30


def check_host_pool(config: CacheConfig, platform: str | None = None) -> None:
    """Raises ValueError, before anything is allocated, when the host pools (K and V, every
    layer) would not fit the GPU's pinned-host pool; does nothing off GPU or for a host tier
    kept in device memory. `platform` defaults to the platform being traced for."""
    from jaxkv.transfer import target_platform

    platform = target_platform() if platform is None else platform
    if platform not in ("gpu", "cuda", "rocm") or config.host_memory_kind != "pinned_host":
        return
    need = 2 * config.num_layers * config.host_blocks * config.block_bytes // 2
    limit = gpu_host_limit_bytes()
    if need > limit:
        raise ValueError(
            f"the cache's host pools need {need / 2**30:.1f} GiB of pinned host memory "
            f"({config.num_layers} layers x {config.host_blocks} slots x "
            f"{config.block_bytes} bytes per K+V block), over the GPU runtime's pinned-host "
            f"limit of {limit / 2**30:.1f} GiB: raise {GPU_HOST_LIMIT_VAR} (e.g. "
            f"{GPU_HOST_LIMIT_VAR}={int(need / 2**30) + 8}, set before jax starts) or lower "
            "max_len, batch or host_capacity"
        )


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
    return _run(_prefill, cache, k, v, lengths)


@jax.jit
def _prefill(cache: TieredKVCache, k, v, lengths) -> TieredKVCache:
    c = cache.config
    L, B, M, bs = c.num_layers, c.batch, c.max_blocks, c.block_size
    S_h, S_x = c.hbm_blocks, c.host_blocks
    T = k.shape[2]
    pad = M * bs - T
    kb = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))).reshape(L, B, M, bs, *k.shape[3:])
    vb = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))).reshape(L, B, M, bs, *v.shape[3:])
    tok = jnp.arange(M * bs).reshape(M, bs)
    live = tok[None] < lengths[:, None, None]  # [B, M, bs]
    kb = jnp.where(live[None, ..., None, None], kb, 0)
    vb = jnp.where(live[None, ..., None, None], vb, 0)

    j = jnp.arange(M)
    n_sealed = lengths // bs  # [B]
    sealed = j[None] < n_sealed[:, None]  # [B, M]
    has_tail = n_sealed < M
    tail = (j[None] == n_sealed[:, None]) & has_tail[:, None]  # [B, M]
    # write order: (logical block, sequence); sealed blocks first fill HBM minus the tails
    order_key = jnp.where(sealed, j[None] * B + jnp.arange(B)[:, None], M * B)  # [B, M]
    rank = jnp.argsort(jnp.argsort(order_key.reshape(-1))).reshape(B, M)
    hbm_for_sealed = S_h - jnp.sum(has_tail)
    to_hbm = sealed & (rank < hbm_for_sealed)
    to_host = sealed & ~to_hbm
    n_hbm_sealed = jnp.sum(to_hbm)
    tail_rank = jnp.cumsum(has_tail) - 1  # [B]
    hbm_slot = jnp.where(to_hbm, rank, n_hbm_sealed + tail_rank[:, None])
    host_slot = rank - hbm_for_sealed
    tier = jnp.where(to_hbm | tail, TIER_HBM, jnp.where(to_host, TIER_HOST, TIER_NONE))
    slot = jnp.where(to_hbm | tail, hbm_slot, jnp.where(to_host, host_slot, 0)).astype(jnp.int32)

    # pools: gather each slot's source block (device side), then place host pools in one copy
    flat_k = kb.reshape(L, B * M, bs, *k.shape[3:])
    flat_v = vb.reshape(L, B * M, bs, *v.shape[3:])
    src = jnp.arange(B * M)

    def pool_for(mask, n_slots):
        m = mask.reshape(-1)
        s = jnp.where(m, slot.reshape(-1), n_slots)  # out of range -> dropped
        owner = jnp.full((n_slots,), B * M, jnp.int32).at[s].set(src, mode="drop")
        used = owner < B * M
        pk = jnp.where(used[None, :, None, None, None], flat_k[:, jnp.minimum(owner, B * M - 1)], 0)
        pv = jnp.where(used[None, :, None, None, None], flat_v[:, jnp.minimum(owner, B * M - 1)], 0)
        return pk, pv, used

    hk, hv, hbm_used = pool_for(to_hbm | tail, S_h)
    xk, xv, host_used = pool_for(to_host, S_x)
    written = sealed | tail
    kf = kb.astype(jnp.float32)
    kmin = jnp.where(live[None, ..., None, None], kf, jnp.inf).min(axis=3)
    kmax = jnp.where(live[None, ..., None, None], kf, -jnp.inf).max(axis=3)
    has_tok = jnp.any(live, axis=-1)[None, ..., None, None]
    return replace(
        cache,
        hbm_k=to_kind(hk, HBM_KIND),
        hbm_v=to_kind(hv, HBM_KIND),
        host_k=to_kind(xk, c.host_memory_kind),
        host_v=to_kind(xv, c.host_memory_kind),
        tier=jnp.broadcast_to(jnp.where(written, tier, TIER_NONE), (L, B, M)).astype(jnp.int32),
        slot=jnp.broadcast_to(slot, (L, B, M)),
        hbm_free=jnp.broadcast_to(~hbm_used, (L, S_h)),
        host_free=jnp.broadcast_to(~host_used, (L, S_x)),
        lengths=lengths,
        kmin=jnp.where(has_tok, kmin, 0.0),
        kmax=jnp.where(has_tok, kmax, 0.0),
    )


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
    return _run(_write_token, cache, layer, k, v, active)


def _write_token(cache: TieredKVCache, layer, k, v, active) -> TieredKVCache:
    c = cache.config
    b = jnp.arange(c.batch)
    pos = cache.lengths
    j = jnp.minimum(pos // c.block_size, c.max_blocks - 1)
    off = pos % c.block_size
    ok = active & (pos < c.max_len)
    s = jnp.where(ok, cache.slot[layer, b, j], c.hbm_blocks)  # out of range -> dropped
    hbm_k = cache.hbm_k.at[layer, s, off].set(k.astype(c.jnp_dtype), mode="drop")
    hbm_v = cache.hbm_v.at[layer, s, off].set(v.astype(c.jnp_dtype), mode="drop")
    kf = k.astype(jnp.float32)
    first = (off == 0)[:, None, None]
    old_min, old_max = cache.kmin[layer, b, j], cache.kmax[layer, b, j]
    new_min = jnp.where(first, kf, jnp.minimum(old_min, kf))
    new_max = jnp.where(first, kf, jnp.maximum(old_max, kf))
    okx = ok[:, None, None]
    kmin = cache.kmin.at[layer, b, j].set(jnp.where(okx, new_min, old_min))
    kmax = cache.kmax.at[layer, b, j].set(jnp.where(okx, new_max, old_max))
    return replace(cache, hbm_k=hbm_k, hbm_v=hbm_v, kmin=kmin, kmax=kmax)


def first_free(free, k: int):
    """The first `k` free slots of each row, in slot order (vectorized: top_k, no loop).

    Args:
      free: [rows, slots] bool.
    Returns:
      slots [rows, k'] int32 (k' = min(k, slots); entries past a row's count are arbitrary)
      and counts [rows] int32 of free slots.
    """
    S = free.shape[1]
    k = min(k, S)
    if k == 0:
        return jnp.zeros((free.shape[0], 0), jnp.int32), jnp.sum(free, axis=1).astype(jnp.int32)
    _, idx = jax.lax.top_k(jnp.where(free, -jnp.arange(S)[None], -S - 1), k)
    return idx.astype(jnp.int32), jnp.sum(free, axis=1).astype(jnp.int32)


def _take(table, idx):
    """table[r, idx[r, i]] for a [rows, n] table and [rows, m] indices (clamped into range;
    zeros from an empty table)."""
    if table.shape[1] == 0:
        return jnp.zeros(idx.shape, table.dtype)
    return jnp.take_along_axis(table, jnp.clip(idx, 0, table.shape[1] - 1), axis=1)


def advance(cache: TieredKVCache, active, *, after_reads=None) -> TieredKVCache:
    """Advances lengths of active sequences by one token and seals tails that filled up.

    A sealed tail keeps its HBM slot when another free HBM slot exists for the new tail;
    otherwise it spills to a host slot and its HBM slot becomes the new tail's. Per layer the
    sealing sequences take the free HBM slots in sequence order; the spills of all layers are
    written to host in one bulk transfer per pool (`jaxkv.transfer.write_blocks`), every step
    (entries that do not spill are marked unused), so no loop or branch depends on the data.

    Args:
      active: [batch] bool.
      after_reads: results of the step's reads of the host pools (e.g. the logits), which the
        in-place spill must follow (`jaxkv.transfer.after`); None if there are none.
    """
    return _run(_advance, cache, active, after_reads)


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
    seal_rank = jnp.maximum(jnp.cumsum(seal) - 1, 0)  # [B]
    hbm_list, n_hbm_free = first_free(cache.hbm_free, B)
    keep = seal[None] & (seal_rank[None] < n_hbm_free[:, None])  # [L, B]
    spill = seal[None] & ~keep
    tail_slot = jnp.where(keep, _take(hbm_list, jnp.broadcast_to(seal_rank, (L, B))), old_slot)
    host_list, _ = first_free(cache.host_free, B)
    host_slot = _take(host_list, jnp.maximum(jnp.cumsum(spill, axis=1) - 1, 0))  # [L, B]

    lay = jnp.arange(L)[:, None]
    rows = rows_of(lay, host_slot, spill, c.host_blocks).reshape(-1)
    kind = c.host_memory_kind
    blk = (L * B, *cache.hbm_k.shape[2:])
    spilled_k = cache.hbm_k[lay, old_slot].reshape(blk)
    spilled_v = cache.hbm_v[lay, old_slot].reshape(blk)
    host_k = write_blocks(
        cache.host_k, rows, spilled_k, c.fetch, pool_kind=kind, after_reads=after_reads
    )
    host_v = write_blocks(
        cache.host_v, rows, spilled_v, c.fetch, pool_kind=kind, after_reads=after_reads
    )
    tier = cache.tier.at[:, b, old_j].set(jnp.where(spill, TIER_HOST, cache.tier[:, b, old_j]))
    tier = tier.at[:, b, new_j].set(jnp.where(seal[None], TIER_HBM, tier[:, b, new_j]))
    slot = cache.slot.at[:, b, old_j].set(jnp.where(spill, host_slot, cache.slot[:, b, old_j]))
    slot = slot.at[:, b, new_j].set(jnp.where(seal[None], tail_slot, slot[:, b, new_j]))
    S_h, S_x = c.hbm_blocks, c.host_blocks
    hbm_free = cache.hbm_free.at[lay, jnp.where(keep, tail_slot, S_h)].set(False, mode="drop")
    host_free = cache.host_free.at[lay, jnp.where(spill, host_slot, S_x)].set(False, mode="drop")
    return replace(
        cache,
        host_k=host_k,
        host_v=host_v,
        tier=tier,
        slot=slot,
        hbm_free=hbm_free,
        host_free=host_free,
        lengths=lengths,
    )


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
    L = c.num_layers
    N = c.batch * c.max_blocks
    target = target.reshape(L, N)
    sealed = cache.sealed.reshape(L, N)
    in_hbm = cache.in_hbm.reshape(L, N)
    want_in = target & sealed & ~in_hbm
    want_out = in_hbm & ~target
    n_free = jnp.sum(cache.hbm_free, axis=1)  # [L]
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
    ok &= _take(sealed, safe) & (_take(tier, safe) == src_tier)
    r = jnp.arange(rows)[:, None]
    first = (
        jnp.full((rows, N), K, jnp.int32)
        .at[r, jnp.where(ok, safe, N)]
        .min(jnp.broadcast_to(i, (rows, K)).astype(jnp.int32), mode="drop")
    )
    return safe, ok & (_take(first, safe) == i)


def _compacted(ok, values, fill=0):
    """Moves the entries of `values` [rows, K] where `ok` to the front (order kept);
    returns (compacted [rows, K], counts [rows] int32)."""
    rows, K = ok.shape
    rank = jnp.cumsum(ok, axis=1) - 1
    r = jnp.arange(rows)[:, None]
    out = (
        jnp.full((rows, K), fill, values.dtype)
        .at[r, jnp.where(ok, rank, K)]
        .set(values, mode="drop")
    )
    return out, jnp.sum(ok, axis=1).astype(jnp.int32)


def _nth(r, first_list, first_count, then_list):
    """Entry r of the sequence `first_list[:first_count]` followed by `then_list`, per row."""
    return jnp.where(
        r < first_count[:, None], _take(first_list, r), _take(then_list, r - first_count[:, None])
    )


def migrate(
    cache: TieredKVCache, moves: Moves, layers=None, *, after_reads=None, fetched=None
) -> tuple[TieredKVCache, jax.Array]:
    """Applies `moves`: per layer its demotions (HBM -> host), then its promotions
    (host -> HBM), all of them in one bulk read and one bulk write per pool and direction.

    Contents are copied bit for bit; table and free masks are updated. Entries that do not
    apply (past the count, a block not sealed, already in the destination tier, or listed
    twice) are skipped. Every read happens before any write, so a promotion may take the HBM
    slot a demotion frees and a demotion the host slot a promotion frees. Demotions beyond the
    host pool's room are dropped. When HBM has too few free slots for the promotions, the
    resident sealed blocks of the lowest flat index that are not being demoted make room
    (use `plan_moves` to control which blocks leave); a block promoted here is never evicted
    here.

    Args:
      layers: python ints, the layers whose moves to apply (default: all); the others' moves
        are not traced at all (the decode loop's in-step plans move one layer at a time).
      after_reads: results of the caller's earlier reads of the host pools (e.g. the
        attention outputs of the layers already read this step), which the in-place host
        writes must follow (`jaxkv.transfer.after`); None if there are none.
      fetched: (k, v), each [layers, P, block_size, kv_heads, head_dim] on the device: the
        contents of the blocks `moves.promote` lists (entry by entry, P its width), already
        read from host by the caller (the decode loop's host read of this step); the
        promotions then write them to HBM without reading the host pool again. None: read.
    Returns:
      (new cache, [layers] int32 number of blocks actually moved; 0 outside `layers`).
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
    return _run(_migrate, cache, moves, after_reads, fetched, pair=True, layers=chosen)


def _migrate(cache: TieredKVCache, moves: Moves, after_reads, fetched, *, layers: tuple):
    c = cache.config
    L, B, M = c.num_layers, c.batch, c.max_blocks
    N = B * M
    ls = jnp.asarray(layers, jnp.int32)
    lay = ls[:, None]
    nl = len(layers)
    tier = cache.tier[ls].reshape(nl, N)
    slot = cache.slot[ls].reshape(nl, N)
    sealed = cache.sealed[ls].reshape(nl, N)
    hbm_free, host_free = cache.hbm_free[ls], cache.host_free[ls]

    d_blk, d_ok = _moves_applying(moves.demote[ls], moves.num_demote[ls], sealed, tier, TIER_HBM)
    p_blk, p_ok = _moves_applying(moves.promote[ls], moves.num_promote[ls], sealed, tier, TIER_HOST)
    d_blk, n_d = _compacted(d_ok, d_blk)
    if fetched is not None:  # which listed entry each compacted promotion came from
        K_in = moves.promote.shape[1]
        p_from = _compacted(p_ok, jnp.broadcast_to(jnp.arange(K_in, dtype=jnp.int32), p_ok.shape))[
            0
        ]
    p_blk, n_p = _compacted(p_ok, p_blk)
    Kd, Kp = d_blk.shape[1], p_blk.shape[1]
    host_list, n_host_free = first_free(host_free, Kd + Kp)
    hbm_list, n_hbm_free = first_free(hbm_free, Kp)
    n_d = jnp.minimum(n_d, n_host_free + n_p)  # host room: free slots and those promotions free
    # victims: resident sealed blocks not being demoted, lowest flat index first
    demoted = (
        jnp.zeros((nl, N), bool)
        .at[jnp.arange(nl)[:, None], jnp.where(jnp.arange(Kd)[None] < n_d[:, None], d_blk, N)]
        .set(True, mode="drop")
    )
    resident = sealed & (tier == TIER_HBM) & ~demoted
    v_blk, n_res = first_free(resident, Kp)
    n_v = jnp.clip(n_p - n_hbm_free - n_d, 0, n_res)
    n_p = jnp.minimum(n_p, n_hbm_free + n_d + n_v)

    # slots: HBM -> host writes (demotions, then victims) take the free host slots, then those
    # the promotions vacate; promotions take the free HBM slots, then those vacated
    d_src = _take(slot, d_blk)  # [nl, Kd] HBM slots
    v_src = _take(slot, v_blk)  # [nl, Kp]
    p_src = _take(slot, p_blk)  # [nl, Kp] host slots
    out_blk = jnp.concatenate([d_blk, v_blk], axis=1)  # [nl, Kd + Kp]
    out_src = jnp.concatenate([d_src, v_src], axis=1)
    j = jnp.arange(Kd + Kp)[None]
    out_ok = jnp.where(j < Kd, j < n_d[:, None], j - Kd < n_v[:, None])
    out_rank = jnp.where(j < Kd, j, n_d[:, None] + j - Kd)
    out_dst = _nth(out_rank, host_list, n_host_free, p_src)
    vacated = _compacted(out_ok, out_src)[0]  # HBM slots of demotions then victims
    r = jnp.arange(Kp)[None]
    p_ok = r < n_p[:, None]
    p_dst = _nth(r, hbm_list, n_hbm_free, vacated)

    # data: every read first (host -> device, HBM -> device), then the writes
    kind = c.host_memory_kind
    blk = cache.hbm_k.shape[2:]
    if fetched is None:
        p_rows = rows_of(lay, p_src, p_ok, c.host_blocks).reshape(-1)
        pk = read_blocks(cache.host_k, p_rows, c.fetch, pool_kind=kind)
        pv = read_blocks(cache.host_v, p_rows, c.fetch, pool_kind=kind)
    else:
        fk, fv = fetched
        want = (L, moves.promote.shape[1], *blk)
        if tuple(fk.shape) != want or tuple(fv.shape) != want:
            raise ValueError(
                f"migrate fetched blocks have shapes {tuple(fk.shape)}, {tuple(fv.shape)}: "
                f"expected {want} (layers, promote entries, block)"
            )
        pick = jnp.arange(nl)[:, None]
        pk = fk[ls][pick, p_from].reshape(-1, *blk).astype(cache.hbm_k.dtype)
        pv = fv[ls][pick, p_from].reshape(-1, *blk).astype(cache.hbm_v.dtype)
    ok_k = cache.hbm_k[lay, out_src].reshape(-1, *blk)
    ok_v = cache.hbm_v[lay, out_src].reshape(-1, *blk)
    reads = (pk, pv, after_reads)
    o_rows = rows_of(lay, out_dst, out_ok, c.host_blocks).reshape(-1)
    host_k = write_blocks(cache.host_k, o_rows, ok_k, c.fetch, pool_kind=kind, after_reads=reads)
    host_v = write_blocks(cache.host_v, o_rows, ok_v, c.fetch, pool_kind=kind, after_reads=reads)
    hbm_k, hbm_v = cache.hbm_k, cache.hbm_v
    S_h, S_x = c.hbm_blocks, c.host_blocks
    p_at = jnp.where(p_ok, p_dst, S_h)
    hbm_k = hbm_k.at[lay, p_at].set(pk.reshape(nl, Kp, *blk), mode="drop")
    hbm_v = hbm_v.at[lay, p_at].set(pv.reshape(nl, Kp, *blk), mode="drop")

    # tables
    rr = jnp.arange(nl)[:, None]
    blocks = jnp.concatenate([jnp.where(out_ok, out_blk, N), jnp.where(p_ok, p_blk, N)], axis=1)
    new_tier = jnp.concatenate(
        [jnp.full(out_blk.shape, TIER_HOST), jnp.full(p_blk.shape, TIER_HBM)], axis=1
    )
    new_slot = jnp.concatenate([out_dst, p_dst], axis=1)
    tier = tier.at[rr, blocks].set(new_tier.astype(jnp.int32), mode="drop")
    slot = slot.at[rr, blocks].set(new_slot.astype(jnp.int32), mode="drop")
    hbm_free = hbm_free.at[rr, jnp.where(out_ok, out_src, S_h)].set(True, mode="drop")
    hbm_free = hbm_free.at[rr, p_at].set(False, mode="drop")
    host_free = host_free.at[rr, jnp.where(p_ok, p_src, S_x)].set(True, mode="drop")
    host_free = host_free.at[rr, jnp.where(out_ok, out_dst, S_x)].set(False, mode="drop")
    moved = n_d + n_v + n_p
    cache = replace(
        cache,
        hbm_k=hbm_k,
        hbm_v=hbm_v,
        host_k=host_k,
        host_v=host_v,
        tier=cache.tier.at[ls].set(tier.reshape(nl, B, M)),
        slot=cache.slot.at[ls].set(slot.reshape(nl, B, M)),
        hbm_free=cache.hbm_free.at[ls].set(hbm_free),
        host_free=cache.host_free.at[ls].set(host_free),
    )
    return cache, jnp.zeros((L,), jnp.int32).at[ls].set(moved)


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
    return _run(_compact, cache, impl=impl)


def _compact(cache: TieredKVCache, *, impl: str) -> TieredKVCache:
    from pallas_kernels.compaction import compaction, compaction_moves

    used = ~cache.hbm_free  # [L, S]
    src, dst, num_moves, new_of_old = compaction_moves(used)
    if impl == "pallas":
        hbm_k = compaction(cache.hbm_k, src, dst, num_moves)
        hbm_v = compaction(cache.hbm_v, src, dst, num_moves)
    else:
        S = cache.config.hbm_blocks
        lay = jnp.arange(cache.config.num_layers)[:, None]
        at = jnp.where(jnp.arange(src.shape[1])[None] < num_moves[:, None], dst, S)  # -> dropped
        hbm_k = cache.hbm_k.at[lay, at].set(cache.hbm_k[lay, src], mode="drop")
        hbm_v = cache.hbm_v.at[lay, at].set(cache.hbm_v[lay, src], mode="drop")
    in_hbm = cache.tier == TIER_HBM
    renum = jnp.take_along_axis(new_of_old, cache.slot.reshape(cache.config.num_layers, -1), 1)
    slot = jnp.where(in_hbm, renum.reshape(cache.slot.shape), cache.slot)
    n_used = jnp.sum(used, axis=1, keepdims=True)
    hbm_free = jnp.arange(cache.config.hbm_blocks)[None] >= n_used
    return replace(cache, hbm_k=hbm_k, hbm_v=hbm_v, slot=slot, hbm_free=hbm_free)


def fragmentation(cache: TieredKVCache) -> jax.Array:
    """[layers] float: fraction of free HBM slots lying below the highest occupied slot."""
    used = ~cache.hbm_free
    S = used.shape[1]
    top = S - jnp.argmax(used[:, ::-1], axis=1)  # one past the highest occupied slot
    holes = jnp.sum(cache.hbm_free & (jnp.arange(S)[None] < top[:, None]), axis=1)
    return holes / jnp.maximum(top, 1)


def to_dense(cache: TieredKVCache) -> tuple[jax.Array, jax.Array]:
    """Reconstructs dense K and V (for tests and debugging).

    Returns:
      k, v: [layers, batch, max_blocks * block_size, kv_heads, head_dim] on the device, zeros at
      positions >= lengths.
    """
    c = cache.config
    host_k = to_kind(cache.host_k, HBM_KIND)
    host_v = to_kind(cache.host_v, HBM_KIND)

    def layer_blocks(hk, hv, xk, xv, tier, slot):
        sk = jnp.where((tier == TIER_HOST)[..., None, None, None], xk[slot], hk[slot])
        sv = jnp.where((tier == TIER_HOST)[..., None, None, None], xv[slot], hv[slot])
        return sk, sv

    bk, bv = jax.vmap(layer_blocks)(
        cache.hbm_k,
        cache.hbm_v,
        host_k,
        host_v,
        cache.tier,
        jnp.minimum(cache.slot, jnp.maximum(c.hbm_blocks, c.host_blocks) - 1),
    )
    shape = (c.num_layers, c.batch, c.max_blocks * c.block_size, c.kv_heads, c.head_dim)
    live = jnp.arange(shape[2])[None, :] < cache.lengths[:, None]  # [B, T]
    mask = live[None, :, :, None, None]
    return jnp.where(mask, bk.reshape(shape), 0), jnp.where(mask, bv.reshape(shape), 0)


def check_invariants(cache: TieredKVCache) -> None:
    """Raises AssertionError if the table and free masks disagree (host-side, for tests)."""
    import numpy as np

    c = cache.config
    tier, slot = np.asarray(cache.tier), np.asarray(cache.slot)
    hbm_free, host_free = np.asarray(cache.hbm_free), np.asarray(cache.host_free)
    lengths = np.asarray(cache.lengths)
    for layer in range(c.num_layers):
        for kind, free, code in (("hbm", hbm_free, TIER_HBM), ("host", host_free, TIER_HOST)):
            owners = slot[layer][tier[layer] == code]
            assert len(np.unique(owners)) == len(owners), f"layer {layer}: {kind} slot shared"
            used = np.zeros(free.shape[1], bool)
            used[owners] = True
            assert (used == ~free[layer]).all(), f"layer {layer}: {kind} free mask disagrees"
        for b in range(c.batch):
            n = lengths[b] // c.block_size
            written = -(-lengths[b] // c.block_size)
            tail = n if n < c.max_blocks else None
            for j in range(c.max_blocks):
                t = tier[layer, b, j]
                if j < written or j == tail:
                    assert t != TIER_NONE, f"layer {layer} seq {b} block {j} lost"
                else:
                    assert t == TIER_NONE, f"layer {layer} seq {b} block {j} unexpectedly placed"
            if tail is not None:
                assert tier[layer, b, tail] == TIER_HBM, f"layer {layer} seq {b}: tail not in HBM"
