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


def check_inputs(
    q, k_pool, v_pool, block_table, block_mask, lengths, layer, *, kernel: bool, starts=None
):
    """Static validation shared by the kernel and the reference (ValueError naming values)."""
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
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
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


def default_tile(dtype, head_dim: int) -> int:
    """Tokens per tile when blocks_per_step is not given: 64, or for fp32 as many as keep a K/V
    stage at 32 KiB (64 / 32 / 16 at head_dim 64 / 128 / 256), so that 3-4 stages plus the
    split buffers fit the SMEM budget."""
    if not runs_bf16x3(dtype):
        return 64
    return max(16, 4096 // max(64, head_dim))


def tile_blocks(requested, block_size: int, max_blocks: int, dtype, head_dim: int) -> int:
    """Blocks per loop step (`requested`, or None for the default tile); ValueError if the
    tile is wider than a WGMMA."""
    step = requested or max(1, default_tile(dtype, head_dim) // block_size)
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


def pipeline_stages(requested, num_tiles, tile, head_dim, dtype, meta_len) -> int:
    """Pipeline depth that fits the SMEM budget; ValueError if even one stage does not."""
    isz = jnp.dtype(dtype).itemsize
    parts, mma_isz = (2, 2) if runs_bf16x3(dtype) else (1, isz)  # fp32: q, p as bf16 (hi, lo)
    fixed = parts * ROWS * (head_dim + tile) * mma_isz + meta_len * 4
    if runs_bf16x3(dtype):
        fixed += 2 * tile * head_dim * 2  # the (hi, lo) bf16 K or V tile
    out = ROWS * (head_dim + 1) * 4  # epilogue buffers, aliased with the K/V stages
    per_stage = 2 * tile * head_dim * isz
    fits = (SMEM_BUDGET - fixed) // per_stage
    if fits < 1 or SMEM_BUDGET - fixed < out:
        raise ValueError(
            f"a tile of {tile} tokens with head_dim={head_dim} ({jnp.dtype(dtype)}) needs "
            f"{fixed + max(per_stage, out)} bytes of SMEM for one K/V stage, over the "
            f"kernel's budget of {SMEM_BUDGET}; lower block_size or blocks_per_step"
        )
    return max(1, min(requested, num_tiles, fits))
