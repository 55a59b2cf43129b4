"""Tier-aware blocked decode attention over a TieredKVCache.

Per layer and step: select blocks (all of them in exact mode; in sparse mode the top-k by the
Quest bound plus sink and recent blocks), attend the selected HBM blocks, copy the selected host
blocks into a device staging pool laid out per sequence (one bulk transfer per pool,
`jaxkv.cache.transfer`, which XLA can overlap with the HBM part) and attend them there, then merge
the two partial results by log-sum-exp. On the XLA path each part reads its blocks where they
lie (`jaxkv.attention.xla.attend_pool`): the HBM part reads each sequence's selected HBM blocks
through the block table (their slots compacted to the front, `compact_ids`, at most the
selection's static bound per sequence), the host part reads the staging pool in place; no
contiguous copy of either is built. Off GPU the host part (the fetch and its attention) runs
under a `lax.cond` on whether the step reads any host block, so a step that reads none (an
all-HBM cache) does no host work; on a GPU a conditional syncs the host, so there it always
runs. The Pallas kernel reads the pools in place through the block table. Placement never
changes what is attended, only where it is read from. Under `CacheConfig(fp8="age")` the HBM
pool holds FP8 blocks (dequantized where read on the XLA path, inside the kernel on the Pallas
path) and a third part reads each sequence's recent blocks from the full-precision ring
(`jaxkv.cache.layout.ring_window`); the three partials merge the same way.

`impl="auto"` takes the implementation measured fastest on the present device
(`jaxkv.attention.measured`), the XLA path where none was measured.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass
from jaxkv.attention.measured import measured_impl
from jaxkv.attention.select import select_blocks, window_starts
from jaxkv.attention.xla import attend_pool, compact_ids
from jaxkv.cache.layout import TieredKVCache, ring_ids, ring_window
from jaxkv.cache.layout import read_host as read_host_blocks
from jaxkv.cache.quant import dequantize
from jaxkv.cache.transfer import rows_of
from jaxkv.config import TIER_HBM, TIER_HOST, PlacementConfig
from pallas_kernels.blocked_attention import (
    blocked_attention,
    merge_partials,
)
from pallas_kernels.common import hopper_available, on_gpu

IMPLS = ("auto", "xla", "pallas")


@pytree_dataclass
class AttentionStats:
    """What one layer's attention read, per logical block."""

    read_hbm: jax.Array  # [batch, max_blocks] bool: read from HBM (tail and fp8 ring included)
    read_host: jax.Array  # [batch, max_blocks] bool: read from host memory
    mass: jax.Array  # [batch, max_blocks] float32: attention probability summed over q heads


@pytree_dataclass
class AttentionPart:
    """One part of a layer's attention (the HBM pool's, the fp8 ring's or the host's blocks),
    before `tiered_attention` merges the parts by log-sum-exp."""

    out: jax.Array  # [batch, q_heads, head_dim] f32, normalised over the part's own tokens
    lse: jax.Array  # [batch, q_heads] f32: log-sum-exp of its logits (-inf: nothing attended)
    # [batch, q_heads, max_blocks] f32 log-sum-exp per logical block (-inf: not attended);
    # None from the Pallas kernel, which does not return it
    block_lse: jax.Array | None


def staging_blocks(placement: PlacementConfig, max_blocks: int) -> int:
    """Static size of the per-sequence host staging buffer (blocks) for a placement config."""
    if placement.attention == "exact":
        return max_blocks
    k = (
        placement.topk
        if isinstance(placement.topk, int)
        else math.ceil(placement.topk * max_blocks)
    )
    return min(max_blocks, max(k, placement.sink_blocks + placement.recent_blocks))


