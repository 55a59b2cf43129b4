"""Block compaction: move KV blocks between slots of a pool in place (Mosaic GPU kernel).

Used by `TieredKVCache.compact` to pack the occupied HBM slots into a dense prefix after
migrations, and by migration staging. The pool is donated and aliased to the output, so only
the moved blocks are read and written.

Grid (layer, kv_head): each program applies its layer's moves in order to its [block, head_dim]
column of every block. Columns are disjoint bytes, so per-column sequential order is exactly
the sequential semantics of the whole move list. Within a program, TMA loads and stores are
double buffered; a load waits for every earlier store that may touch its slot.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import _interpret_params, compiler_params


@dataclasses.dataclass(frozen=True)
class CompactionBlockSizes:
    """Tuning knobs.

    Attributes:
      num_buffers: SMEM staging buffers per program (1 = fully serial, 2 = a load overlaps
        the previous move's store).
      moves_per_call: the move list is applied in chunks of this many moves per kernel launch
        (in order), which bounds the list's SMEM copy (8 bytes per move).
    """

    num_buffers: int = 2
    moves_per_call: int = 8192

    def __post_init__(self):
        if self.num_buffers not in (1, 2):
            raise ValueError(f"num_buffers={self.num_buffers} must be 1 or 2")
        if self.moves_per_call < 1:
            raise ValueError(f"moves_per_call={self.moves_per_call} must be >= 1")


def compaction_kernel(
    moves_ref,  # [layers, 4 + 2 * max_moves (+ pad to 32)] int32: n, 0, 0, 0, src, dst, 0...
    pool_ref,  # [layers, slots, block_size, kv_heads, head_dim] mutable, updated in place
    moves_smem,  # [4 + 2 * max_moves (+ pad to 32)] int32
    buf_smem,  # [num_buffers, block_size, head_dim]
    moves_barrier,  # Barrier
    load_barriers,  # Barrier[num_buffers]
    *,
    max_moves: int,
    num_buffers: int,
):
    """Applies layer `l`'s moves i < num_moves[l], in order, to kv head `h`'s column."""
    layer = lax.axis_index("layer")
    head = lax.axis_index("kv_head")
    # In bounds by construction (padded table): the plain bulk copy, no 256-element TMA limit.
    plgpu.copy_gmem_to_smem(
        moves_ref.at[layer],
        moves_smem,
        moves_barrier,
        oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
    )
    plgpu.barrier_wait(moves_barrier)
    num_moves = moves_smem[0]

    def move(i, _):
        buf = lax.rem(i, num_buffers)
        src = moves_smem[4 + i]
        dst = moves_smem[4 + max_moves + i]
        prev_dst = moves_smem[4 + max_moves + jnp.maximum(i - 1, 0)]
        # Stores before move i - 1 are complete; move i - 1's store may still be in flight
        # (num_buffers == 2) unless move i reads or rewrites the slot it writes.
        plgpu.wait_smem_to_gmem(num_buffers - 1)
        hazard = (i > 0) & ((src == prev_dst) | (dst == prev_dst))
        pl.when(hazard)(lambda: plgpu.wait_smem_to_gmem(0))
        plgpu.copy_gmem_to_smem(
            pool_ref.at[layer, src, :, head], buf_smem.at[buf], load_barriers.at[buf]
        )
        plgpu.barrier_wait(load_barriers.at[buf])
        plgpu.copy_smem_to_gmem(buf_smem.at[buf], pool_ref.at[layer, dst, :, head])
        return ()

    lax.fori_loop(0, num_moves, move, ())
    plgpu.wait_smem_to_gmem(0)


def _check_inputs(pool, src, dst, num_moves):
    if pool.ndim != 5:
        raise ValueError(
            f"pool must be [layers, slots, block_size, kv_heads, head_dim], got shape {pool.shape}"
        )
    layers = pool.shape[0]
    if src.ndim != 2 or src.shape[0] != layers:
        raise ValueError(f"src must be [layers={layers}, max_moves], got shape {src.shape}")
    if dst.shape != src.shape:
        raise ValueError(f"dst shape {dst.shape} must equal src shape {src.shape}")
    if num_moves.shape != (layers,):
        raise ValueError(f"num_moves must be [layers={layers}], got shape {num_moves.shape}")
    for name, x in (("src", src), ("dst", dst), ("num_moves", num_moves)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} dtype {x.dtype} must be int32")


def _check_kernel_inputs(pool):
    head_dim_bytes = pool.shape[-1] * pool.dtype.itemsize
    if head_dim_bytes % 16:
        raise ValueError(
            f"head_dim={pool.shape[-1]} ({pool.dtype}) unsupported by the compaction kernel: "
            "a row of head_dim must be a multiple of 16 bytes (TMA)"
        )
    block_bytes = pool.shape[2] * head_dim_bytes
    if block_bytes % 128:
        raise ValueError(
            f"block_size={pool.shape[2]} x head_dim={pool.shape[-1]} ({pool.dtype}) = "
            f"{block_bytes} bytes per kv head unsupported by the compaction kernel: it must be "
            "a multiple of 128 bytes (one TMA share per warpgroup thread)"
        )
    if pool.shape[2] > 256 or pool.shape[-1] > 256:
        raise ValueError(
            f"block_size={pool.shape[2]} / head_dim={pool.shape[-1]} unsupported by the "
            "compaction kernel: at most 256 each (TMA box)"
        )


def _moves_table(src, dst, num_moves, num_slots):
    """[layers, 4 + 2 * max_moves] int32 header + src + dst, indices clipped into range."""
    layers, max_moves = src.shape
    n = jnp.clip(num_moves, 0, max_moves)
    header = jnp.zeros((layers, 4), jnp.int32).at[:, 0].set(n)
    src = jnp.clip(src, 0, num_slots - 1)
    dst = jnp.clip(dst, 0, num_slots - 1)
    table = jnp.concatenate([header, src, dst], axis=1)
    pad = (-table.shape[1]) % 32  # a TMA copy into a barrier moves a multiple of 128 bytes
    return jnp.pad(table, ((0, 0), (0, pad)))


def _launch(pool, src, dst, num_moves, *, num_buffers, interpret):
    layers, num_slots, block_size, kv_heads, head_dim = pool.shape
    max_moves = src.shape[1]
    table = _moves_table(src, dst, num_moves, num_slots)
    body = functools.partial(compaction_kernel, max_moves=max_moves, num_buffers=num_buffers)
    # The pool goes in as a mutable Ref: the kernel writes it in place, which lowers to an
    # operand->output alias on the custom call, and jit donation makes it the caller's buffer.
    pool_ref = jax.new_ref(pool)
    plgpu.kernel(
        body,
        out_type=(),
        scratch_types=[
            plgpu.SMEM((table.shape[1],), jnp.int32),
            plgpu.SMEM((num_buffers, block_size, head_dim), pool.dtype),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=num_buffers),
        ],
        grid=(layers, kv_heads),
        grid_names=("layer", "kv_head"),
        compiler_params=compiler_params(),
        interpret=_interpret_params(interpret),
    )(table, pool_ref)
    return pool_ref[...]


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"), donate_argnums=(0,))
def _compaction(pool, src, dst, num_moves, *, block_sizes, interpret):
    max_moves = src.shape[1]
    chunk = min(block_sizes.moves_per_call, max(max_moves, 1))
    # Chunks run one after another, so the whole list keeps its sequential semantics.
    for start in range(0, max_moves, chunk):
        pool = _launch(
            pool,
            src[:, start : start + chunk],
            dst[:, start : start + chunk],
            jnp.clip(num_moves - start, 0, chunk),
            num_buffers=block_sizes.num_buffers,
            interpret=interpret,
        )
    return pool


def compaction(
    pool,
    src,
    dst,
    num_moves,
    *,
    block_sizes: CompactionBlockSizes | None = None,
    interpret: bool | None = None,
):
    """Moves blocks between slots of a pool, in place (Mosaic GPU kernel).

    Args:
      pool: [layers, slots, block_size, kv_heads, head_dim], donated: the result aliases it.
      src: [layers, max_moves] int32 source slots.
      dst: [layers, max_moves] int32 destination slots.
      num_moves: [layers] int32; moves i < num_moves[l] of layer l are applied, in order (move
        i sees the result of moves < i), the others ignored.
      block_sizes: `CompactionBlockSizes`; defaults if None.
      interpret: None interprets on CPU and compiles on GPU; True / False force it; a
        `plgpu.InterpretGPUParams` interprets with those settings (e.g. race detection).

    Returns:
      The updated pool (same shape and dtype; slots not written are untouched).
    """
    _check_inputs(pool, src, dst, num_moves)
    _check_kernel_inputs(pool)
    return _compaction(
        pool,
        src,
        dst,
        num_moves,
        block_sizes=block_sizes or CompactionBlockSizes(),
        interpret=interpret,
    )


@functools.partial(jax.jit, donate_argnums=(0,))
def _compaction_reference(pool, src, dst, num_moves):
    def per_layer(p, s, d, n):
        def move(i, p):
            return p.at[d[i]].set(p[s[i]])

        return lax.fori_loop(0, jnp.clip(n, 0, s.shape[0]), move, p)

    return jax.vmap(per_layer)(pool, src, dst, num_moves)


def compaction_reference(pool, src, dst, num_moves, *, block_sizes=None, interpret=None):
    """Pure-jnp `compaction` (a sequential fori_loop of block copies per layer, vmapped).

    Same arguments and result as `compaction`; `block_sizes` and `interpret` are ignored.
    The pool is donated.
    """
    del block_sizes, interpret
    _check_inputs(pool, src, dst, num_moves)
    return _compaction_reference(pool, src, dst, num_moves)


@jax.jit
def compaction_moves(occupied):
    """Moves that pack each layer's occupied slots into a dense prefix, preserving order.

    The k-th occupied slot (ascending) moves to slot k; slots already in place do not move.
    Sources ascend and every destination is <= its source and was free or already vacated by
    an earlier move, so applying the moves in order (as `compaction` does) is safe.

    Args:
      occupied: [layers, slots] bool.

    Returns:
      src [layers, slots] int32, dst [layers, slots] int32 (moves first, padding 0 after),
      num_moves [layers] int32, new_slot_of_old [layers, slots] int32 (new slot of each old
      occupied slot; -1 for free slots).
    """
    layers, slots = occupied.shape
    occ = occupied.astype(jnp.int32)
    rank = jnp.cumsum(occ, axis=1) - occ  # new slot of each occupied slot
    old = jnp.arange(slots, dtype=jnp.int32)[None, :]
    new_slot_of_old = jnp.where(occupied, rank, -1).astype(jnp.int32)
    moving = occupied & (rank != old)
    num_moves = moving.sum(axis=1, dtype=jnp.int32)
    # Stable order of moving slots first, ascending by old slot.
    order = jnp.argsort(~moving, axis=1, stable=True).astype(jnp.int32)
    valid = jnp.arange(slots)[None, :] < num_moves[:, None]
    src = jnp.where(valid, order, 0)
    dst = jnp.where(valid, jnp.take_along_axis(rank, order, axis=1), 0).astype(jnp.int32)
    return src, dst, num_moves, new_slot_of_old
