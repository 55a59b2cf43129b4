"""A recorded trace replayed in the decode loop's accounting (`jaxkv.sim.loop`): the decode a
trace's model would run with a tiered cache, without the model.

`trace_setup` builds the cache a Decoder would have for the trace (one sequence of the trace's
prompt and steps; a modeled batch of B identical sequences, as the trace simulator's `--batch`,
is one sequence with B times the KV bytes per token) and the policy as the Decoder builds it
(`jaxkv.decode.setup.live_policy` in `plan_env`); `trace_record` turns the trace's attention
mass into a `LoopRecord`: each step reads its top ceil((1 - s) x sealed) sealed blocks by mass
(`jaxkv.sim.trace.read_mask`, as the simulator and a Quest-style selection) and its tail, from
the placement a Decoder's prefill leaves (HBM in write order). `jaxkv.sim.loop.replay` and
`bounds` then run on it as on a decode's record.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.cost import Geometry
from jaxkv.decode.setup import live_policy, plan_env
from jaxkv.decode.state import new_window
from jaxkv.placement import registry
from jaxkv.placement import statistics as imp
from jaxkv.placement.admission import rule_state
from jaxkv.placement.presets import Settings, resolve
from jaxkv.sim.loop import LoopMetrics, LoopRecord, LoopSetup, LoopStart
from jaxkv.sim.trace import read_mask

_DTYPES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


def trace_setup(
    trace,
    policy,
    *,
    hbm_blocks: int,
    steps: int,
    batch: int = 1,
    window: int = 16,
    max_moves: int = 64,
    profile: HardwareProfile | str = "gh200-paper",
    host_tier: str = "write-through",
    geometry: Geometry | None = None,
    policy_kwargs: dict | None = None,
) -> LoopSetup:
    """The LoopSetup of a Decoder decoding `trace` (its first `steps` steps): `hbm_blocks`
    sealed blocks per layer in HBM (the pool, the tail's slot apart), W `window`, policy
    `policy` (a name or object, as `PlacementConfig.policy`; an oracle's name too, e.g.
    "belady", which a decode cannot run but a replay can), on `profile`, in `geometry` (the
    trace's own by default, which a trace recorded with `jaxkv trace` stores) with its layers.
    """
    g = geometry or trace.geometry
    if g is None:
        raise ValueError(
            f"trace {trace.name!r} stores no geometry: pass geometry= (jaxkv.cost.GEOMETRIES)"
        )
    if g.dtype_bytes not in _DTYPES:
        raise ValueError(f"geometry dtype_bytes={g.dtype_bytes}: expected one of {list(_DTYPES)}")
    for name, v, low in (("hbm_blocks", hbm_blocks, 0), ("steps", steps, 1), ("batch", batch, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r}: expected an int >= {low}")
    if steps > trace.steps:
        raise ValueError(f"steps={steps}: expected at most the trace's {trace.steps}")
    cfg = CacheConfig(
        num_layers=trace.num_layers,
        kv_heads=g.kv_heads * g.batch * batch,
        head_dim=g.head_dim,
        batch=1,
        max_len=trace.prompt_len + steps,
        block_size=trace.block_size,
        hbm_blocks=hbm_blocks + 1,
        dtype=_DTYPES[g.dtype_bytes],
        host_tier=host_tier,
    )
    prof = HardwareProfile.preset(profile) if isinstance(profile, str) else profile
    env = plan_env(prof, cfg, float(g.weight_bytes))
    if isinstance(policy, str) and not registry.is_online(policy):  # an oracle: offline here
        settings = Settings(window=window, budget=max_moves)
        pol = resolve(policy, env, settings, **(policy_kwargs or {}))
        placement = PlacementConfig(policy="static", window=window, max_moves=max_moves)
    else:
        placement = PlacementConfig(policy=policy, window=window, max_moves=max_moves)
        pol = live_policy(placement, env, policy_kwargs or {})
    return LoopSetup(
        cache_config=cfg,
        model_config=None,
        placement=placement,
        policy=pol,
        env=env,
        profile=prof,
        weight_bytes=float(g.weight_bytes),
    )


def trace_record(trace, setup: LoopSetup, sparsity: float, *, decay: float = 0.9) -> LoopRecord:
    """The reads of the first `setup`'s steps of `trace` at sparsity s (the top ceil((1 - s)
    x sealed) sealed blocks by mass, and the tail), from a prefill's placement (the first
    blocks in HBM), with empty statistics (`decay`: the Decoder's `ema_decay`). The record's
    `decoded` figures are zeros: no decode ran."""
    c = setup.cache_config
    L, M, bs, P = c.num_layers, c.max_blocks, c.block_size, trace.prompt_len
    steps = c.max_len - P
    mass = np.zeros((steps, L, M), np.float32)
    got = np.asarray(trace.mass(0, steps), np.float32)[:, :, :M]
    mass[:, :, : got.shape[2]] = got
    reads = np.array(read_mask(jnp.asarray(mass), P, bs, sparsity, 0))
    t = np.arange(steps)
    tail = (P + t) // bs
    ok = tail < M
    reads[t[ok], :, tail[ok]] = True
    j = np.arange(M)
    start = LoopStart(
        in_hbm=np.broadcast_to(j < min(P // bs, c.hbm_pool_slots), (L, 1, M)).copy(),
        lengths=np.asarray([P], np.int32),
        stats=imp.init_stats(L, M, decay=decay),
        placement=new_window(
            jnp.int32(setup.placement.window),
            jnp.float32(0),
            setup.policy.init(L, M),
            rule_state(setup.policy, L, M),
        ),
        step=jnp.int32(0),
    )
    z = np.zeros(steps, np.float32)
    return LoopRecord(
        start=start,
        reads=reads.reshape(steps, L, 1, M),
        mass=mass.reshape(steps, L, 1, M),
        decoded=LoopMetrics(z, z, z, z.astype(np.int32), z, z),
        policy=setup.policy,
    )
