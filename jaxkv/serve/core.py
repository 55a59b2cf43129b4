"""The engine's compiled functions over its fixed slots: JetStream's shape (prefill, insert,
generate, free_resource), each jitted once, the slot index traced.

  `chunk`        prefill `chunk` tokens of a prompt into its buffer (`jaxkv.serve.prefill`)
  `insert`       a prefilled request into a free slot: its prompt's KV into both tiers of
                 that slot's rows (`jaxkv.cache.rows.insert`: host pages for every sealed block,
                 HBM for its tail and for the blocks the policy's prefill placement puts
                 there), its read statistics, rule and policy entries reset (the prompt's prior
                 for lrfu), its sampling row, and its first token sampled
  `release`      a finished, cancelled or preempted request's blocks back to the free masks of
                 both tiers at once (`jaxkv.cache.rows.release`), its slot masked
  `step`         one decode step of every slot (`window_step`: the step that ends a window,
                 the policy's plan included); empty and finished slots are masked

`step` and `window_step` are the decode loop's own step (`jaxkv.Decoder`'s layers, in-step
rule, lookahead, sealing, read statistics, plan and modeled latency, run by a `Decoder` built
over the engine's cache) with per-slot sampling in place of the Decoder's one sampler
(`jaxkv.serve.sampling`). None of them recompiles when requests come and go: a request's
prompt length, slot and sampling parameters are traced values (`compilations` counts).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv import cache as kvc
from jaxkv._pytree import replace
from jaxkv.cache import ops as cache_ops
from jaxkv.cache import rows
from jaxkv.config import PROMPT_QUERIES, CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.decode import follow as fl
from jaxkv.decode.decoder import Decoder
from jaxkv.decode.prompt import prompt_prior, prompt_queries, queries_needed, uses_prompt_prior
from jaxkv.decode.state import initial_state, record_step
from jaxkv.model_api import bind
from jaxkv.placement import statistics as imp
from jaxkv.placement.admission import rule_state
from jaxkv.serve import prefill as pf
from jaxkv.serve.sampling import (
    LENGTH,
    NONFINITE,
    NOT_DONE,
    STOP,
    Row,
    Slots,
    sample,
    sample_slots,
    with_row,
)
from jaxkv.serve.state import EngineState, PrefillBuffer, StepOut, per_block, reset_rows, set_row

NO_LIMIT = 2**31 - 1  # the Decoder's max_new_tokens: the engine counts tokens per slot instead


@dataclasses.dataclass(frozen=True, init=False)
class EngineCore:
    """The compiled functions of an engine (module docstring): frozen, its jitted functions
    hang off it, all state is the explicit `EngineState` and `PrefillBuffer`.

    Args:
      model: the model (`jaxkv.model_api`).
      cache_config: a `CacheConfig` with `paged_host=True`; its batch is the number of slots.
      placement: attention mode, policy, window, migration budget.
      chunk: tokens a prefill chunk takes at most.
      profile: hardware profile of the modeled step latency.
      impl, ema_decay, policy_kwargs: as `jaxkv.Decoder`'s.
      hbm_quota: HBM blocks per layer each request keeps of its prompt at insert (None: the
        free slots, the policy's prefill placement).
    """

    decoder: Decoder
    chunk: int
    hbm_quota: int | None

    def __init__(
        self,
        model,
        cache_config: CacheConfig,
        placement: PlacementConfig,
        *,
        chunk: int,
        profile: HardwareProfile | str,
        impl: str = "auto",
        ema_decay: float = 0.9,
        policy_kwargs: dict | None = None,
        hbm_quota: int | None = None,
    ):
        dec = Decoder(
            model, cache_config, placement, max_new_tokens=NO_LIMIT, profile=profile,
            impl=impl, ema_decay=ema_decay, policy_kwargs=policy_kwargs,
        )  # fmt: skip
        object.__setattr__(self, "decoder", dec)
        object.__setattr__(self, "chunk", chunk)
        object.__setattr__(self, "hbm_quota", hbm_quota)
        jits = dict(
            step=jax.jit(functools.partial(self._step, plan=False), donate_argnums=(1,)),
            window_step=jax.jit(functools.partial(self._step, plan=True), donate_argnums=(1,)),
            chunk_step=jax.jit(self._chunk, donate_argnums=(1,)),
            insert=jax.jit(self._insert, donate_argnums=(1,)),
            release=jax.jit(self._release, donate_argnums=(0,)),
            init=jax.jit(self._init),
        )
        for k, v in jits.items():
            object.__setattr__(self, k, v)

    @property
    def cache_config(self) -> CacheConfig:
        return self.decoder.cache_config

    @property
    def windows(self) -> tuple[int, ...] | None:
        """Each layer's sliding window (0: full attention), or None for a model without: when
        every layer slides, the blocks that pass every window are freed in both tiers after
        each step and insert (`jaxkv.cache.rows.drop_passed`)."""
        mc = self.decoder.model_config
        if getattr(mc, "sliding_window", None) is None:
            return None
        return tuple(int(w) for w in mc.layer_windows())

    def compilations(self) -> dict:
        """Executables compiled so far, per jitted function."""
        names = ("step", "window_step", "chunk_step", "insert", "release", "init")
        return {n: int(getattr(self, n)._cache_size()) for n in names}

    # ---- state ---------------------------------------------------------------------------------

    def _init(self, key) -> EngineState:
        """Every slot empty: a fresh cache, the policy's and rule's initial state, no statistics."""
        dec, c = self.decoder, self.cache_config
        B, L, N = c.batch, c.num_layers, c.batch * c.max_blocks
        cache = kvc.TieredKVCache.create(c)
        prior, steady = self._priors_zero()
        ds = initial_state(
            cache,
            jnp.zeros((B,), jnp.int32),
            jnp.ones((B,), bool),
            key,
            dec.placement.window,
            dec.policy.init(L, N),
            1,  # the per-step metric arrays: one scratch entry (StepOut carries each step's)
            dec.ema_decay,
            jnp.full((B,), -1, jnp.int32),
            prior,
            steady,
            c.hbm_pool_slots,
            dec.lookahead,
            rule_state(dec.policy, L, N),
        )
        return EngineState(decode=ds, slots=Slots.empty(B))

    def _priors_zero(self):
        """(read prior, steady prior) zeros [layers, N] where the policy starts from the
        prompt's prior (`uses_prompt_prior`), else None."""
        dec, c = self.decoder, self.cache_config
        if not uses_prompt_prior(dec.policy, dec.placement):
            return None, None
        z = jnp.zeros((c.num_layers, c.batch * c.max_blocks), jnp.float32)
        return z, (z if int(getattr(dec.policy, "steady_queries", 0)) else None)

    def empty_buffer(self) -> PrefillBuffer:
        """A prompt buffer for one request's chunks."""
        return pf.empty_buffer(self.decoder.model_config, self.cache_config, self.chunk)

    # ---- prefill and insert --------------------------------------------------------------------

    def _chunk(self, params, buf: PrefillBuffer, start, count) -> PrefillBuffer:
        dec = self.decoder
        run = pf.chunk_fn(self.chunk)
        return run(dec.graphdef, params, buf, start, count, dec._layer_windows())

    def _insert(self, params, st: EngineState, buf: PrefillBuffer, row, length, req: Row,
                produced, resume_token):  # fmt: skip
        """The request prefilled in `buf` (`length` tokens) into slot `row`; `produced` tokens
        of it were produced before (0: a new request, whose first token is sampled here from
        the buffer's logits; else a preempted one recomputed, `resume_token` its last token,
        the next input). Returns (state, first token [] int32, reason [] int32)."""
        c = self.cache_config
        ds = st.decode
        k, v = buf.k[:, : c.max_len], buf.v[:, : c.max_len]
        prior, steady = self._prompt_priors(params, buf, k, v, length)
        cap = None if self.hbm_quota is None else jnp.int32(self.hbm_quota)
        cache = rows.insert(ds.cache, row, k, v, length, prior, cap)
        cache = rows.drop_passed(cache, self.windows)

        new = produced == 0
        tok = sample(
            buf.logits[None], req.temperature[None], req.top_k[None], req.top_p[None],
            req.key[None], jnp.zeros((1,), jnp.int32),
        )[0]  # fmt: skip
        first = jnp.where(new, tok, resume_token).astype(jnp.int32)
        bad = new & ~jnp.all(jnp.isfinite(buf.logits))
        count = jnp.where(new, 1, produced).astype(jnp.int32)
        stop = new & jnp.any(first == req.stop)
        reason = jnp.where(
            bad, NONFINITE, jnp.where(stop, STOP, jnp.where(count >= req.max_new, LENGTH, NOT_DONE))
        ).astype(jnp.int32)
        sm = ds.sampling
        sampling = replace(
            sm,
            last=sm.last.at[row].set(first),
            done=sm.done.at[row].set(reason != NOT_DONE),
            bad_step=sm.bad_step.at[row].set(-1),
        )
        stats, rule, pol = self._reset_row(ds, row, prior, steady)
        statistics = replace(
            ds.statistics,
            blocks=stats,
            step_mass=ds.statistics.step_mass.at[:, row].set(0.0),
            ahead=None if ds.statistics.ahead is None else ds.statistics.ahead.at[row].set(False),
        )
        placement = replace(ds.placement, policy=pol, rule=rule)
        ds = replace(ds, cache=cache, sampling=sampling, statistics=statistics, placement=placement)
        slots = with_row(st.slots, row, req, count)
        return EngineState(decode=ds, slots=slots), first, reason

    def _prompt_priors(self, params, buf: PrefillBuffer, k, v, length):
        """The prompt's prior ([layers, max_blocks] read prior, steady prior or None) of a
        policy that starts from it (`jaxkv.decode.prompt`), else (None, None): the prompt's
        last queries recomputed over its KV, their selections counted on a one-row cache."""
        dec, c = self.decoder, self.cache_config
        if not uses_prompt_prior(dec.policy, dec.placement):
            return None, None
        windows = dec._layer_windows()
        n = queries_needed(dec.policy)
        model = bind(dec.graphdef, params)
        lengths = length[None]
        tokens = buf.tokens[None, : c.max_len]
        q = prompt_queries(model, tokens, lengths, k[:, None], v[:, None], windows, n)
        one = dataclasses.replace(
            c, batch=1, hbm_fraction=1.0, hbm_blocks=None, hbm_bytes=None, host_fraction=None,
            host_blocks=None, host_bytes=None, paged_host=False,
        )  # fmt: skip
        # the selection reads this cache's key bounds only (XLA drops its pools)
        tmp = cache_ops._prefill(kvc.TieredKVCache.create(one), k[:, None], v[:, None], lengths)
        prior = prompt_prior(q[:, :, -PROMPT_QUERIES:], tmp, dec.placement, windows)[:, 0]
        steady = None
        if int(getattr(dec.policy, "steady_queries", 0)):
            steady = prompt_prior(q[:, :, -n:], tmp, dec.placement, windows)[:, 0]
        return prior, steady

    def _reset_row(self, ds, row, prior, steady):
        """(statistics, rule state, policy state) with slot `row`'s blocks at their initial
        values: no reads, the policy's and rule's initial entries; the prompt's prior as the
        blocks' read frequency (and steady prior) where the policy starts from it."""
        dec, c = self.decoder, self.cache_config
        L, M = c.num_layers, c.max_blocks
        N = c.batch * M
        stats = ds.statistics.blocks

        def stats_of(n):
            s = imp.init_stats(L, n, decay=dec.ema_decay)
            if stats.steady is not None:
                s = imp.with_steady(s, jnp.zeros((L, n)), stats.room)
            return s

        stats = reset_rows(stats, stats_of(N), per_block(stats_of, N), row, M)
        if prior is not None:
            stats = replace(stats, read_ema=set_row(stats.read_ema, row, prior, M))
        if steady is not None:
            stats = replace(stats, steady=set_row(stats.steady, row, steady, M))
        rule_of = functools.partial(rule_state, dec.policy, L)
        rule = reset_rows(ds.placement.rule, rule_of(N), per_block(rule_of, N), row, M)
        pol_of = functools.partial(dec.policy.init, L)
        pol = reset_rows(ds.placement.policy, pol_of(N), per_block(pol_of, N), row, M)
        return stats, rule, pol

    def _release(self, st: EngineState, row) -> EngineState:
        """Slot `row`'s blocks back to both free pools, the slot masked."""
        ds = st.decode
        cache = rows.release(ds.cache, row)
        sampling = replace(ds.sampling, done=ds.sampling.done.at[row].set(True))
        slots = replace(st.slots, live=st.slots.live.at[row].set(False))
        return EngineState(decode=replace(ds, cache=cache, sampling=sampling), slots=slots)

    # ---- the decode step -----------------------------------------------------------------------

    def _step(self, params, st: EngineState, *, plan: bool):
        """One decode step of every slot that decodes (a live request not finished); with
        `plan`, it also ends the window. Returns (state, `StepOut`)."""
        dec, c = self.decoder, self.cache_config
        L = c.num_layers
        ds = st.decode
        active = dec._active(ds)
        logits, cache, reads, fol, staged0, rstate = dec._run_layers(params, ds, active)
        ds = replace(ds, placement=replace(ds.placement, rule=rstate))
        tokens, slots, reason = sample_slots(st.slots, logits, active)
        sm = ds.sampling
        sampled = replace(
            sm,
            last=jnp.where(tokens >= 0, tokens, sm.last),
            done=sm.done | (reason != NOT_DONE),
            step=sm.step + 1,
        )
        ahead = None
        promoted, demoted = jnp.zeros((L,), jnp.int32), jnp.zeros((L,), jnp.int32)
        if dec.lookahead:
            ahead, fol = fl.look_ahead(dec, params, ds, cache, (reads, fol, staged0), sampled)
        if dec.follows:
            cache, promoted, demoted = fl.apply_follow_moves(cache, fol, logits)
        cache = kvc.advance(cache, active, after_reads=logits)
        cache = rows.drop_passed(cache, self.windows)
        before = ds
        ds, hbm_b, host_b = record_step(c, ds, cache, sampled, reads, promoted, demoted)
        if ahead is not None:
            ds = replace(ds, statistics=replace(ds.statistics, ahead=ahead))
        moved = jnp.zeros((L,), jnp.int32)
        if plan:
            ds, moved = dec._window(ds)
        lat = dec._step_latency(hbm_b, host_b, moved, promoted, demoted)
        out = StepOut(
            tokens=tokens,
            reason=reason,
            active=active,
            lengths=before.cache.lengths,
            hbm_blocks=reads.read_hbm.sum(axis=(1, 2)).astype(jnp.int32),
            host_blocks=reads.read_host.sum(axis=(1, 2)).astype(jnp.int32),
            promoted=promoted,
            demoted=demoted,
            moved=moved,
            latency=lat,
            since_plan=ds.placement.since_plan,
            window=ds.placement.window,
        )
        return EngineState(decode=ds, slots=slots), out
