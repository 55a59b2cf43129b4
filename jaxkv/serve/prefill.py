"""Prefill in chunks of a bounded size, between decode steps.

A long prompt prefilled in one forward pass stalls every running request for its whole
duration; the engine instead prefills a prompt `chunk` tokens at a time, one chunk per
engine step, and decodes the running requests between chunks (vLLM's chunked prefill,
Sarathi-Serve's stall-free batching). Chunk i attends over the keys and values of chunks
0..i-1 and causally within itself.

The design needs nothing new of the model: a chunk runs through the model's own
`decode_step` (the model protocol, `jaxkv.model_api`) with one row per position of the chunk
and an `attend` of this module's. At each layer `attend` receives the chunk's queries, keys
and values for all of its positions at once, writes the keys and values into the request's
prompt buffer (`PrefillBuffer`, dense, `max_len` rounded up to whole chunks) and attends each
position over the buffer up to itself (and inside the layer's sliding window): exact,
float32 softmax. `decode_step` treats rows as independent sequences (`jaxkv.model_api`: "rows
are independent sequences of any count"), which holds here because `attend` is where the rows
meet. Its cost beyond a prefill's is the LM head on every row of the chunk (the model's
`decode_step` returns every row's logits; the last row's are kept), about a fifth of a chunk's
work for SmolLM2 (vocabulary 49,152, dim 576). The prompt buffer is the request's until its
last chunk: the engine then inserts it into a slot (`jaxkv.serve.core`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.model_api import bind
from jaxkv.serve.state import PrefillBuffer


def buffer_length(max_len: int, chunk: int) -> int:
    """Tokens of a prompt buffer: `max_len` rounded up to whole chunks (a chunk's write at a
    multiple of `chunk` never runs past the end)."""
    return -(-max_len // chunk) * chunk


def empty_buffer(model_config, cache_config, chunk: int) -> PrefillBuffer:
    """A prompt buffer of zeros for the model and cache."""
    T = buffer_length(cache_config.max_len, chunk)
    kv = (cache_config.num_layers, T, cache_config.kv_heads, cache_config.head_dim)
    return PrefillBuffer(
        tokens=jnp.zeros((T,), jnp.int32),
        k=jnp.zeros(kv, cache_config.jnp_dtype),
        v=jnp.zeros(kv, cache_config.jnp_dtype),
        logits=jnp.zeros((model_config.vocab_size,), jnp.float32),
    )


def chunk_fn(chunk: int):
    """The prefill of one chunk of `chunk` tokens: a function (graphdef, params, buf, start,
    count, windows=None) -> `buf` after prefilling its tokens [start, start + count), with
    the logits after the chunk's last token.

    graphdef, params: the model (`jaxkv.model_api.bind`'s); buf: the prompt buffer, its
    `tokens` the whole prompt; start ([] int32, a multiple of `chunk`), count ([] int32, 1 to
    `chunk`): traced; windows: [layers] int32 sliding windows (0: full) or None. Positions
    past `start + count` are written too (from the buffer's padding) and overwritten by the
    next chunk or never read."""

    def run(graphdef, params, buf: PrefillBuffer, start, count, windows=None):
        model = bind(graphdef, params)
        T = buf.tokens.shape[0]
        pos = start + jnp.arange(chunk, dtype=jnp.int32)  # [C]
        tokens = jax.lax.dynamic_slice_in_dim(buf.tokens, start, chunk)
        key_pos = jnp.arange(T, dtype=jnp.int32)
        see = key_pos[None] <= pos[:, None]  # [C, T]
        dtype = buf.k.dtype

        def attend(layer, q, k_new, v_new, carry):
            kb, vb = carry
            kb = jax.lax.dynamic_update_slice(kb, k_new.astype(dtype)[None], (layer, start, 0, 0))
            vb = jax.lax.dynamic_update_slice(vb, v_new.astype(dtype)[None], (layer, start, 0, 0))
            kl = jax.lax.dynamic_index_in_dim(kb, layer, keepdims=False)  # [T, KV, D]
            vl = jax.lax.dynamic_index_in_dim(vb, layer, keepdims=False)
            C, H, D = q.shape
            KV = kl.shape[1]
            qg = q.astype(jnp.float32).reshape(C, KV, H // KV, D)
            hi = jax.lax.Precision.HIGHEST
            s = jnp.einsum("ckgd,tkd->kgct", qg, kl.astype(jnp.float32), precision=hi)
            s = s / math.sqrt(D)
            mask = see
            if windows is not None:
                w = windows[layer]
                mask = mask & ((w <= 0) | (pos[:, None] - key_pos[None] < w))
            p = jax.nn.softmax(jnp.where(mask[None, None], s, -jnp.inf), axis=-1)
            out = jnp.einsum("kgct,tkd->ckgd", p, vl.astype(jnp.float32), precision=hi)
            return out.reshape(C, H, D).astype(q.dtype), (kb, vb)

        logits, (k, v) = model.decode_step(tokens, pos, attend, (buf.k, buf.v))
        last = jax.lax.dynamic_index_in_dim(logits, count - 1, keepdims=False)
        return PrefillBuffer(tokens=buf.tokens, k=k, v=v, logits=last.astype(jnp.float32))

    return run
