"""Functional decoding over a TieredKVCache: prefill, decode_step, generate.

`Decoder` holds everything static (the model's graph, cache geometry, placement config, policy,
sampler, hardware profile) and compiles the step twice: `decode_step` (one token per sequence,
the state donated; no plan, no migration, so no branch on the data: a GPU conditional syncs the
host) and `window_step`, the step that ends a window: every W steps (W lives in the state, so
changing it never recompiles) the policy plans a target placement from the per-block read
statistics, `plan_moves` bounds it to a migration budget, and the cache migrates in bulk.
`step` and `generate` (a `lax.while_loop` that stops at a step limit, when every sequence has
finished, or when a cache is full) pick one of the two on the device at each step. A policy
with `now` (e.g. "anneal+reuse+now") plans inside the window step instead: for each layer,
after the Quest selection of the blocks it is about to read and before it reads them, so it can
promote a block for the very step that reads it (the simulator's `+now`). DecodeState
carries the metrics: per-step bytes read from each tier, the modeled step latency under a
HardwareProfile (PAPER.md's max of the two tiers), blocks migrated, HBM hit rate.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import cache as kvc
from jaxkv import importance as imp
from jaxkv._pytree import pytree_dataclass, replace
from jaxkv.attention import resolve_impl, select_blocks, tiered_attention
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.cost import layer_step_time
from jaxkv.policies import (
    NOW_WINDOW,
    POLICIES,
    Observation,
    adapt_window,
    modifier_kwargs,
    split_name,
)

# ---- sampling ---------------------------------------------------------------------------------


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
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k!r}")
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


# ---- state ------------------------------------------------------------------------------------


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


@pytree_dataclass
class DecodeState:
    cache: kvc.TieredKVCache
    tokens: jax.Array  # [batch, max_new_tokens] int32; column 0 is the token sampled at prefill
    last: jax.Array  # [batch] int32: the next input token
    done: jax.Array  # [batch] bool: finished (EOS)
    step: jax.Array  # [] int32: decode steps taken
    key: jax.Array  # PRNG key
    window: jax.Array  # [] int32: W, steps between plans
    since_plan: jax.Array  # [] int32
    win_hbm: jax.Array  # [] f32: HBM block reads in the current window
    win_total: jax.Array  # [] f32: block reads in the current window
    prev_hit: jax.Array  # [] f32: HBM hit rate of the previous window
    policy_state: Any
    stats: imp.Stats  # per-block statistics, [layers, batch * max_blocks]
    step_mass: jax.Array  # [layers, batch, max_blocks] f32: last step's attention mass (0 unread)
    metrics: Metrics

    @property
    def num_tokens(self) -> jax.Array:
        """[] int32: tokens generated per sequence so far (the prefill token included)."""
        return self.step + 1


def model_weight_bytes(params) -> float:
    """Bytes of all arrays in a parameter pytree."""
    return float(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


class Decoder:
    """Compiled decoding of one model over a TieredKVCache.

    Args:
      model: a `models.Llama` (or any nnx.Module with `prefill` and `decode_step` as Llama's).
      cache_config: cache geometry and capacities; its num_layers, kv_heads and head_dim must
        match the model.
      placement: attention mode, window, policy name and migration budget. Names take the
        simulator's modifiers a live decode can honour (`jaxkv.policies.split_name`): "+reuse",
        "+now", "+ec" on "anneal". With "+now" every `window` steps each layer is planned inside
        the step, between its block selection and its read, over a NOW_WINDOW-step lookahead;
        every migration, in the step or at a window's end, loads both sides of its step (a
        block crosses the link once and is written to or read from HBM once), as in the
        simulator and PAPER.md's cost model.
      max_new_tokens: tokens to generate per sequence (the prefill token included).
      sampler: `Greedy()` or `Sampling(...)`.
      profile: a HardwareProfile or a preset name, for the modeled latency.
      eos_id: token id that finishes a sequence, or None.
      impl: attention implementation, "auto" | "xla" | "pallas".
      ema_decay: decay of the per-block read statistics per step.
      policy_kwargs: overrides of the policy's fields (e.g. {"now": True, "spread": 1.0}).
    """

    def __init__(
        self,
        model: nnx.Module,
        cache_config: CacheConfig,
        placement: PlacementConfig = PlacementConfig(),
        *,
        max_new_tokens: int = 128,
        sampler=Greedy(),
        profile: HardwareProfile | str = "gh200",
        eos_id: int | None = None,
        impl: str = "auto",
        ema_decay: float = 0.9,
        policy_kwargs: dict | None = None,
    ):
        mc = model.config
        geometry = (mc.num_layers, mc.num_kv_heads, mc.head_dim)
        have = (cache_config.num_layers, cache_config.kv_heads, cache_config.head_dim)
        if geometry != have:
            raise ValueError(
                f"cache_config (num_layers, kv_heads, head_dim)={have} does not match the "
                f"model's {geometry}"
            )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self.graphdef, params = nnx.split(model)
        self.model_config = mc
        self.cache_config = cache_config
        self.placement = placement
        self.max_new_tokens = max_new_tokens
        self.sampler = sampler
        self.profile = HardwareProfile.preset(profile) if isinstance(profile, str) else profile
        self.eos_id = eos_id
        self.impl = impl
        self.ema_decay = ema_decay
        self.weight_bytes_per_layer = model_weight_bytes(params) / mc.num_layers
        self.policy = self._make_policy(policy_kwargs or {})
        # `now` policies plan each layer inside the step, between its block selection and read
        self.plans_in_step = bool(getattr(self.policy, "now", False))
        self._prefill = jax.jit(self._prefill_impl)
        # The decode step and the step that ends a window are compiled apart, so that neither
        # branches on the data (a GPU conditional syncs the host): `decode_step` has no plan,
        # no migration and no host sync; `window_step` adds the plan and its migrations.
        self.decode_step = jax.jit(
            functools.partial(self._step_impl, plan=False), donate_argnums=(1,)
        )
        self.window_step = jax.jit(
            functools.partial(self._step_impl, plan=True), donate_argnums=(1,)
        )
        self._step = jax.jit(self._either_step, donate_argnums=(1,))
        self._generate = jax.jit(self._generate_impl, donate_argnums=(1,))

    def _make_policy(self, overrides: dict):
        """Builds the placement policy, filling in what it models from this decoder's geometry
        (hardware profile, block bytes, weight bytes, window, migration budget).

        Names take the simulator's modifiers (`jaxkv.policies.split_name`) where a live decode
        can honour them: "anneal+reuse", "anneal+now", "anneal+reuse+now", "+ec". A policy with
        `now` plans inside the step (see the class docstring); its lookahead is NOW_WINDOW steps
        unless policy_kwargs sets `window`, and it plans every `placement.window` steps."""
        c, p = self.cache_config, self.placement
        base, mods = split_name(p.policy)
        if "aw" in mods:
            raise ValueError(
                f"policy {p.policy!r}: +aw adapts the simulator's window; in the decode loop use "
                "PlacementConfig(adaptive_window=True)"
            )
        cls = POLICIES[base]
        known = (
            {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        )
        auto = {
            "profile": self.profile,
            "block_bytes": float(c.block_bytes),
            "fixed_bytes": self.weight_bytes_per_layer,
            "window": p.window,
            "budget": p.max_moves,
            "block_size": c.block_size,
            # the cache is exclusive: a demotion copies the block over the link
            "demote_cost": 1.0,
        }
        kwargs = {k: v for k, v in auto.items() if k in known}
        if mods:
            kwargs.update(name=p.policy, **modifier_kwargs(mods))
        kwargs.update(overrides)
        if kwargs.get("now", False):
            # the lookahead of a plan that knows its step; it re-plans every placement.window
            kwargs["window"] = overrides.get("window", NOW_WINDOW)
            kwargs["interval"] = overrides.get("interval", p.window)
        policy = cls(**kwargs)
        if getattr(policy, "needs_forecast", False) and not getattr(policy, "now", False):
            raise ValueError(
                f"policy {p.policy!r} plans from perfect knowledge of future reads, which a live "
                "decode does not have; use it in `jaxkv simulate`, or an online policy here "
                "(e.g. 'lru', 'anneal' or 'anneal+reuse+now')"
            )
        return policy

    # ---- public API ---------------------------------------------------------------------------

    def prefill(self, params, prompts, lengths=None, *, key=None) -> DecodeState:
        """Runs the prompts through the model, fills the cache and samples the first token.

        Args:
          params: the model's state (`nnx.split(model)[1]`).
          prompts: [batch, T] int32 token ids (right-padded when lengths differ).
          lengths: [batch] prompt lengths (default: all T).
          key: PRNG key for sampling (default: key 0).
        """
        c = self.cache_config
        prompts = jnp.asarray(prompts)
        if prompts.ndim != 2 or prompts.shape[0] != c.batch:
            raise ValueError(
                f"prompts has shape {tuple(prompts.shape)}, expected (batch={c.batch}, T)"
            )
        if not jnp.issubdtype(prompts.dtype, jnp.integer):
            raise ValueError(f"prompts has dtype {prompts.dtype}, expected an integer dtype")
        T = prompts.shape[1]
        if T > c.max_len:
            raise ValueError(
                f"prompt length {T} exceeds the cache's max_len={c.max_len}: the cache cannot "
                "hold the prompt"
            )
        lengths = np.full((c.batch,), T) if lengths is None else np.asarray(lengths)
        if lengths.shape != (c.batch,) or (lengths < 1).any() or (lengths > T).any():
            raise ValueError(f"lengths={lengths.tolist()} must be {c.batch} values in [1, {T}]")
        key = jax.random.key(0) if key is None else key
        return self._prefill(
            params, prompts.astype(jnp.int32), jnp.asarray(lengths, jnp.int32), key
        )

    def step(self, params, state: DecodeState) -> DecodeState:
        """One decode step for every unfinished sequence (the state is donated): `window_step`
        when the step ends a window, else `decode_step`, chosen on the device."""
        return self._step(params, state)

    def generate(self, params, state: DecodeState, until: int | None = None) -> DecodeState:
        """Decodes until `until` steps (default: max_new_tokens - 1), EOS everywhere, or a full
        cache. `until` is a traced value: calling in chunks does not recompile."""
        until = self.max_new_tokens - 1 if until is None else min(until, self.max_new_tokens - 1)
        return self._generate(params, state, jnp.int32(until))

    def with_window(self, state: DecodeState, window: int) -> DecodeState:
        """Returns the state with a new window W (no recompilation)."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        # same placement as the old value: an uncommitted scalar would change the jit cache key
        return replace(state, window=jax.device_put(jnp.int32(window), state.window.sharding))

    # ---- implementation -----------------------------------------------------------------------

    def _prefill_impl(self, params, prompts, lengths, key) -> DecodeState:
        c = self.cache_config
        model = nnx.merge(self.graphdef, params)
        logits, k, v = model.prefill(prompts)
        cache = kvc._prefill(
            kvc.TieredKVCache.create(c), k.astype(c.jnp_dtype), v.astype(c.jnp_dtype), lengths
        )
        key, sub = jax.random.split(key)
        last_logits = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        first = self.sampler(last_logits, sub)
        L, B, M = c.num_layers, c.batch, c.max_blocks
        n = self.max_new_tokens
        zeros_f = jnp.zeros((n,), jnp.float32)
        done = (first == self.eos_id) if self.eos_id is not None else jnp.zeros((B,), bool)
        return DecodeState(
            cache=cache,
            tokens=jnp.zeros((B, n), jnp.int32).at[:, 0].set(first),
            last=first,
            done=done,
            step=jnp.int32(0),
            key=key,
            window=jnp.int32(self.placement.window),
            since_plan=jnp.int32(0),
            win_hbm=jnp.float32(0),
            win_total=jnp.float32(0),
            prev_hit=jnp.float32(0),
            policy_state=self.policy.init(L, B * M),
            stats=imp.init_stats(L, B * M, decay=self.ema_decay),
            step_mass=jnp.zeros((L, B, M), jnp.float32),
            metrics=Metrics(
                hbm_bytes=zeros_f,
                host_bytes=zeros_f,
                latency=zeros_f,
                migrated_blocks=jnp.int32(0),
                hbm_reads=jnp.float32(0),
                total_reads=jnp.float32(0),
                windows=jnp.int32(0),
                window_trace=jnp.zeros((n,), jnp.int32),
            ),
        )

    def _active(self, state: DecodeState):
        c = self.cache_config
        return ~state.done & (state.cache.lengths < c.max_len)

    def _either_step(self, params, state: DecodeState) -> DecodeState:
        """`window_step` when this step ends the window, else `decode_step` (one branch)."""
        return jax.lax.cond(
            state.since_plan + 1 >= state.window,
            lambda s: self._step_impl(params, s, plan=True),
            lambda s: self._step_impl(params, s, plan=False),
            state,
        )

    def _step_impl(self, params, state: DecodeState, *, plan: bool) -> DecodeState:
        """One decode step; with `plan` (a python bool) it also ends the window: the policy
        plans (per layer inside the step for a `now` policy, else after it) and migrates."""
        c, p = self.cache_config, self.placement
        model = nnx.merge(self.graphdef, params)
        active = self._active(state)
        attn_len = state.cache.lengths + active.astype(jnp.int32)
        scale = 1.0 / float(np.sqrt(self.model_config.head_dim))

        L, N = c.num_layers, c.batch * c.max_blocks
        in_step = self.plans_in_step

        def attend(layer, q, k_new, v_new, carry):
            cache, layer_stats, pstate, migrated = carry
            dt = c.jnp_dtype
            cache = kvc.write_token(cache, layer, k_new.astype(dt), v_new.astype(dt), active)
            selected = None
            if in_step and plan:  # plan this layer knowing what it is about to read, then read
                selected = select_blocks(q, cache, layer, attn_len, p)
                # q depends on every earlier layer's reads: the host writes follow them
                cache, pstate, moved = self._plan_layer(
                    cache, pstate, layer, selected, state.stats, state.step, q
                )
                migrated = migrated.at[layer].set(moved)
            out, st = tiered_attention(
                q, cache, layer, attn_len, p, scale=scale, impl=self.impl, selected=selected
            )
            return out.astype(q.dtype), (cache, layer_stats + (st,), pstate, migrated)

        with jax.named_scope("model"):
            carry = (state.cache, (), state.policy_state, jnp.zeros((L, 2), jnp.int32))
            logits, (cache, layer_stats, policy_state, migrated) = model.decode_step(
                state.last, state.cache.lengths, attend, carry
            )
        cache = kvc.advance(cache, active, after_reads=logits)
        key, sub = jax.random.split(state.key)
        nxt = self.sampler(logits, sub)
        nxt = jnp.where(active, nxt, state.last)
        step = state.step
        col = jnp.minimum(step + 1, self.max_new_tokens - 1)
        tokens = state.tokens.at[:, col].set(jnp.where(active, nxt, state.tokens[:, col]))
        done = state.done | (active & (nxt == self.eos_id) if self.eos_id is not None else False)

        # statistics and metrics of this step
        read_hbm = jnp.stack([s.read_hbm for s in layer_stats])  # [L, B, M]
        read_host = jnp.stack([s.read_host for s in layer_stats])
        mass = jnp.stack([s.mass for s in layer_stats])
        read = read_hbm | read_host
        stats = state.stats
        if in_step and plan:  # the plan saw the reads since the last plan: count afresh
            stats = replace(stats, window_reads=jnp.zeros_like(stats.window_reads))
        stats = imp.update_stats(
            stats,
            read.reshape(L, N),
            mass.reshape(L, N),
            step,
            state.cache.sealed.reshape(L, N),
        )
        bb = float(c.block_bytes)
        hbm_b = read_hbm.sum(axis=(1, 2)) * bb  # [L]
        host_b = read_host.sum(axis=(1, 2)) * bb
        write_b = float(c.batch * c.block_bytes // c.block_size)
        n_hbm, n_all = read_hbm.sum().astype(jnp.float32), read.sum().astype(jnp.float32)
        m = state.metrics
        metrics = replace(
            m,
            hbm_bytes=m.hbm_bytes.at[step].set(hbm_b.sum()),
            host_bytes=m.host_bytes.at[step].set(host_b.sum()),
            migrated_blocks=m.migrated_blocks + migrated.sum(),
            hbm_reads=m.hbm_reads + n_hbm,
            total_reads=m.total_reads + n_all,
            window_trace=m.window_trace.at[step].set(state.window),
        )
        state = replace(
            state,
            cache=cache,
            tokens=tokens,
            last=nxt,
            done=done,
            step=step + 1,
            key=key,
            since_plan=state.since_plan + 1,
            win_hbm=state.win_hbm + n_hbm,
            win_total=state.win_total + n_all,
            stats=stats,
            step_mass=mass,
            policy_state=policy_state,
            metrics=metrics,
        )
        if plan:
            state, moved = self._window(state)
        else:
            moved = jnp.zeros((L,), jnp.int32)
        # migrations load both sides of the step they are made in, as in the simulator and
        # PAPER.md: each block crosses the link once and is written to or read from HBM once
        mig_b = (migrated.sum(axis=1) + moved).astype(jnp.float32) * bb  # [L]
        lat = layer_step_time(
            hbm_b,
            host_b,
            profile=self.profile,
            weight_bytes=self.weight_bytes_per_layer,
            hbm_write_bytes=write_b,
            hbm_migration_bytes=mig_b,
            link_migration_bytes=mig_b,
        ).sum()
        m = state.metrics
        return replace(state, metrics=replace(m, latency=m.latency.at[step].set(lat)))

    def _observation(self, cache, stats: imp.Stats, step, rows=None, forecast=None):
        """What the policy sees: all layers, or the layer slice `rows` (a python slice)."""
        c = self.cache_config
        L, N = c.num_layers, c.batch * c.max_blocks
        rows = slice(None) if rows is None else rows

        def cut(x):
            return None if x is None else x[rows]

        return Observation(
            in_hbm=cache.in_hbm.reshape(L, N)[rows],
            valid=cache.sealed.reshape(L, N)[rows],
            last_read=stats.last_read[rows],
            read_ema=stats.read_ema[rows],
            mass_ema=stats.mass_ema[rows],
            step=step,
            forecast=forecast,
            window_reads=stats.window_reads[rows],
            since_seen=cut(stats.since_seen),
            since_read=cut(stats.since_read),
            streak=cut(stats.streak),
            capacity=c.hbm_pool_slots,
        )

    def _plan_layer(self, cache, pstate, layer: int, selected, stats, step, after_reads=None):
        """The in-step plan of one layer (`plans_in_step`): the blocks this layer reads at this
        step (`selected` [batch, max_blocks], the Quest selection `tiered_attention` then reads)
        are the forecast's row 0; the policy plans this layer alone, and the cache migrates it
        before the read.

        Returns:
          (cache, policy state, [2] int32 promotions and demotions made)."""
        c, p = self.cache_config, self.placement
        L, N = c.num_layers, c.batch * c.max_blocks
        rows = slice(layer, layer + 1)
        forecast = selected.reshape(1, 1, N).astype(jnp.float32)
        obs = self._observation(cache, stats, step, rows, forecast)
        # the policy state's per-block [layers, N] leaves are cut to this layer, the rest shared
        per_block = jax.tree.map(lambda x: x.shape == (L, N), pstate)
        sub = jax.tree.map(lambda x, b: x[rows] if b else x, pstate, per_block)
        sub, target = self.policy.plan(sub, obs)
        pstate = jax.tree.map(lambda x, y, b: x.at[rows].set(y) if b else y, pstate, sub, per_block)
        before = cache.in_hbm.reshape(L, N)
        moves = kvc.plan_moves(cache, before.at[layer].set(target[0]), p.max_moves)
        cache, _ = kvc.migrate(cache, moves, layers=(layer,), after_reads=after_reads)
        was, now = before[layer], cache.in_hbm.reshape(L, N)[layer]
        moved = jnp.stack([jnp.sum(now & ~was), jnp.sum(was & ~now)]).astype(jnp.int32)
        return cache, pstate, moved

    def _window(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
        """The window boundary: observe -> plan -> migrate (-> compact), adapt W. A policy that
        plans in the step (`plans_in_step`) has already planned and migrated this step.

        Returns:
          (state, [layers] int32 blocks migrated here)."""
        c, p = self.cache_config, self.placement
        cache, policy_state = state.cache, state.policy_state
        moved = jnp.zeros((c.num_layers,), jnp.int32)
        stats = state.stats
        if not self.plans_in_step:
            obs = self._observation(cache, stats, state.step)
            policy_state, target = self.policy.plan(policy_state, obs)
            moves = kvc.plan_moves(cache, target, p.max_moves)
            cache, moved = kvc.migrate(cache, moves)
            stats = replace(stats, window_reads=jnp.zeros_like(stats.window_reads))
        windows = state.metrics.windows + 1
        if p.compact_every:
            impl = "pallas" if resolve_impl(self.impl, c) == "pallas" else "xla"
            cache = jax.lax.cond(
                windows % p.compact_every == 0,
                lambda x: kvc.compact(x, impl=impl),
                lambda x: x,
                cache,
            )
        m = state.metrics
        metrics = replace(m, migrated_blocks=m.migrated_blocks + moved.sum(), windows=windows)
        hit = state.win_hbm / jnp.maximum(state.win_total, 1.0)
        window = state.window
        if p.adaptive_window:
            window = adapt_window(
                window, hit, state.prev_hit, p.min_window, p.max_window, p.window_step
            )
        state = replace(
            state,
            cache=cache,
            policy_state=policy_state,
            stats=stats,
            metrics=metrics,
            window=window,
            since_plan=jnp.int32(0),
            win_hbm=jnp.float32(0),
            win_total=jnp.float32(0),
            prev_hit=hit,
        )
        return state, moved

    def _generate_impl(self, params, state: DecodeState, until) -> DecodeState:
        c = self.cache_config

        def cond(s: DecodeState):
            full = jnp.any(~s.done & (s.cache.lengths >= c.max_len))
            return (s.step < until) & ~jnp.all(s.done) & ~full

        return jax.lax.while_loop(cond, lambda s: self._either_step(params, s), state)


def summarize(state: DecodeState) -> dict:
    """Host-side summary of a finished decode: hit rate, migrations, modeled time."""
    m = jax.device_get(state.metrics)
    steps = int(state.step)
    lat = float(np.sum(m.latency[:steps]))
    batch = state.tokens.shape[0]
    return {
        "steps": steps,
        "hbm_hit_rate": float(m.hbm_reads / max(m.total_reads, 1.0)),
        "migrated_blocks": int(m.migrated_blocks),
        "modeled_seconds": lat,
        "modeled_tokens_per_s": batch * steps / lat if lat > 0 else float("nan"),
        "hbm_bytes": float(np.sum(m.hbm_bytes[:steps])),
        "host_bytes": float(np.sum(m.host_bytes[:steps])),
        "windows": int(m.windows),
    }
