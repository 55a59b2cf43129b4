"""A request's sampling parameters (`SamplingParams`) and the checks `Engine.submit` runs on a
request before it enters the queue: every refusal is a ValueError naming the value and what was
expected, raised at submit, never later in a step."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxkv.cache.rows import passed_blocks

MAX_STOP_IDS = 8  # stop tokens a request may name (the slot's row of the stop table)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: each field lives in its slot's row of the engine's state,
    so requests with different parameters share one compiled step.

    Attributes:
      max_new_tokens: tokens to generate, the first (sampled from the prompt's last logits)
        included; >= 1.
      temperature: 0 takes the argmax (greedy); > 0 samples at that temperature.
      top_k: keep the k most likely tokens (None: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p
        (nucleus; 1.0: all), applied after top_k.
      seed: the request's PRNG seed: token i is drawn with `fold_in(key(seed), i)`, so a
        request's tokens do not depend on which slot it runs in, on the other requests, or on
        a preemption.
      stop_ids: the tokens that end the request (the stop token is emitted); None: the
        engine's default, the model's EOS ids (`Engine(eos_id=...)`); () for none.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(f"max_new_tokens={n!r}: expected an int >= 1")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r}: expected a finite number >= 0 (0: greedy)")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1):
            raise ValueError(f"top_k={k!r}: expected None (all tokens) or an int >= 1")
        p = self.top_p
        bad_p = isinstance(p, bool) or not isinstance(p, int | float) or not math.isfinite(p)
        if bad_p or not 0 < p <= 1:
            raise ValueError(f"top_p={p!r}: expected a number in (0, 1] (1: all tokens)")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int | np.integer) or not 0 <= s < 2**32:
            raise ValueError(f"seed={s!r}: expected an int in [0, 2**32)")
        if self.stop_ids is not None:
            ids = self.stop_ids
            if isinstance(ids, int | np.integer) or not hasattr(ids, "__iter__"):
                raise ValueError(f"stop_ids={ids!r}: expected None or a sequence of token ids")
            ids = tuple(ids)
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int | np.integer) or i < 0:
                    raise ValueError(f"stop_ids={ids!r}: expected token ids, ints >= 0")
            ids = tuple(dict.fromkeys(int(i) for i in ids))
            if len(ids) > MAX_STOP_IDS:
                raise ValueError(f"stop_ids has {len(ids)} tokens: expected at most {MAX_STOP_IDS}")
            object.__setattr__(self, "stop_ids", ids)


def check_request(prompt, params, *, vocab_size: int, max_len: int, context: int, pages: int,
                  block_size: int):  # fmt: skip
    """The prompt as an int32 array, checked with its parameters against the engine: ValueError
    for an empty prompt, a token id outside the vocabulary, a stop id outside it, or a request
    longer than the model's context, a slot (`max_len`) or the whole host pool (`pages` pages
    of `block_size` tokens), naming the figures."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected a SamplingParams, got a {type(params).__name__}")
    ids = np.asarray(prompt)
    if ids.ndim != 1:
        raise ValueError(f"prompt has shape {ids.shape}: expected one sequence of token ids [T]")
    if ids.size == 0:
        raise ValueError("the prompt is empty: expected at least one token id")
    if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt has dtype {ids.dtype}: expected integer token ids")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        t = int(bad[0])
        raise ValueError(
            f"prompt[{t}] = {int(ids[t])}: expected token ids in [0, vocab_size={vocab_size}) "
            f"({bad.size} outside)"
        )
    for i in params.stop_ids or ():
        if i >= vocab_size:
            raise ValueError(
                f"stop id {i} is outside the vocabulary: expected ids < vocab_size={vocab_size}"
            )
    T, n = int(ids.size), int(params.max_new_tokens)
    if T > context:
        raise ValueError(
            f"the prompt has {T} tokens, longer than the model's context of {context} tokens"
        )
    if T + n > max_len:
        raise ValueError(
            f"the prompt's {T} tokens plus max_new_tokens={n} exceed a slot's {max_len} tokens "
            f"(the cache's max_len): expected prompt + max_new_tokens <= {max_len}"
        )
    need = pages_needed(T + n - 1, block_size)
    if need > pages:
        raise ValueError(
            f"the prompt's {T} tokens plus max_new_tokens={n} keep {T + n - 1} tokens in the "
            f"cache, {need} sealed blocks of {block_size}, more than the whole host pool's "
            f"{pages} pages"
        )
    return ids.astype(np.int32)


def pages_needed(tokens: int, block_size: int, window: int | None = None) -> int:
    """Host pages a sequence of `tokens` cached tokens holds: its sealed blocks (the tail, the
    block being filled, lives in the row's HBM tail slot), less, when every layer of the model
    slides (`window`: the widest, `jaxkv.cache.rows.passed_window`), the blocks that have passed
    every layer's window and were freed (`jaxkv.cache.rows.passed_blocks`)."""
    held = int(tokens) // int(block_size)
    if window is not None:
        held -= int(passed_blocks(int(tokens), int(block_size), int(window)))
    return held
