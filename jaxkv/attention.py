"""Tier-aware blocked decode attention over a TieredKVCache.

Per layer and step: select blocks (all of them in exact mode; in sparse mode the top-k by the
Quest bound plus sink and recent blocks), attend the selected HBM blocks in place, copy the
selected host blocks into a fixed-size device staging buffer (one bulk transfer per pool,
`jaxkv.transfer`, which XLA can overlap with the HBM part) and attend them, then merge the two
partial results by log-sum-exp. Placement never changes what is attended, only where it is
read from.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass
from jaxkv.cache import TieredKVCache
from jaxkv.config import TIER_HBM, TIER_HOST, PlacementConfig
from jaxkv.transfer import read_blocks, rows_of
from pallas_kernels.blocked_attention import (
    blocked_attention,
    blocked_attention_reference,
    merge_partials,
)
from pallas_kernels.common import hopper_available

IMPLS = ("auto", "xla", "pallas")
PALLAS_MEASURED_FASTER = False  # no GPU measurement yet (bench/RESULTS.md, Kernels section)


@pytree_dataclass
class AttentionStats:
    """What one layer's attention read, per logical block."""

    read_hbm: jax.Array  # [batch, max_blocks] bool: read from HBM (tail included)
    read_host: jax.Array  # [batch, max_blocks] bool: read from host memory
    mass: jax.Array  # [batch, max_blocks] float32: attention probability summed over q heads


