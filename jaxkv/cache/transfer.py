"""Bulk block transfers between the cache's tiers: one operation per pool and direction.

Every path that moves KV between HBM and host memory (the attention's host reads, promotions,
demotions, spills of sealed tail blocks) goes through `read_blocks` / `write_blocks`: a fixed-size
list of (layer, slot) blocks, unused entries marked, moved in ONE gather or scatter per pool,
never a loop over blocks. The mechanism is the cache's `fetch` option:

- "pallas": `pallas_kernels.host_transfer` (Triton lowering): one kernel launch that receives
  the pinned_host pool itself and copies only the listed blocks (zero-copy; unused entries cost
  nothing but their program's exit). On a GPU the read runs on its own stream
  (`_on_copy_stream`), so it overlaps the layer's HBM part; off GPU the kernels run in the
  Pallas interpreter (on pinned_host pools too, inside jit).
- "xla": an XLA gather / scatter whose indices (and, for a write, values) are placed in the host
  memory space, as JAX requires of a gather's operands. On a GPU XLA runs it as host compute
  plus one DMA of the whole list (unused entries included); on CPU it is a plain gather.
- "auto": "xla" off GPU (correct and fastest there: no interpreter); on a GPU "pallas", the one
  mechanism whose link bytes are the listed blocks only, until `bench/bench_transfer.py`
  measures otherwise (`GPU_AUTO`).

A pool whose memory kind is "device" (`CacheConfig(host_memory_kind="device")`, the host tier
emulated in HBM) is read and written with plain device gathers / scatters under every option.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from jaxkv.config import FETCH_OPTIONS
from pallas_kernels import host_transfer as ht
from pallas_kernels.common import on_gpu, single_device_sharding, target_platform

GPU_AUTO = "pallas"  # what "auto" means on a GPU; see the module docstring


def resolve_fetch(fetch: str) -> str:
    """The mechanism `fetch` stands for on the platform being traced for."""
    if fetch not in FETCH_OPTIONS:
        raise ValueError(f"unknown fetch mechanism {fetch!r}; expected one of {FETCH_OPTIONS}")
    if fetch != "auto":
        return fetch
    return GPU_AUTO if on_gpu() else "xla"


def kind_sharding(kind: str) -> jax.sharding.Sharding:
    """The sharding of an array on the default device in memory kind `kind`."""
    return single_device_sharding(jax.devices()[0], memory_kind=kind)


def traced(*trees) -> bool:
    """Whether any leaf of `trees` is a tracer (the call is being traced, e.g. under jit)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


def to_kind(x: jax.Array, kind: str) -> jax.Array:
    """Places `x` in memory kind `kind`.

    Outside jit the result has that kind. Inside jit the kind lives in the value's type, which
    knows two memory spaces only: "device" and "pinned_host" (jax's `Space.Device` and
    `Space.Host`). An "unpinned_host" value traced here is typed "device" (a jit returns it as
    "device" on CPU); it gets its kind only where a jit boundary names it in `out_shardings`
    (`kind_sharding`, `jaxkv.cache.cache_shardings`), as every cache op called outside jit does.
    Traced, the value is placed by memory space alone (`jax.memory.Space`), naming no device,
    so the same code runs per device under `shard_map` (`jaxkv.decode.sharded`).
    """
    if isinstance(x, jax.core.Tracer):  # no device named: also right inside a shard_map
        space = jax.memory.Space.Host if kind == "pinned_host" else jax.memory.Space.Device
        return jax.device_put(x, space)
    return jax.device_put(x, kind_sharding(kind))


def rows_of(layer, slot, valid, slots_per_layer: int):
    """Flat row indices `layer * slots_per_layer + slot` of a pool's [layers * slots, ...] view,
    -1 where `valid` is False (all arrays broadcast; int32 result)."""
    row = jnp.asarray(layer, jnp.int32) * slots_per_layer + jnp.asarray(slot, jnp.int32)
    return jnp.where(valid, row, -1).astype(jnp.int32)


def after(rows, values):
    """`rows` unchanged, but as a value that XLA sees computed from `values`.

    A bulk write updates its pool in place (the scatter aliases it). XLA must then run every
    earlier read of the pool before the write, or it copies the whole pool first to keep the
    read's value, and it only knows that order from data dependencies (an optimization barrier
    does not survive its GPU pipeline). So the write's row list is made to depend on one
    element of each read's result: `min(rows, 2**30 + (e != e))` is `rows` for any e (row
    indices are < 2**30), a comparison XLA cannot fold for floats (NaN).
    """
    leaves = [
        x for x in jax.tree.leaves(values) if jnp.issubdtype(x.dtype, jnp.floating) and x.size
    ]
    for x in leaves:
        e = jnp.ravel(x)[0]
        rows = jnp.minimum(rows, jnp.int32(1 << 30) + (e != e).astype(jnp.int32))
    return rows


COPY_STREAM = 1  # the GPU stream host reads run on, beside the compute stream (0)


