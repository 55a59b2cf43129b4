"""The tiered cache and decode loop on a `jax.sharding.Mesh`: sequences over a "data" axis, KV
heads (and the model's tensor parallelism) over a "model" axis, every device with its own two
tiers, its own block table and its own placement plans.

Layout. The decode loop runs per device under `jax.shard_map` (`ShardedDecoder`): each device
runs `jaxkv.Decoder`'s step on its shard, a local `Decoder` built for batch / data
sequences and kv_heads / model KV heads (and the matching query heads, with ffn_dim / model of
the MLP). The model is tensor-parallel over the same "model" axis, Megatron style: Q/K/V, gate
and up projections split by output (heads stay whole), the attention output and MLP down
projections split by input and summed over the axis (a `psum` before the bias); embeddings,
norms and the LM head are replicated. The model says how it splits: it implements
`jaxkv.model_api.TensorParallel` (`tensor_shard`, `tensor_split_axes`; `models.llama.Llama`
does), and this module never imports a model. So
the cache needs no collective at all: a device's heads attend only its own KV heads. Exact
attention gives the one-device tokens; sparse attention ranks blocks by the Quest bound summed
over a device's own query heads, so each KV-head shard selects its own blocks (a finer
selection than one device's, whose tokens it need not reproduce).

State. Every leaf of the local `DecodeState` gets two leading axes [data, model] and the
sharding `P("data", "model")`, so each device's shard is its own cache, statistics, policy
state and metrics (`local_state` reads one back). The host pools are `NamedSharding`s with the
configured memory kind ("pinned_host" on a GPU, also on CPU) and stay so across steps; inside
the shard_map the cache's transfers place values by memory space (`jaxkv.cache.transfer.to_kind`).

Plans. Each device plans its own shard from the attention mass its own heads saw (one plan per
device: the devices of one "model" group read different heads, so their hot blocks differ), or,
with `plan_over="model"`, the devices of a model group plan from their statistics pooled over
the axis (one all-reduce a step) and so place their shards alike. Windows
are staggered: device d (row-major over data, model) starts its first window `d x stagger`
steps (mod W) late, so with `stagger > 0` the devices' migrations do not hit shared links in
the same step (the seed's phase offsets). Whether a window ends is decided on each device
(`lax.cond` inside the shard_map, after the step's last collective: every device runs the same
collectives whichever branch it takes). On a GPU that conditional copies its predicate to the
host unless XLA captures it in a command buffer; the single-device `Decoder` compiles its
window step apart for that reason.

Links. `link_bandwidths` gives each device its own host-link bandwidth (a pool on a far NUMA
node): each distinct bandwidth gets a profile, and a device's plan and modeled step time are its
profile's (`lax.switch` on the device index; no collective inside). The local `Decoder` is
composed for this through its public seam, `Decoder(per_device=PerDevice(...))`
(`jaxkv.decode.per_device`: the profiles, the devices that share a link, the axis a plan pools
statistics over); the per-device step and prefill are `Decoder.device_step` /
`device_prefill`. JAX offers no control over which NUMA node XLA's pinned-host allocator uses;
one process per GPU bound to its node (`numactl --membind`) is the lever, and this prices the
rest.

Hosts. The same code runs under `jax.distributed.initialize` with a mesh over every process's
devices (tests/test_sharded.py starts two processes on localhost); inputs are built from each
process's copy of the prompts and parameters (`global_array`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv._pytree import replace
from jaxkv.config import HBM_KIND, CacheConfig, PlacementConfig
from jaxkv.decode.decoder import Decoder
from jaxkv.decode.per_device import PerDevice
from jaxkv.decode.state import check_finite

DATA, MODEL = "data", "model"
_TP_METHODS = ("tensor_shard", "tensor_split_axes")  # jaxkv.model_api.TensorParallel
STATE_SPEC = P(DATA, MODEL)


def make_mesh(data: int, model: int, devices=None) -> Mesh:
    """A ("data", "model") mesh of data x model devices (default: the first of jax.devices())."""
    for name, n in (("data", data), ("model", model)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"make_mesh: {name}={n!r}: expected an int >= 1")
    devices = jax.devices() if devices is None else list(devices)
    if data * model > len(devices):
        raise ValueError(
            f"make_mesh: data x model = {data} x {model} devices, but {len(devices)} are "
            "available (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
            "jax starts)"
        )
    return Mesh(np.asarray(devices[: data * model]).reshape(data, model), (DATA, MODEL))


def param_specs(model, params):
    """The PartitionSpec of every leaf of `params` (`model`'s state, `nnx.split`): split over
    MODEL along the axis `model.tensor_split_axes` names, replicated where it names None."""
    axes = model.tensor_split_axes(params)
    return jax.tree.map(
        lambda a: P() if a is None else P(*([None] * a), MODEL), axes, is_leaf=lambda a: a is None
    )


def global_array(x, sharding: NamedSharding) -> jax.Array:
    """`x` (the same full value on every process) as a global array with `sharding`: each
    process places only its devices' shards (works in one process and under jax.distributed)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x  # already placed (e.g. shard_params called twice)
    x = np.asarray(x)  # a process-local value (a multi-process array must already be placed)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


class ShardedDecoder:
    """`jaxkv.Decoder` over a mesh (module docstring).

    Args:
      model: the (global) model, or an abstract one (`nnx.eval_shape`), implementing
        `jaxkv.model_api.TensorParallel` (as `models.llama.Llama` does).
      cache_config: the global cache: `batch` sequences, the model's `kv_heads`; capacities
        per device and layer (a fraction means of the device's own footprint).
      placement: as for `Decoder`; each device runs the policy on its shard.
      mesh: a mesh with axes "data" and "model" (`make_mesh`); batch must divide over data,
        KV heads, query heads and ffn_dim over model.
      stagger: steps between successive devices' window phases (0: all plan together).
      link_bandwidths: None, or one host-link bandwidth (bytes/s) per device (row-major over
        data, model): each device's plans and modeled time price its own link (a host pool on
        a far NUMA node: about a third of the near one's on a GB200). The profile's otherwise.
      shared_link: None (a link per device), or "model" / "data": the devices along that mesh
        axis share one host link (one PCIe switch, one host's memory), so a step's link time
        is their bytes together; this is where `stagger` pays. Priced in the modeled time;
        each device still plans as if its link were its own.
      plan_over: "device" (each device plans its shard from its own heads' statistics) or
        "model": the devices of a model group (one data row: the same sequences, different KV
        heads) plan from their statistics pooled over the "model" axis, so they place their
        shards alike; `stagger` then offsets rows, not devices. bench/RESULTS.md, section 11,
        measures the two.
      **kwargs: `Decoder`'s (max_new_tokens, profile, sampler, eos_id, impl, ...).
    """

    def __init__(
        self,
        model,
        cache_config: CacheConfig,
        placement: PlacementConfig,
        *,
        mesh: Mesh,
        stagger: int = 0,
        link_bandwidths=None,
        shared_link: str | None = None,
        plan_over: str = "device",
        **kwargs,
    ):
        from flax import nnx

        if not all(callable(getattr(model, m, None)) for m in _TP_METHODS):
            raise TypeError(
                f"ShardedDecoder: model is a {type(model).__name__}: expected a model that "
                "says how it splits over the mesh (jaxkv.model_api.TensorParallel: "
                "tensor_shard, tensor_split_axes; models.Llama has them); other models run "
                "on one device (Decoder)"
            )
        if not isinstance(mesh, Mesh) or set(mesh.axis_names) != {DATA, MODEL}:
            raise ValueError(f"mesh must be a Mesh with axes {(DATA, MODEL)}, got {mesh!r}")
        if not isinstance(stagger, int) or isinstance(stagger, bool) or stagger < 0:
            raise ValueError(f"stagger={stagger!r}: expected an int >= 0 (steps)")
        if cache_config.host_memory_kind == "unpinned_host":
            raise ValueError(
                "ShardedDecoder: host_memory_kind='unpinned_host' is not supported (a traced "
                "value has no unpinned memory space); use 'pinned_host' or 'device'"
            )
        mc = model.config
        nd, nm = mesh.shape[DATA], mesh.shape[MODEL]
        if cache_config.batch % nd:
            raise ValueError(
                f"ShardedDecoder: cache batch={cache_config.batch} does not divide over the "
                f"mesh's 'data' axis of {nd} devices"
            )
        local_model = model.tensor_shard(nm, MODEL if nm > 1 else None)
        local_cache = dataclasses.replace(
            cache_config, batch=cache_config.batch // nd, kv_heads=cache_config.kv_heads // nm
        )
        self.mesh, self.stagger = mesh, stagger
        self.model_config, self.cache_config, self.placement = mc, cache_config, placement
        if shared_link not in (None, DATA, MODEL):
            raise ValueError(f"shared_link={shared_link!r}: expected None, {DATA!r} or {MODEL!r}")
        if plan_over not in ("device", MODEL):
            raise ValueError(f"plan_over={plan_over!r}: expected 'device' or {MODEL!r}")
        self.link_bandwidths, self.shared_link, self.plan_over = None, shared_link, plan_over
        if link_bandwidths is None and shared_link is None and plan_over == "device":
            self.local = Decoder(local_model, local_cache, placement, **kwargs)
        else:
            self.local = self._per_device(local_model, local_cache, link_bandwidths, kwargs)
        self.max_new_tokens = self.local.max_new_tokens
        self._abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.split(model)[1]
        )  # the global parameters' shapes
        self.param_specs = param_specs(model, self._abstract)
        self._prefills: dict[int, object] = {}

    def _per_device(self, local_model, local_cache, bandwidths, kwargs):
        from jaxkv.config import HardwareProfile

        base = kwargs.pop("profile", "gh200")
        base = HardwareProfile.preset(base) if isinstance(base, str) else base
        if bandwidths is None:
            bandwidths = [base.link_bandwidth] * self.mesh.size
        bws = [float(b) for b in bandwidths]
        if len(bws) != self.mesh.size or not all(np.isfinite(b) and b > 0 for b in bws):
            raise ValueError(
                f"link_bandwidths={list(bandwidths)!r}: expected {self.mesh.size} positive "
                "bandwidths (bytes/s), one per device"
            )
        distinct = sorted(set(bws))
        profiles = tuple(
            dataclasses.replace(base, name=f"{base.name}@{b / 1e9:g}GB/s", link_bandwidth=b)
            for b in distinct
        )
        self.link_bandwidths = tuple(bws)
        per_device = PerDevice(
            profiles=profiles,
            index=tuple(distinct.index(b) for b in bws),
            model_devices=self.mesh.shape[MODEL],
            axes=(DATA, MODEL),
            shared_link=self.shared_link,
            plan_axis=MODEL if self.plan_over == MODEL else None,
        )
        return Decoder(
            local_model,
            local_cache,
            self.placement,
            profile=profiles[0],
            per_device=per_device,
            **kwargs,
        )

    # ---- placement on the mesh --------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    def shard_params(self, params):
        """The model's parameters placed on the mesh: tensor-parallel weights split over
        "model", the rest replicated."""
        return jax.tree.map(
            lambda x, s: global_array(x, NamedSharding(self.mesh, s)), params, self.param_specs
        )

    def state_shardings(self, state_like):
        """NamedShardings for a global DecodeState like `state_like`: P("data", "model") on
        every leaf, the host pools in the cache's host memory kind."""
        dev = NamedSharding(self.mesh, STATE_SPEC, memory_kind=HBM_KIND)
        host = NamedSharding(self.mesh, STATE_SPEC, memory_kind=self.cache_config.host_memory_kind)
        sh = jax.tree.map(lambda _: dev, state_like)
        cache = replace(sh.cache, host_k=host, host_v=host)
        return replace(sh, cache=cache)

    # ---- decoding -----------------------------------------------------------------------------

    def prefill(self, params, prompts, lengths=None, *, key=None):
        """The prompts [batch, T] (every process passes all of them) prefilled on the mesh:
        each data shard its sequences, each model shard its KV heads. Returns the global
        state. `params`: the global model's state, placed or not (`shard_params`)."""
        prompts = np.asarray(prompts, np.int32)
        B = self.cache_config.batch
        if prompts.ndim != 2 or prompts.shape[0] != B:
            raise ValueError(f"prompts has shape {prompts.shape}, expected ({B}, T)")
        lengths = np.full((B,), prompts.shape[1], np.int32) if lengths is None else lengths
        # the single-device checks (ids, lengths against max_len), before anything runs
        from jaxkv.decode.setup import check_prompts

        check_prompts(prompts, lengths, self.cache_config, self.model_config.vocab_size)
        lengths = np.asarray(lengths, np.int32)  # whole numbers: checked
        nd = self.mesh.shape[DATA]
        data = NamedSharding(self.mesh, P(DATA))
        p = global_array(prompts.reshape(nd, B // nd, -1), data)
        n = global_array(lengths.reshape(nd, B // nd), data)
        key = jax.random.key(0) if key is None else key
        return self._prefill_fn(p.shape[-1])(params, p, n, jax.random.key_data(key))

    def step(self, params, state):
        """One decode step on every device (the state is donated); each device ends its
        window when its own (staggered) window is due."""
        if _steps(state) >= self.max_new_tokens - 1:
            raise ValueError(
                f"the state has decoded max_new_tokens={self.max_new_tokens} tokens: no room "
                "for another; build the ShardedDecoder with a larger max_new_tokens"
            )
        return self._step_fn(params, state)

    def generate(self, params, state, until: int | None = None):
        """Steps until `until` steps (default max_new_tokens - 1); the state is donated.

        Raises NonFiniteLogitsError (`.state` holds the state) naming the first step and the
        (global) sequences whose logits held a NaN or inf, as `Decoder.generate` does: read
        once after the loop (the steps never sync with the host)."""
        until = self.max_new_tokens - 1 if until is None else min(until, self.max_new_tokens - 1)
        done = _steps(state)
        for _ in range(max(0, until - done)):
            state = self._step_fn(params, state)
        bad = _host(state.sampling.bad_step)  # [data, model, batch / data]
        # a sequence's logits are the same on its model shards; the earliest flag if not
        bad = np.where(bad < 0, np.iinfo(np.int32).max, bad).min(axis=1)
        check_finite(state, np.where(bad == np.iinfo(np.int32).max, -1, bad).reshape(-1))
        return state

    # ---- reading results ----------------------------------------------------------------------

    def tokens(self, state) -> np.ndarray:
        """[batch, max_new_tokens] tokens (every model shard holds the same; the first's)."""
        t = _host(state.sampling.tokens)[:, 0]  # [data, batch / data, n]
        return t.reshape(self.cache_config.batch, -1)

    def local_state(self, state, device: int):
        """Device `device`'s (row-major over data, model) own DecodeState, on the host."""
        nm = self.mesh.shape[MODEL]
        i, j = divmod(device, nm)
        return jax.tree.map(lambda x: _host(x)[i, j], state)

    def phases(self) -> list[int]:
        """Each device's window phase: steps its first window is delayed by."""
        nm = self.mesh.shape[MODEL]
        return [self._phase(d // nm, d % nm) for d in range(self.num_devices)]

    def _phase(self, row, col):
        """The window phase of the device at (row, col) of the mesh (ints or traced): the
        stagger times its index, or its row's under plan_over="model"."""
        d = row if self.plan_over == MODEL else row * self.mesh.shape[MODEL] + col
        return (d * self.stagger) % self.placement.window

    # ---- the per-device functions --------------------------------------------------------------

    def _unstack(self, tree):
        return jax.tree.map(lambda x: x[0, 0], tree)

    def _stack(self, tree):
        return jax.tree.map(lambda x: x[None, None], tree)

    def _prefill_fn(self, T: int):
        """The jitted prefill of prompts of T tokens (one compile per T)."""
        if T not in self._prefills:
            self._prefills[T] = self._build_prefill(T)
        return self._prefills[T]

    def _build_prefill(self, T: int):
        return jax.jit(self._prefill_map(), out_shardings=self._shardings)

    @functools.cached_property
    def _shardings(self):
        """The global state's shardings (its shapes do not depend on the prompt length)."""
        nd, c = self.mesh.shape[DATA], self.cache_config
        shapes = jax.eval_shape(
            self._prefill_map(),
            self._abstract,
            jax.ShapeDtypeStruct((nd, c.batch // nd, 1), jnp.int32),
            jax.ShapeDtypeStruct((nd, c.batch // nd), jnp.int32),
            jax.ShapeDtypeStruct((2,), jnp.uint32),
        )
        return self.state_shardings(shapes)

    def _prefill_map(self):
        """The prefill over the mesh (a shard_map, not jitted)."""
        local, mesh = self.local, self.mesh

        def body(params, prompts, lengths, key):
            st = local.device_prefill(params, prompts[0], lengths[0], jax.random.wrap_key_data(key))
            phase = self._phase(jax.lax.axis_index(DATA), jax.lax.axis_index(MODEL))
            pl = st.placement
            st = replace(st, placement=replace(pl, since_plan=pl.since_plan - phase))
            return self._stack(st)

        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(self.param_specs, P(DATA), P(DATA), P()),
            out_specs=STATE_SPEC,
            check_vma=False,
        )

    @functools.cached_property
    def _step_fn(self):
        local = self.local

        def body(params, state):
            st = local.device_step(params, self._unstack(state))
            return self._stack(st)

        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(self.param_specs, STATE_SPEC),
            out_specs=STATE_SPEC,
            check_vma=False,
        )
        return jax.jit(fn, donate_argnums=(1,), out_shardings=self._shardings)


def _steps(state) -> int:
    """Steps a global state has taken (every device takes the same)."""
    return int(_host(state.sampling.step).reshape(-1)[0])


def _host(x) -> np.ndarray:
    """A global array's value on this process (all of it: gathered across processes); a PRNG
    key array's key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def summarize(dec: ShardedDecoder, state) -> dict:
    """The mesh's decode: per step the slowest device's modeled time (the devices step in
    lockstep), bytes and migrations summed over devices, and each device's migrations per
    step (`moved_trace`)."""
    m = jax.tree.map(_host, state.metrics)
    steps = _steps(state)
    lat = m.latency[..., :steps].max(axis=(0, 1))  # [steps]
    total = float(lat.sum())
    B = dec.cache_config.batch
    return {
        "devices": dec.num_devices,
        "mesh": dict(dec.mesh.shape),
        "steps": steps,
        "modeled_seconds": total,
        "modeled_tokens_per_s": B * steps / total if total > 0 else float("nan"),
        "hbm_hit_rate": float(m.hbm_reads.sum() / max(float(m.total_reads.sum()), 1.0)),
        "hbm_bytes": float(m.hbm_bytes[..., :steps].sum()),
        "host_bytes": float(m.host_bytes[..., :steps].sum()),
        "migrated_blocks": int(m.migrated_blocks.sum()),
        "moved_per_device_step": m.moved_trace[..., :steps].reshape(dec.num_devices, steps),
        "phases": dec.phases(),
    }
