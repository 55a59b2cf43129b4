"""Per-slot sampling: every slot's request has its own temperature, top-k, top-p, seed, stop
tokens and token budget, held as rows of arrays in the engine's state (`Slots`), so one
compiled step samples any mix of requests (no recompilation per request).

Token i of a request (i = 0 the one sampled from the prompt's last logits) is drawn with the
key `fold_in(key(seed), i)`: what a request samples depends on its own logits and seed only,
not on its slot, the other requests, or a preemption that recomputed it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._pytree import pytree_dataclass
from jaxkv.serve.params import MAX_STOP_IDS, SamplingParams
from pallas_kernels.common import on_gpu

# why a request finished (`StepOut.reason`, `Engine` events)
NOT_DONE, STOP, LENGTH, NONFINITE = 0, 1, 2, 3
REASONS = {STOP: "stop", LENGTH: "length", NONFINITE: "nonfinite"}


@pytree_dataclass
class Slots:
    """The requests in the slots, one row each (a row is meaningful while `live`)."""

    live: jax.Array  # [slots] bool: a request is decoding in the slot
    produced: jax.Array  # [slots] int32: tokens the request produced so far
    max_new: jax.Array  # [slots] int32: its max_new_tokens
    temperature: jax.Array  # [slots] f32: 0 = greedy
    top_k: jax.Array  # [slots] int32: 0 = off
    top_p: jax.Array  # [slots] f32: 1 = off
    key: jax.Array  # [slots, 2] uint32: key data of key(seed)
    stop: jax.Array  # [slots, MAX_STOP_IDS] int32: stop tokens, -1 = none

    @staticmethod
    def empty(slots: int) -> Slots:
        """No request anywhere."""
        return Slots(
            live=jnp.zeros((slots,), bool),
            produced=jnp.zeros((slots,), jnp.int32),
            max_new=jnp.zeros((slots,), jnp.int32),
            temperature=jnp.zeros((slots,), jnp.float32),
            top_k=jnp.zeros((slots,), jnp.int32),
            top_p=jnp.ones((slots,), jnp.float32),
            key=jnp.zeros((slots, 2), jnp.uint32),
            stop=jnp.full((slots, MAX_STOP_IDS), -1, jnp.int32),
        )


@pytree_dataclass
class Row:
    """One request's sampling parameters as arrays (`row_of`), for a traced insert."""

    max_new: jax.Array  # [] int32
    temperature: jax.Array  # [] f32
    top_k: jax.Array  # [] int32
    top_p: jax.Array  # [] f32
    key: jax.Array  # [2] uint32
    stop: jax.Array  # [MAX_STOP_IDS] int32


def row_of(params: SamplingParams, default_stop: tuple[int, ...]) -> Row:
    """`params` as a `Row` of numpy arrays (stop ids None: `default_stop`)."""
    stop = default_stop if params.stop_ids is None else params.stop_ids
    table = np.full((MAX_STOP_IDS,), -1, np.int32)
    table[: len(stop)] = stop
    key = np.asarray(jax.random.key_data(jax.random.key(params.seed)), np.uint32)
    return Row(
        max_new=np.int32(params.max_new_tokens),
        temperature=np.float32(params.temperature),
        top_k=np.int32(params.top_k or 0),
        top_p=np.float32(params.top_p),
        key=key,
        stop=table,
    )


def with_row(slots: Slots, b, row: Row, produced) -> Slots:
    """`slots` with slot `b` (traced) holding a request of parameters `row` that has produced
    `produced` tokens."""
    return Slots(
        live=slots.live.at[b].set(True),
        produced=slots.produced.at[b].set(produced),
        max_new=slots.max_new.at[b].set(row.max_new),
        temperature=slots.temperature.at[b].set(row.temperature),
        top_k=slots.top_k.at[b].set(row.top_k),
        top_p=slots.top_p.at[b].set(row.top_p),
        key=slots.key.at[b].set(row.key),
        stop=slots.stop.at[b].set(row.stop),
    )


def truncate(logits, top_k, top_p):
    """[rows, vocab] logits with the tokens outside each row's top-k (0: off) and nucleus
    (`top_p`, 1: off) set to -inf: one sort per row."""
    V = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)  # [rows, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    rank = jnp.arange(V)[None]
    desc = jnp.where(rank < k[:, None], desc, -jnp.inf)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
    # the smallest prefix whose mass reaches top_p (at least one token)
    cut = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1, keepdims=True), V - 1)
    cutoff = jnp.maximum(jnp.take_along_axis(desc, cut, axis=-1), kth)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def sample(logits, temperature, top_k, top_p, key, index):
    """[rows] int32 tokens from [rows, vocab] logits, each row by its own parameters: the
    argmax where temperature is 0, else a draw at that temperature from its truncated
    distribution with key `fold_in(key_data, index)` (`key` [rows, 2] uint32, `index` [rows]).
    Off GPU the truncation runs only when a row asks for one (a GPU conditional syncs the
    host: there it always runs)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    cut = (top_k > 0) | (top_p < 1)
    if on_gpu():
        scaled = truncate(scaled, top_k, top_p)
    else:
        scaled = jax.lax.cond(
            jnp.any(cut & (temperature > 0)),
            lambda x: truncate(x, top_k, top_p),
            lambda x: x,
            scaled,
        )
    keys = jax.vmap(lambda k, i: jax.random.fold_in(jax.random.wrap_key_data(k), i))(key, index)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def sample_slots(slots: Slots, logits, active):
    """The step's token of every `active` slot and what it ends: (tokens [slots] int32, -1
    where not active; slots with `produced` advanced; reason [slots] int32, `NOT_DONE` or why
    the request finished with this token: a stop token, its max_new_tokens, non-finite
    logits)."""
    bad = active & ~jnp.all(jnp.isfinite(logits), axis=-1)
    tok = sample(logits, slots.temperature, slots.top_k, slots.top_p, slots.key, slots.produced)
    ok = active & ~bad
    produced = slots.produced + ok.astype(jnp.int32)
    stop = jnp.any(tok[:, None] == slots.stop, axis=-1)  # -1 never matches a token
    reason = jnp.where(
        bad,
        NONFINITE,
        jnp.where(ok & stop, STOP, jnp.where(ok & (produced >= slots.max_new), LENGTH, NOT_DONE)),
    ).astype(jnp.int32)
    tokens = jnp.where(ok, tok, -1)
    return tokens, Slots(**{**vars_of(slots), "produced": produced}), reason


def vars_of(x) -> dict:
    """A pytree dataclass's fields as a dict."""
    return {k: getattr(x, k) for k in x.__dataclass_fields__}
