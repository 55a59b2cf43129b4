"""Blocked (paged) decode attention over one layer's KV pool, as a Mosaic GPU kernel.

One query token per sequence attends the KV blocks that `block_mask` selects, read through
`block_table` from a pool of fixed-size blocks. Returns the normalised output and the
log-sum-exp of the logits, so that two partial results (HBM-resident blocks and host blocks
staged on the device) merge exactly by log-sum-exp.

Layout of the computation (Hopper, `plgpu.kernel`, one warpgroup per program):
  * grid (split, kv_head, batch). The query heads that share a kv head (the GQA group, up to
    64) are padded to a 64-row WGMMA tile.
  * The wrapper compacts each row's attended blocks to the front of a per-row list (XLA, on
    [batch, max_blocks] int32, negligible) and cuts it into `num_splits` chunks (split-K).
    Masked blocks are never loaded: a program streams only its chunk's blocks, through a
    `num_stages`-deep TMA pipeline of tiles of `blocks_per_step` blocks (a chunk's last tile
    is topped up by reloading its first block, an L2 hit, and masked).
  * Per tile: logits [64, tile] = q [64, D] @ K^T (WGMMA), scale / soft-cap / token mask,
    online softmax in fp32 registers, p (input dtype, SMEM) @ V (WGMMA, fp32 accumulator).
  * Each program writes a partial (out, lse); `merge_partials` (XLA, small) combines the
    splits by log-sum-exp.
Inputs: bf16 / fp16 (fp32 pools: use the reference); block_size and head_dim multiples of 16.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (
    _interpret_params,
    _smem_2d_transforms,
    _swizzle,
    compiler_params,
)
from pallas_kernels.paging import ROWS, check_inputs, meta_row_len, plan_blocks, token_counts

_ROWS = ROWS
_TARGET_PROGRAMS = 264  # about two waves of programs on a 132-SM H100/H200
_MAX_BLOCKS_PER_SPLIT = 1024
_SMEM_BUDGET = 200 * 1024  # of 227 KiB per block on Hopper, leaving room for barriers


def _num_stages(requested, num_tiles, tile, head_dim, dtype, meta_len) -> int:
    """Pipeline depth that fits the SMEM budget; ValueError if even one stage does not."""
    isz = jnp.dtype(dtype).itemsize
    fixed = _ROWS * head_dim * isz + _ROWS * tile * isz + meta_len * 4
    out = _ROWS * (head_dim + 1) * 4  # epilogue buffers, aliased with the K/V stages
    per_stage = 2 * tile * head_dim * isz
    fits = (_SMEM_BUDGET - fixed) // per_stage
    if fits < 1 or _SMEM_BUDGET - fixed < out:
        raise ValueError(
            f"a tile of {tile} tokens with head_dim={head_dim} ({jnp.dtype(dtype)}) needs "
            f"{fixed + max(per_stage, out)} bytes of SMEM for one K/V stage, over the "
            f"kernel's budget of {_SMEM_BUDGET}; lower block_size or blocks_per_step"
        )
    return max(1, min(requested, num_tiles, fits))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tuning knobs of the kernel.

    Attributes:
      num_stages: K/V tiles in flight per program (TMA pipeline depth).
      blocks_per_step: KV blocks per loop step (one WGMMA tile of blocks_per_step *
        block_size tokens, at most 256); None picks max(1, 64 // block_size).
      num_splits: split-K factor over each row's attended blocks; None picks one so that
        batch * kv_heads * num_splits fills the GPU, capped by `min_blocks_per_split`.
      min_blocks_per_split: lower bound on a split's length when `num_splits` is None.
    """

    num_stages: int = 4
    blocks_per_step: int | None = None
    num_splits: int | None = None
    min_blocks_per_split: int = 16

    def __post_init__(self):
        if self.blocks_per_step is not None and self.blocks_per_step < 1:
            raise ValueError(f"blocks_per_step={self.blocks_per_step} must be >= 1 or None")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be >= 1 or None")
        if self.min_blocks_per_split < 1:
            raise ValueError(f"min_blocks_per_split={self.min_blocks_per_split} must be >= 1")