def quest_scores(q, kmin, kmax):
    """Quest upper bound on each block's attention logit, summed over query heads.

    Args:
      q: [batch, q_heads, head_dim]; kmin, kmax: [batch, max_blocks, kv_heads, head_dim].
    Returns:
      [batch, max_blocks] f32.
    """
    B, H, D = q.shape
    KV = kmin.shape[2]
    qg = q.astype(jnp.float32).reshape(B, KV, H // KV, D)
    bound = jnp.maximum(
        jnp.einsum("bkgd,bmkd->bkgmd", qg, kmin), jnp.einsum("bkgd,bmkd->bkgmd", qg, kmax)
    ).sum(-1)
    return bound.sum(axis=(1, 2))


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


def select_blocks(q, cache: TieredKVCache, layer: int, lengths, placement: PlacementConfig):
    """Logical blocks to read this step.

    Args:
      q: [batch, q_heads, head_dim]; lengths: [batch] tokens including the current one.
    Returns:
      [batch, max_blocks] bool.
    """
    c = cache.config
    M = c.max_blocks
    j = jnp.arange(M)
    n_written = -(-lengths // c.block_size)  # [B]
    written = j[None] < n_written[:, None]
    if placement.attention == "exact":
        return written
    score = quest_scores(q, cache.kmin[layer], cache.kmax[layer])
    forced = (j[None] < placement.sink_blocks) | (
        j[None] >= n_written[:, None] - placement.recent_blocks
    )
    score = jnp.where(forced, jnp.inf, score)
    score = jnp.where(written, score, -jnp.inf)
    if isinstance(placement.topk, int):
        k = jnp.minimum(placement.topk, n_written)
    else:
        k = jnp.ceil(placement.topk * n_written).astype(jnp.int32)
    k = jnp.maximum(k, jnp.sum(forced & written, axis=1))
    rank = jnp.argsort(jnp.argsort(-score, axis=1, stable=True), axis=1)
    return written & (rank < k[:, None])


def fetch_host_blocks(cache: TieredKVCache, layer, read_host, num_staging: int):
    """Copies the selected host blocks of `layer` to a device staging pool in one transfer per
    pool (K and V; `jaxkv.transfer.read_blocks`, the cache's `fetch` mechanism).

    The selected blocks are listed in (sequence, logical block) order, by a cumsum, into a
    fixed-size list of `staging_size` entries; unused entries are marked and (under "pallas")
    never read.

    Args:
      layer: int or traced int32 scalar.
      read_host: [batch, max_blocks] bool, at most `num_staging` per sequence.
      num_staging: per-sequence bound on the selected host blocks (`staging_blocks`).
    Returns:
      staging_k, staging_v: [staging_size(...), block_size, kv_heads, head_dim] on the device;
      staging_table: [batch, max_blocks] int32 staging slot of each selected block.
    """
    c = cache.config
    n = staging_size(c, num_staging)
    flat = read_host.reshape(-1)
    rank = (jnp.cumsum(flat) - 1).astype(jnp.int32)
    rows = rows_of(layer, cache.slot[layer].reshape(-1), flat, c.host_blocks)
    listed = jnp.full((n,), -1, jnp.int32).at[jnp.where(flat, rank, n)].set(rows, mode="drop")
    kind = c.host_memory_kind
    sk = read_blocks(cache.host_k, listed, c.fetch, pool_kind=kind)
    sv = read_blocks(cache.host_v, listed, c.fetch, pool_kind=kind)
    staging_table = jnp.where(read_host, rank.reshape(read_host.shape), 0)
    return sk, sv, staging_table


def staging_size(config, num_staging: int) -> int:
    """Entries of a layer's host staging list: the per-sequence bound times the batch, capped
    by the host pool (no more blocks can live there)."""
    return max(1, min(config.batch * num_staging, config.host_blocks))


def resolve_impl(impl: str, config) -> str:
    """The attention implementation for `impl` on this device and cache geometry.

    "auto" stays on the XLA path: the Pallas kernel has not yet been measured faster on a GPU
    (bench/RESULTS.md); flip `PALLAS_MEASURED_FASTER` once bench_kernels.py shows it is.
    "pallas" requires the geometry the kernel supports (block size and head_dim multiples of 16,
    head_dim <= 256; any cache dtype, fp32 as bf16x3 products) and raises ValueError otherwise.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {IMPLS}")
    supported = config.block_size % 16 == 0 and config.head_dim % 16 == 0 and config.head_dim <= 256
    if impl == "auto":
        return "pallas" if PALLAS_MEASURED_FASTER and supported and hopper_available() else "xla"
    if impl == "pallas" and not supported:
        raise ValueError(
            f"impl='pallas' needs block_size and head_dim multiples of 16 (head_dim <= 256); "
            f"got block_size={config.block_size}, head_dim={config.head_dim}: use impl='xla'"
        )
    return impl


def _attend(impl, q, k_pool, v_pool, table, mask, lengths, scale, layer=None):
    """(out, lse, block_lse or None) of one tier's part."""
    if impl == "pallas":
        out, lse = blocked_attention(
            q, k_pool, v_pool, table, mask, lengths, scale=scale, layer=layer
        )
        return out, lse, None
    return blocked_attention_reference(
        q, k_pool, v_pool, table, mask, lengths, scale=scale, layer=layer, return_block_lse=True
    )


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
    if selected is None:
        selected = select_blocks(q, cache, layer, lengths, placement)
    tier = cache.tier[layer]
    read_hbm = selected & (tier == TIER_HBM)
    read_host = selected & (tier == TIER_HOST)
    slot = cache.slot[layer]
    with jax.named_scope("hbm_part"):
        out_h, lse_h, blse_h = _attend(
            impl, q, cache.hbm_k, cache.hbm_v, slot, read_hbm, lengths, scale, layer=layer
        )
    with jax.named_scope("host_part"):
        n_stage = staging_blocks(placement, c.max_blocks)
        sk, sv, stable = fetch_host_blocks(cache, layer, read_host, n_stage)
        out_d, lse_d, blse_d = _attend(impl, q, sk, sv, stable, read_host, lengths, scale)
    out, lse = merge_partials(jnp.stack([out_h, out_d]), jnp.stack([lse_h, lse_d]))
    if blse_h is None:
        mass = jnp.zeros(selected.shape, jnp.float32)
    else:
        blse = jnp.where(read_host[:, None, :], blse_d, blse_h)  # [B, H, M]
        safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        mass = jnp.where(selected[:, None], jnp.exp(blse - safe[..., None]), 0.0).sum(axis=1)
    stats = AttentionStats(read_hbm=read_hbm, read_host=read_host, mass=mass)
    return (out, stats, (sk, sv, stable)) if return_staging else (out, stats)


def dense_attention_reference(q, k, v, lengths, *, scale=None):
    """Exact attention over dense K/V (the ground truth for tests).

    Args:
      q: [batch, q_heads, head_dim]; k, v: [batch, T, kv_heads, head_dim]; lengths: [batch].
    Returns:
      [batch, q_heads, head_dim] f32.
    """
    B, H, D = q.shape
    KV = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.astype(jnp.float32).reshape(B, KV, H // KV, D)
    logits = jnp.einsum("bkgd,btkd->bkgt", qg, k.astype(jnp.float32)) * scale
    valid = jnp.arange(k.shape[1])[None] < lengths[:, None]
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bkgt,btkd->bkgd", p, v.astype(jnp.float32)).reshape(B, H, D)
