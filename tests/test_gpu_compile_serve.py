"""The serving engine's compiled functions (`jaxkv.serve.core.EngineCore`) compiled for an H200
without one: no host syncs and no loop of unknown trip count, whatever the context, in the
decode step, the step that ends a window (the annealer's plan included), the prefill chunk, the
insert and the release.

Marked `gpu_compile`: `make test-gpu-compile` runs it with JAX_PLATFORMS=cpu and the CUDA
plugin (`pip install -e .[gpu-compile]`); without them it skips with the reason. The model and
cache are the decode loop's compile check's (bench/gpu_ops.py: its small shape, 2 layers, 4
slots, HBM 25%, bf16, paged host pool), under sparse attention.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest

from jaxkv.gpu import aot as gc

pytestmark = pytest.mark.gpu_compile

needs_plugin = pytest.mark.skipif(
    not gc.plugin_available() or os.environ.get("JAX_PLATFORMS", "").split(",")[0] != "cpu",
    reason="needs the CUDA PJRT plugin (pip install -e .[gpu-compile]) and JAX_PLATFORMS=cpu",
)
LAYERS, SLOTS, CONTEXTS = 2, 4, (256, 1024)


def _gpu_ops():
    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_ops.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_engine(policy: str, context: int, names, **model_kw) -> dict:
    """{name: analysis} of the engine's functions `names` compiled for an H200, the cache's
    slots `context` tokens long; `model_kw`: LlamaConfig fields over the small shape's."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxkv import PlacementConfig
    from jaxkv.serve.core import EngineCore
    from jaxkv.serve.params import MAX_STOP_IDS
    from jaxkv.serve.sampling import Row

    g = _gpu_ops()
    model = g.abstract_model(LAYERS, {**g.SMALL, **model_kw}, context)
    c = dataclasses.replace(g.cache_config(model.config, SLOTS, context), paged_host=True)
    place = PlacementConfig(policy=policy, attention="sparse", window=16)
    core = EngineCore(model, c, place, chunk=256, profile="h200-pcie")
    params = gc.abstract(nnx.split(model)[1], host=lambda p, x: False)
    state = gc.abstract(jax.eval_shape(core.init, jax.random.key(0)), host=g._is_host_pool)
    buf = gc.abstract(jax.eval_shape(core.empty_buffer), host=lambda p, x: False)
    i32, f32 = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
    row = Row(max_new=i32, temperature=f32, top_k=i32, top_p=f32,
              key=jax.ShapeDtypeStruct((2,), jnp.uint32),
              stop=jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32))  # fmt: skip
    args = dict(
        step=(params, state), window_step=(params, state), release=(state, i32),
        insert=(params, state, buf, i32, i32, row, i32, i32), chunk_step=(params, buf, i32, i32),
    )  # fmt: skip
    return {
        n: gc.compile_for_gpu(getattr(core, n), *args[n], target="h200", name=n).analysis
        for n in names
    }


def _assert_no_sync_and_fixed_trips(rows: dict, names) -> None:
    """rows {context: {name: analysis}}: 0 host syncs and 0 unknown-trip loops in each of
    `names` at every context, its loops' trip counts the same at every context."""
    for name in names:
        for ctx in CONTEXTS:
            a = rows[ctx][name]
            assert a["host_syncs"] == 0 and a["unknown_trip_loops"] == 0, (name, ctx)
        trips = [dict(rows[ctx][name]["loop_trips"]) for ctx in CONTEXTS]
        assert trips[0] == trips[1], f"{name}: loop trips {trips} grow with the context"


@needs_plugin
@pytest.mark.parametrize("policy", ["lrfu", "lru"])
def test_engine_steps_keep_no_host_sync_and_no_loop_that_grows(policy):
    """The layer scan is the step's one loop under lrfu; lru (a sequential rule) adds its scan
    over a step's misses, of the migration budget's length (64), whatever the context."""
    rows = {ctx: compile_engine(policy, ctx, ("step", "window_step")) for ctx in CONTEXTS}
    for name in ("step", "window_step"):
        for ctx in CONTEXTS:
            a, where = rows[ctx][name], f"{policy} {name} at {ctx} tokens"
            assert a["host_syncs"] == 0, f"{where}: {a['host_syncs']} host syncs"
            assert a["unknown_trip_loops"] == 0, where
            assert dict(a["loop_trips"]).get(LAYERS, 0) >= 1, f"{where}: no layer scan"
            if policy == "lrfu":
                assert dict(a["loop_trips"]) == {LAYERS: 1}, f"{where}: {dict(a['loop_trips'])}"
        trips = [dict(rows[ctx][name]["loop_trips"]) for ctx in CONTEXTS]
        assert trips[0] == trips[1], f"{policy} {name}: loop trips {trips} grow with the context"


@needs_plugin
def test_engine_annealer_window_step_keeps_no_host_sync_and_no_loop_that_grows():
    """anneal+reuse+follow's window step: the layer scan, the reuse forecast's scan over the
    window and the annealer's loop of `max_iters` trips (compiled for a GPU it never exits
    early: `jaxkv.placement.anneal.run`), none of them growing with the context."""
    from jaxkv.config import AnnealConfig

    rows = {ctx: compile_engine("anneal+reuse+follow", ctx, ("window_step",)) for ctx in CONTEXTS}
    for ctx in CONTEXTS:
        a = rows[ctx]["window_step"]
        assert a["host_syncs"] == 0 and a["unknown_trip_loops"] == 0, (ctx, a["loop_trips"])
        assert dict(a["loop_trips"]).get(AnnealConfig().max_iters) == 1, a["loop_trips"]
    trips = [dict(rows[ctx]["window_step"]["loop_trips"]) for ctx in CONTEXTS]
    assert trips[0] == trips[1], f"loop trips {trips} grow with the context"


@needs_plugin
def test_engine_freeing_blocks_past_every_sliding_window_adds_no_loop_and_no_sync():
    """Every layer slides (128 tokens): the step and the insert also free the blocks past
    every window (`jaxkv.cache.rows.drop_passed`), scatters into the free masks and tables."""
    names = ("step", "insert")
    rows = {ctx: compile_engine("lrfu", ctx, names, sliding_window=128) for ctx in CONTEXTS}
    _assert_no_sync_and_fixed_trips(rows, names)
    assert dict(rows[CONTEXTS[0]]["step"]["loop_trips"]) == {LAYERS: 1}


@needs_plugin
def test_engine_insert_prefill_and_release_keep_no_host_sync_at_any_context():
    names = ("insert", "chunk_step", "release")
    rows = {ctx: compile_engine("lrfu", ctx, names) for ctx in CONTEXTS}
    _assert_no_sync_and_fixed_trips(rows, names)
