"""The TieredKVCache pytree: its pools, block table and free masks, the memory kinds they live
in, and the check that the host pools fit the GPU runtime's pinned-host memory.

The operations on a cache (prefill, write_token, advance, compact, ...) are in `jaxkv.cache`,
its migrations (plan_moves, migrate) in `jaxkv.migration`; both run them through
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
from jaxkv.config import HBM_KIND, TIER_HBM, TIER_NONE, CacheConfig
from jaxkv.transfer import kind_sharding, target_platform, to_kind, traced


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
