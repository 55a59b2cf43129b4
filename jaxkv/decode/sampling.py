"""Token samplers of the decode loop (`jaxkv.Decoder`'s `sampler`).

A sampler is a frozen, hashable dataclass (static configuration of a jitted step) called as
`sampler(logits, key)`: [batch, vocab] logits and a PRNG key -> [batch] int32 token ids.
`Greedy` takes the argmax; `Sampling` draws at a temperature, optionally truncated to the top-k
tokens and to the nucleus (top-p).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.decode.state import SamplingState


@dataclasses.dataclass(frozen=True)
class Greedy:
    """Argmax sampling."""

    def __call__(self, logits, key):  # [batch, vocab] -> [batch] int32
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Temperature sampling with optional top-k and nucleus (top-p) truncation."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature!r}")
        k = self.top_k
        if k is not None and (not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 1):
            raise ValueError(f"top_k must be an int >= 1 or None, got {k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] or be None, got {self.top_p!r}")

    def __call__(self, logits, key):  # [batch, vocab] -> [batch] int32
        logits = logits.astype(jnp.float32) / self.temperature
        if self.top_k is not None:
            kth = jax.lax.top_k(logits, min(self.top_k, logits.shape[-1]))[0][..., -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if self.top_p is not None:
            sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
            cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            cutoff_idx = jnp.sum(cum < self.top_p, axis=-1, keepdims=True)
            cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
            logits = jnp.where(logits < cutoff, -jnp.inf, logits)
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def eos_ids(eos_id, vocab_size: int | None = None) -> tuple[int, ...] | None:
    """The stop tokens as a hashable tuple (None: none): `eos_id` is None, an int or a sequence
    of ints, each in [0, vocab_size) when `vocab_size` is given; ValueError otherwise."""
    if eos_id is None:
        return None
    many = isinstance(eos_id, list | tuple | np.ndarray)
    ids = list(np.asarray(eos_id).reshape(-1)) if many else [eos_id]
    for i in ids:
        bad = not isinstance(i, int | np.integer) or isinstance(i, bool)
        if bad or i < 0 or (vocab_size is not None and i >= vocab_size):
            top = f" < vocab_size={vocab_size}" if vocab_size is not None else ""
            raise ValueError(
                f"eos_id={eos_id!r}: expected None, an int or a sequence of ints, each >= 0{top}"
            )
    if not ids:
        raise ValueError(f"eos_id={eos_id!r} is empty: expected None for no stop token")
    return tuple(dict.fromkeys(int(i) for i in ids))


def is_eos(tokens: jax.Array, eos: tuple[int, ...] | None) -> jax.Array:
    """[...] bool: which `tokens` are one of the stop tokens `eos` (`eos_ids`'s result)."""
    if eos is None:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos, tokens.dtype))


def next_tokens(sampler, eos_id, max_new_tokens: int, sm: SamplingState, logits, active):
    """The sampling state `sm` after a step with `logits` [batch, vocab]: the next token of
    every `active` [batch] sequence (the others keep theirs), in the token buffer, which
    sequences are done, the first step whose logits were not finite, the step count. A sequence
    with non-finite logits stops there (its token is PAD_ID)."""
    key, sub = jax.random.split(sm.key)
    col = jnp.minimum(sm.step + 1, max_new_tokens - 1)
    bad = active & ~jnp.all(jnp.isfinite(logits), axis=-1)
    bad_step = jnp.where(bad & (sm.bad_step < 0), col, sm.bad_step)
    active = active & ~bad
    nxt = sampler(logits, sub)
    nxt = jnp.where(active, nxt, sm.last)
    tokens = sm.tokens.at[:, col].set(jnp.where(active, nxt, sm.tokens[:, col]))
    done = sm.done | bad | (active & is_eos(nxt, eos_id))
    return SamplingState(
        tokens=tokens, last=nxt, done=done, step=sm.step + 1, key=key, bad_step=bad_step
    )