def blocked_attention_kernel(
    q_ref,  # [batch, kv_heads, 64, head_dim]  GQA group rows, zero padded to 64
    k_ref,  # [(layers,) slots, block_size, kv_heads, head_dim]
    v_ref,  # [(layers,) slots, block_size, kv_heads, head_dim]
    meta_ref,  # [batch, splits, meta_len] int32: n, layer, 0, 0, slots[per_split], ntoks, 0..
    out_ref,  # [splits, batch, kv_heads, 64, head_dim] f32 partial outputs
    lse_ref,  # [splits, batch, kv_heads, 64] f32 partial log-sum-exp
    q_smem,  # [64, head_dim]
    kv_or_out,  # union of ((k_smem, v_smem), (o_smem, l_smem)): the loop, then the epilogue
    p_smem,  # [64, tile] probabilities in the input dtype (WGMMA A operand)
    meta_smem,  # [meta_len] int32
    q_barrier,  # Barrier
    meta_barrier,  # Barrier
    k_barriers,  # Barrier[num_stages], blocks_per_step arrivals each
    v_barriers,  # Barrier[num_stages], blocks_per_step arrivals each
    *,
    block_size: int,
    head_dim: int,
    blocks_per_split: int,
    blocks_per_step: int,
    num_stages: int,
    scale: float,
    softcap: float | None,
    multi_layer: bool,
):
    """One (split, kv head, batch row): online softmax over its chunk of attended blocks.

    Each step handles a tile of blocks_per_step blocks (tile = blocks_per_step * block_size
    tokens) so that small blocks still give WGMMA-sized tiles and few loop iterations.
    """
    split = lax.axis_index("split")
    head = lax.axis_index("kv_head")
    row = lax.axis_index("batch")
    dtype = q_smem.dtype
    # k_smem, v_smem: [num_stages, tile, head_dim]; o_smem: [64, head_dim] f32;
    # l_smem: [64] f32. The output buffers reuse the K/V buffers' SMEM: they are written only
    # after the last K/V block has been waited for and consumed.
    (k_smem, v_smem), (o_smem, l_smem) = kv_or_out

    # The table is padded and its indices clipped, so the copy is in bounds; saying so takes the
    # plain bulk copy (a bounds-checked TMA copy allows at most 256 elements per dimension).
    plgpu.copy_gmem_to_smem(
        meta_ref.at[row, split],
        meta_smem,
        meta_barrier,
        oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
    )
    plgpu.copy_gmem_to_smem(q_ref.at[row, head], q_smem, q_barrier)
    plgpu.barrier_wait(meta_barrier)
    num_blocks = meta_smem[0]
    layer = meta_smem[1]

    def block(ref, slot):  # [block_size, head_dim] view of one block of this kv head
        return ref.at[layer, slot, :, head] if multi_layer else ref.at[slot, :, head]

    num_steps = lax.div(num_blocks + blocks_per_step - 1, blocks_per_step)
    tile = blocks_per_step * block_size

    def fetch(i, buf):
        # Always blocks_per_step copies (the barriers count that many arrivals): a tile's
        # entries past the list's end reload its first block (an L2 hit) and are masked out,
        # so the SMEM the products read is never uninitialised.
        first = meta_smem[4 + i * blocks_per_step]
        for j in range(blocks_per_step):
            e = i * blocks_per_step + j
            slot = jnp.where(e < num_blocks, meta_smem[4 + e], first)
            rows = pl.ds(j * block_size, block_size)
            plgpu.copy_gmem_to_smem(block(k_ref, slot), k_smem.at[buf, rows], k_barriers.at[buf])
            plgpu.copy_gmem_to_smem(block(v_ref, slot), v_smem.at[buf, rows], v_barriers.at[buf])

    for i in range(num_stages):
        pl.when(i < num_steps)(functools.partial(fetch, i, i))
    plgpu.barrier_wait(q_barrier)

    reduced = plgpu.Layout.WGMMA.reduce(1)
    m_i = plgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32), reduced)
    l_i = plgpu.layout_cast(jnp.full((_ROWS,), 0.0, jnp.float32), reduced)
    acc = plgpu.layout_cast(jnp.full((_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    def step(i, carry):
        acc, m_i, l_i = carry
        buf = lax.rem(i, num_stages)
        plgpu.barrier_wait(k_barriers.at[buf])

        def qk_product(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[buf].T)
            return acc_ref[...]

        s = pl.run_scoped(qk_product, plgpu.ACC((_ROWS, tile), jnp.float32))
        s = s * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        col = plgpu.broadcasted_iota(jnp.int32, (_ROWS, tile), 1, layout=plgpu.Layout.WGMMA)
        valid = None
        for j in range(blocks_per_step):
            # ntok is 0 for list entries past the end.
            ntok = meta_smem[4 + blocks_per_split + i * blocks_per_step + j]
            in_block = col < j * block_size + ntok
            if j:
                in_block = in_block & (col >= j * block_size)
            valid = in_block if valid is None else valid | in_block
        s = jnp.where(valid, s, -jnp.inf)
        # A tile's first block is listed and holds >= 1 valid token, so m_new is finite and
        # exp() never sees inf - inf.
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_barriers.at[buf])

        def pv_product(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[buf])
            return acc_ref[...]

        # A fresh accumulator plus a register add, not pl.run_state(ACC.init(acc)): the GPU
        # interpreter does not implement run_state, and the add is free next to the loads.
        acc = acc + pl.run_scoped(pv_product, plgpu.ACC((_ROWS, head_dim), jnp.float32))
        # Both products have completed (their accumulators were read), so `buf` is free.
        nxt = i + num_stages
        pl.when(nxt < num_steps)(functools.partial(fetch, nxt, buf))
        return acc, m_new, l_i

    acc, m_i, l_i = lax.fori_loop(0, num_steps, step, (acc, m_i, l_i))

    nonempty = l_i > 0.0
    inv_l = jnp.where(nonempty, 1.0 / jnp.where(nonempty, l_i, 1.0), 0.0)
    o_smem[...] = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    l_smem[...] = jnp.where(nonempty, m_i + jnp.log(jnp.where(nonempty, l_i, 1.0)), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[split, row, head])
    plgpu.copy_smem_to_gmem(l_smem, lse_ref.at[split, row, head])
    plgpu.wait_smem_to_gmem(0)


def _blocks_per_step(block_sizes: BlockSizes, block_size: int, max_blocks: int) -> int:
    step = block_sizes.blocks_per_step or max(1, 64 // block_size)
    step = min(step, max(1, max_blocks))
    if step * block_size > 256:
        raise ValueError(
            f"blocks_per_step={step} x block_size={block_size} = {step * block_size} tokens "
            "per tile unsupported by the Mosaic GPU kernel: at most 256 (WGMMA N)"
        )
    return step


def _split_sizes(batch, kv_heads, max_blocks, step, block_sizes: BlockSizes) -> tuple[int, int]:
    if block_sizes.num_splits is not None:
        num_splits = min(block_sizes.num_splits, max_blocks)
    else:
        wanted = -(-_TARGET_PROGRAMS // (batch * kv_heads))
        num_splits = max(1, min(wanted, max_blocks // block_sizes.min_blocks_per_split))
    # Bounds the per-program block list kept in SMEM.
    num_splits = max(num_splits, -(-max_blocks // _MAX_BLOCKS_PER_SPLIT))
    per_split = -(-max_blocks // num_splits)
    per_split = -(-per_split // step) * step  # whole tiles
    return num_splits, per_split


def merge_partials(out, lse):
    """Merges partial results along axis 0 by log-sum-exp.

    Args:
      out: [parts, ...rows, head_dim] float32, each part normalised over its own tokens.
      lse: [parts, ...rows] float32; -inf for a part with nothing attended.

    Returns:
      (out [...rows, head_dim], lse [...rows]); rows empty in every part give 0 and -inf.
    """
    m = lse.max(axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for empty parts
    total = w.sum(axis=0)
    merged = (w[..., None] * out).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return merged, jnp.where(total > 0, m_safe + jnp.log(total), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block_sizes", "interpret"))
def _blocked_attention(
    q,
    k_pool,
    v_pool,
    block_table,
    block_mask,
    lengths,
    layer,
    *,
    scale,
    softcap,
    block_sizes,
    interpret,
):
    batch, q_heads, head_dim = q.shape
    num_slots, block_size, kv_heads, _ = k_pool.shape[-4:]
    multi_layer = k_pool.ndim == 5
    # A [layers, ...] pool is indexed in the kernel, never sliced here: a slice of a pool
    # feeding a custom call can make XLA copy the whole layer.
    layer = jnp.clip(layer, 0, k_pool.shape[0] - 1) if multi_layer else 0
    max_blocks = block_table.shape[1]
    group = q_heads // kv_heads
    step = _blocks_per_step(block_sizes, block_size, max_blocks)
    num_splits, per_split = _split_sizes(batch, kv_heads, max(max_blocks, 1), step, block_sizes)
    meta = plan_blocks(
        block_table,
        block_mask,
        lengths,
        layer,
        block_size=block_size,
        num_slots=num_slots,
        num_splits=num_splits,
        per_split=per_split,
    )
    q_rows = q.reshape(batch, kv_heads, group, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, _ROWS - group), (0, 0)))
    tile = step * block_size
    pv_swizzle = min(_swizzle(tile, q.dtype), _swizzle(head_dim, q.dtype))
    meta_len = meta_row_len(per_split)
    num_stages = _num_stages(
        block_sizes.num_stages, per_split // step, tile, head_dim, q.dtype, meta_len
    )
    dtype = q.dtype

    body = functools.partial(
        blocked_attention_kernel,
        block_size=block_size,
        head_dim=head_dim,
        blocks_per_split=per_split,
        blocks_per_step=step,
        num_stages=num_stages,
        scale=scale,
        softcap=softcap,
        multi_layer=multi_layer,
    )
    out_p, lse_p = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((num_splits, batch, kv_heads, _ROWS, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, kv_heads, _ROWS), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((_ROWS, head_dim), dtype, transforms=_smem_2d_transforms(head_dim, dtype)),
            plgpu.RefUnion(
                (
                    plgpu.SMEM(
                        (num_stages, tile, head_dim),
                        dtype,
                        transforms=_smem_2d_transforms(head_dim, dtype),
                    ),
                    # V and P are the B and A operands of one WGMMA: they must share a
                    # swizzle that fits both P's rows (tile) and V's (head_dim).
                    plgpu.SMEM(
                        (num_stages, tile, head_dim),
                        dtype,
                        transforms=_smem_2d_transforms(head_dim, dtype, pv_swizzle),
                    ),
                ),
                (
                    plgpu.SMEM(
                        (_ROWS, head_dim),
                        jnp.float32,
                        transforms=_smem_2d_transforms(head_dim, jnp.float32),
                    ),
                    plgpu.SMEM((_ROWS,), jnp.float32),
                ),
            ),
            plgpu.SMEM(
                (_ROWS, tile), dtype, transforms=_smem_2d_transforms(tile, dtype, pv_swizzle)
            ),
            plgpu.SMEM((meta_len,), jnp.int32),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=step, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=step, num_barriers=num_stages),
        ],
        grid=(num_splits, kv_heads, batch),
        grid_names=("split", "kv_head", "batch"),
        compiler_params=compiler_params(),
        interpret=_interpret_params(interpret),
    )(q_rows, k_pool, v_pool, meta)
    out_p = out_p[:, :, :, :group].reshape(num_splits, batch, q_heads, head_dim)
    lse_p = lse_p[:, :, :, :group].reshape(num_splits, batch, q_heads)
    if num_splits == 1:
        return out_p[0], lse_p[0]
    return merge_partials(out_p, lse_p)


def blocked_attention(
    q,
    k_pool,
    v_pool,
    block_table,
    block_mask,
    lengths,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    layer=None,
):
    """Decode attention of one query token per row over a paged KV pool (Mosaic GPU kernel).

    Args:
      q: [batch, q_heads, head_dim] bf16 or fp16 (fp32: use `blocked_attention_reference`).
      k_pool: [slots, block_size, kv_heads, head_dim], q's dtype; block_size and head_dim
        multiples of 16, head_dim at most 256. Or the whole [layers, slots, ...] pool with
        `layer` given: the kernel reads that layer in place (no slice, no copy).
      v_pool: same shape and dtype as k_pool.
      block_table: [batch, max_blocks] int32 slot of each logical block; entries whose
        block_mask is False are never read (they may be out of range).
      block_mask: [batch, max_blocks] bool, the logical blocks to attend.
      lengths: [batch] int32 tokens per row including the current one; token t of logical
        block j is valid iff j * block_size + t < lengths[b].
      scale: logit scale, default 1 / sqrt(head_dim).
      softcap: if set, logits = softcap * tanh(logits / softcap) (after scaling).
      block_sizes: kernel tuning (`BlockSizes`); defaults if None.
      interpret: None interprets on CPU and compiles on GPU; True / False force it; a
        `plgpu.InterpretGPUParams` interprets with those settings (e.g. race detection).
      layer: int32 scalar (may be traced, e.g. a scan index) selecting the layer of a
        [layers, ...] pool; None for a one-layer pool.

    Returns:
      out [batch, q_heads, head_dim] float32 and lse [batch, q_heads] float32 (natural log);
      rows with nothing attended give out = 0 and lse = -inf.
    """
    check_inputs(q, k_pool, v_pool, block_table, block_mask, lengths, layer, kernel=True)
    head_dim = q.shape[-1]
    block_sizes = block_sizes or BlockSizes()
    _blocks_per_step(block_sizes, k_pool.shape[-3], block_table.shape[1])  # validates the tile
    return _blocked_attention(
        q,
        k_pool,
        v_pool,
        block_table,
        block_mask,
        lengths,
        None if layer is None else jnp.asarray(layer, jnp.int32),
        scale=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
        softcap=None if softcap is None else float(softcap),
        block_sizes=block_sizes,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "return_block_lse"))
def _blocked_attention_reference(
    q,
    k_pool,
    v_pool,
    block_table,
    block_mask,
    lengths,
    layer,
    *,
    scale,
    softcap,
    return_block_lse=False,
):
    batch, q_heads, head_dim = q.shape
    num_slots, block_size, kv_heads, _ = k_pool.shape[-4:]
    max_blocks = block_table.shape[1]
    ntok = token_counts(block_mask, lengths, block_size)  # [batch, max_blocks]
    valid = jnp.arange(block_size)[None, None, :] < ntok[:, :, None]  # [batch, blocks, bs]
    valid = valid.reshape(batch, max_blocks * block_size)
    slots = jnp.where(ntok > 0, jnp.clip(block_table, 0, num_slots - 1), 0)
    if k_pool.ndim == 5:  # one gather of the needed blocks, not a copy of the layer
        layer = jnp.clip(layer, 0, k_pool.shape[0] - 1)
        k, v = k_pool[layer, slots], v_pool[layer, slots]
    else:
        k, v = k_pool[slots], v_pool[slots]
    k = k.reshape(batch, max_blocks * block_size, kv_heads, head_dim)
    v = v.reshape(batch, max_blocks * block_size, kv_heads, head_dim)
    qg = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim).astype(jnp.float32)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, k.astype(jnp.float32)) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    total = p.sum(axis=-1)
    out = jnp.einsum("bhgt,bthd->bhgd", p, v.astype(jnp.float32))
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, m_safe[..., 0] + jnp.log(total), -jnp.inf)
    out, lse = out.reshape(batch, q_heads, head_dim), lse.reshape(batch, q_heads)
    if not return_block_lse:
        return out, lse
    # per-block log-sum-exp, for attention-mass statistics: [batch, q_heads, max_blocks]
    pb = p.reshape(*p.shape[:-1], max_blocks, block_size).sum(axis=-1)
    block_lse = jnp.where(pb > 0, m_safe + jnp.log(jnp.where(pb > 0, pb, 1.0)), -jnp.inf)
    return out, lse, block_lse.reshape(batch, q_heads, max_blocks)


def blocked_attention_reference(
    q,
    k_pool,
    v_pool,
    block_table,
    block_mask,
    lengths,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    layer=None,
    return_block_lse: bool = False,
):
    """Pure-jnp `blocked_attention` (gather + masked softmax, fp32); any block size, fp32 too.

    Same arguments and results as `blocked_attention`; `block_sizes` and `interpret` are
    accepted for a uniform signature and ignored. With `return_block_lse=True` it also returns
    block_lse [batch, q_heads, max_blocks] f32, each attended block's log-sum-exp (-inf where
    nothing is attended), so exp(block_lse - lse) is the block's share of the attention.
    """
    del block_sizes, interpret
    check_inputs(q, k_pool, v_pool, block_table, block_mask, lengths, layer, kernel=False)
    head_dim = q.shape[-1]
    return _blocked_attention_reference(
        q,
        k_pool,
        v_pool,
        block_table,
        block_mask,
        lengths,
        None if layer is None else jnp.asarray(layer, jnp.int32),
        scale=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
        softcap=None if softcap is None else float(softcap),
        return_block_lse=return_block_lse,
    )
