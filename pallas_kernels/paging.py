"""Input validation and block-list planning for paged decode attention (pure jnp / Python)."""

from __future__ import annotations

import jax.numpy as jnp

ROWS = 64  # WGMMA M tile: the GQA group is padded to this many rows.
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
REFERENCE_DTYPES = (*SUPPORTED_DTYPES, jnp.dtype(jnp.float32))


def check_inputs(q, k_pool, v_pool, block_table, block_mask, lengths, layer, *, kernel: bool):
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
    dtypes = SUPPORTED_DTYPES if kernel else REFERENCE_DTYPES
    if q.dtype not in dtypes:
        raise ValueError(
            f"q dtype {q.dtype} unsupported"
            f"{' by the Mosaic GPU kernel (use the reference / XLA path)' if kernel else ''};"
            f" expected one of {[str(d) for d in dtypes]}"
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
    if kernel:
        if block_size % 16:
            raise ValueError(
                f"block_size={block_size} unsupported by the Mosaic GPU kernel: it must be a "
                "multiple of 16 (WGMMA K step for 16-bit inputs); use the reference / XLA path"
            )
        if head_dim % 16:
            raise ValueError(
                f"head_dim={head_dim} unsupported by the Mosaic GPU kernel: it must be a "
                "multiple of 16 (WGMMA K step for 16-bit inputs)"
            )
        if head_dim > 256:
            raise ValueError(f"head_dim={head_dim} unsupported by the Mosaic GPU kernel: max 256")
        if q_heads // kv_heads > ROWS:
            raise ValueError(
                f"q_heads // kv_heads = {q_heads // kv_heads} unsupported by the Mosaic GPU "
                f"kernel: at most {ROWS} query heads per kv head"
            )


def token_counts(block_mask, lengths, block_size: int):
    """[batch, max_blocks] int32: valid tokens of each attended block (0 if not attended)."""
    starts = jnp.arange(block_mask.shape[1], dtype=jnp.int32) * block_size
    ntok = jnp.clip(lengths[:, None] - starts[None, :], 0, block_size)
    return jnp.where(block_mask, ntok, 0)


def plan_blocks(
    block_table, block_mask, lengths, layer=0, *, block_size, num_slots, num_splits, per_split
):
    """Compacts each row's attended blocks to the front; returns meta [batch, splits, L]."""
    batch, max_blocks = block_table.shape
    ntok = token_counts(block_mask, lengths, block_size)
    active = ntok > 0
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
    pad = num_splits * per_split - max_blocks
    slots = jnp.pad(slots, ((0, 0), (0, pad))).reshape(batch, num_splits, per_split)
    ntok = jnp.pad(ntok, ((0, 0), (0, pad))).reshape(batch, num_splits, per_split)
    starts = jnp.arange(num_splits, dtype=jnp.int32) * per_split
    n_local = jnp.clip(count[:, None] - starts[None, :], 0, per_split)
    header = jnp.zeros((batch, num_splits, 4), jnp.int32).at[:, :, 0].set(n_local)
    header = header.at[:, :, 1].set(jnp.asarray(layer, jnp.int32))
    meta = jnp.concatenate([header, slots, ntok], axis=2)
    return jnp.pad(meta, ((0, 0), (0, 0), (0, meta_row_len(per_split) - meta.shape[2])))


def meta_row_len(per_split: int) -> int:
    # A TMA copy into a barrier must move a multiple of 128 bytes (one per warpgroup thread).
    return -(-(4 + 2 * per_split) // 32) * 32
