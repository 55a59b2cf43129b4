"""Input validation, block-list planning and tile / split-K / SMEM sizing for paged decode
attention (pure jnp / Python; the kernel is in blocked_attention.py)."""

from __future__ import annotations

import jax.numpy as jnp

ROWS = 64  # WGMMA M tile: the GQA group is padded to this many rows.
TARGET_PROGRAMS = 264  # about two waves of programs on a 132-SM H100/H200
MAX_BLOCKS_PER_SPLIT = 1024
SMEM_BUDGET = 200 * 1024  # of 227 KiB per block on Hopper, leaving room for barriers
# The kernel and the reference take the same dtypes; the kernel runs fp32 as bf16x3 products.
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Quantized pools (with per-(slot, kv head) float32 scales); q keeps one of SUPPORTED_DTYPES.
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def check_inputs(
    q,
    k_pool,
    v_pool,
    block_table,
    block_mask,
    lengths,
    layer,
    *,
    kernel: bool,
    starts=None,
    k_scale=None,
    v_scale=None,
):
    """Static validation shared by the kernel and the reference (ValueError naming values).

    Pools are q's dtype, or float8_e4m3fn with `k_scale` / `v_scale` (float32
    `k_pool.shape[:-3] + (kv_heads,)`, per (slot, kv head)); see `check_scales`.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    if k_pool.ndim not in (4, 5):
        raise ValueError(
            "k_pool must be [slots, block_size, kv_heads, head_dim] or [layers, slots, "
            f"block_size, kv_heads, head_dim], got shape {k_pool.shape}"
        )
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool shape {v_pool.shape} must equal k_pool shape {k_pool.shape}")
    if (k_pool.ndim == 5) != (layer is not None):
        raise ValueError(
            f"layer={layer!r} with a {k_pool.ndim}-D pool: a [layers, ...] pool needs the layer "
            "index, a one-layer pool takes none"
        )
    if layer is not None and jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, pool_head_dim = k_pool.shape[-4:]
    if pool_head_dim != head_dim:
        raise ValueError(f"k_pool head_dim {pool_head_dim} must equal q head_dim {head_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q dtype {q.dtype} unsupported; expected one of {[str(d) for d in SUPPORTED_DTYPES]}"
        )
    scaled = check_scales(k_pool, v_pool, k_scale, v_scale)
    if not scaled and (k_pool.dtype != q.dtype or v_pool.dtype != q.dtype):
        raise ValueError(
            f"k_pool/v_pool dtypes {k_pool.dtype}/{v_pool.dtype} must equal q dtype {q.dtype}"
        )
    if block_table.ndim != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must be [batch={batch}, max_blocks], got {block_table.shape}"
        )
    if block_table.dtype != jnp.int32:
        raise ValueError(f"block_table dtype {block_table.dtype} must be int32")
    if block_mask.shape != block_table.shape:
        raise ValueError(
            f"block_mask shape {block_mask.shape} must equal block_table shape {block_table.shape}"
        )
    if block_mask.dtype != jnp.bool_:
        raise ValueError(f"block_mask dtype {block_mask.dtype} must be bool")
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(
            f"lengths must be int32 [batch={batch}], got {lengths.dtype} {lengths.shape}"
        )
    if starts is not None and (starts.shape != (batch,) or starts.dtype != jnp.int32):
        raise ValueError(
            f"starts must be None or int32 [batch={batch}], got {starts.dtype} {starts.shape}"
        )
    if kernel:
        if block_size % 16:
            raise ValueError(
                f"block_size={block_size} unsupported by the Mosaic GPU kernel: it must be a "
                "multiple of 16 (the WGMMA K step of its 16-bit products); use the reference / "
                "XLA path"
            )
        if head_dim % 16:
            raise ValueError(
                f"head_dim={head_dim} unsupported by the Mosaic GPU kernel: it must be a "
                "multiple of 16 (the WGMMA K step of its 16-bit products)"
            )
        if head_dim > 256:
            raise ValueError(f"head_dim={head_dim} unsupported by the Mosaic GPU kernel: max 256")
        if q_heads // kv_heads > ROWS:
            raise ValueError(
                f"q_heads // kv_heads = {q_heads // kv_heads} unsupported by the Mosaic GPU "
                f"kernel: at most {ROWS} query heads per kv head"
            )


def check_scales(k_pool, v_pool, k_scale, v_scale) -> bool:
    """True for float8_e4m3fn pools with their scales, False for unscaled pools; ValueError for
    scales without fp8 pools, fp8 pools without scales, or scales of the wrong shape / dtype."""
    fp8 = (jnp.dtype(k_pool.dtype) == FP8, jnp.dtype(v_pool.dtype) == FP8)
    want = f"float32 of shape {tuple(k_pool.shape[:-3]) + (k_pool.shape[-2],)}"
    if (k_scale is None) != (v_scale is None):
        raise ValueError(
            "k_scale and v_scale must be given together (or neither): float8_e4m3fn pools "
            f"take both, each {want} (per slot and kv head)"
        )
    if k_scale is None:
        if any(fp8):
            raise ValueError(
                f"float8_e4m3fn k_pool/v_pool ({k_pool.dtype}/{v_pool.dtype}) need k_scale and "
                f"v_scale, each {want} (per slot and kv head)"
            )
        return False
    if not all(fp8):
        raise ValueError(
            f"k_scale/v_scale given with k_pool/v_pool dtypes {k_pool.dtype}/{v_pool.dtype}: "
            "scaled pools must both be float8_e4m3fn"
        )
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x.dtype != jnp.float32 or x.shape != tuple(k_pool.shape[:-3]) + (k_pool.shape[-2],):
            raise ValueError(f"{name} must be {want}, got {x.dtype} {tuple(x.shape)}")
    return True


def token_ranges(block_mask, lengths, block_size: int, starts=None):
    """The valid tokens of each attended block: token t of logical block j of row b is valid
    iff first[b, j] <= t < end[b, j], i.e. starts[b] <= j * block_size + t < lengths[b]
    (`starts`: a sliding window's first attended token, None for 0).

    Returns:
      (first, end) [batch, max_blocks] int32 offsets within the block; both 0 where the block
      is not attended or holds no valid token (so `end > first` marks the blocks to read).
    """
    base = jnp.arange(block_mask.shape[1], dtype=jnp.int32)[None, :] * block_size
    end = jnp.clip(lengths[:, None] - base, 0, block_size)
    first = jnp.zeros_like(end) if starts is None else jnp.clip(starts[:, None] - base, 0, end)
    active = block_mask & (end > first)
    return jnp.where(active, first, 0), jnp.where(active, end, 0)


def plan_blocks(
    block_table,
    block_mask,
    lengths,
    layer=0,
    *,
    block_size,
    num_slots,
    num_splits,
    per_split,
    starts=None,
):
    """Compacts each row's attended blocks to the front; returns meta [batch, splits, L]:
    per split a header (n, layer, 0, 0), then per listed block its slot, its end and its first
    valid token (`token_ranges`)."""
    batch, max_blocks = block_table.shape
    first, ntok = token_ranges(block_mask, lengths, block_size, starts)
    active = ntok > first
    count = active.sum(axis=1, dtype=jnp.int32)
    # A stable partition by cumsum + scatter (O(max_blocks), no sort): attended blocks first,
    # in logical order, so the accumulation order is deterministic.
    rank = jnp.where(
        active,
        jnp.cumsum(active, axis=1, dtype=jnp.int32) - 1,
        count[:, None] + jnp.cumsum(~active, axis=1, dtype=jnp.int32) - 1,
    )
    rows = jnp.arange(batch)[:, None]
    slots = jnp.where(active, jnp.clip(block_table, 0, num_slots - 1), 0)
    slots = jnp.zeros_like(slots).at[rows, rank].set(slots, unique_indices=True)
    ntok = jnp.zeros_like(ntok).at[rows, rank].set(ntok, unique_indices=True)
    first = jnp.zeros_like(first).at[rows, rank].set(first, unique_indices=True)
    pad = num_splits * per_split - max_blocks

    def split_rows(x):
        return jnp.pad(x, ((0, 0), (0, pad))).reshape(batch, num_splits, per_split)

    slots, ntok, first = split_rows(slots), split_rows(ntok), split_rows(first)
    starts = jnp.arange(num_splits, dtype=jnp.int32) * per_split
    n_local = jnp.clip(count[:, None] - starts[None, :], 0, per_split)
    header = jnp.zeros((batch, num_splits, 4), jnp.int32).at[:, :, 0].set(n_local)
    header = header.at[:, :, 1].set(jnp.asarray(layer, jnp.int32))
    meta = jnp.concatenate([header, slots, ntok, first], axis=2)
    return jnp.pad(meta, ((0, 0), (0, 0), (0, meta_row_len(per_split) - meta.shape[2])))


def meta_row_len(per_split: int) -> int:
    # A TMA copy into a barrier must move a multiple of 128 bytes (one per warpgroup thread).
    return -(-(4 + 3 * per_split) // 32) * 32


def runs_bf16x3(dtype) -> bool:
    """True for fp32 inputs, which the kernel runs as bf16 (hi, lo) parts (bf16x3 products)."""
    return jnp.dtype(dtype) == jnp.float32


def default_tile(dtype, head_dim: int, kv_dtype=None) -> int:
    """Tokens per tile when blocks_per_step is not given (`dtype`: q's, `kv_dtype`: the pools',
    default q's): 64, or for fp32 pools as many as keep a K/V stage at 32 KiB (64 / 32 / 16 at
    head_dim 64 / 128 / 256), so that 3-4 stages plus the split buffers fit the SMEM budget.
    fp8 pools: 64 / 64 / 32 at head_dim 64 / 128 / 256 (at 256 the tile converted in
    registers next to the accumulator spills twice as much at 64 tokens; fp32 q's bf16
    (hi, lo) q and p would also leave room for only 2 stages)."""
    if kv_dtype is not None and jnp.dtype(kv_dtype) == FP8:
        return min(64, 8192 // max(64, head_dim))
    if not runs_bf16x3(dtype):
        return 64
    return max(16, 4096 // max(64, head_dim))


def tile_blocks(
    requested, block_size: int, max_blocks: int, dtype, head_dim: int, kv_dtype=None
) -> int:
    """Blocks per loop step (`requested`, or None for the default tile); ValueError if the
    tile is wider than a WGMMA."""
    step = requested or max(1, default_tile(dtype, head_dim, kv_dtype) // block_size)
    step = min(step, max(1, max_blocks))
    if step * block_size > 256:
        raise ValueError(
            f"blocks_per_step={step} x block_size={block_size} = {step * block_size} tokens "
            "per tile unsupported by the Mosaic GPU kernel: at most 256 (WGMMA N)"
        )
    return step


def split_sizes(
    batch, kv_heads, max_blocks, step, num_splits, min_blocks_per_split
) -> tuple[int, int]:
    """(num_splits, blocks per split): `num_splits`, or None to fill the GPU."""
    if num_splits is not None:
        num_splits = min(num_splits, max_blocks)
    else:
        wanted = -(-TARGET_PROGRAMS // (batch * kv_heads))
        num_splits = max(1, min(wanted, max_blocks // min_blocks_per_split))
    # Bounds the per-program block list kept in SMEM.
    num_splits = max(num_splits, -(-max_blocks // MAX_BLOCKS_PER_SPLIT))
    per_split = -(-max_blocks // num_splits)
    per_split = -(-per_split // step) * step  # whole tiles
    return num_splits, per_split


def pipeline_stages(requested, num_tiles, tile, head_dim, dtype, meta_len, kv_dtype=None) -> int:
    """Pipeline depth that fits the SMEM budget; ValueError if even one stage does not.

    `dtype` is q's, `kv_dtype` the pools' (default q's); `meta_len`: 4-byte words of per-program
    metadata in SMEM (the block list, plus the scales for fp8 pools)."""
    kv_dtype = jnp.dtype(kv_dtype or dtype)
    isz = kv_dtype.itemsize
    parts, mma_isz = (2, 2) if runs_bf16x3(dtype) else (1, jnp.dtype(dtype).itemsize)
    fixed = parts * ROWS * (head_dim + tile) * mma_isz + meta_len * 4  # fp32: bf16 (hi, lo) q, p
    if kv_dtype == FP8:
        fixed += tile * head_dim * mma_isz  # the K or V tile converted to the WGMMA dtype
    elif runs_bf16x3(dtype):
        fixed += 2 * tile * head_dim * 2  # the (hi, lo) bf16 K or V tile
    out = ROWS * (head_dim + 1) * 4  # epilogue buffers, aliased with the K/V stages
    per_stage = 2 * tile * head_dim * isz
    fits = (SMEM_BUDGET - fixed) // per_stage
    if fits < 1 or SMEM_BUDGET - fixed < out:
        pools = "" if kv_dtype == jnp.dtype(dtype) else f", {kv_dtype} pools"
        raise ValueError(
            f"a tile of {tile} tokens with head_dim={head_dim} ({jnp.dtype(dtype)}{pools}) needs "
            f"{fixed + max(per_stage, out)} bytes of SMEM for one K/V stage, over the "
            f"kernel's budget of {SMEM_BUDGET}; lower block_size or blocks_per_step"
        )
    return max(1, min(requested, num_tiles, fits))


def scale_row_len(per_split: int) -> int:
    """Words of each of the three sections of a program's fp8 scale row (`plan_scales`)."""
    return -(-per_split // 32) * 32  # 128-byte multiples, as `meta_row_len`


def plan_scales(meta, k_scale, v_scale, layer, *, per_split, step, scale):
    """The fp8 pools' scales of each program's listed blocks, for the kernel to fold into its
    products: [batch, splits, kv_heads, 3 * L] float32 (L = `scale_row_len(per_split)`), per
    (row, split, kv head) three sections of L:
      * k_scale of each listed block times the softmax `scale` (0 past the list's end: the
        kernel masks those columns);
      * v_scale of each listed block divided by its tile's largest |v_scale| (so that p times
        it stays <= 1 in the WGMMA dtype, fp16 included);
      * that largest |v_scale| of each tile of `step` blocks (1 where it is 0), by which the
        tile's p @ V product is multiplied.

    Args:
      meta: [batch, splits, meta_len] int32 from `plan_blocks` (slots at 4 : 4 + per_split).
      k_scale, v_scale: [(layers,) slots, kv_heads] float32.
      layer: int32 scalar (clipped) for [layers, ...] scales, else ignored.
    """
    slots = meta[:, :, 4 : 4 + per_split]  # [batch, splits, per_split]
    listed = jnp.arange(per_split)[None, None, :] < meta[:, :, :1]
    if k_scale.ndim == 3:
        k_scale, v_scale = k_scale[layer], v_scale[layer]

    def listed_scales(x):  # [batch, splits, kv_heads, per_split]
        return jnp.moveaxis(jnp.where(listed[..., None], x[slots], 0.0), -1, 2)

    ks, vs = listed_scales(k_scale) * scale, listed_scales(v_scale)
    tiles = jnp.abs(vs).reshape(*vs.shape[:-1], per_split // step, step).max(axis=-1)
    tiles = jnp.where(tiles > 0, tiles, 1.0)
    vs = vs / jnp.repeat(tiles, step, axis=-1)
    length = scale_row_len(per_split)

    def pad(x):
        return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, length - x.shape[-1])))

    return jnp.concatenate([pad(ks), pad(vs), pad(tiles)], axis=-1).astype(jnp.float32)
