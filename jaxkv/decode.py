"""Functional decoding over a TieredKVCache: prefill, decode_step, generate.

`Decoder` is frozen: it holds only static, hashable things (the model's graph, cache geometry,
placement config, policy, sampler, hardware profile) and jitted functions over an explicit
`DecodeState`. It compiles the step twice: `decode_step` (one token per sequence, the state
donated; no plan, so no branch on the data: a GPU conditional syncs the host) and `window_step`,
the step that ends a window: every W steps (W lives in the state, so changing it never
recompiles) the policy plans from the per-block read statistics, between steps and for all
layers at once. `step` and `generate` (a `lax.while_loop` that stops at a step limit, when every
sequence has finished, or when a cache is full) pick one of the two on the device at each step.

The model's layers run under one `lax.scan` (`models.llama.Llama.decode_step`): one layer body
is traced and compiled, whatever the depth, and the layer index is traced through the token
write, the block selection, the host read and the attention.

What a plan does depends on the policy. Most (static, lru, anneal, anneal+reuse) return a
target placement that `plan_moves` bounds to a migration budget and the cache migrates to in
bulk. A `follow` policy ("anneal+reuse+follow", `jaxkv.policies.Anneal.follow`) only sets a
target; then at every step, inside each layer's body, the vector rule
`jaxkv.policies.follow_moves` promotes the host blocks the layer reads that the target marks
for HBM, from the copies the read has just fetched (no second link read), and demotes, to make
room, resident blocks the target leaves out; the moves of all layers are applied in one bulk
migration after the layers. Nothing heavier than that rule runs on a layer's critical path.

DecodeState nests the sampling state, the placement state (window bookkeeping and the policy's
own state), the read statistics and the metrics: per-step bytes read from each tier, the
modeled step latency under a HardwareProfile (PAPER.md's max of the two tiers), blocks
migrated, HBM hit rate. `Decoder.plan_seconds` measures one plan on the present device, which
`summarize` charges beside the modeled time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvc
from jaxkv import importance as imp
from jaxkv._pytree import pytree_dataclass, replace
from jaxkv.attention import resolve_impl, tiered_attention, window_starts
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.cost import layer_step_time
from jaxkv.policies import (
    POLICIES,
    Observation,
    adapt_window,
    follow_moves,
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
class SamplingState:
    tokens: jax.Array  # [batch, max_new_tokens] int32; column 0 is the token sampled at prefill
    last: jax.Array  # [batch] int32: the next input token
    done: jax.Array  # [batch] bool: finished (EOS)
    step: jax.Array  # [] int32: decode steps taken
    key: jax.Array  # PRNG key


@pytree_dataclass
class PlacementState:
    window: jax.Array  # [] int32: W, steps between plans
    since_plan: jax.Array  # [] int32
    win_hbm: jax.Array  # [] f32: HBM block reads in the current window
    win_total: jax.Array  # [] f32: block reads in the current window
    prev_hit: jax.Array  # [] f32: HBM hit rate of the previous window
    policy: Any  # the policy's own state (`Policy.init`)


@pytree_dataclass
class Statistics:
    blocks: imp.Stats  # per-block read statistics, [layers, batch * max_blocks]
    step_mass: jax.Array  # [layers, batch, max_blocks] f32: last step's attention mass (0 unread)


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


def model_weight_bytes(params) -> float:
    """Bytes of all arrays in a parameter pytree."""
    return float(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


def _layer_weight_bytes(params, num_layers: int) -> float:
    """Bytes one decode step reads per layer: that layer's weights, plus the final norm and
    the output head spread over the layers (the embedding is a gather of one row per token)."""
    total = model_weight_bytes(params)
    embed = getattr(params, "embed", None)
    if embed is not None and getattr(params, "lm_head", None) is not None:
        total -= model_weight_bytes(embed)  # untied: the table is not read, only B rows
    return total / num_layers


class Decoder:
    """Compiled decoding of one model over a TieredKVCache. Frozen: attributes are static
    configuration and the jitted functions; all state is the explicit `DecodeState`.

    Args:
      model: a `models.Llama` (or any nnx.Module with `prefill` and `decode_step` as Llama's,
        whose `attend` callback receives a traced layer index).
      cache_config: cache geometry and capacities; its num_layers, kv_heads and head_dim must
        match the model.
      placement: attention mode, window, policy name and migration budget. Names take the
        simulator's modifiers a live decode can honour (`jaxkv.policies.split_name`): "+reuse",
        "+follow", "+aw", "+ec" on "anneal". Under "+follow" the plan every `window` steps
        sets a target and each step's layers follow it (see the module docstring); every
        migration loads both sides of its step (a block crosses the link once and is written to
        or read from HBM once), as in the simulator and PAPER.md's cost model.
      max_new_tokens: tokens to generate per sequence (the prefill token included).
      sampler: `Greedy()` or `Sampling(...)`.
      profile: a HardwareProfile or a preset name, for the modeled latency.
      eos_id: token id that finishes a sequence, or None.
      impl: attention implementation, "auto" | "xla" | "pallas".
      ema_decay: decay of the per-block read statistics per step.
      policy_kwargs: overrides of the policy's fields (e.g. {"spread": 1.0}).
    """

    _FIELDS = (
        "graphdef",
        "model_config",
        "cache_config",
        "placement",
        "max_new_tokens",
        "sampler",
        "profile",
        "eos_id",
        "impl",
        "ema_decay",
        "weight_bytes_per_layer",
        "policy",
    )

    def __init__(
        self,
        model: Any,
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
        from flax import nnx  # the model brings flax; the decode loop itself does not need it

        graphdef, params = nnx.split(model)
        profile = HardwareProfile.preset(profile) if isinstance(profile, str) else profile
        values = dict(
            graphdef=graphdef,
            model_config=mc,
            cache_config=cache_config,
            placement=placement,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            profile=profile,
            eos_id=eos_id,
            impl=impl,
            ema_decay=ema_decay,
            weight_bytes_per_layer=_layer_weight_bytes(params, mc.num_layers),
        )
        for k, v in values.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "policy", self._make_policy(policy_kwargs or {}))
        # The decode step and the step that ends a window are compiled apart, so that neither
        # branches on the data (a GPU conditional syncs the host): `decode_step` has no plan
        # and no host sync; `window_step` adds the plan (and, but for `follow`, its migration).
        # An unpinned_host cache keeps its kind only where a jit's out_shardings name it (jax
        # types a traced unpinned_host value as device: jaxkv.cache's module docstring); the
        # other kinds keep theirs, and their jits stay free of device-bound shardings.
        out = {}
        if cache_config.host_memory_kind == "unpinned_host":
            none = dict(sampling=None, placement=None, statistics=None, metrics=None)
            out = dict(out_shardings=DecodeState(cache=kvc.cache_shardings(cache_config), **none))
        jits = dict(
            _prefill=jax.jit(self._prefill_impl, **out),
            decode_step=jax.jit(
                functools.partial(self._step_impl, plan=False), donate_argnums=(1,), **out
            ),
            window_step=jax.jit(
                functools.partial(self._step_impl, plan=True), donate_argnums=(1,), **out
            ),
            _step=jax.jit(self._either_step, donate_argnums=(1,), **out),
            _generate=jax.jit(self._generate_impl, donate_argnums=(1,), **out),
            _plan=jax.jit(self._plan_impl),
        )
        for k, v in jits.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"Decoder is frozen: cannot set {name!r}")

    def _key(self):
        return tuple(getattr(self, f) for f in self._FIELDS)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return type(other) is type(self) and self._key() == other._key()

    @property
    def follows(self) -> bool:
        """The policy sets a target between steps that each step's layers follow."""
        return bool(getattr(self.policy, "follow", False))

    @property
    def prefill_fn(self):
        """The jitted prefill (params, prompts, lengths, key) -> DecodeState, unchecked."""
        return self._prefill

    def compilations(self) -> int:
        """Executables compiled so far by this decoder's jitted functions (all of them)."""
        fns = (self._prefill, self.decode_step, self.window_step, self._step, self._generate)
        return sum(int(f._cache_size()) for f in fns)

    def _make_policy(self, overrides: dict):
        """Builds the placement policy, filling in what it models from this decoder's geometry
        (hardware profile, block bytes, weight bytes, window, migration budget).

        Names take the simulator's modifiers (`jaxkv.policies.split_name`) where a live decode
        can honour them: "anneal+reuse", "anneal+reuse+follow", "+aw", "+ec". The adaptive
        window is one controller (`jaxkv.policies.adapt_window`): the anneal policy's own
        (`Anneal.adaptive`, as in the simulator) for anneal names, with the bounds of
        `placement`; the decode loop's for the others."""
        c, p = self.cache_config, self.placement
        base, mods = split_name(p.policy)
        if "now" in mods:
            raise ValueError(
                f"policy {p.policy!r}: +now anneals each layer on its critical path, between its "
                "block selection and its read; the decode loop plans between steps and follows "
                "the plan inside the step instead: use "
                f"{p.policy.replace('+now', '+follow')!r}"
            )
        if base == "unlimited":
            raise ValueError(
                f"policy {p.policy!r} is the Unlimited-HBM bound (every block in HBM), not a "
                "placement: use hbm_capacity=1.0 for an all-HBM decode, or an online policy "
                "(e.g. 'lru', 'anneal' or 'anneal+reuse+follow')"
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
        if "adaptive" in known and (p.adaptive_window or kwargs.get("adaptive", False)):
            kwargs.update(
                adaptive=True,
                min_window=p.min_window,
                max_window=p.max_window,
                window_step=p.window_step,
            )
        kwargs.update(overrides)
        policy = cls(**kwargs)
        if getattr(policy, "needs_forecast", False):
            raise ValueError(
                f"policy {p.policy!r} plans from perfect knowledge of future reads, which a live "
                "decode does not have; use it in `jaxkv simulate`, or an online policy here "
                "(e.g. 'lru', 'anneal' or 'anneal+reuse+follow')"
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
        _check_token_ids(prompts, lengths, self.model_config.vocab_size)
        key = jax.random.key(0) if key is None else key
        return self._prefill(
            params, prompts.astype(jnp.int32), jnp.asarray(lengths, jnp.int32), key
        )

    def step(self, params, state: DecodeState) -> DecodeState:
        """One decode step for every unfinished sequence (the state is donated): `window_step`
        when the step ends a window, else `decode_step`, chosen on the device.

        Raises ValueError once the state holds max_new_tokens tokens (it reads the state's
        step counter, which waits for the previous step; `decode_step` / `window_step` are
        the unchecked jits, where a step past the end leaves every sequence as it is)."""
        done = int(state.sampling.step)
        if done >= self.max_new_tokens - 1:
            raise ValueError(
                f"the state has decoded max_new_tokens={self.max_new_tokens} tokens (step "
                f"{done}): no room for another; build the Decoder with a larger max_new_tokens"
            )
        return self._step(params, state)

    def generate(self, params, state: DecodeState, until: int | None = None) -> DecodeState:
        """Decodes until `until` steps (default: max_new_tokens - 1), EOS everywhere, or a full
        cache. `until` is a traced value: calling in chunks does not recompile."""
        until = self.max_new_tokens - 1 if until is None else min(until, self.max_new_tokens - 1)
        return self._generate(params, state, jnp.int32(until))

    def with_window(self, state: DecodeState, window: int) -> DecodeState:
        """Returns the state with a new window W (no recompilation)."""
        if not isinstance(window, int | np.integer) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        pl = state.placement
        # same placement as the old value: an uncommitted scalar would change the jit cache key
        w = jax.device_put(jnp.int32(window), pl.window.sharding)
        policy = pl.policy
        if dataclasses.is_dataclass(policy) and "window" in {
            f.name for f in dataclasses.fields(policy)
        }:  # the anneal policy's own W, its energy's window (`Anneal.plan`): its own buffer,
            # since the state is donated
            w_policy = jax.device_put(jnp.int32(window), policy.window.sharding)
            policy = replace(policy, window=w_policy)
        return replace(state, placement=replace(pl, window=w, policy=policy))

    def plan_seconds(self, params, state: DecodeState, repeats: int = 3) -> float:
        """Wall seconds of one plan (observe -> policy.plan, all layers) on the present device,
        compiled and warmed first, best of `repeats`; 0.0 for a policy that never plans
        (static). `state` is not consumed."""
        del params
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
        if self.policy.name == "static":
            return 0.0
        jax.block_until_ready(self._plan(state))
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(self._plan(state))
            best = min(best, time.perf_counter() - t0)
        return best

    # ---- implementation -----------------------------------------------------------------------

    def _prefill_impl(self, params, prompts, lengths, key) -> DecodeState:
        c = self.cache_config
        model = _merge(self.graphdef, params)
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
            sampling=SamplingState(
                tokens=jnp.zeros((B, n), jnp.int32).at[:, 0].set(first),
                last=first,
                done=done,
                step=jnp.int32(0),
                key=key,
            ),
            placement=PlacementState(
                window=jnp.int32(self.placement.window),
                since_plan=jnp.int32(0),
                win_hbm=jnp.float32(0),
                win_total=jnp.float32(0),
                prev_hit=jnp.float32(0),
                policy=self.policy.init(L, B * M),
            ),
            statistics=Statistics(
                blocks=imp.init_stats(L, B * M, decay=self.ema_decay),
                step_mass=jnp.zeros((L, B, M), jnp.float32),
            ),
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
        """[batch] bool: the sequences this step decodes (not done, room in the cache and in
        the token buffer)."""
        c = self.cache_config
        room = state.sampling.step < self.max_new_tokens - 1
        return ~state.sampling.done & (state.cache.lengths < c.max_len) & room

    def _either_step(self, params, state: DecodeState) -> DecodeState:
        """`window_step` when this step ends the window, else `decode_step` (one branch)."""
        pl = state.placement
        return jax.lax.cond(
            pl.since_plan + 1 >= pl.window,
            lambda s: self._step_impl(params, s, plan=True),
            lambda s: self._step_impl(params, s, plan=False),
            state,
        )

    def _follow_layer(self, cache, layer, st, staged, pstate, fol):
        """The `follow` rule of one layer (traced `layer`) after its read: the promotions and
        the demotions that make room for them (`jaxkv.policies.follow_moves`), and the fetched
        contents of the promoted blocks, written into the per-layer lists `fol`."""
        c = self.cache_config
        N = c.batch * c.max_blocks
        K = fol[0].shape[1]
        sealed = cache.sealed[layer].reshape(1, N)
        in_hbm = sealed & (cache.tier[layer].reshape(1, N) == kvc.TIER_HBM)
        reads = (st.read_hbm | st.read_host).reshape(1, N)
        room = jnp.sum(cache.hbm_free[layer])[None]
        pro, n_p, dem, n_d = follow_moves(
            in_hbm,
            sealed,
            reads,
            pstate.target[layer][None],
            pstate.priority[layer][None],
            room,
            K,
            admit=self.policy.follow_admit,
        )
        sk, sv, stable = staged
        at = jnp.take(stable.reshape(-1), pro[0])  # staging slot of each promoted block
        P, NP, D, ND, PK, PV = fol
        return (
            P.at[layer].set(pro[0]),
            NP.at[layer].set(n_p[0]),
            D.at[layer].set(dem[0]),
            ND.at[layer].set(n_d[0]),
            PK.at[layer].set(sk[at].astype(PK.dtype)),
            PV.at[layer].set(sv[at].astype(PV.dtype)),
        )

    def _step_impl(self, params, state: DecodeState, *, plan: bool) -> DecodeState:
        """One decode step; with `plan` (a python bool) it also ends the window: the policy
        plans, between steps and for all layers, and (unless it `follows`) migrates."""
        c, p = self.cache_config, self.placement
        model = _merge(self.graphdef, params)
        sm = state.sampling
        active = self._active(state)
        attn_len = state.cache.lengths + active.astype(jnp.int32)
        scale = 1.0 / float(np.sqrt(self.model_config.head_dim))
        L, B, M = c.num_layers, c.batch, c.max_blocks
        N = B * M
        follow = self.follows
        pstate = state.placement.policy
        dt = c.jnp_dtype

        windows = self._layer_windows()

        def attend(layer, q, k_new, v_new, carry):
            cache, reads, fol = carry
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
            reads = tuple(
                r.at[layer].set(x)
                for r, x in zip(reads, (st.read_hbm, st.read_host, st.mass), strict=True)
            )
            if follow:
                fol = self._follow_layer(cache, layer, st, staged, pstate, fol)
            return out.astype(q.dtype), (cache, reads, fol)

        reads0 = (jnp.zeros((L, B, M), bool), jnp.zeros((L, B, M), bool), jnp.zeros((L, B, M)))
        fol0 = ()
        if follow:
            K = max(0, min(p.max_moves, N))
            blk = (c.block_size, c.kv_heads, c.head_dim)
            zi, zn = jnp.zeros((L, K), jnp.int32), jnp.zeros((L,), jnp.int32)
            zb = jnp.zeros((L, K, *blk), dt)
            fol0 = (zi, zn, zi, zn, zb, zb)
        with jax.named_scope("model"):
            logits, (cache, (read_hbm, read_host, mass), fol) = model.decode_step(
                sm.last, state.cache.lengths, attend, (state.cache, reads0, fol0)
            )
        promoted = demoted = jnp.zeros((L,), jnp.int32)
        if follow:  # the layers' follow moves, all at once, from the blocks they fetched
            with jax.named_scope("follow"):
                before = cache.in_hbm
                moves = kvc.Moves(
                    demote=fol[2], promote=fol[0], num_demote=fol[3], num_promote=fol[1]
                )
                cache, _ = kvc.migrate(cache, moves, after_reads=logits, fetched=fol[4:])
                now = cache.in_hbm
                promoted = jnp.sum(now & ~before, axis=(1, 2)).astype(jnp.int32)
                demoted = jnp.sum(before & ~now, axis=(1, 2)).astype(jnp.int32)
        cache = kvc.advance(cache, active, after_reads=logits)
        key, sub = jax.random.split(sm.key)
        nxt = self.sampler(logits, sub)
        nxt = jnp.where(active, nxt, sm.last)
        step = sm.step
        col = jnp.minimum(step + 1, self.max_new_tokens - 1)
        tokens = sm.tokens.at[:, col].set(jnp.where(active, nxt, sm.tokens[:, col]))
        done = sm.done | (active & (nxt == self.eos_id) if self.eos_id is not None else False)

        # statistics and metrics of this step
        read = read_hbm | read_host
        stats = imp.update_stats(
            state.statistics.blocks,
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
            migrated_blocks=m.migrated_blocks + (promoted + demoted).sum(),
            hbm_reads=m.hbm_reads + n_hbm,
            total_reads=m.total_reads + n_all,
            window_trace=m.window_trace.at[step].set(state.placement.window),
        )
        pl = state.placement
        state = DecodeState(
            cache=cache,
            sampling=SamplingState(tokens=tokens, last=nxt, done=done, step=step + 1, key=key),
            placement=replace(
                pl,
                since_plan=pl.since_plan + 1,
                win_hbm=pl.win_hbm + n_hbm,
                win_total=pl.win_total + n_all,
            ),
            statistics=Statistics(blocks=stats, step_mass=mass),
            metrics=metrics,
        )
        moved = jnp.zeros((L,), jnp.int32)
        if plan:
            state, moved = self._window(state)
        # migrations load both sides of the step they are made in, as in the simulator and
        # PAPER.md: a window's migration (and a follow demotion) crosses the link once and is
        # read or written in HBM once; a follow promotion rides on this step's host read, so
        # it costs the HBM write alone
        mig_h = (moved + promoted + demoted).astype(jnp.float32) * bb  # [L]
        mig_l = (moved + demoted).astype(jnp.float32) * bb
        lat = layer_step_time(
            hbm_b,
            host_b,
            profile=self.profile,
            weight_bytes=self.weight_bytes_per_layer,
            hbm_write_bytes=write_b,
            hbm_migration_bytes=mig_h,
            link_migration_bytes=mig_l,
        ).sum()
        m = state.metrics
        return replace(state, metrics=replace(m, latency=m.latency.at[step].set(lat)))

    def _layer_windows(self):
        """[layers] int32 sliding window of each layer (0: full attention), None without."""
        if getattr(self.model_config, "sliding_window", None) is None:
            return None
        return jnp.asarray(self.model_config.layer_windows(), jnp.int32)

    def _placeable(self, cache):
        """[layers, N] bool: the sealed blocks a later step can read. A block wholly before
        its layer's sliding window at the next step is never read again (the window only
        moves forward), so no plan targets it and it leaves HBM first."""
        c = self.cache_config
        L, N = c.num_layers, c.batch * c.max_blocks
        sealed = cache.sealed.reshape(L, N)
        windows = self._layer_windows()
        if windows is None:
            return sealed
        # the next step's query is at position `lengths`: it attends from lengths + 1 - w
        starts = window_starts(cache.lengths[None] + 1, windows[:, None])  # [L, B]
        ends = (jnp.arange(c.max_blocks, dtype=jnp.int32) + 1) * c.block_size
        live = ends[None, None, :] > starts[:, :, None]  # [L, B, M]
        return sealed & live.reshape(L, N)

    def _observation(self, cache, stats: imp.Stats, step) -> Observation:
        """What the policy sees at a plan: every layer's blocks."""
        c = self.cache_config
        L, N = c.num_layers, c.batch * c.max_blocks
        return Observation(
            in_hbm=cache.in_hbm.reshape(L, N),
            valid=self._placeable(cache),
            last_read=stats.last_read,
            read_ema=stats.read_ema,
            mass_ema=stats.mass_ema,
            step=step,
            window_reads=stats.window_reads,
            since_seen=stats.since_seen,
            since_read=stats.since_read,
            streak=stats.streak,
            capacity=c.hbm_pool_slots,
        )

    def _plan_impl(self, state: DecodeState):
        """observe -> plan, all layers: (the policy's new state, target [layers, N])."""
        obs = self._observation(state.cache, state.statistics.blocks, state.sampling.step)
        return self.policy.plan(state.placement.policy, obs)

    def _window(self, state: DecodeState) -> tuple[DecodeState, jax.Array]:
        """The window boundary, between steps: observe -> plan (-> migrate -> compact), and
        the next W (the adaptive window's one controller, `adapt_window`: the policy's own
        for an adaptive anneal policy, else this loop's when `adaptive_window`).

        Returns:
          (state, [layers] int32 blocks migrated here)."""
        c, p = self.cache_config, self.placement
        cache = state.cache
        moved = jnp.zeros((c.num_layers,), jnp.int32)
        policy_state, target = self._plan_impl(state)
        if not self.follows:  # a follow policy's target is followed by the steps' layers
            passed = None  # blocks behind every later step's window leave HBM first
            if self._layer_windows() is not None:
                passed = cache.sealed.reshape(c.num_layers, -1) & ~self._placeable(cache)
            moves = kvc.plan_moves(cache, target, p.max_moves, demote_first=passed)
            cache, moved = kvc.migrate(cache, moves)
        stats = state.statistics.blocks
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
        pl = state.placement
        hit = pl.win_hbm / jnp.maximum(pl.win_total, 1.0)
        window = pl.window
        if getattr(self.policy, "adaptive", False):
            window = self.policy.next_window(policy_state)
        elif p.adaptive_window:
            window = adapt_window(
                window, hit, pl.prev_hit, p.min_window, p.max_window, p.window_step
            )
        state = replace(
            state,
            cache=cache,
            placement=PlacementState(
                window=window.astype(jnp.int32),
                since_plan=jnp.int32(0),
                win_hbm=jnp.float32(0),
                win_total=jnp.float32(0),
                prev_hit=hit,
                policy=policy_state,
            ),
            statistics=replace(state.statistics, blocks=stats),
            metrics=metrics,
        )
        return state, moved

    def _generate_impl(self, params, state: DecodeState, until) -> DecodeState:
        c = self.cache_config

        def cond(s: DecodeState):
            full = jnp.any(~s.sampling.done & (s.cache.lengths >= c.max_len))
            return (s.sampling.step < until) & ~jnp.all(s.sampling.done) & ~full

        return jax.lax.while_loop(cond, lambda s: self._either_step(params, s), state)


def _check_token_ids(prompts, lengths, vocab_size: int):
    """ValueError naming the first prompt token (inside its sequence's length) outside
    [0, vocab_size): the embedding lookup would clamp it silently."""
    ids = np.asarray(prompts)
    inside = np.arange(ids.shape[1])[None] < np.asarray(lengths)[:, None]
    bad = inside & ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        b, t = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(
            f"prompts[{b}, {t}] = {int(ids[b, t])}: expected token ids in [0, "
            f"vocab_size={vocab_size}) ({int(bad.sum())} outside)"
        )


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


def _merge(graphdef, params):
    """The nnx model from its graph and state (flax imported here, where a model exists)."""
    from flax import nnx

    return nnx.merge(graphdef, params)
