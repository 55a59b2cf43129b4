"""Vectorized helpers over per-row tables ([rows, n] arrays, one row per layer): the first free
slots of a free mask, clamped gathers, and moving selected entries to the front. No loops and no
data-dependent shapes, so they trace once per shape inside the cache's jitted operations."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def seal_keeps(seal, n_free):
    """Where the blocks sealing at a step go: ([layers, batch] bool, the sealing blocks that keep
    their HBM slot; [batch] int32, each sealing sequence's rank). Per layer the sealing
    sequences (seal [batch] bool) take the `n_free` [layers] free HBM slots (the new tails')
    in sequence order; the others spill to host. The cache's `advance` and the simulator's
    replay of the decode loop (`jaxkv.sim.loop`) place sealed blocks by this rule."""
    rank = jnp.maximum(jnp.cumsum(seal) - 1, 0)
    return seal[None] & (rank[None] < n_free[:, None]), rank


def first_free(free, k: int):
    """The first `k` free slots of each row, in slot order (vectorized: top_k, no loop).

    Args:
      free: [rows, slots] bool.
    Returns:
      slots [rows, k'] int32 (k' = min(k, slots); entries past a row's count are arbitrary)
      and counts [rows] int32 of free slots.
    """
    S = free.shape[1]
    k = min(k, S)
    if k == 0:
        return jnp.zeros((free.shape[0], 0), jnp.int32), jnp.sum(free, axis=1).astype(jnp.int32)
    _, idx = jax.lax.top_k(jnp.where(free, -jnp.arange(S)[None], -S - 1), k)
    return idx.astype(jnp.int32), jnp.sum(free, axis=1).astype(jnp.int32)


def take(table, idx):
    """table[r, idx[r, i]] for a [rows, n] table and [rows, m] indices (clamped into range;
    zeros from an empty table)."""
    if table.shape[1] == 0:
        return jnp.zeros(idx.shape, table.dtype)
    return jnp.take_along_axis(table, jnp.clip(idx, 0, table.shape[1] - 1), axis=1)


def compacted(ok, values, fill=0):
    """Moves the entries of `values` [rows, K] where `ok` to the front (order kept);
    returns (compacted [rows, K], counts [rows] int32)."""
    rows, K = ok.shape
    rank = jnp.cumsum(ok, axis=1) - 1
    r = jnp.arange(rows)[:, None]
    out = (
        jnp.full((rows, K), fill, values.dtype)
        .at[r, jnp.where(ok, rank, K)]
        .set(values, mode="drop")
    )
    return out, jnp.sum(ok, axis=1).astype(jnp.int32)


def nth(r, first_list, first_count, then_list):
    """Entry r of the sequence `first_list[:first_count]` followed by `then_list`, per row."""
    return jnp.where(
        r < first_count[:, None], take(first_list, r), take(then_list, r - first_count[:, None])
    )
