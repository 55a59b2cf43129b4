"""The explicit state of the decode loop (`jaxkv.Decoder`), how a step updates it, and
its host-side summary.

`DecodeState` is the pytree a Decoder's prefill returns and its steps take (donated) and
return. It nests:
  cache       the `TieredKVCache` (`jaxkv.cache`)
  sampling    `SamplingState`: the tokens so far (PAD_ID after a sequence's last), the next
              input, finished sequences, the first step with non-finite logits, the PRNG key
  placement   `PlacementState`: window bookkeeping (W, steps since the last plan, this window's
              HBM hit counts), the placement policy's own state and its in-step rule's
  statistics  `Statistics`: per-block read statistics the policy plans from
  metrics     `Metrics`: per-step bytes read from each tier, the modeled step latency, blocks
              migrated, HBM hits

`new_window` starts a window's bookkeeping; `record_step` writes a decode step's reads, tokens
and metrics into the state; `summarize` turns a finished state's metrics into a dict on the
host.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvc
from jaxkv._pytree import pytree_dataclass, replace
from jaxkv.config import CacheConfig
from jaxkv.placement import statistics as imp
from jaxkv.placement.charging import (  # noqa: F401  (the decode loop's charging, re-exported)
    copied_demotions,
    link_migration_bytes,
    read_bytes,
    step_latency,
    token_write_bytes,
)
from jaxkv.placement.pricing import adapt_window

PAD_ID = -1  # the token buffer's entry after a sequence's last token (never a valid id)


@pytree_dataclass
class Metrics:
    hbm_bytes: jax.Array  # [max_steps] f32: KV bytes read from HBM per step (all layers)
    host_bytes: jax.Array  # [max_steps] f32: KV bytes read over the link per step
    latency: jax.Array  # [max_steps] f32: modeled seconds per step (migrations included)
    migrated_blocks: jax.Array  # [] int32
    hbm_reads: jax.Array  # [] f32: block reads served from HBM
    total_reads: jax.Array  # [] f32: block reads
    windows: jax.Array  # [] int32: plans made
    window_trace: jax.Array  # [max_steps] int32: W in force at each step
    moved_trace: jax.Array  # [max_steps] int32: blocks migrated at each step (all layers)


@pytree_dataclass
class StepReads:
    """What one decode step's layers read, per logical block: every layer's
    `jaxkv.attention.AttentionStats`, stacked (`record_step` turns it into statistics and
    metrics)."""

    read_hbm: jax.Array  # [layers, batch, max_blocks] bool: read from HBM (fp8 ring included)
    read_host: jax.Array  # [layers, batch, max_blocks] bool: read from host memory
    mass: jax.Array  # [layers, batch, max_blocks] f32: attention probability summed over q heads

    @staticmethod
    def zeros(num_layers: int, batch: int, max_blocks: int) -> StepReads:
        """No block read yet, by any layer: the carry the layer scan starts from."""
        shape = (num_layers, batch, max_blocks)
        return StepReads(
            read_hbm=jnp.zeros(shape, bool),
            read_host=jnp.zeros(shape, bool),
            mass=jnp.zeros(shape, jnp.float32),
        )

    def with_layer(self, layer, stats) -> StepReads:
        """The reads with row `layer` (int or traced int32) set to that layer's
        `AttentionStats` `stats` ([batch, max_blocks] each)."""
        return StepReads(
            read_hbm=self.read_hbm.at[layer].set(stats.read_hbm),
            read_host=self.read_host.at[layer].set(stats.read_host),
            mass=self.mass.at[layer].set(stats.mass),
        )


@pytree_dataclass
class SamplingState:
    # [batch, max_new_tokens] int32; column 0 is the token sampled at prefill, column s the
    # one decode step s sampled; PAD_ID (-1) after a sequence's last token (EOS, a full cache,
    # or steps not taken yet): `DecodeState.lengths` counts the rest
    tokens: jax.Array
    last: jax.Array  # [batch] int32: the next input token
    done: jax.Array  # [batch] bool: finished (EOS, or non-finite logits)
    step: jax.Array  # [] int32: decode steps taken
    key: jax.Array  # PRNG key
    # [batch] int32: the first token column whose logits held a NaN or inf (0: the prefill's),
    # -1 if none; `Decoder.generate` (and `ShardedDecoder`'s) raise NonFiniteLogitsError on it
    bad_step: jax.Array


@pytree_dataclass
class PlacementState:
    window: jax.Array  # [] int32: W, steps between plans
    since_plan: jax.Array  # [] int32
    win_hbm: jax.Array  # [] f32: HBM block reads in the current window
    win_total: jax.Array  # [] f32: block reads in the current window
    prev_hit: jax.Array  # [] f32: HBM hit rate of the previous window
    policy: Any  # the policy's own state (`Policy.init`)
    # the in-step rule's state (`Rule.init(layers, batch * max_blocks)`: every leaf [layers, ...];
    # () for a rule that keeps none, or no rule)
    rule: Any = ()


@pytree_dataclass
class Statistics:
    blocks: imp.Stats  # per-block read statistics, [layers, batch * max_blocks]
    step_mass: jax.Array  # [layers, batch, max_blocks] f32: last step's attention mass (0 unread)
    # [batch, max_blocks] bool: layer 0's reads at the next step, known at the end of the last
    # (`Lrfu.lookahead`, `jaxkv.decode.follow.look_ahead`); None without the lookahead
    ahead: jax.Array | None = None


@pytree_dataclass
class DecodeState:
    cache: kvc.TieredKVCache
    sampling: SamplingState
    placement: PlacementState
    statistics: Statistics
    metrics: Metrics

    # shortcuts to the nested fields read most
    @property
    def tokens(self) -> jax.Array:
        return self.sampling.tokens

    @property
    def step(self) -> jax.Array:
        return self.sampling.step

    @property
    def lengths(self) -> jax.Array:
        """[batch] int32: tokens each sequence generated (the prefill's included): the entries
        of `tokens[b]` before its PAD_ID padding."""
        return jnp.sum(self.sampling.tokens != PAD_ID, axis=1, dtype=jnp.int32)

    @property
    def done(self) -> jax.Array:
        return self.sampling.done

    @property
    def window(self) -> jax.Array:
        return self.placement.window

    @property
    def policy_state(self) -> Any:
        return self.placement.policy

    @property
    def stats(self) -> imp.Stats:
        return self.statistics.blocks

    @property
    def step_mass(self) -> jax.Array:
        return self.statistics.step_mass

    @property
    def num_tokens(self) -> jax.Array:
        """[] int32: tokens generated per sequence so far (the prefill token included)."""
        return self.sampling.step + 1


@pytree_dataclass
class Prefilled:
    """A model's forward pass over the prompts (`Decoder.model_prefill`), from which any
    Decoder of that model can start (`Decoder.prefill(prefilled=...)`)."""

    last_logits: jax.Array  # [batch, vocab] f32: logits after each prompt's last token
    k: jax.Array  # [layers, batch, T, kv_heads, head_dim]
    v: jax.Array  # [layers, batch, T, kv_heads, head_dim]
    lengths: jax.Array  # [batch] int32: prompt lengths
    queries: jax.Array  # [layers, batch, n, q_heads, head_dim]: the last n positions' queries
    # (`jaxkv.decode.prompt.prompt_queries`, n = `queries_needed(policy)`: 32 or more)


def initial_state(
    cache,
    first,
    done,
    key,
    window: int,
    policy,
    max_new_tokens: int,
    decay: float,
    bad_step,
    read_prior=None,
    steady=None,
    room: int = 0,
    lookahead: bool = False,
    rule=(),
):
    """The DecodeState after prefill: `first` [batch] sampled tokens (`done` those that stop;
    `bad_step` [batch] int32 0 where the prefill's logits were not finite, else -1),
    the first window of `window` steps with the policy's initial state, and empty statistics
    and metrics over `max_new_tokens` steps (read statistics decaying by `decay` a step; the
    blocks' read frequency starts at `read_prior` [layers, batch * max_blocks] if given, the
    prompt's prior of `jaxkv.decode.prompt`; with `steady`, the adaptive estimator's steady
    read frequency, over a layer's `room` HBM slots: `jaxkv.placement.statistics.with_steady`;
    `lookahead`: the statistics keep layer 0's next reads, none known yet; `rule`: the in-step
    rule's initial state)."""
    L, B, M = cache.tier.shape
    stats = imp.init_stats(L, B * M, decay=decay)
    if read_prior is not None:
        stats = replace(stats, read_ema=read_prior.astype(jnp.float32))
    if steady is not None:
        stats = imp.with_steady(stats, steady, room)
    zeros_f = jnp.zeros((max_new_tokens,), jnp.float32)
    return DecodeState(
        cache=cache,
        sampling=SamplingState(
            tokens=jnp.full((B, max_new_tokens), PAD_ID, jnp.int32).at[:, 0].set(first),
            last=first,
            done=done | (bad_step == 0),
            step=jnp.int32(0),
            key=key,
            bad_step=bad_step,
        ),
        placement=new_window(jnp.int32(window), jnp.float32(0), policy, rule),
        statistics=Statistics(
            blocks=stats,
            step_mass=jnp.zeros((L, B, M), jnp.float32),
            ahead=jnp.zeros((B, M), bool) if lookahead else None,
        ),
        metrics=Metrics(
            hbm_bytes=zeros_f,
            host_bytes=zeros_f,
            latency=zeros_f,
            migrated_blocks=jnp.int32(0),
            hbm_reads=jnp.float32(0),
            total_reads=jnp.float32(0),
            windows=jnp.int32(0),
            window_trace=jnp.zeros((max_new_tokens,), jnp.int32),
            moved_trace=jnp.zeros((max_new_tokens,), jnp.int32),
        ),
    )


def new_window(window, prev_hit, policy, rule=()) -> PlacementState:
    """The placement state at the start of a window of W=`window` steps, none taken yet, with
    the policy's state `policy` and its in-step rule's `rule`."""
    return PlacementState(
        window=window,
        since_plan=jnp.int32(0),
        win_hbm=jnp.float32(0),
        win_total=jnp.float32(0),
        prev_hit=prev_hit,
        policy=policy,
        rule=rule,
    )


def next_window(policy, p, pl: PlacementState, policy_state):
    """(the next W, the ending window's HBM hit rate) at a plan of `policy` under the
    PlacementConfig `p`. The adaptive window has one controller, `adapt_window`: the policy's
    own for an adaptive anneal policy, else the decode loop's when `p.adaptive_window`; W stays
    otherwise."""
    hit = pl.win_hbm / jnp.maximum(pl.win_total, 1.0)
    window = pl.window
    if policy.adapts_window:
        window = policy.next_window(policy_state)
    elif p.adaptive_window:
        window = adapt_window(window, hit, pl.prev_hit, p.min_window, p.max_window, p.window_step)
    return window, hit


def record_step(
    c: CacheConfig,
    state: DecodeState,
    cache,
    sampled: SamplingState,
    reads: StepReads,
    promoted,
    demoted,
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """The state after one decode step, before any plan: the new cache and sampling state, the
    read statistics, the window's hit counts and the step's metrics (but for its latency).

    Args:
      c: the cache's config.
      state: the state before the step.
      cache: the cache after the step.
      sampled: the sampling state after the step (its tokens and step count advanced).
      reads: the step's block reads, every layer's.
      promoted, demoted: [layers] int32 blocks the step's follow moves migrated.

    Returns:
      (state, hbm_b, host_b): the KV bytes the step read from each tier, [layers] f32."""
    L, N = c.num_layers, c.batch * c.max_blocks
    read_hbm, read_host, mass = reads.read_hbm, reads.read_host, reads.mass
    step = state.sampling.step
    read = read_hbm | read_host
    stats = imp.update_stats(
        state.statistics.blocks,
        read.reshape(L, N),
        mass.reshape(L, N),
        step,
        state.cache.sealed.reshape(L, N),
    )
    hbm_b, host_b = read_bytes(c, read_hbm, read_host, state.cache.lengths)
    n_hbm, n_all = read_hbm.sum().astype(jnp.float32), read.sum().astype(jnp.float32)
    m = state.metrics
    metrics = replace(
        m,
        hbm_bytes=m.hbm_bytes.at[step].set(hbm_b.sum()),
        host_bytes=m.host_bytes.at[step].set(host_b.sum()),
        migrated_blocks=m.migrated_blocks + (promoted + copied_demotions(c, demoted)).sum(),
        hbm_reads=m.hbm_reads + n_hbm,
        total_reads=m.total_reads + n_all,
        window_trace=m.window_trace.at[step].set(state.placement.window),
    )
    pl = state.placement
    state = DecodeState(
        cache=cache,
        sampling=sampled,
        placement=replace(
            pl,
            since_plan=pl.since_plan + 1,
            win_hbm=pl.win_hbm + n_hbm,
            win_total=pl.win_total + n_all,
        ),
        statistics=replace(state.statistics, blocks=stats, step_mass=mass),
        metrics=metrics,
    )
    return state, hbm_b, host_b


def summarize(
    state: DecodeState, *, plan_seconds: float | None = None, step_seconds: float | None = None
) -> dict:
    """Host-side summary of a finished decode: hit rate, migrations, modeled time.

    With `plan_seconds` (one plan's wall time on the present device, `Decoder.plan_seconds`)
    it adds the planning cost: `plan_ms`, `plan_ms_per_step` (a plan per window, spread over
    the steps) and, with `step_seconds` too (the measured wall time of one decode step on the
    same device), `plan_share` (planning time per step over the step's wall time) and
    `modeled_tokens_per_s_with_plan`: the modeled time with each step lengthened by that
    share, i.e. planning charged serially, as it runs on this device, and at the speed ratio
    this device shows between the plan and the step (the modeled step is a GPU's; the plan
    is not modeled)."""
    m = jax.device_get(state.metrics)
    steps = int(state.step)
    lat = float(np.sum(m.latency[:steps]))
    batch = state.tokens.shape[0]
    out = {
        "steps": steps,
        "hbm_hit_rate": float(m.hbm_reads / max(m.total_reads, 1.0)),
        "migrated_blocks": int(m.migrated_blocks),
        "modeled_seconds": lat,
        "modeled_tokens_per_s": batch * steps / lat if lat > 0 else float("nan"),
        "hbm_bytes": float(np.sum(m.hbm_bytes[:steps])),
        "host_bytes": float(np.sum(m.host_bytes[:steps])),
        "windows": int(m.windows),
    }
    if plan_seconds is not None:
        per_step = plan_seconds * int(m.windows) / max(steps, 1)
        out.update(plan_ms=1e3 * plan_seconds, plan_ms_per_step=1e3 * per_step)
        if step_seconds is not None and step_seconds > 0:
            share = per_step / step_seconds
            charged = lat * (1.0 + share)
            out.update(
                plan_share=share,
                modeled_tokens_per_s_with_plan=batch * steps / charged
                if charged > 0
                else float("nan"),
            )
    return out


class NonFiniteLogitsError(FloatingPointError):
    """A decode produced NaN or inf logits (`Decoder.generate`, `ShardedDecoder.generate`);
    `.state` is the state."""

    def __init__(self, message: str, state: DecodeState):
        super().__init__(message)
        self.state = state


def check_finite(state: DecodeState, bad_step=None) -> None:
    """Raises NonFiniteLogitsError naming the first step (the token column; 0 is the
    prefill's) and the sequences whose logits held a NaN or inf, if any (one host read).
    `bad_step`: [batch] the state's `sampling.bad_step` (default), or those of a sharded state
    already read back in global sequence order (`jaxkv.decode.sharded.ShardedDecoder.generate`)."""
    bad = np.asarray(state.sampling.bad_step if bad_step is None else bad_step).reshape(-1)
    if (bad < 0).all():
        return
    first = int(bad[bad >= 0].min())
    rows = np.flatnonzero(bad == first).tolist()
    others = np.flatnonzero(bad > first).tolist()
    where = "the prefill (step 0)" if first == 0 else f"decode step {first}"
    raise NonFiniteLogitsError(
        f"the logits of sequence{'s' if len(rows) > 1 else ''} {rows} held NaN or inf at "
        f"{where}, the token at column {first} of state.tokens"
        + (f" (sequences {others} later)" if others else "")
        + ": expected finite logits; the model's weights or activations are not finite (NaN "
        f"weights, an overflow in the cache's dtype); those sequences stopped there (tokens "
        f"after are {PAD_ID})",
        state,
    )
