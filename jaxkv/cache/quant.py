"""FP8 storage for KV blocks: float8_e4m3fn values with a dynamic fp32 scale per block and KV
head, the form the cache's host tier takes under `CacheConfig(fp8="host")`, and both tiers' sealed
blocks under `CacheConfig(fp8="age")` (the recent ones read from a full-precision ring).

A block `[block_size, kv_heads, head_dim]` is quantized per KV head: `scale = amax / 448` over
that head's `block_size x head_dim` elements (448 is e4m3fn's largest finite value), and every
element is stored as `round_to_e4m3(x / scale)`. The scale is computed when the block enters the
host tier (spilled at sealing, demoted, or written there by prefill; under fp8="age" when it is
sealed, in either tier) and stays with the block: a migration dequantizes and re-quantizes it,
which gives back the same bytes and scale (`test_requantizing_a_dequantized_block_is_exact`), so
only FP8 bytes cross the link. Dequantizing is `q * scale`. K and V have their own scales.

Error bound (`error_bound`): e4m3 has 3 mantissa bits, so rounding to nearest moves a normal
value by at most 2^-4 of itself; below the smallest normal (2^-6, i.e. |x| < 2^-6 * scale) the
spacing is 2^-9, so a subnormal moves by at most 2^-10 * scale. Values never overflow: |x| /
scale <= 448 by construction (clipped against fp32 rounding of the division).

Why per (block, KV head): a block is the unit the cache moves and the annealer places, so its
scale must travel with it; per KV head because heads' key norms differ by an order of magnitude
in Llama-class models (one outlier head would otherwise flatten every other head's values into
e4m3's subnormals). The scales are 4 bytes per block, head and pool (K, V): 0.2% of a
16-token, 128-dim block at one byte an element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_REL_ERROR = 2.0**-4  # half the spacing of normal values, relative
FP8_SUB_ERROR = 2.0**-10  # half the spacing of subnormals, relative to the scale
FP8_MODES = ("off", "host", "age")


def fp8_block_bytes(block_size: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one FP8 block of one layer, K and V: an element a byte plus an fp32 scale per
    (pool, KV head)."""
    return 2 * block_size * kv_heads * head_dim + 2 * kv_heads * 4


def block_scales(blocks: jax.Array) -> jax.Array:
    """[n, kv_heads] f32 scales of blocks [n, block_size, kv_heads, head_dim]: amax / 448 per
    block and KV head, 1 where a block's head is all zeros (so dequantizing gives zeros)."""
    amax = jnp.max(jnp.abs(blocks.astype(jnp.float32)), axis=(1, 3))
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0)


def quantize(blocks: jax.Array, scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(float8_e4m3fn blocks, [n, kv_heads] f32 scales) of blocks [n, block_size, kv_heads,
    head_dim] in any float dtype. `scale` [n, kv_heads]: quantize with these scales (a block
    dequantized with its scale re-quantizes to the same bytes with it; recomputing the scale
    from the dequantized values can move it by an ulp), else `block_scales`."""
    scale = block_scales(blocks) if scale is None else scale
    x = blocks.astype(jnp.float32) / scale[:, None, :, None]
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Blocks [n, block_size, kv_heads, head_dim] in `dtype` from float8 values and their
    [n, kv_heads] scales."""
    return (q.astype(jnp.float32) * scale[:, None, :, None]).astype(dtype)


def error_bound(blocks: jax.Array) -> jax.Array:
    """Elementwise bound on |x - dequantize(quantize(x))| in fp32 (the module docstring), before
    the dequantized value is rounded to a narrower cache dtype."""
    scale = block_scales(blocks)[:, None, :, None]
    x = jnp.abs(blocks.astype(jnp.float32))
    return jnp.maximum(FP8_REL_ERROR * x, FP8_SUB_ERROR * scale) * (1 + 2.0**-20)


def pool_blocks(config, blocks: jax.Array, tier: str = "host", scale=None):
    """What a pool of `tier` ("host" or "hbm") stores for device blocks [n, ...] in the cache
    dtype: (values in that pool's dtype, [n, kv_heads] scales, or None where it is not FP8).
    `scale`: the FP8 scales the blocks were dequantized with (a copy between FP8 pools), so the
    bytes come back exactly; None: computed."""
    if not config.fp8_in(tier):
        return blocks.astype(config.jnp_dtype), None
    return quantize(blocks, scale)


def host_rounded(config, blocks: jax.Array) -> jax.Array:
    """Blocks [n, ...] in the cache dtype as they read back from the host pool: dequantized
    from their FP8 copy under fp8="host" (a write-through HBM copy holds these), else as is."""
    if config.fp8 != "host":
        return blocks
    return dequantize(*quantize(blocks), config.jnp_dtype)


def parse_policy(spec: str) -> tuple[str, int]:
    """(fp8, fp8_age) of an FP8 policy written as on the benchmarks' command lines: "off",
    "host" or "age:N" (N tokens). Raises ValueError otherwise."""
    if spec in ("off", "host"):
        return spec, 0
    mode, _, age = spec.partition(":")
    if mode != "age" or not age.isdigit():
        raise ValueError(f"FP8 policy {spec!r}: expected off, host or age:N (N tokens)")
    return "age", int(age)
