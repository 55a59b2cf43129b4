"""The TieredKVCache pytree: its pools, block table and free masks, the memory kinds they live
in, and the check that the host pools fit the GPU runtime's pinned-host memory.

The operations on a cache (prefill, write_token, advance, compact, ...) are in `jaxkv.cache`,
its migrations (plan_moves, migrate) in `jaxkv.cache.migration`; both run them through
`run_in_kinds`, which outside jit returns the pools in their configured memory kinds (see the
`jaxkv.cache` module docstring for why a jit boundary is needed for "unpinned_host").
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, static_field
from jaxkv.cache.quant import dequantize, pool_blocks
from jaxkv.cache.transfer import kind_sharding, read_blocks, to_kind, traced, write_blocks
from jaxkv.config import HBM_KIND, TIER_HBM, TIER_NONE, CacheConfig
from pallas_kernels.common import target_platform


@pytree_dataclass
class TieredKVCache:
    hbm_k: jax.Array  # [layers, hbm_slots, block, kv_heads, head_dim]  memory kind "device"
    hbm_v: jax.Array  # [layers, hbm_slots, block, kv_heads, head_dim]  memory kind "device"
    host_k: jax.Array  # [layers, host_slots, block, kv_heads, head_dim]  config.host_memory_kind
    host_v: jax.Array  # [layers, host_slots, block, kv_heads, head_dim]  config.host_memory_kind
    # FP8 scales of the host blocks (`jaxkv.cache.quant`), "device": [layers, host_slots, kv_heads]
    # f32 under fp8="host", [layers, 0, kv_heads] without FP8
    host_ks: jax.Array
    host_vs: jax.Array
    # FP8 scales of the HBM blocks under fp8="age", "device": [layers, hbm_slots, kv_heads] f32
    # ([layers, 0, kv_heads] otherwise)
    hbm_ks: jax.Array
    hbm_vs: jax.Array
    # the full-precision ring under fp8="age" (`CacheConfig.ring_blocks` = W entries per
    # sequence; logical block j at entry j % W): [layers, batch, W, block, kv_heads, head_dim]
    # in `dtype`, "device" (W = 0 otherwise). It holds each sequence's tail and its W - 1 most
    # recent sealed blocks, which attention reads from here (`ring_window`).
    ring_k: jax.Array
    ring_v: jax.Array
    tier: jax.Array  # [layers, batch, max_blocks] int32: TIER_HBM / TIER_HOST / TIER_NONE
    slot: jax.Array  # [layers, batch, max_blocks] int32: slot in that tier's pool (0 if none)
    # [batch, max_blocks] int32: the host page of each block's write-through copy, the same in
    # every layer (their blocks seal together): b * max_blocks + j, or under `paged_host` the
    # page the block took when it sealed (-1: none yet)
    host_page: jax.Array
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
        hbm = jnp.zeros((L, c.hbm_slots, *blk), c.hbm_dtype)
        host = jnp.zeros((L, c.host_slots, *blk), c.host_dtype)
        scales = jnp.ones((L, c.host_slots if c.fp8_in("host") else 0, c.kv_heads), jnp.float32)
        hbm_scales = jnp.ones((L, c.hbm_slots if c.fp8_in("hbm") else 0, c.kv_heads))
        ring = jnp.zeros((L, B, c.ring_blocks, *blk), c.jnp_dtype)
        tier = jnp.full((L, B, M), TIER_NONE, jnp.int32).at[:, :, 0].set(TIER_HBM)
        slot = jnp.zeros((L, B, M), jnp.int32).at[:, :, 0].set(jnp.arange(B, dtype=jnp.int32))
        hbm_free = jnp.ones((L, c.hbm_slots), bool).at[:, :B].set(False)
        flat = jnp.arange(B * M, dtype=jnp.int32).reshape(B, M)
        host_page = jnp.full((B, M), -1, jnp.int32) if c.paged_host else flat
        summary = jnp.zeros((L, B, M, c.kv_heads, c.head_dim), jnp.float32)
        return TieredKVCache(
            hbm_k=to_kind(hbm, HBM_KIND),
            hbm_v=to_kind(hbm, HBM_KIND),
            host_k=to_kind(host, c.host_memory_kind),
            host_v=to_kind(jnp.zeros_like(host), c.host_memory_kind),
            host_ks=scales,
            host_vs=scales,
            hbm_ks=hbm_scales,
            hbm_vs=hbm_scales,
            ring_k=ring,
            ring_v=ring,
            tier=tier,
            slot=slot,
            host_page=host_page,
            hbm_free=hbm_free,
            host_free=jnp.ones((L, c.host_slots), bool),
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


def read_host(cache: TieredKVCache, rows) -> tuple[jax.Array, jax.Array]:
    """Host blocks on the device, in the cache dtype: one bulk read per pool
    (`jaxkv.cache.transfer.read_blocks`) of the flat rows `rows` [n] (`rows_of`, -1: unused, zeros),
    dequantized there under fp8="host" (the FP8 values cross the link, the scales are already
    on the device). Returns (k, v), each [n, block_size, kv_heads, head_dim]."""
    c = cache.config
    kind = c.host_memory_kind
    xk = read_blocks(cache.host_k, rows, c.fetch, pool_kind=kind)
    xv = read_blocks(cache.host_v, rows, c.fetch, pool_kind=kind)
    if not c.fp8_in("host"):
        return xk, xv
    at = jnp.maximum(rows, 0)
    sk = cache.host_ks.reshape(-1, c.kv_heads)[at]
    sv = cache.host_vs.reshape(-1, c.kv_heads)[at]
    return dequantize(xk, sk, c.jnp_dtype), dequantize(xv, sv, c.jnp_dtype)


def write_host(cache: TieredKVCache, rows, k, v, after_reads=None, scales=None) -> dict:
    """The host pools (and FP8 scales) with device blocks `k`, `v` [n, block_size, kv_heads,
    head_dim] written at flat rows `rows` [n] (distinct, -1: not written): one bulk write per
    pool (`jaxkv.cache.transfer.write_blocks`, after `after_reads`), quantized on the device first
    under fp8="host" / "age" (with `scales` = (sk, sv) [n, kv_heads] when the blocks come
    dequantized from FP8 blocks of these scales: their bytes come back exactly). Returns the
    changed fields, for `replace(cache, **fields)`."""
    c = cache.config
    kind = c.host_memory_kind
    sk0, sv0 = (None, None) if scales is None else scales
    qk, sk = pool_blocks(c, k, "host", sk0)
    qv, sv = pool_blocks(c, v, "host", sv0)
    out = dict(
        host_k=write_blocks(
            cache.host_k, rows, qk, c.fetch, pool_kind=kind, after_reads=after_reads
        ),
        host_v=write_blocks(
            cache.host_v, rows, qv, c.fetch, pool_kind=kind, after_reads=after_reads
        ),
    )
    if c.fp8_in("host"):
        shape = cache.host_ks.shape
        at = jnp.where(rows >= 0, rows, shape[0] * shape[1])  # -> dropped
        flat = (-1, c.kv_heads)
        out["host_ks"] = cache.host_ks.reshape(flat).at[at].set(sk, mode="drop").reshape(shape)
        out["host_vs"] = cache.host_vs.reshape(flat).at[at].set(sv, mode="drop").reshape(shape)
    return out


def read_hbm(cache: TieredKVCache, lay, slots) -> tuple[jax.Array, jax.Array]:
    """HBM blocks `cache.hbm_k[lay, slots]` (and V; `lay`, `slots` broadcast, in range) in the
    cache dtype: dequantized under fp8="age". Returns (k, v), each [*shape, block_size,
    kv_heads, head_dim]."""
    c = cache.config
    k, v = cache.hbm_k[lay, slots], cache.hbm_v[lay, slots]
    if not c.fp8_in("hbm"):
        return k, v
    sk, sv = cache.hbm_ks[lay, slots], cache.hbm_vs[lay, slots]
    flat = (-1, *k.shape[-3:])
    k = dequantize(k.reshape(flat), sk.reshape(-1, c.kv_heads), c.jnp_dtype).reshape(k.shape)
    v = dequantize(v.reshape(flat), sv.reshape(-1, c.kv_heads), c.jnp_dtype).reshape(v.shape)
    return k, v


def write_hbm(cache: TieredKVCache, lay, slots, k, v, scales=None) -> dict:
    """The HBM pools (and FP8 scales) with blocks `k`, `v` [*shape, block_size, kv_heads,
    head_dim] in the cache dtype written at `cache.hbm_k[lay, slots]` (`slots` >= hbm_blocks:
    not written), quantized first under fp8="age" (with `scales` = (sk, sv) [*shape,
    kv_heads] when they come dequantized from FP8 blocks of these scales). Returns the changed
    fields."""
    c = cache.config
    shape = k.shape[:-3]
    flat = lambda s: None if s is None else s.reshape(-1, c.kv_heads)  # noqa: E731
    sk0, sv0 = (None, None) if scales is None else map(flat, scales)
    qk, sk = pool_blocks(c, k.reshape(-1, *k.shape[-3:]), "hbm", sk0)
    qv, sv = pool_blocks(c, v.reshape(-1, *v.shape[-3:]), "hbm", sv0)
    out = dict(
        hbm_k=cache.hbm_k.at[lay, slots].set(qk.reshape(k.shape), mode="drop"),
        hbm_v=cache.hbm_v.at[lay, slots].set(qv.reshape(v.shape), mode="drop"),
    )
    if c.fp8_in("hbm"):
        scales = (*shape, c.kv_heads)
        out["hbm_ks"] = cache.hbm_ks.at[lay, slots].set(sk.reshape(scales), mode="drop")
        out["hbm_vs"] = cache.hbm_vs.at[lay, slots].set(sv.reshape(scales), mode="drop")
    return out


def ring_window(config: CacheConfig, lengths) -> jax.Array:
    """[batch, max_blocks] bool: the logical blocks read from the full-precision ring under
    fp8="age" (each sequence's tail, or its last block once full, and the `ring_blocks - 1`
    blocks before it), for a cache holding `lengths` [batch] tokens; all False otherwise."""
    M, W = config.max_blocks, config.ring_blocks
    tail = jnp.minimum(lengths // config.block_size, M - 1)[:, None]
    j = jnp.arange(M)[None]
    return (j <= tail) & (j > tail - W)


def ring_ids(config: CacheConfig, lengths, mask) -> jax.Array:
    """[batch, ring_blocks] int32: the logical block at each ring entry where `mask`
    [batch, max_blocks] selects it (a block inside `ring_window`), -1 elsewhere."""
    W = config.ring_blocks
    tail = jnp.minimum(lengths // config.block_size, config.max_blocks - 1)[:, None]
    e = jnp.arange(W)[None]
    j = tail - (tail - e) % W  # the window's block at entry e (< 0: none)
    hit = (j >= 0) & jnp.take_along_axis(mask, jnp.maximum(j, 0), axis=1)
    return jnp.where(hit, j, -1).astype(jnp.int32)


def pool_fields(config: CacheConfig, tier: str, pool_k, pool_v) -> dict:
    """The pool fields of `tier` ("hbm" or "host") of a cache, from whole pools [layers, slots,
    ...] in the cache dtype (on the device; prefill): quantized where that tier is FP8, then
    placed in its memory kind."""
    c = config
    L, S = pool_k.shape[:2]
    kind = HBM_KIND if tier == "hbm" else c.host_memory_kind
    qk, sk = pool_blocks(c, pool_k.reshape(L * S, *pool_k.shape[2:]), tier)
    qv, sv = pool_blocks(c, pool_v.reshape(L * S, *pool_v.shape[2:]), tier)
    out = {
        f"{tier}_k": to_kind(qk.reshape(pool_k.shape), kind),
        f"{tier}_v": to_kind(qv.reshape(pool_v.shape), kind),
    }
    if c.fp8_in(tier):
        out[f"{tier}_ks"] = sk.reshape(L, S, c.kv_heads)
        out[f"{tier}_vs"] = sv.reshape(L, S, c.kv_heads)
    return out


def cache_shardings(config: CacheConfig) -> TieredKVCache:
    """A TieredKVCache of shardings: the host pools in `config.host_memory_kind`, every other
    array in "device". Pass it for a cache in a jit's `out_shardings` (e.g. the `cache` field of
    a state's out_shardings prefix, None elsewhere): only a jit boundary gives a traced
    "unpinned_host" pool its kind back (see the `jaxkv.cache` module docstring)."""
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


def run_in_kinds(op, cache: TieredKVCache, *args, pair: bool = False, **static):
    """`op(cache, *args, **static)`: as is when traced; outside jit as one jit that returns the
    pools in their configured memory kinds (`cache_shardings`). `pair`: `op` returns
    (cache, [layers] array) rather than a cache."""
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
    platform = target_platform() if platform is None else platform
    if platform not in ("gpu", "cuda", "rocm") or config.host_memory_kind != "pinned_host":
        return
    need = config.num_layers * config.host_slots * config.host_block_bytes
    limit = gpu_host_limit_bytes()
    if need > limit:
        raise ValueError(
            f"the cache's host pools need {need / 2**30:.1f} GiB of pinned host memory "
            f"({config.num_layers} layers x {config.host_slots} slots x "
            f"{config.host_block_bytes} bytes per K+V block), over the GPU runtime's pinned-host "
            f"limit of {limit / 2**30:.1f} GiB: raise {GPU_HOST_LIMIT_VAR} (e.g. "
            f"{GPU_HOST_LIMIT_VAR}={int(need / 2**30) + 8}, set before jax starts) or lower "
            + (
                "max_len or batch (host_tier='write-through' keeps every block on host; "
                "host_tier='exclusive' with a smaller host_* capacity keeps only what HBM "
                "does not hold)"
                if config.write_through
                else "max_len, batch or the host_* capacity"
            )
        )
