"""The engine's device state and what its steps return.

`EngineState` is the pytree the engine's compiled functions take (donated) and return:
  decode  the decode loop's own `DecodeState` (`jaxkv.decode.state`) over the engine's slots:
          its cache (one row a slot, `CacheConfig(paged_host=True)`), the next input token
          and which slots are done, the placement policy's and its in-step rule's state, the
          per-block read statistics, the window bookkeeping; its per-step metric arrays are
          one entry long (the engine returns each step's figures in a `StepOut` instead)
  slots   `jaxkv.serve.sampling.Slots`: each slot's request parameters and progress

`StepOut` is what one decode step hands back to the host (one small transfer a step): the
token each slot produced, which requests finished and why, and the step's reads and moves per
layer, from which `jaxkv.serve.timing` prices the step on any hardware profile and model size.

`reset_rows` gives a slot's blocks (entries [row * max_blocks, (row + 1) * max_blocks) of
every per-block leaf) their initial values when a request is inserted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass
from jaxkv.decode.state import DecodeState
from jaxkv.serve.sampling import Slots


@pytree_dataclass
class EngineState:
    decode: DecodeState  # the decode loop's state over every slot
    slots: Slots  # the slots' requests


@pytree_dataclass
class StepOut:
    """One decode step's results, per slot and per layer."""

    tokens: jax.Array  # [slots] int32: the token each decoding slot produced (-1: none)
    reason: jax.Array  # [slots] int32: why the slot's request finished (`sampling.REASONS`; 0)
    active: jax.Array  # [slots] bool: the slots this step decoded
    lengths: jax.Array  # [slots] int32: tokens in each slot's cache row before the step
    hbm_blocks: jax.Array  # [layers] int32: blocks read from HBM (tails included)
    host_blocks: jax.Array  # [layers] int32: blocks read over the link
    promoted: jax.Array  # [layers] int32: blocks the in-step rule promoted
    demoted: jax.Array  # [layers] int32: blocks it demoted
    moved: jax.Array  # [layers] int32: blocks a window's plan copied over the link
    latency: jax.Array  # [] f32: the step's modeled seconds under the engine's profile
    since_plan: jax.Array  # [] int32: steps since the last plan, after this step
    window: jax.Array  # [] int32: W, steps between plans


@pytree_dataclass
class PrefillBuffer:
    """One request's prompt while it is prefilled chunk by chunk (`jaxkv.serve.prefill`)."""

    tokens: jax.Array  # [T] int32: the prompt (T = max_len rounded up to whole chunks)
    k: jax.Array  # [layers, T, kv_heads, head_dim]: its keys (after RoPE), the chunks done
    v: jax.Array  # [layers, T, kv_heads, head_dim]: its values
    logits: jax.Array  # [vocab] f32: the logits after the last token prefilled


def per_block(init, num_blocks: int):
    """A pytree of bools over `init`'s leaves (an init function of `num_blocks`): whether the
    leaf's axis 1 is the blocks' (it changes with `num_blocks`), found by tracing `init` at
    `num_blocks` and `num_blocks + 1` (a leaf of a size equal to N by chance stays put)."""
    a = jax.eval_shape(lambda: init(num_blocks))
    b = jax.eval_shape(lambda: init(num_blocks + 1))
    n = num_blocks
    return jax.tree.map(lambda x, y: x.ndim >= 2 and (x.shape[1], y.shape[1]) == (n, n + 1), a, b)


def reset_rows(tree, init_tree, mask, row, max_blocks: int):
    """`tree` with the entries [row * max_blocks, (row + 1) * max_blocks) of axis 1 of every
    leaf `mask` marks (`per_block`) taken from `init_tree`'s (the same structure): a slot's
    blocks back to their initial values; other leaves as they are. `row` may be traced."""
    start = row * max_blocks

    def one(x, x0, m):
        if not m:
            return x
        seg = jax.lax.dynamic_slice_in_dim(x0, start, max_blocks, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(x, seg.astype(x.dtype), start, axis=1)

    return jax.tree.map(one, tree, init_tree, mask)


def set_row(x, row, values, max_blocks: int):
    """[layers, N, ...] `x` with slot `row`'s entries (axis 1) set to `values` [layers,
    max_blocks, ...]."""
    return jax.lax.dynamic_update_slice_in_dim(
        x, jnp.asarray(values, x.dtype), row * max_blocks, axis=1
    )
