"""Bulk block transfers between a pool in host memory and the device (Pallas, Triton lowering).

A KV pool `[layers, slots, block_size, kv_heads, head_dim]` is seen as a table of rows, one row
per (layer, slot) block: `pool.reshape(layers * slots, -1)`. `gather_rows` copies a list of rows
into a device array; `scatter_rows` writes a list of rows into the pool in place. Either runs
as ONE kernel launch whatever the number of rows: the grid is (rows, chunks of a row), each
program copies one chunk of one row, and a row index < 0 marks an unused entry (not read, not
written; a gathered unused entry is zeros), so a fixed-size list can carry a varying number of
real rows and only those cross the link.

Why a kernel: on a GPU, XLA hands a Triton custom call the pinned_host buffer itself (no staging
copy; the kernel's loads and stores go over NVLink-C2C or PCIe directly, 16 bytes a thread), so
the whole pool is an operand and only the listed rows are touched. The pool must be passed
WHOLE: a slice of a host array (`pool[layer]`) makes XLA copy the slice to the device first.
`scatter_rows` aliases the pool to its output (`input_output_aliases`), so inside a jit whose
pool argument is donated it writes the host buffer in place. Mosaic GPU rejects host refs at
trace time, which is why these kernels use the Triton lowering (deprecated in jax 0.12 but
working); `jaxkv.cache.transfer` keeps them behind its `fetch` option with the pure-XLA path always
available, and the `*_reference` functions below are that path's semantics in pure jnp.

On CPU the kernels run in the Pallas interpreter (`interpret=True`, the default off GPU), on
device or pinned_host pools, inside jit or not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import on_gpu

MAX_CHUNK = 4096  # elements per program: 8 KiB of bf16, 16 KiB of fp32


def row_chunk(row_elems: int) -> int:
    """Elements each program copies: the largest power of two dividing a row, <= MAX_CHUNK
    (a Triton block must be a power of two; dividing the row keeps every access in bounds)."""
    if row_elems < 1:
        raise ValueError(f"rows must have at least one element, got {row_elems}")
    return min(MAX_CHUNK, row_elems & -row_elems)


def check_rows(pool, rows, values=None):
    """Raises ValueError unless pool is [R, E], rows 1-D int32 and values [len(rows), E]."""
    if pool.ndim != 2:
        raise ValueError(f"pool must be [rows, elements], got shape {tuple(pool.shape)}")
    if rows.ndim != 1 or rows.dtype != jnp.int32:
        raise ValueError(f"rows must be a 1-D int32 array, got {rows.dtype} {tuple(rows.shape)}")
    if values is not None:
        want = (rows.shape[0], pool.shape[1])
        if tuple(values.shape) != want or values.dtype != pool.dtype:
            raise ValueError(
                f"values is {values.dtype} {tuple(values.shape)}, expected {pool.dtype} {want}"
            )


def _triton_params():
    from jax.experimental.pallas import triton as pltr

    return pltr.CompilerParams(num_warps=4, num_stages=1)


def _interpret(interpret) -> bool:
    return not on_gpu() if interpret is None else bool(interpret)


def gather_rows_kernel(rows_ref, pool_ref, out_ref, *, chunk: int):
    """Program (i, c): out[i, chunk c] = pool[rows[i], chunk c], or zeros when rows[i] < 0.

    rows_ref: [n] int32; pool_ref: [R, E] (any memory space); out_ref: [n, E] on the device.
    """
    i, c = pl.program_id(0), pl.program_id(1)
    row = rows_ref[i]
    cols = pl.ds(c * chunk, chunk)

    @pl.when(row >= 0)
    def _():
        out_ref[i, cols] = pool_ref[row, cols]

    @pl.when(row < 0)
    def _():
        out_ref[i, cols] = jnp.zeros((chunk,), out_ref.dtype)


def scatter_rows_kernel(rows_ref, values_ref, pool_in_ref, pool_ref, *, chunk: int):
    """Program (i, c): pool[rows[i], chunk c] = values[i, chunk c] when rows[i] >= 0.

    rows_ref: [n] int32; values_ref: [n, E]; pool_in_ref / pool_ref: [R, E], aliased.
    """
    del pool_in_ref  # the same buffer as pool_ref (input_output_aliases)
    i, c = pl.program_id(0), pl.program_id(1)
    row = rows_ref[i]
    cols = pl.ds(c * chunk, chunk)

    @pl.when(row >= 0)
    def _():
        pool_ref[row, cols] = values_ref[i, cols]


def gather_rows_call(pool, rows, *, interpret: bool):
    """The `gather_rows` kernel launch itself, unjitted and unchecked: for callers that wrap it
    (e.g. in `compute_on`, whose stream annotation must see the launch, not a nested jit)."""
    n, E = rows.shape[0], pool.shape[1]
    chunk = row_chunk(E)
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(gather_rows_kernel, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct((n, E), pool.dtype),
        grid=(n, E // chunk),
        in_specs=[any_space, any_space],
        out_specs=any_space,
        compiler_params=None if interpret else _triton_params(),
        interpret=interpret,
        name="gather_rows",
    )(rows, pool)


_gather_rows = jax.jit(gather_rows_call, static_argnames=("interpret",))


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def _scatter_rows(pool, rows, values, *, interpret):
    n, E = rows.shape[0], pool.shape[1]
    chunk = row_chunk(E)
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(scatter_rows_kernel, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=(n, E // chunk),
        in_specs=[any_space, any_space, any_space],
        out_specs=any_space,
        input_output_aliases={2: 0},
        compiler_params=None if interpret else _triton_params(),
        interpret=interpret,
        name="scatter_rows",
    )(rows, values, pool)


def gather_rows(pool, rows, *, interpret: bool | None = None):
    """Copies rows of `pool` into a new device array in one launch.

    Args:
      pool: [R, E], in device or (on a GPU) pinned_host memory; passed whole.
      rows: [n] int32 row indices in [0, R), or < 0 for an unused entry.
      interpret: None interprets off GPU and compiles on GPU; True / False force it.
    Returns:
      [n, E] in pool's dtype: row rows[i] of pool, zeros where rows[i] < 0.
    """
    check_rows(pool, rows)
    return _gather_rows(pool, rows, interpret=_interpret(interpret))


def scatter_rows(pool, rows, values, *, interpret: bool | None = None):
    """Writes `values[i]` into row `rows[i]` of `pool` in one launch (in place when donated).

    Args:
      pool: [R, E], in device or (on a GPU) pinned_host memory; donated.
      rows: [n] int32 distinct row indices in [0, R), or < 0 for an entry not to write.
      values: [n, E] in pool's dtype.
    Returns:
      The updated pool (rows not listed are untouched).
    """
    check_rows(pool, rows, values)
    return _scatter_rows(pool, rows, values, interpret=_interpret(interpret))


def gather_rows_reference(pool, rows, *, interpret=None):
    """Pure-jnp `gather_rows` (same arguments and result; `interpret` is ignored)."""
    del interpret
    check_rows(pool, rows)
    out = pool[jnp.maximum(rows, 0)]
    return jnp.where((rows >= 0)[:, None], out, jnp.zeros((), pool.dtype))


def scatter_rows_reference(pool, rows, values, *, interpret=None):
    """Pure-jnp `scatter_rows` (same arguments and result; `interpret` is ignored)."""
    del interpret
    check_rows(pool, rows, values)
    safe = jnp.where(rows >= 0, rows, pool.shape[0])  # out of range -> dropped
    return pool.at[safe].set(values, mode="drop", unique_indices=True)
