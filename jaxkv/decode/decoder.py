"""Functional decoding over a TieredKVCache: prefill, decode_step, generate.

`Decoder` is frozen: it holds only static, hashable things (the model's graph, cache geometry,
placement config, policy, sampler, hardware profile) and jitted functions over an explicit
`DecodeState`. It compiles the step twice: `decode_step` (one token per sequence, the state
donated; no plan, so no branch on the data: a GPU conditional syncs the host) and `window_step`,
the step that ends a window: every W steps (W lives in the state, so changing it never
recompiles) the policy plans from the per-block read statistics, between steps and for all
layers at once. `step` and `generate` (a `lax.while_loop` that stops at a step limit, when every
sequence has finished, or when a cache is full) pick one of the two on the device at each step.

The model is an NNX module or plain JAX functions (`jaxkv.FunctionalModel`); what the loop
uses of it is written down and checked in `jaxkv.model_api`. Its layers may run under one
`lax.scan` (`models.llama.Llama.decode_step`): one layer body is traced and compiled, whatever
the depth, and the layer index is traced through the token write, the block selection, the
host read and the attention.

What a plan does depends on the policy. Most (static, lru, anneal, anneal+reuse) return a
target placement that `plan_moves` bounds to a migration budget and the cache migrates to in
bulk. Under a `follow` policy (lrfu, "anneal+reuse+follow") each layer's body runs a vector rule
on the host blocks it reads, promoting from the copies the read fetched, and all layers' moves
are applied in one bulk migration after the layers (`jaxkv.decode.follow`, also lrfu's lookahead).

`DecodeState` (`jaxkv.decode.state`) holds the sampling and placement state, the read
statistics and the metrics; `Decoder.plan_seconds` measures one plan, which `summarize` charges.

The rest of the loop lives beside this module (the `jaxkv.decode` package's docstring); a
plan's observation in `jaxkv.placement.observation`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvc
from jaxkv._pytree import replace
from jaxkv.attention.tiered import resolve_impl, tiered_attention
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.decode import follow as fl
from jaxkv.decode import window
from jaxkv.decode.per_device import PerDevice
from jaxkv.decode.prompt import forward_prompts, queries_needed, start_cache
from jaxkv.decode.sampling import Greedy, eos_ids, is_eos, next_tokens
from jaxkv.decode.setup import (
    abstract_state,
    best_seconds,
    check_decoder_args,
    check_prefilled,
    check_prompts,
    check_state,
    live_policy,
    plan_env,
    split_model,
    state_with_window,
)
from jaxkv.decode.state import (
    DecodeState,
    Prefilled,
    StepReads,
    check_finite,
    copied_demotions,
    initial_state,
    link_migration_bytes,
    record_step,
    step_latency,
)
from jaxkv.model_api import bind, check_model, has_first_query
from jaxkv.placement.admission import rule_budget, rule_state
from jaxkv.placement.charging import loop_free_promotions
from jaxkv.placement.observation import layer_windows, placeable
from jaxkv.placement.policies import looks_ahead, plans

__all__ = ["PLAN_MODES", "Decoder"]


@dataclasses.dataclass(frozen=True, init=False)
class Decoder:
    """Compiled decoding of one model over a TieredKVCache. A frozen dataclass: its fields are
    static, hashable configuration (equal decoders compile the same programs); the jitted
    functions hang off it; all state is the explicit `DecodeState`.

    `step`, `generate` and `score` donate the state they are given: use the one they return
    (the old one's arrays are deleted, and passing it again raises ValueError).

    Args:
      model: a `models.Llama`, any nnx.Module with Llama's `config`, `prefill` and
        `decode_step`, or a `jaxkv.FunctionalModel` (plain JAX functions over a params
        pytree): the interface is `jaxkv.model_api`'s, checked here (TypeError / ValueError
        naming the missing piece).
      cache_config: cache geometry and capacities; its num_layers, kv_heads and head_dim must
        match the model.
      placement: attention mode, window, policy and migration budget. The policy is a preset
        name (with the simulator's modifiers a live decode can honour: "+reuse", "+follow",
        "+aw", "+ec" on "anneal"; `jaxkv.decode.setup.live_policy`) or a policy object
        (`jaxkv.placement.policies.Policy`, online, with `window` = placement.window).
      max_new_tokens: tokens to generate per sequence (the prefill token included).
      sampler: `Greedy()` or `Sampling(...)`.
      profile: a HardwareProfile or a preset name, for the modeled latency.
      eos_id: the stop token(s): an int, a sequence of ints (instruct models list several), or None.
      impl: attention implementation, "auto" | "xla" | "pallas". The Pallas kernel returns no
        per-block log-sum-exp, so under it the attention mass statistics (`step_mass`,
        `mass_ema`) stay zero (`collects_mass`); the read statistics, placement and outputs
        are the same. What needs the mass (a trace, `jaxkv.sim.loop.record`) refuses it.
      ema_decay: decay of the per-block read statistics per step.
      policy_kwargs: knob overrides of an anneal policy (`jaxkv.placement.presets.KNOBS`, e.g.
        {"spread": 1.0}).
      per_device: None on one device; run per device of a mesh, what differs between the
        devices and what they share (`jaxkv.decode.per_device.PerDevice`, the seam
        `jaxkv.decode.sharded.ShardedDecoder` composes through).
    """

    graphdef: Any = dataclasses.field(repr=False)  # the nnx GraphDef, or FunctionalModel
    model_config: Any
    cache_config: CacheConfig
    placement: PlacementConfig
    max_new_tokens: int
    sampler: Any
    profile: HardwareProfile
    eos_id: tuple[int, ...] | None
    impl: str
    ema_decay: float
    weight_bytes_per_layer: float
    env: Any = dataclasses.field(repr=False)  # the CostModel plans are priced in (`plan_env`)
    policy: Any  # the resolved placement policy (`live_policy`)
    per_device: PerDevice | None
    lookahead: bool  # layer 0's next reads join its admission (`jaxkv.decode.follow.look_ahead`)

    def __init__(
        self,
        model: Any,
        cache_config: CacheConfig,
        placement: PlacementConfig = PlacementConfig(),
        *,
        max_new_tokens: int = 128,
        sampler=Greedy(),
        profile: HardwareProfile | str = "gh200",
        eos_id: int | tuple | list | None = None,
        impl: str = "auto",
        ema_decay: float = 0.9,
        policy_kwargs: dict | None = None,
        per_device: PerDevice | None = None,
    ):
        mc = check_model(model)
        check_decoder_args(mc, cache_config, max_new_tokens)
        graphdef, weight_bytes = split_model(model, mc.num_layers)
        profile = HardwareProfile.preset(profile) if isinstance(profile, str) else profile
        values = dict(
            graphdef=graphdef,
            model_config=mc,
            cache_config=cache_config,
            placement=placement,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            profile=profile,
            eos_id=eos_ids(eos_id, mc.vocab_size),
            impl=impl,
            ema_decay=ema_decay,
            weight_bytes_per_layer=weight_bytes,
            env=plan_env(profile, cache_config, weight_bytes),
        )
        values["policy"] = pol = live_policy(placement, values["env"], policy_kwargs or {})
        values["per_device"] = per_device
        values["lookahead"] = looks_ahead(pol) and has_first_query(model)
        siblings = ()
        if per_device is not None:  # one plain decoder per link profile, the first this one's
            if per_device.profiles[0] != profile:
                raise ValueError(
                    f"per_device.profiles[0]={per_device.profiles[0].name!r}: expected the "
                    f"Decoder's own profile {profile.name!r}"
                )
            kw = dict(max_new_tokens=max_new_tokens, sampler=sampler, eos_id=eos_id, impl=impl)
            kw.update(ema_decay=ema_decay, policy_kwargs=policy_kwargs)
            siblings = tuple(
                Decoder(model, cache_config, placement, profile=p, **kw)
                for p in per_device.profiles
            )
        # fields first, then what is derived from them (not compared, not hashed)
        for k, v in dict(values, _memo={}, _siblings=siblings).items():
            object.__setattr__(self, k, v)
        for k, v in self._jitted().items():
            object.__setattr__(self, k, v)

    def _jitted(self) -> dict:
        """The jitted functions, by attribute name.

        The decode step and the step that ends a window are compiled apart, so that neither
        branches on the data (a GPU conditional syncs the host): `decode_step` has no plan
        and no host sync; `window_step` adds the plan (and, but for `follow`, its migration).
        An unpinned_host cache keeps its kind only where a jit's out_shardings name it (jax
        types a traced unpinned_host value as device: jaxkv.cache's module docstring); the
        other kinds keep theirs, and their jits stay free of device-bound shardings."""
        cache_config = self.cache_config
        out = {}
        if cache_config.host_memory_kind == "unpinned_host":
            none = dict(sampling=None, placement=None, statistics=None, metrics=None)
            out = dict(out_shardings=DecodeState(cache=kvc.cache_shardings(cache_config), **none))
        return dict(
            _prefill=jax.jit(self._prefill_impl, **out),
            _model_prefill=jax.jit(functools.partial(self._model_prefill_impl, shared=True)),
            _start=jax.jit(self._start_impl, **out),
            decode_step=jax.jit(
                functools.partial(self._step_impl, plan="never"), donate_argnums=(1,), **out
            ),
            window_step=jax.jit(
                functools.partial(self._step_impl, plan="always"), donate_argnums=(1,), **out
            ),
            _step=jax.jit(self._either_step, donate_argnums=(1,), **out),
            _generate=jax.jit(self._generate_impl, donate_argnums=(1,), **out),
            _plan=jax.jit(self._plan_impl),
            _score=jax.jit(
                self._score_impl,
                donate_argnums=(1,),
                **({"out_shardings": (out["out_shardings"], None)} if out else {}),
            ),
        )

    @property
    def follows(self) -> bool:
        """The policy has an in-step rule (`Policy.rule`) that each step's layers run."""
        return self.policy.rule is not None

    @property
    def collects_mass(self) -> bool:
        """The step records each block's attention mass (the XLA path; not the Pallas kernel,
        which returns no per-block log-sum-exp: the mass statistics stay zero)."""
        return resolve_impl(self.impl, self.cache_config) != "pallas"

    @property
    def prefill_fn(self):
        """The jitted prefill (params, prompts, lengths, key) -> DecodeState, unchecked."""
        return self._prefill

    def compilations(self) -> int:
        """Executables compiled so far by this decoder's jitted functions (all of them)."""
        fns = (self._prefill, self.decode_step, self.window_step, self._step, self._generate)
        return sum(int(f._cache_size()) for f in fns)

    # ---- public API ---------------------------------------------------------------------------

    def prefill(self, params, prompts, lengths=None, *, key=None, prefilled=None) -> DecodeState:
        """Runs the prompts through the model, fills the cache and samples the first token.

        Args:
          params: the model's state (`nnx.split(model)[1]`; a FunctionalModel's params pytree).
          prompts: [batch, T] int32 token ids (right-padded when lengths differ).
          lengths: [batch] prompt lengths (default: all T).
          key: PRNG key for sampling (default: key 0).
          prefilled: `model_prefill(params, prompts, lengths)` of any Decoder of this model:
            starts from that forward pass instead of running the model again (several
            decoders, e.g. one per policy, from one prompt).
        """
        vocab_size = self.model_config.vocab_size
        prompts, lengths = check_prompts(prompts, lengths, self.cache_config, vocab_size)
        key = jax.random.key(0) if key is None else key
        prompts, lengths = prompts.astype(jnp.int32), jnp.asarray(lengths, jnp.int32)
        if prefilled is None:
            return self._prefill(params, prompts, lengths, key)
        check_prefilled(prefilled, prompts, lengths, self.model_config, queries_needed(self.policy))
        return self._start(prefilled, key)

    def model_prefill(self, params, prompts, lengths=None) -> Prefilled:
        """The model's forward pass over the prompts (`prefill`'s expensive part) as a
        `Prefilled` (logits, K, V, the last queries: 128, as lrfu needs), for any Decoder's
        `prefill(prefilled=...)` (but one with more `steady_queries`)."""
        vocab_size = self.model_config.vocab_size
        prompts, lengths = check_prompts(prompts, lengths, self.cache_config, vocab_size)
        return self._model_prefill(params, prompts.astype(jnp.int32), jnp.asarray(lengths, "int32"))

    def step(self, params, state: DecodeState) -> DecodeState:
        """One decode step for every unfinished sequence (the state is donated): `window_step`
        when the step ends a window, else `decode_step`, chosen on the device.

        Raises ValueError once the state holds max_new_tokens tokens, NonFiniteLogitsError
        when the state's logits were not finite (`generate`) (it reads the state's step counter,
        which waits for the previous step; `decode_step` / `window_step` are
        the unchecked jits, where a step past the end leaves every sequence as it is)."""
        self._check_state(state, "Decoder.step")
        check_finite(state)  # the previous step's logits (it waits for that step anyway)
        done = int(state.sampling.step)
        if done >= self.max_new_tokens - 1:
            raise ValueError(
                f"the state has decoded max_new_tokens={self.max_new_tokens} tokens (step "
                f"{done}): no room for another; build the Decoder with a larger max_new_tokens"
            )
        return self._step(params, state)

    def generate(self, params, state: DecodeState, until: int | None = None) -> DecodeState:
        """Decodes until `until` steps (default: max_new_tokens - 1), EOS everywhere, or a full
        cache (the state is donated: use the one returned). `until` is a traced value: calling
        in chunks does not recompile.

        Raises NonFiniteLogitsError (a FloatingPointError; `.state` holds the state) naming the
        first step and sequence whose logits held a NaN or inf, e.g. from NaN weights: read
        once after the loop (the loop itself never syncs with the host), which stops such a
        sequence at that step."""
        self._check_state(state, "Decoder.generate")
        until = self.max_new_tokens - 1 if until is None else min(until, self.max_new_tokens - 1)
        state = self._generate(params, state, jnp.int32(until))
        check_finite(state)
        return state

    def score(self, params, state: DecodeState, tokens) -> tuple[DecodeState, jax.Array]:
        """Teacher forcing: decodes with `tokens` [batch, n] fed one a step in place of the
        sampled ones (the state is donated), exactly as `step` does otherwise (plans,
        migrations, metrics). Returns (state, logits [n, batch, vocab] f32), the logits after
        each fed token: with prompts x[:P] prefilled and tokens x[P:P+n], logits[i] predicts
        x[P+i+1] (bench/fp8_quality.py compares them across cache settings)."""
        self._check_state(state, "Decoder.score")
        tokens = jnp.asarray(tokens, jnp.int32)
        B, n = self.cache_config.batch, int(state.sampling.step)
        if tokens.ndim != 2 or tokens.shape[0] != B:
            raise ValueError(f"score: tokens has shape {tokens.shape}, expected ({B}, steps)")
        if n + tokens.shape[1] > self.max_new_tokens - 1:
            raise ValueError(
                f"score: {tokens.shape[1]} steps after step {n} exceed max_new_tokens="
                f"{self.max_new_tokens} (one token is the prefill's): build a larger Decoder"
            )
        return self._score(params, state, tokens)

    def with_window(self, state: DecodeState, window: int) -> DecodeState:
        """Returns the state with a new window W (no recompilation)."""
        self._check_state(state, "Decoder.with_window")
        return state_with_window(state, window)

    def plan_seconds(self, params, state: DecodeState, repeats: int = 3) -> float:
        """Wall seconds of one plan (observe -> policy.plan, all layers) on the present device,
        compiled and warmed first, best of `repeats`; 0.0 for a policy whose plan keeps the
        placement as it is (`plans` False: static, lrfu). `state` is not consumed."""
        del params
        self._check_state(state, "Decoder.plan_seconds")
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
        return best_seconds(self._plan, state, repeats) if plans(self.policy) else 0.0

    def _check_state(self, state, where: str) -> None:
        """ValueError unless `state` is a live state of this Decoder (`check_state`)."""
        c, vocab, n = self.cache_config, self.model_config.vocab_size, queries_needed(self.policy)
        if "state" not in self._memo:  # the shapes of this Decoder's states, traced once
            self._memo["state"] = abstract_state(self._start_impl, c, vocab, n)
        check_state(state, self._memo["state"], c, where)

    # ---- implementation -----------------------------------------------------------------------

    def _model_prefill_impl(self, params, prompts, lengths, shared=False) -> Prefilled:
        model = bind(self.graphdef, params)
        n = queries_needed(self.policy, shared)  # 32 or steady_queries; shared: >= 128
        return forward_prompts(model, prompts, lengths, self._layer_windows(), n)

    def _prefill_impl(self, params, prompts, lengths, key) -> DecodeState:
        return self._start_impl(self._model_prefill_impl(params, prompts, lengths), key)

    def _start_impl(self, pre: Prefilled, key) -> DecodeState:
        c = self.cache_config
        cache, *priors = start_cache(c, pre, self.placement, self.policy, self._layer_windows())
        key, sub = jax.random.split(key)
        first = self.sampler(pre.last_logits, sub)
        N = c.batch * c.max_blocks
        pol = self.policy.init(c.num_layers, N)
        rule = rule_state(self.policy, c.num_layers, N)
        done, w, n = is_eos(first, self.eos_id), self.placement.window, self.max_new_tokens
        bad = jnp.where(jnp.all(jnp.isfinite(pre.last_logits), axis=-1), -1, 0).astype(jnp.int32)
        args = (w, pol, n, self.ema_decay, bad, *priors, c.hbm_pool_slots, self.lookahead, rule)
        return initial_state(cache, first, done, key, *args)

    def _active(self, state: DecodeState, sampling=None, lengths=None):
        """[batch] bool: the sequences this step decodes (not done, room in the cache and in
        the token buffer); of the next step, given its `sampling` state and `lengths`."""
        sm, n = sampling or state.sampling, state.cache.lengths if lengths is None else lengths
        return ~sm.done & (n < self.cache_config.max_len) & (sm.step < self.max_new_tokens - 1)

    def _either_step(self, params, state: DecodeState, with_logits: bool = False):
        """`window_step` when this step ends the window, else `decode_step` (one branch)."""
        return jax.lax.cond(
            _window_due(state),
            lambda s: self._step_impl(params, s, plan="always", with_logits=with_logits),
            lambda s: self._step_impl(params, s, plan="never", with_logits=with_logits),
            state,
        )

    def device_step(self, params, state: DecodeState) -> DecodeState:
        """One decode step that ends the window when it is due, decided on the device with a
        `lax.cond` after every collective of the step: the unjitted body a caller runs inside
        its own jit or shard_map (`jaxkv.decode.sharded`), unchecked and not donated."""
        return self._step_impl(params, state, plan="when_due")

    def device_prefill(self, params, prompts, lengths, key) -> DecodeState:
        """`prefill`'s unjitted, unchecked body, for a caller's own jit or shard_map."""
        return self._prefill_impl(params, prompts, lengths, key)

    def _step_impl(self, params, state: DecodeState, *, plan: str, with_logits: bool = False):
        """One decode step; `plan` (`PLAN_MODES`): "never", or "always" it also ends the
        window (the policy plans, between steps and for all layers, and unless it `follows`
        migrates), or "when_due": it does so when the window is due, decided on the device
        (`device_step`).

        The steps: the layers (token write, read, attention and, for `follow`, each layer's
        moves), sampling, the lookahead, the follow migration, the cache's advance, the step's
        statistics and metrics, the plan, and the step's modeled latency."""
        c = self.cache_config
        L = c.num_layers
        active = self._active(state)
        due = _window_due(state)
        logits, cache, reads, fol, staged0, rstate = self._run_layers(params, state, active)
        state = replace(state, placement=replace(state.placement, rule=rstate))
        sampled = next_tokens(
            self.sampler, self.eos_id, self.max_new_tokens, state.sampling, logits, active
        )
        ahead, promoted, demoted = None, jnp.zeros((L,), jnp.int32), jnp.zeros((L,), jnp.int32)
        if self.lookahead:  # layer 0's next reads, now that the next tokens are known
            ahead, fol = fl.look_ahead(self, params, state, cache, (reads, fol, staged0), sampled)
        if self.follows:  # the layers' follow moves, all at once, from the blocks they fetched
            cache, promoted, demoted = fl.apply_follow_moves(cache, fol, logits)
        cache = kvc.advance(cache, active, after_reads=logits)
        step = state.sampling.step
        state, hbm_b, host_b = record_step(c, state, cache, sampled, reads, promoted, demoted)
        if ahead is not None:
            state = replace(state, statistics=replace(state.statistics, ahead=ahead))
        if self.per_device is not None:  # pooled over the mesh axis, outside any branch
            state = self.per_device.pool_statistics(state)
        moved = jnp.zeros((L,), jnp.int32)
        if plan not in PLAN_MODES:
            raise ValueError(f"plan={plan!r}: expected one of {PLAN_MODES}")
        if plan == "when_due":  # decided on the device, after every collective
            state, moved = jax.lax.cond(due, self._window, lambda s: (s, moved), state)
        elif plan == "always":
            state, moved = self._window(state)
        lat = self._step_latency(hbm_b, host_b, moved, promoted, demoted)
        m = state.metrics
        n_moved = (moved + promoted + copied_demotions(c, demoted)).sum().astype(jnp.int32)
        m = replace(m, latency=m.latency.at[step].set(lat))
        state = replace(state, metrics=replace(m, moved_trace=m.moved_trace.at[step].set(n_moved)))
        return (state, logits.astype(jnp.float32)) if with_logits else state

    def _score_impl(self, params, state: DecodeState, tokens):
        def body(s: DecodeState, tok):
            s = replace(s, sampling=replace(s.sampling, last=tok))
            return self._either_step(params, s, with_logits=True)

        return jax.lax.scan(body, state, tokens.T)

    def _run_layers(self, params, state: DecodeState, active):
        """The model's layers for one token per sequence: each writes the token, reads its
        blocks from both tiers and attends (and, with an in-step rule, gathers its moves).

        Returns:
          (logits, cache, the layers' `StepReads`, their `FollowMoves` (None without a rule),
           layer 0's staged host blocks (`jaxkv.decode.follow.keep_first`; None without the
           lookahead), the rule's state after every layer)."""
        c, p = self.cache_config, self.placement
        model = bind(self.graphdef, params)
        attn_len = state.cache.lengths + active.astype(jnp.int32)
        scale = 1.0 / float(np.sqrt(self.model_config.head_dim))
        L, B, M = c.num_layers, c.batch, c.max_blocks
        follow, rule = self.follows, self.policy.rule
        pstate, stats, step = state.placement.policy, state.statistics.blocks, state.sampling.step
        dt = c.jnp_dtype
        windows = self._layer_windows()

        def attend(layer, q, k_new, v_new, carry):
            cache, reads, fol, staged0, rstate = carry
            cache = kvc.write_token(cache, layer, k_new.astype(dt), v_new.astype(dt), active)
            out, st, staged = tiered_attention(
                q,
                cache,
                layer,
                attn_len,
                p,
                scale=scale,
                impl=self.impl,
                return_staging=True,
                window=None if windows is None else windows[layer],
            )
            reads = reads.with_layer(layer, st)
            if follow:
                fol, rstate = fl.follow_layer(
                    cache, layer, st, staged, pstate, rstate, fol, stats, step,
                    num_blocks=B * M, rule=rule, slack_of=self._slack_of,
                )  # fmt: skip
            if staged0 is not None:
                staged0 = fl.keep_first(staged0, layer, staged)
            return out.astype(q.dtype), (cache, reads, fol, staged0, rstate)

        fol0 = fl.empty_follow_moves(c, rule_budget(self.policy, p.max_moves)) if follow else None
        first = fl.first_staging(state.cache, p) if self.lookahead else None
        # the rule's state rides the carry (() for a rule that keeps none: nothing carried)
        carry = (state.cache, StepReads.zeros(L, B, M), fol0, first, state.placement.rule)
        with jax.named_scope("model"):
            tokens, positions = state.sampling.last, state.cache.lengths
            logits, carry = model.decode_step(tokens, positions, attend, carry)
        return logits, *carry

    def _step_latency(self, hbm_b, host_b, moved, promoted, demoted):
        """[] f32: the step's modeled seconds (`jaxkv.decode.state.step_latency`); per device
        (`per_device`), under the device's own link profile, with the link bytes of the
        devices that share it."""
        pd = self.per_device
        if pd is None:
            return self._link_latency(hbm_b, host_b, moved, promoted, demoted)
        link_mig = None
        if pd.shared_link is not None:  # the group's link bytes, summed before any branch
            link_mig = link_migration_bytes(self.cache_config, moved, demoted)
            host_b, link_mig = jax.lax.psum((host_b, link_mig), pd.shared_link)
        fns = [functools.partial(x._link_latency, link_mig=link_mig) for x in self._siblings]
        args = (hbm_b, host_b, moved, promoted, demoted)
        return jax.lax.switch(pd.choice(), fns, *args) if len(fns) > 1 else fns[0](*args)

    def _link_latency(self, hbm_b, host_b, moved, promoted, demoted, link_mig=None):
        """[] f32: the step's modeled seconds under this decoder's profile; `link_mig`: the
        link's migration bytes [layers] when others share it."""
        return step_latency(
            self.cache_config,
            self.profile,
            self.weight_bytes_per_layer,
            hbm_b,
            host_b,
            moved,
            promoted,
            demoted,
            link_mig,
        )

    def _slack_of(self, hbm_b, host_b):
        """[rows] int32: the promotions a layer's step hides under its link time, from its
        reads' bytes (`jaxkv.placement.charging.loop_free_promotions`, the simulators' own;
        under a sharded decode with per-device links, this decoder's profile)."""
        return loop_free_promotions(
            self.cache_config, self.profile, self.weight_bytes_per_layer, hbm_b, host_b
        )

    def _layer_windows(self):
        """[layers] int32 sliding window of each layer (0: full attention), None without."""
        return layer_windows(self.model_config)

    def _placeable(self, cache):
        """[layers, N] bool: the sealed blocks a later step can read (`placeable`)."""
        return placeable(cache, self.cache_config, self.model_config)

    def _plan_impl(self, state: DecodeState):
        """observe -> plan, all layers: (the policy's new state, target [layers, N])."""
        return window.plan(self, state)

    def _window(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
        """The window boundary: `_plain_window`, per device (`per_device`) the one of the
        device's own link profile."""
        if self.per_device is None:
            return self._plain_window(state)
        windows = [x._plain_window for x in self._siblings]
        return jax.lax.switch(self.per_device.choice(), windows, state)

    def _plain_window(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
        """The window boundary under this decoder's profile (`jaxkv.decode.window`)."""
        return window.end_window(self, state)

    def _generate_impl(self, params, state: DecodeState, until) -> DecodeState:
        c = self.cache_config

        def cond(s: DecodeState):
            full = jnp.any(~s.sampling.done & (s.cache.lengths >= c.max_len))
            return (s.sampling.step < until) & ~jnp.all(s.sampling.done) & ~full

        return jax.lax.while_loop(cond, lambda s: self._either_step(params, s), state)


PLAN_MODES = ("never", "always", "when_due")  # a step's plan: `_step_impl`
_window_due = window.window_due