def fetch_host_blocks(cache: TieredKVCache, layer, read_host, num_staging: int):
    """Copies the selected host blocks of `layer` to a device staging pool in one transfer per
    pool (K and V; `jaxkv.cache.transfer.read_blocks`, the cache's `fetch` mechanism).

    The staging pool is laid out per sequence: entry b * K + r holds sequence b's r-th selected
    host block in logical order (K = `staging_width`), unused entries are marked and (under
    "pallas") never read. So attention can read it in place, as [batch, K] blocks.

    Args:
      layer: int or traced int32 scalar.
      read_host: [batch, max_blocks] bool, at most `num_staging` per sequence.
      num_staging: per-sequence bound on the selected host blocks (`staging_blocks`).
    Returns:
      staging_k, staging_v: [batch * K, block_size, kv_heads, head_dim] on the device;
      staging_table: [batch, max_blocks] int32 staging entry of each selected block;
      ids: [batch, K] int32 logical block of each entry, -1 where unused.
    """
    c = cache.config
    K = staging_width(c, num_staging)
    ids = compact_ids(read_host, K)
    B = read_host.shape[0]
    slot = jnp.take_along_axis(cache.slot[layer], jnp.maximum(ids, 0), axis=1)
    listed = rows_of(layer, slot, ids >= 0, c.host_slots).reshape(-1)  # [B * K]
    sk, sv = read_host_blocks(cache, listed)  # dequantized on the device under fp8="host"
    rank = (jnp.cumsum(read_host, axis=1) - 1).astype(jnp.int32)
    staging_table = jnp.where(read_host, jnp.arange(B, dtype=jnp.int32)[:, None] * K + rank, 0)
    return sk, sv, staging_table, ids


def staging_width(config, num_staging: int) -> int:
    """Staging entries per sequence: the per-sequence bound, capped by the logical blocks and
    by the host pool (no more blocks can live there)."""
    return max(1, min(num_staging, config.max_blocks, config.host_slots))


def staging_size(config, num_staging: int) -> int:
    """Entries of a layer's host staging pool (`fetch_host_blocks`): batch x staging_width."""
    return config.batch * staging_width(config, num_staging)


