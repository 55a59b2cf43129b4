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
  * fp32 pools: WGMMA's 32-bit mode is tf32 (10-bit mantissa, ~1e-3 errors) and takes only
    K-major operands, which V [tile, D] is not. So the fp32 K/V tiles are TMA-loaded as they are
    (the HBM bytes read do not change), split in registers into bf16 hi + lo (hi = bf16(x),
    lo = bf16(x - hi): |x - hi - lo| <= 2^-16 |x|) into one bf16 SMEM buffer, and each product
    is three bf16 WGMMAs into the fp32 accumulator, a @ b ~ a_lo @ b_hi + a_hi @ b_lo +
    a_hi @ b_hi ("bf16x3"; q is split once in the wrapper, p per tile): max abs error ~1.5e-5
    on unit-scale inputs, against ~1e-3 for tf32. Per byte read that is 1.5x the 16-bit
    kernel's WGMMA work (three products, twice the bytes per element) plus the split; fp32
    tiles are smaller (`paging.default_tile`) so that the pipeline still fits the SMEM
    budget.
  * fp8 (float8_e4m3fn) pools with per-(slot, kv head) fp32 scales: the fp8 tiles are
    TMA-loaded as they are (half the HBM bytes of bf16), converted in registers to the WGMMA
    dtype (q's; e4m3 values are exact in bf16 and fp16) into one SMEM buffer, as fp32's split,
    and the scales are folded into the products, not into K/V: the logits of block j's columns
    are multiplied by its k_scale (times the softmax scale), p's columns by its v_scale relative
    to the tile's largest (the softmax normaliser takes the unscaled p), and the tile's p @ V by
    that largest. The wrapper gathers the listed blocks' scales (`paging.plan_scales`, XLA,
    tiny), which each program copies into SMEM beside its block list. fp32 q with fp8 pools
    runs q and p as bf16 (hi, lo) against the one exact bf16 K / V part: two products each.
  * Each program writes a partial (out, lse); `merge_partials` (XLA, small) combines the
    splits by log-sum-exp.
Inputs: bf16 / fp16 / fp32 q; pools of q's dtype or float8_e4m3fn with scales; block_size and
head_dim multiples of 16.
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

from pallas_kernels.blocked_attention_ref import blocked_attention_reference, merge_partials
from pallas_kernels.common import (
    BF16X3,
    SPLIT_LAYOUT,
    _interpret_params,
    _smem_2d_transforms,
    _swizzle,
    compiler_params,
    split_bf16,
)
from pallas_kernels.paging import (
    ROWS,
    check_inputs,
    meta_row_len,
    pipeline_stages,
    plan_blocks,
    plan_scales,
    runs_bf16x3,
    scale_row_len,
    split_sizes,
    tile_blocks,
)