def _on_copy_stream(fn):
    """`fn` as an async computation on GPU stream COPY_STREAM (XLA's explicit stream
    annotation, `compute_on("gpu_stream:N")`): XLA starts it, schedules independent compute
    (the layer's HBM part, the previous layer) on the compute stream, and waits for it where
    its result is used. `fn` itself where the installed jax has no such compute_on."""
    try:
        from jax.experimental.compute_on import compute_on
    except ImportError:  # pragma: no cover - jax without compute_on
        return fn
    if "out_memory_spaces" not in inspect.signature(compute_on).parameters:
        return fn  # pragma: no cover - an older compute_on (a context manager)
    return compute_on(
        fn, compute_type=f"gpu_stream:{COPY_STREAM}", out_memory_spaces=jax.memory.Space.Device
    )


def read_blocks(pool, rows, fetch: str, *, pool_kind: str):
    """Copies blocks of a pool to the device in one operation.

    Args:
      pool: [layers, slots, block_size, kv_heads, head_dim] in memory kind `pool_kind`.
      rows: [n] int32 flat (layer * slots + slot) indices (`rows_of`), -1 for an unused entry.
      fetch: a resolved or "auto" mechanism (`resolve_fetch`).
      pool_kind: the pool's memory kind ("device" means no host transfer at all).
    Returns:
      [n, block_size, kv_heads, head_dim] on the device; zeros for unused entries.
    """
    if pool_kind != "device" and not traced(pool, rows):  # one jit, as the decode loop runs it
        return _read_blocks_jit(resolve_fetch(fetch), pool_kind, target_platform())(pool, rows)
    flat = pool.reshape(pool.shape[0] * pool.shape[1], -1)
    if pool_kind == "device":
        out = ht.gather_rows_reference(flat, rows)
    elif resolve_fetch(fetch) == "pallas" and on_gpu():  # on the copy stream: overlapped
        ht.check_rows(flat, rows)
        out = _on_copy_stream(functools.partial(ht.gather_rows_call, interpret=False))(flat, rows)
    elif resolve_fetch(fetch) == "pallas":
        out = ht.gather_rows(flat, rows, interpret=True)
    else:  # "xla": the gather runs where its operands live, the result then moves to HBM
        safe = to_kind(jnp.maximum(rows, 0), pool_kind)
        out = to_kind(flat[safe], "device")
        out = jnp.where((rows >= 0)[:, None], out, jnp.zeros((), out.dtype))
    return out.reshape(rows.shape[0], *pool.shape[2:])


@functools.cache
def _read_blocks_jit(fetch: str, pool_kind: str, platform: str):
    """`read_blocks` for calls outside jit (a debug view, a test): under jax 0.12.1 on CPU an
    array computed eagerly in host memory cannot be moved to the device, so the gather and the
    move run in one jit, as `_write_blocks_jit` does for writes. `platform` keys the compile
    target it was traced for."""
    del platform
    return jax.jit(lambda pool, rows: read_blocks(pool, rows, fetch, pool_kind=pool_kind))


def write_blocks(pool, rows, blocks, fetch: str, *, pool_kind: str, after_reads=None):
    """Writes device blocks into a pool in one operation (in place when the pool is donated).

    Args:
      pool: [layers, slots, block_size, kv_heads, head_dim] in memory kind `pool_kind`.
      rows: [n] int32 distinct flat indices (`rows_of`), -1 for an entry not to write.
      blocks: [n, block_size, kv_heads, head_dim] in pool's dtype.
      after_reads: results of every earlier read of `pool` that the write must follow (any
        pytree; see `after`), or None.
    Returns:
      The pool with those blocks written, in memory kind `pool_kind`.
    """
    if not traced(pool, rows, blocks, after_reads):  # one jit naming the pool's kind
        return _write_blocks_jit(resolve_fetch(fetch), pool_kind, target_platform())(
            pool, rows, blocks, after_reads
        )
    if after_reads is not None:
        rows = after(rows, after_reads)
    flat = pool.reshape(pool.shape[0] * pool.shape[1], -1)
    vals = blocks.reshape(blocks.shape[0], -1).astype(pool.dtype)
    if pool_kind == "device":
        out = ht.scatter_rows_reference(flat, rows, vals)
    elif resolve_fetch(fetch) == "pallas":
        # the kernel writes the (aliased) host buffer in place; the device_put only tells JAX
        # that the result lives in host memory, as the pool did
        out = ht.scatter_rows(flat, rows, vals, interpret=not on_gpu())
        out = to_kind(out, pool_kind)
    else:
        safe = to_kind(jnp.where(rows >= 0, rows, flat.shape[0]), pool_kind)  # -> dropped
        out = flat.at[safe].set(to_kind(vals, pool_kind), mode="drop", unique_indices=True)
    return out.reshape(pool.shape)


@functools.cache
def _write_blocks_jit(fetch: str, pool_kind: str, platform: str):
    """`write_blocks` for calls outside jit: out_shardings give the result the pool's kind (an
    eager Pallas scatter into a pinned_host pool otherwise returns, aliased, a host buffer typed
    "device", which aborts the process). `platform` keys the compile target it was traced for.
    """
    del platform

    def write(pool, rows, blocks, after_reads):
        return write_blocks(pool, rows, blocks, fetch, pool_kind=pool_kind, after_reads=after_reads)

    return jax.jit(write, out_shardings=kind_sharding(pool_kind))
