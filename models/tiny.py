"""Tiny random-init Llama for tests and the demo until the trained default model ships.

The init is deliberately large (``init_std=0.5`` instead of the usual 0.02): logits then spread
over several units and attention is sharp, so greedy continuations do not collapse into one
repeated token, depend on the context, and have top-2 logit gaps far above float32 noise, which
makes "same greedy tokens under every cache placement" a meaningful test.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from models.llama import Llama, LlamaConfig

_TINY = dict(
    vocab_size=256,
    dim=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    max_seq_len=4096,
    rope_theta=10000.0,
    init_std=0.5,
)


def tiny_config(**overrides) -> LlamaConfig:
    """The tiny test config (vocab 256, dim 64, 2 layers, 4 heads, 2 KV heads, head_dim 16,
    ffn 128, max_seq_len 4096), with any LlamaConfig field overridden by keyword."""
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"tiny_config overrides {unknown}: expected LlamaConfig fields")
    return LlamaConfig(**{**_TINY, **overrides})


def tiny_model(seed: int = 0, **overrides) -> Llama:
    """A randomly initialised tiny Llama (``tiny_config(**overrides)``), seeded by ``seed``."""
    return Llama(tiny_config(**overrides), rngs=nnx.Rngs(seed))