_ROWS = ROWS
__all__ = [
    "BlockSizes",
    "blocked_attention",
    "blocked_attention_kernel",
    "blocked_attention_reference",
    "merge_partials",
]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tuning knobs of the kernel.

    Attributes:
      num_stages: K/V tiles in flight per program (TMA pipeline depth), capped by what fits
        in SMEM.
      blocks_per_step: KV blocks per loop step (one WGMMA tile of blocks_per_step *
        block_size tokens, at most 256); None picks max(1, 64 // block_size) (fp32:
        max(1, tile // block_size) with tile 64 / 32 / 16 at head_dim <= 64 / 128 / 256;
        `paging.default_tile`).
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
    q_ref,  # [batch, kv_heads, parts, 64, head_dim]  GQA group rows, zero padded to 64
    k_ref,  # [(layers,) slots, block_size, kv_heads, head_dim]
    v_ref,  # [(layers,) slots, block_size, kv_heads, head_dim]
    meta_ref,  # [batch, splits, meta_len] int32: n, layer, 0, 0, slots, ends, firsts, 0..
    out_ref,  # [splits, batch, kv_heads, 64, head_dim] f32 partial outputs
    lse_ref,  # [splits, batch, kv_heads, 64] f32 partial log-sum-exp
    q_smem,  # [parts, 64, head_dim] q (parts=1), or bf16 (hi, lo) of fp32 q (parts=2)
    kv_or_out,  # union of ((k_smem, v_smem), (o_smem, l_smem)): the loop, then the epilogue
    p_smem,  # [parts, 64, tile] probabilities (WGMMA A operand), in q_smem's dtype
    meta_smem,  # [meta_len] int32
    q_barrier,  # Barrier, one arrival per q part
    meta_barrier,  # Barrier
    k_barriers,  # Barrier[num_stages], blocks_per_step arrivals each
    v_barriers,  # Barrier[num_stages], blocks_per_step arrivals each
    kv_split=None,  # [kv_parts, tile, head_dim] mma dtype: bf16 (hi, lo) of an fp32 K or V
    # tile (kv_parts=2), or an fp8 tile converted to q_smem's dtype (kv_parts=1); else None
    scales_ref=None,  # [batch, splits, kv_heads, 3 * L] f32 (`paging.plan_scales`); fp8 only
    scales_smem=None,  # [3 * L] f32: k scales, relative v scales, per-tile v scales; fp8 only
    *,
    block_size: int,
    head_dim: int,
    blocks_per_split: int,
    blocks_per_step: int,
    num_stages: int,
    scale: float,
    softcap: float | None,
    multi_layer: bool,
    optimized_split_load: bool = True,
    scale_len: int = 0,
):
    """One (split, kv head, batch row): online softmax over its chunk of attended blocks.

    Each step handles a tile of blocks_per_step blocks (tile = blocks_per_step * block_size
    tokens) so that small blocks still give WGMMA-sized tiles and few loop iterations. With
    `kv_split` (fp32 inputs) every product is bf16x3 over (hi, lo) parts; `optimized_split_load`
    False lets Mosaic GPU load the fp32 (or fp8) tile with bank conflicts (a 64-byte or
    narrower swizzle: it finds no conflict-free plan). With `scales_smem` (fp8 pools, each
    section `scale_len` words) the K / V tiles are converted through `kv_split` and the
    scales folded into the products (module docstring); `scale` is then in the k scales.
    """
    split = lax.axis_index("split")
    head = lax.axis_index("kv_head")
    row = lax.axis_index("batch")
    mma_dtype = q_smem.dtype  # bf16 for fp32 inputs
    fp8 = scales_smem is not None
    if fp8:  # (q or p part, K or V part): q, p parts against the one exact K / V part
        pairs = tuple((a, 0) for a in reversed(range(q_smem.shape[0])))
    else:
        pairs = BF16X3 if kv_split is not None else ((0, 0),)
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
    if fp8:  # the second arrival on meta_barrier
        plgpu.copy_gmem_to_smem(
            scales_ref.at[row, split, head],
            scales_smem,
            meta_barrier,
            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
        )
    for part in range(q_smem.shape[0]):  # one 2-D copy each: TMA takes at most 5 tiled dims
        plgpu.copy_gmem_to_smem(q_ref.at[row, head, part], q_smem.at[part], q_barrier)
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

    def operand(ref, buf):  # the WGMMA operand parts of stage `buf` of K or V
        if kv_split is None:
            return (ref.at[buf],)
        # fp32: the (hi, lo) split through registers; fp8: the conversion. The loop step's
        # previous products have completed (their accumulators were read), so kv_split is free.
        x = plgpu.load(ref.at[buf], layout=SPLIT_LAYOUT, optimized=optimized_split_load)
        if fp8:
            # e4m3 -> f16 is exact and native; Mosaic GPU converts e4m3 -> bf16 directly only
            # from PTX ISA 9.2 (f16 -> bf16 goes through f32, exact too).
            kv_split[0] = x.astype(jnp.float16).astype(mma_dtype)
            plgpu.commit_smem()
            return (kv_split.at[0],)
        kv_split[0], kv_split[1] = split_bf16(x)
        plgpu.commit_smem()
        return kv_split.at[0], kv_split.at[1]

    def column_scales(i, section):
        # [64, tile] f32 (or a scalar for one block a tile): each column's scale, that of its
        # block of tile i, from `section` (0: k, 1: relative v) of the program's scales.
        base = section * scale_len + i * blocks_per_step
        col = plgpu.broadcasted_iota(jnp.int32, (_ROWS, tile), 1, layout=plgpu.Layout.WGMMA)
        out = scales_smem[base + blocks_per_step - 1]
        for j in reversed(range(blocks_per_step - 1)):
            out = jnp.where(col < (j + 1) * block_size, scales_smem[base + j], out)
        return out

    def step(i, carry):
        acc, m_i, l_i = carry
        buf = lax.rem(i, num_stages)
        plgpu.barrier_wait(k_barriers.at[buf])
        k_parts = operand(k_smem, buf)

        def qk_product(acc_ref):
            for a, b in pairs:
                plgpu.wgmma(acc_ref, q_smem.at[a], k_parts[b].T)
            return acc_ref[...]

        s = pl.run_scoped(qk_product, plgpu.ACC((_ROWS, tile), jnp.float32))
        # fp8: each column's k_scale (times `scale`), before the soft-cap
        s = s * column_scales(i, 0) if fp8 else s * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        col = plgpu.broadcasted_iota(jnp.int32, (_ROWS, tile), 1, layout=plgpu.Layout.WGMMA)
        valid = None
        for j in range(blocks_per_step):
            # The block's valid tokens are [first, end) (a sliding window's boundary block
            # starts past 0); both are 0 for list entries past the end.
            e = i * blocks_per_step + j
            end = meta_smem[4 + blocks_per_split + e]
            first = meta_smem[4 + 2 * blocks_per_split + e]
            in_block = (col >= j * block_size + first) & (col < j * block_size + end)
            valid = in_block if valid is None else valid | in_block
        s = jnp.where(valid, s, -jnp.inf)
        # A tile's first block is listed and holds >= 1 valid token, so m_new is finite and
        # exp() never sees inf - inf.
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        pv_in = p * column_scales(i, 1) if fp8 else p  # l_i above takes the unscaled p
        if q_smem.shape[0] == 1:
            p_smem[0] = pv_in.astype(mma_dtype)
        else:
            p_smem[0], p_smem[1] = split_bf16(pv_in)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_barriers.at[buf])
        v_parts = operand(v_smem, buf)

        def pv_product(acc_ref):
            for a, b in pairs:
                plgpu.wgmma(acc_ref, p_smem.at[a], v_parts[b])
            return acc_ref[...]

        # A fresh accumulator plus a register add, not pl.run_state(ACC.init(acc)): the GPU
        # interpreter does not implement run_state, and the add is free next to the loads.
        pv = pl.run_scoped(pv_product, plgpu.ACC((_ROWS, head_dim), jnp.float32))
        acc = acc + (pv * scales_smem[2 * scale_len + i] if fp8 else pv)  # the tile's v_scale
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


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block_sizes", "interpret"))
def _blocked_attention(
    q,
    k_pool,
    v_pool,
    block_table,
    block_mask,
    lengths,
    layer,
    starts=None,
    k_scale=None,
    v_scale=None,
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
    dtype = q.dtype  # the compute dtype
    kv_dtype = k_pool.dtype  # q's, or float8_e4m3fn with k_scale / v_scale
    fp8 = k_scale is not None
    step = tile_blocks(
        block_sizes.blocks_per_step, block_size, max_blocks, dtype, head_dim, kv_dtype
    )
    num_splits, per_split = split_sizes(
        batch,
        kv_heads,
        max(max_blocks, 1),
        step,
        block_sizes.num_splits,
        block_sizes.min_blocks_per_split,
    )
    meta = plan_blocks(
        block_table,
        block_mask,
        lengths,
        layer,
        block_size=block_size,
        num_slots=num_slots,
        num_splits=num_splits,
        per_split=per_split,
        starts=starts,
    )
    split = runs_bf16x3(dtype)
    mma_dtype = jnp.bfloat16 if split else dtype  # what the WGMMAs read
    # K / V tiles that reach the WGMMAs through registers: fp32 split, fp8 converted
    through_registers = split or fp8
    q_rows = q.reshape(batch, kv_heads, group, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, _ROWS - group), (0, 0)))
    # [batch, kv_heads, parts, 64, head_dim]: q, or bf16 (hi, lo) of fp32 q
    q_rows = jnp.stack(split_bf16(q_rows), axis=2) if split else q_rows[:, :, None]
    tile = step * block_size
    pv_swizzle = min(_swizzle(tile, mma_dtype), _swizzle(head_dim, mma_dtype))
    # fp32 / fp8: q and the split or converted K / V tile share one swizzle (that buffer is a
    # WGMMA operand of both products); the fp32 / fp8 stages are read only through registers.
    qk_swizzle = pv_swizzle if through_registers else None
    meta_len = meta_row_len(per_split)
    scale_len = scale_row_len(per_split) if fp8 else 0
    num_stages = pipeline_stages(
        block_sizes.num_stages,
        per_split // step,
        tile,
        head_dim,
        dtype,
        meta_len + 3 * scale_len,
        kv_dtype,
    )
    parts = q_rows.shape[2]
    # K / V stages: swizzled, or plain for fp8 rows under 32 bytes (TMA swizzles >= 32 bytes;
    # the stages are then read only through registers)
    plain = _swizzle(head_dim, kv_dtype) < 32
    kv_transforms = () if plain else _smem_2d_transforms(head_dim, kv_dtype)

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
        optimized_split_load=_swizzle(head_dim, kv_dtype) == 128,
    )
    inputs = (q_rows, k_pool, v_pool, meta)
    extra_scratch = []
    if through_registers:
        extra_scratch.append(
            plgpu.SMEM(
                (1 if fp8 else 2, tile, head_dim),
                mma_dtype,
                transforms=_smem_2d_transforms(head_dim, mma_dtype, pv_swizzle),
            )
        )
    if fp8:
        # [batch, splits, kv_heads, 3 * scale_len] f32; the kernel takes it after `meta` and
        # its SMEM copy after the split buffer
        inputs += (
            plan_scales(meta, k_scale, v_scale, layer, per_split=per_split, step=step, scale=scale),
        )
        extra_scratch.append(plgpu.SMEM((3 * scale_len,), jnp.float32))
        body = functools.partial(_scaled_kernel, functools.partial(body, scale_len=scale_len))
    out_p, lse_p = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((num_splits, batch, kv_heads, _ROWS, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, kv_heads, _ROWS), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM(
                (parts, _ROWS, head_dim),
                mma_dtype,
                transforms=_smem_2d_transforms(head_dim, mma_dtype, qk_swizzle),
            ),
            plgpu.RefUnion(
                (
                    plgpu.SMEM((num_stages, tile, head_dim), kv_dtype, transforms=kv_transforms),
                    # V and P are the B and A operands of one WGMMA: they must share a
                    # swizzle that fits both P's rows (tile) and V's (head_dim).
                    plgpu.SMEM(
                        (num_stages, tile, head_dim),
                        kv_dtype,
                        transforms=kv_transforms
                        if through_registers
                        else _smem_2d_transforms(head_dim, kv_dtype, pv_swizzle),
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
                (parts, _ROWS, tile),
                mma_dtype,
                transforms=_smem_2d_transforms(tile, mma_dtype, pv_swizzle),
            ),
            plgpu.SMEM((meta_len,), jnp.int32),
            plgpu.Barrier(num_arrivals=parts),
            plgpu.Barrier(num_arrivals=2 if fp8 else 1),  # meta (and the scales)
            plgpu.Barrier(num_arrivals=step, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=step, num_barriers=num_stages),
            *extra_scratch,
        ],
        grid=(num_splits, kv_heads, batch),
        grid_names=("split", "kv_head", "batch"),
        compiler_params=compiler_params(),
        interpret=_interpret_params(interpret),
    )(*inputs)
    out_p = out_p[:, :, :, :group].reshape(num_splits, batch, q_heads, head_dim)
    lse_p = lse_p[:, :, :, :group].reshape(num_splits, batch, q_heads)
    if num_splits == 1:
        return out_p[0], lse_p[0]
    return merge_partials(out_p, lse_p)


def _scaled_kernel(kernel, q_ref, k_ref, v_ref, meta_ref, scales_ref, out_ref, lse_ref, *scratch):
    """`kernel` (a partial of `blocked_attention_kernel`) with the fp8 scales: the inputs end
    with `scales_ref`, the scratch with the converted K / V tile and the scales' SMEM."""
    *scratch, kv_conv, scales_smem = scratch
    refs = (q_ref, k_ref, v_ref, meta_ref, out_ref, lse_ref, *scratch, kv_conv)
    kernel(*refs, scales_ref=scales_ref, scales_smem=scales_smem)


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
    starts=None,
    k_scale=None,
    v_scale=None,
):
    """Decode attention of one query token per row over a paged KV pool (Mosaic GPU kernel).

    Args:
      q: [batch, q_heads, head_dim] bf16, fp16 or fp32 (fp32 runs as bf16x3 products with
        fp32 accumulation: ~2^-16 relative per operand, see the module docstring); the compute
        dtype.
      k_pool: [slots, block_size, kv_heads, head_dim], q's dtype, or float8_e4m3fn with
        `k_scale` / `v_scale`; block_size and head_dim multiples of 16, head_dim at most 256
        (fp32 tiles must fit SMEM: block_size up to 32 at head_dim 256, 80 at 128, 176 at 64; a
        ValueError otherwise). Or the whole [layers, slots, ...] pool with `layer` given: the
        kernel reads that layer in place.
      v_pool: same shape and dtype as k_pool.
      block_table: [batch, max_blocks] int32 slot of each logical block; entries whose
        block_mask is False are never read (they may be out of range).
      block_mask: [batch, max_blocks] bool, the logical blocks to attend.
      lengths: [batch] int32 tokens per row including the current one; token t of logical
        block j is valid iff starts[b] <= j * block_size + t < lengths[b].
      scale: logit scale, default 1 / sqrt(head_dim).
      softcap: if set, logits = softcap * tanh(logits / softcap) (after scaling).
      block_sizes: kernel tuning (`BlockSizes`); defaults if None.
      interpret: None interprets on CPU and compiles on GPU; True / False force it; a
        `plgpu.InterpretGPUParams` interprets with those settings (e.g. race detection).
      layer: int32 scalar (may be traced, e.g. a scan index) selecting the layer of a
        [layers, ...] pool; None for a one-layer pool.
      starts: [batch] int32 first attended token per row (a sliding window: lengths - window,
        clipped at 0), or None for 0. Blocks wholly before it are never loaded; the boundary
        block is masked token by token.
      k_scale, v_scale: None (both), or for float8_e4m3fn pools float32 of shape
        `k_pool.shape[:-3] + (kv_heads,)` ([slots, kv_heads], or [layers, slots, kv_heads]
        with `layer`): key t of slot s, kv head h is k_pool[(layer,) s, t, h] * k_scale[
        (layer,) s, h] (in fp32), values likewise. The kernel reads the fp8 bytes and folds the
        scales into its products (module docstring).

    Returns:
      out [batch, q_heads, head_dim] float32 and lse [batch, q_heads] float32 (natural log);
      rows with nothing attended give out = 0 and lse = -inf.
    """
    check_inputs(
        q,
        k_pool,
        v_pool,
        block_table,
        block_mask,
        lengths,
        layer,
        kernel=True,
        starts=starts,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    head_dim = q.shape[-1]
    block_sizes = block_sizes or BlockSizes()
    # Validates the tile.
    tile_blocks(
        block_sizes.blocks_per_step,
        k_pool.shape[-3],
        block_table.shape[1],
        q.dtype,
        head_dim,
        k_pool.dtype,
    )
    return _blocked_attention(
        q,
        k_pool,
        v_pool,
        block_table,
        block_mask,
        lengths,
        None if layer is None else jnp.asarray(layer, jnp.int32),
        starts,
        k_scale,
        v_scale,
        scale=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
        softcap=None if softcap is None else float(softcap),
        block_sizes=block_sizes,
        interpret=interpret,
    )
