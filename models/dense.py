"""A dense per-sequence KV buffer and its ``attend`` for ``Llama.decode_step``: the plain
reference that tiered-cache attention is compared with, and a way to decode without jaxkv."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from models.llama import LlamaConfig


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["k", "v", "lengths"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class DenseKV:
    """Dense KV buffers; ``lengths`` counts the tokens written per sequence."""

    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim] float32
    v: jax.Array  # [layers, batch, max_len, kv_heads, head_dim] float32
    lengths: jax.Array  # [batch] int32


def init_dense_kv(config: LlamaConfig, batch: int, max_len: int) -> DenseKV:
    """Empty buffers for ``batch`` sequences of up to ``max_len`` tokens."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return DenseKV(
        jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((batch,), jnp.int32)
    )


def dense_kv_from_prefill(
    k: jax.Array,  # [layers, batch, T, kv_heads, head_dim]
    v: jax.Array,  # [layers, batch, T, kv_heads, head_dim]
    max_len: int,
) -> DenseKV:
    """Buffers holding a prefill's K/V (all sequences of length T), room up to ``max_len``."""
    t = k.shape[2]
    if max_len < t:
        raise ValueError(f"dense_kv_from_prefill max_len={max_len}: expected >= prompt length {t}")
    pad = [(0, 0), (0, 0), (0, max_len - t), (0, 0), (0, 0)]
    return DenseKV(
        jnp.pad(k.astype(jnp.float32), pad),
        jnp.pad(v.astype(jnp.float32), pad),
        jnp.full((k.shape[1],), t, jnp.int32),
    )


def make_dense_attend(config: LlamaConfig):
    """``attend(i, q, k_new, v_new, kv) -> (out, kv)`` over a :class:`DenseKV` carry.

    Layer ``i`` writes the new token at index ``kv.lengths`` and attends over indices
    ``0..lengths`` inclusive (the last ``config.layer_windows()[i]`` of them in a sliding-window
    layer); the last layer advances ``lengths`` by one. Positions are taken as equal to
    ``lengths`` (the caller passes ``positions=kv.lengths`` to decode_step).
    """
    g = config.group_size
    scale = 1.0 / math.sqrt(config.head_dim)
    last = config.num_layers - 1
    hi = jax.lax.Precision.HIGHEST

    def attend(i, q, k_new, v_new, kv: DenseKV):
        # q [B, H, hd]; k_new, v_new [B, Hkv, hd]
        pos = kv.lengths
        b = jnp.arange(q.shape[0])
        k = kv.k.at[i, b, pos].set(k_new.astype(jnp.float32))
        v = kv.v.at[i, b, pos].set(v_new.astype(jnp.float32))
        qg = q.astype(jnp.float32).reshape(q.shape[0], config.num_kv_heads, g, config.head_dim)
        s = jnp.einsum("bkgd,bskd->bkgs", qg, k[i], precision=hi) * scale
        t = jnp.arange(k.shape[2])[None, None, None, :]
        p_ = pos[:, None, None, None]
        valid = t <= p_
        if config.sliding_window is not None:
            w = jnp.asarray(config.layer_windows(), jnp.int32)[i]  # i: the traced layer index
            valid &= (w <= 0) | (p_ - t < w)
        p = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
        out = jnp.einsum("bkgs,bskd->bkgd", p, v[i], precision=hi).reshape(q.shape)
        lengths = jnp.where(i == last, pos + 1, pos)  # i: the traced layer index
        return out.astype(q.dtype), DenseKV(k, v, lengths)

    return attend