def resolve_impl(impl: str, config) -> str:
    """The attention implementation for `impl` on this device and cache geometry.

    "auto" takes what `jaxkv.attention.measured` records as measured fastest on the present
    device (`measured_impl`: the XLA path on CPU and on any device not measured yet), the
    Pallas kernel only where the geometry is supported and a Hopper GPU is present.
    "pallas" requires the geometry the kernel supports (block size and head_dim multiples of 16,
    head_dim <= 256; any cache dtype, fp32 as bf16x3 products) and raises ValueError otherwise.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    supported = config.block_size % 16 == 0 and config.head_dim % 16 == 0 and config.head_dim <= 256
    if impl == "auto":
        fastest = measured_impl()
        return "pallas" if fastest == "pallas" and supported and hopper_available() else "xla"
    if impl == "pallas" and not supported:
        raise ValueError(
            f"impl='pallas' needs block_size and head_dim multiples of 16 (head_dim <= 256); "
            f"got block_size={config.block_size}, head_dim={config.head_dim}: use impl='xla'"
        )
    return impl


def _kernel_part(q, k_pool, v_pool, table, mask, lengths, scale, layer=None, starts=None, fp8=None):
    """One part read by the Pallas kernel (no `block_lse`); `fp8`: the FP8 pools' (k, v)
    scales, or None."""
    ks, vs = (None, None) if fp8 is None else fp8
    out, lse = blocked_attention(
        q, k_pool, v_pool, table, mask, lengths, scale=scale, layer=layer, starts=starts,
        k_scale=ks, v_scale=vs,
    )  # fmt: skip
    return AttentionPart(out=out, lse=lse, block_lse=None)


def read_layer_blocks(pool, lay, slots, scale=None, dtype=None):
    """Blocks `pool[lay][slots]` [*slots.shape, block_size, kv_heads, head_dim] (dequantized to
    `dtype` with `scale` [layers, slots, kv_heads] for an FP8 pool), written as a slice of
    the layer and a gather within it, which XLA fuses into the attention that consumes them
    (and its cost analysis reads as touching that layer's pool, not every layer's)."""
    layer = jax.lax.dynamic_index_in_dim(pool, lay, keepdims=False)  # [slots, bs, KV, D]
    x = layer[slots]
    if scale is None:
        return x
    sc = jax.lax.dynamic_index_in_dim(scale, lay, keepdims=False)[slots]  # [*, KV]
    flat = x.reshape(-1, *x.shape[-3:])
    return dequantize(flat, sc.reshape(-1, sc.shape[-1]), dtype).reshape(x.shape)


def _pool_part(q, k, v, ids, lengths, scale, max_blocks: int, starts) -> AttentionPart:
    """One part read on the XLA path: blocks `k`, `v` [batch, K, ...] given as their read from
    where they lie (`attend_pool`)."""
    out, lse, block_lse = attend_pool(q, k, v, ids, lengths, scale, max_blocks, starts)
    return AttentionPart(out=out, lse=lse, block_lse=block_lse)


def _empty_part(q, max_blocks: int) -> AttentionPart:
    """The part of a tier that holds none of the blocks read: nothing attended."""
    B, H, D = q.shape
    return AttentionPart(
        out=jnp.zeros((B, H, D), jnp.float32),
        lse=jnp.full((B, H), -jnp.inf, jnp.float32),
        block_lse=jnp.full((B, H, max_blocks), -jnp.inf, jnp.float32),
    )


def _host_part_xla(q, cache, layer, read_host, lengths, scale, n_stage, starts):
    """The host part on the XLA path: the fetch of the selected host blocks into the staging
    pool, and attention over it in place. Returns (AttentionPart, (staging K, V, table))."""
    c = cache.config

    def fetch_and_attend(_):
        sk, sv, stable, ids = fetch_host_blocks(cache, layer, read_host, n_stage)
        K = ids.shape[1]
        if on_gpu():  # read as a gather of its entries, which XLA:GPU fuses into the reductions
            at = jnp.arange(c.batch * K, dtype=jnp.int32).reshape(c.batch, K)
            kx, vx = sk[at], sv[at]
        else:  # laid out per sequence: a view
            kx = sk.reshape(c.batch, K, *sk.shape[1:])
            vx = sv.reshape(c.batch, K, *sv.shape[1:])
        return _pool_part(q, kx, vx, ids, lengths, scale, c.max_blocks, starts), (sk, sv, stable)

    if on_gpu():  # a conditional syncs the host on a GPU: always fetch (listed blocks only)
        return fetch_and_attend(None)

    def nothing(_):  # no host block read: no transfer, no attention (staging unread)
        shapes = jax.eval_shape(fetch_and_attend, None)[1]
        return _empty_part(q, c.max_blocks), tuple(jnp.zeros(x.shape, x.dtype) for x in shapes)

    return jax.lax.cond(jnp.any(read_host), fetch_and_attend, nothing, None)


def tiered_attention(
    q,
    cache: TieredKVCache,
    layer: int,
    lengths,
    placement: PlacementConfig,
    *,
    scale=None,
    impl: str = "auto",
    selected=None,
    return_staging: bool = False,
    window=None,
):
    """Decode attention of one layer over both tiers.

    Args:
      q: [batch, q_heads, head_dim] queries of the current token.
      cache: the cache, already holding the current token's K and V (see `write_token`).
      layer: python int or traced int32 scalar (the decode loop's scan over layers).
      lengths: [batch] int32 tokens per sequence including the current one (0 for a sequence
        that is not decoding; it attends nothing and gets zeros).
      placement: attention mode and sparse-selection parameters.
      scale: logit scale, default 1/sqrt(head_dim).
      impl: "auto" | "xla" | "pallas".
      selected: [batch, max_blocks] bool, this step's `select_blocks` when the caller has it
        already (it depends on the logical blocks only, so a migration does not change it).
      return_staging: also return what the host read fetched (`fetch_host_blocks`: staging
        K, V and the staging slot of each selected host block), e.g. to promote fetched
        blocks to HBM without reading them again.
      window: the layer's sliding window in tokens (Mistral; `window_starts`): None or <= 0
        for full attention; may be traced (a per-layer value under the layer scan). Only the
        blocks holding a token inside it are read; the boundary block is masked per token.
    Returns:
      out [batch, q_heads, head_dim] f32 and AttentionStats (and the staging triple).
    """
    c = cache.config
    B, H, D = q.shape
    if (B, D) != (c.batch, c.head_dim) or H % c.kv_heads:
        raise ValueError(
            f"q has shape {tuple(q.shape)}, expected ({c.batch}, a multiple of "
            f"kv_heads={c.kv_heads}, {c.head_dim})"
        )
    impl = resolve_impl(impl, c)
    starts = window_starts(lengths, window)
    if selected is None:
        selected = select_blocks(q, cache, layer, lengths, placement, window=window)
    tier = cache.tier[layer]
    read_pool, read_host = selected & (tier == TIER_HBM), selected & (tier == TIER_HOST)
    read_ring = jnp.zeros_like(selected)
    if c.ring_blocks:  # fp8="age": the recent blocks are read from the ring alone
        in_ring = ring_window(c, cache.lengths)
        read_ring = selected & in_ring
        read_pool, read_host = read_pool & ~in_ring, read_host & ~in_ring
    slot = cache.slot[layer]
    n_stage = staging_blocks(placement, c.max_blocks)
    scale_f = float(1.0 / math.sqrt(D) if scale is None else scale)
    lay = jnp.clip(jnp.asarray(layer, jnp.int32), 0, c.num_layers - 1)
    with jax.named_scope("hbm_part"):
        if impl == "pallas":
            fp8 = (cache.hbm_ks, cache.hbm_vs) if c.fp8_in("hbm") else None
            pool = (cache.hbm_k, cache.hbm_v, slot, read_pool)
            hbm_part = _kernel_part(q, *pool, lengths, scale, lay, starts, fp8)
        else:  # read where they lie: at most the selection's bound per sequence (or HBM's)
            ids_h = compact_ids(read_pool, max(1, min(n_stage, c.max_blocks, c.hbm_slots)))
            at = jnp.clip(
                jnp.take_along_axis(slot, jnp.maximum(ids_h, 0), axis=1), 0, c.hbm_slots - 1
            )
            fp8 = c.fp8_in("hbm")
            kh = read_layer_blocks(cache.hbm_k, lay, at, cache.hbm_ks if fp8 else None, c.jnp_dtype)
            vh = read_layer_blocks(cache.hbm_v, lay, at, cache.hbm_vs if fp8 else None, c.jnp_dtype)
            hbm_part = _pool_part(q, kh, vh, ids_h, lengths, scale_f, c.max_blocks, starts)
    ring_part = None
    if c.ring_blocks:  # fp8="age": the recent blocks, at full precision, laid out per sequence
        with jax.named_scope("ring_part"):
            W = c.ring_blocks
            if impl == "pallas":
                flat = (c.num_layers, c.batch * W, *cache.ring_k.shape[3:])
                table = jnp.arange(c.batch, dtype=jnp.int32)[:, None] * W + (
                    jnp.arange(c.max_blocks, dtype=jnp.int32)[None] % W
                )
                ring = (cache.ring_k.reshape(flat), cache.ring_v.reshape(flat), table, read_ring)
                ring_part = _kernel_part(q, *ring, lengths, scale, lay, starts)
            else:
                ids_r = ring_ids(c, cache.lengths, read_ring)
                kr, vr = cache.ring_k[lay], cache.ring_v[lay]
                ring_part = _pool_part(q, kr, vr, ids_r, lengths, scale_f, c.max_blocks, starts)
    with jax.named_scope("host_part"):
        if impl == "pallas":
            sk, sv, stable, _ = fetch_host_blocks(cache, layer, read_host, n_stage)
            host_part = _kernel_part(q, sk, sv, stable, read_host, lengths, scale, None, starts)
        else:  # the staging pool is laid out per sequence: read in place
            args = (q, cache, layer, read_host, lengths, scale_f, n_stage, starts)
            host_part, (sk, sv, stable) = _host_part_xla(*args)
    # merged in this order (HBM, ring, host): the sum's order, so the result's bits, follow it
    parts = [p for p in (hbm_part, ring_part, host_part) if p is not None]
    out, lse = merge_partials(jnp.stack([p.out for p in parts]), jnp.stack([p.lse for p in parts]))
    if impl == "pallas":  # the kernel returns no per-block log-sum-exp
        mass = jnp.zeros(selected.shape, jnp.float32)
    else:  # each block's from the part that read it
        blse = jnp.where(read_host[:, None, :], host_part.block_lse, hbm_part.block_lse)
        if ring_part is not None:
            blse = jnp.where(read_ring[:, None, :], ring_part.block_lse, blse)  # [B, H, M]
        safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        mass = jnp.where(selected[:, None], jnp.exp(blse - safe[..., None]), 0.0).sum(axis=1)
    read_hbm = read_pool | read_ring if c.ring_blocks else read_pool  # the ring is HBM too
    stats = AttentionStats(read_hbm=read_hbm, read_host=read_host, mass=mass)
    return (out, stats, (sk, sv, stable)) if return_staging else (out, stats)
