"""jaxkv.gpu.aot: the HLO analyzer on hand-written snippets and on real compiles for an H200,
and the decode loop's must-hold structure (no host syncs, no per-block loops, bulk host reads).

Marked `gpu_compile`: `make test` skips them; `make test-gpu-compile` runs them with
JAX_PLATFORMS=cpu and the CUDA plugin (`pip install -e .[gpu-compile]`). Without the plugin the
compile tests skip with the reason; the snippet tests need only jax.
"""

# ruff: noqa: E501  (hand-written HLO instruction lines are kept whole, as XLA prints them)

from __future__ import annotations

import os
import re

import pytest

from jaxkv.gpu import aot as gc
from jaxkv.gpu import hlo as gpu_hlo

pytestmark = pytest.mark.gpu_compile

needs_plugin = pytest.mark.skipif(
    not gc.plugin_available() or os.environ.get("JAX_PLATFORMS", "").split(",")[0] != "cpu",
    reason="needs the CUDA PJRT plugin (pip install -e .[gpu-compile]) and JAX_PLATFORMS=cpu",
)

# ---- hand-written HLO ---------------------------------------------------------------------

_FUSED = """
%fused_add (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %add.1 = f32[8]{0} add(%p0, %p0)
}
"""


def _module(body: str, entry: str) -> str:
    """An HLO module: the fused computation, `body` computations, then ENTRY's `entry` lines."""
    head = "HloModule m, is_scheduled=true"
    return f"{head}\n{_FUSED}\n{body}\nENTRY %main (x: f32[8]) -> f32[8] {{\n{entry}\n}}\n"


_LOOP_BODY = """
%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %f1 = f32[8]{0} fusion(%v), kind=kLoop, calls=%fused_add
  %f2 = f32[8]{0} fusion(%f1), kind=kLoop, calls=%fused_add
  %bc = f32[8]{0} bitcast(%f2)
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %bc)
}

%cond (t.1: (s32[], f32[8])) -> pred[] {
  %t.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  ROOT %lt = pred[] fusion(%i.1), kind=kLoop, calls=%fused_add
}
"""


def test_known_trip_count_multiplies_the_body():
    text = _module(
        _LOOP_BODY,
        """  %x = f32[8]{0} parameter(0)
  %c = s32[] constant(0)
  %t0 = (s32[], f32[8]{0}) tuple(%c, %x)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"},"known_init_step":{"init":"0","step":"1"}}
  %g = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %out = f32[8]{0} fusion(%g), kind=kLoop, calls=%fused_add""",
    )
    a = gpu_hlo.analyze(text)
    assert a["gpu_ops"] == 5 * 2 + 1  # body fusions x trip count + the final fusion
    assert a["unknown_trip_loops"] == 0 and a["host_syncs"] == 0 and a["loops"] == 1
    assert dict(a["loop_trips"]) == {5: 1}
    assert a["ops_by_kind"]["fusion:kLoop"] == 11


def test_unknown_trip_loop_is_a_host_sync():
    text = _module(
        _LOOP_BODY,
        """  %x = f32[8]{0} parameter(0)
  %c = s32[] constant(0)
  %t0 = (s32[], f32[8]{0}) tuple(%c, %x)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body
  ROOT %g = f32[8]{0} get-tuple-element(%w), index=1""",
    )
    a = gpu_hlo.analyze(text)
    assert a["unknown_trip_loops"] == 1 and a["host_syncs"] == 1
    assert a["gpu_ops"] == 2 + 1  # body and condition once each (per iteration)


def test_nested_unknown_loop_counts_per_outer_iteration():
    outer = """
%obody (u: (s32[], f32[8])) -> (s32[], f32[8]) {
  %u = (s32[], f32[8]{0}) parameter(0)
  ROOT %w2 = (s32[], f32[8]{0}) while(%u), condition=%cond, body=%body
}
"""
    text = _module(
        _LOOP_BODY + outer,
        """  %x = f32[8]{0} parameter(0)
  %c = s32[] constant(0)
  %t0 = (s32[], f32[8]{0}) tuple(%c, %x)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%obody, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %g = f32[8]{0} get-tuple-element(%w), index=1""",
    )
    a = gpu_hlo.analyze(text)
    assert a["unknown_trip_loops"] == 3 and a["host_syncs"] == 3 and a["gpu_ops"] == 9


def test_host_dma_direction_and_async_slices():
    text = _module(
        "",
        """  %x = f32[8]{0} parameter(0)
  %h = f32[64,8]{1,0:S(5)} parameter(1)
  %i = s32[] parameter(2)
  %cs = (f32[64,8]{1,0}, f32[64,8]{1,0:S(5)}, u32[]) copy-start(%h)
  %cd = f32[64,8]{1,0} copy-done(%cs)
  %cs2 = (f32[64,8]{1,0:S(5)}, f32[64,8]{1,0}, u32[]) copy-start(%cd)
  %cd2 = f32[64,8]{1,0:S(5)} copy-done(%cs2)
  %ds = ((f32[64,8]{1,0:S(5)}, s32[], s32[]), f32[1,8]{1,0}, u32[]) fusion-start(%h, %i, %i), kind=kLoop, calls=%fused_add
  %dd = f32[1,8]{1,0} fusion-done(%ds)
  %hk = f32[8]{0} custom-call(%h, %i), custom_call_target="__gpu$xla.gpu.triton"
  %hc = f32[64,8]{1,0:S(5)} fusion(%cd2), kind=kLoop, calls=%fused_add, frontend_attributes={_xla_compute_type="host"}
  ROOT %out = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add""",
    )
    a = gpu_hlo.analyze(text)
    assert a["h2d"] == 3  # copy-start from host, async dynamic-slice from host, the kernel
    assert a["d2h"] == 1  # copy-start to host
    assert a["host_kernels"] == 1 and a["host_compute"] == 1
    assert a["transfers"] == {
        "h2d:copy-start": 1,
        "h2d:fusion-start": 1,
        "h2d:custom-call": 1,
        "d2h:copy-start": 1,
    }
    assert a["gpu_ops"] == 9  # 2 copy-start, 2 copy-done, fusion-start/-done, kernel, 2 fusions


_BRANCHES = """
%big (b: (f32[8])) -> (f32[8]) {
  %b = (f32[8]{0}) parameter(0)
  %b0 = f32[8]{0} get-tuple-element(%b), index=0
  %b1 = f32[8]{0} fusion(%b0), kind=kLoop, calls=%fused_add
  %b2 = f32[8]{0} fusion(%b1), kind=kLoop, calls=%fused_add
  %b3 = f32[8]{0} fusion(%b2), kind=kLoop, calls=%fused_add
  ROOT %bt = (f32[8]{0}) tuple(%b3)
}

%small (s: (f32[8])) -> (f32[8]) {
  %s = (f32[8]{0}) parameter(0)
  %s0 = f32[8]{0} get-tuple-element(%s), index=0
  %s1 = f32[8]{0} fusion(%s0), kind=kLoop, calls=%fused_add
  ROOT %st = (f32[8]{0}) tuple(%s1)
}
"""


def test_conditional_takes_the_largest_branch_and_syncs():
    text = _module(
        _BRANCHES,
        """  %x = f32[8]{0} parameter(0)
  %p = pred[] parameter(1)
  %t = (f32[8]{0}) tuple(%x)
  %c = (f32[8]{0}) conditional(%p, %t, %t), true_computation=%big, false_computation=%small
  ROOT %g = f32[8]{0} get-tuple-element(%c), index=0""",
    )
    a = gpu_hlo.analyze(text)
    assert a["gpu_ops"] == 3 and a["conditionals"] == 1 and a["host_syncs"] == 1


def test_conditional_in_a_command_buffer_is_no_sync():
    cb = """
%command_buffer (q: f32[8], p.2: pred[]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  %p.2 = pred[] parameter(1)
  %t = (f32[8]{0}) tuple(%q)
  %c = (f32[8]{0}) conditional(%p.2, %t, %t), branch_computations={%big, %small}
  ROOT %g = f32[8]{0} get-tuple-element(%c), index=0
}
"""
    text = _module(
        _BRANCHES + cb,
        """  %x = f32[8]{0} parameter(0)
  %p = pred[] parameter(1)
  ROOT %r = f32[8]{0} call(%x, %p), to_apply=%command_buffer""",
    )
    a = gpu_hlo.analyze(text)
    assert a["gpu_ops"] == 3 and a["conditionals"] == 1 and a["host_syncs"] == 0
    assert a["command_buffers"] == 1


def test_scope_counts_named_scope_transfers():
    text = _module(
        "",
        """  %x = f32[8]{0} parameter(0)
  %h = f32[64,8]{1,0:S(5)} parameter(1)
  %cs = (f32[64,8]{1,0}, f32[64,8]{1,0:S(5)}, u32[]) copy-start(%h), metadata={op_name="jit(f)/model/host_part/device_put"}
  %cd = f32[64,8]{1,0} copy-done(%cs), metadata={op_name="jit(f)/model/host_part/device_put"}
  %cs2 = (f32[64,8]{1,0}, f32[64,8]{1,0:S(5)}, u32[]) copy-start(%h), metadata={op_name="jit(f)/migrate/device_put"}
  %cd2 = f32[64,8]{1,0} copy-done(%cs2)
  ROOT %out = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add""",
    )
    a = gpu_hlo.analyze(text, scope="host_part")
    assert a["h2d"] == 2 and a["scope_h2d"] == 1 and a["scope_gpu_ops"] == 2
    # every executed op is attributed to its jax source path (jit frames dropped)
    assert a["ops_by_source"] == {
        ("copy-start", "model/host_part/device_put"): 1,
        ("copy-done", "model/host_part/device_put"): 1,
        ("copy-start", "migrate/device_put"): 1,
        ("copy-done", "?"): 1,
        ("fusion:kLoop", "?"): 1,
    }


def test_explain_names_the_source_ops_that_differ_between_contexts(bench):
    same, split = ("fusion:kLoop", "model/mlp/dot"), ("fusion:kInput", "attention/reduce_max")
    sources = {
        ("step", 1, "exact", "static"): {8192: {same: 3, split: 1}, 32768: {same: 3, split: 2}}
    }
    assert bench.explain(sources) == [
        "step 1 exact static: fusion:kInput attention/reduce_max: 1 at 8192 / 2 at 32768"
    ]
    assert bench.explain({("compact", 1, "-", "-"): {8192: {same: 1}, 32768: {same: 1}}}) == []


def test_program_ops_see_a_shape_dependent_branch_but_not_a_shape():
    """`program_ops` lists a lowered program's operations whatever the shapes; a Python branch
    on a shape changes the list (what the must-hold's same-program check catches)."""
    import jax
    import jax.numpy as jnp

    def f(x):
        y = jnp.exp(x) + 1.0
        if x.shape[0] > 16:  # per-size structure, as a per-block unroll would be
            y = y * 2.0
        return y.sum()

    def ops(n):
        return gpu_hlo.program_ops(jax.jit(f).lower(jnp.zeros((n,), jnp.float32)).as_text())

    assert ops(32) == ops(1024) and "stablehlo.exponential" in ops(32)
    assert len(ops(8)) < len(ops(32)) and gpu_hlo.program_digest(ops(8)) != gpu_hlo.program_digest(
        ops(32)
    )
    assert gpu_hlo.program_digest(ops(32)) == gpu_hlo.program_digest(ops(1024))

    # jax shares a private function between calls of equal shapes: the list inlines them
    def g(x, y):
        return jnp.clip(x, 0.0, 1.0).sum() + jnp.clip(y, 0.0, 1.0).sum()

    def text(n, m):
        return jax.jit(g).lower(jnp.zeros((n,)), jnp.zeros((m,))).as_text()

    assert text(8, 8).count("func.func private") < text(8, 16).count("func.func private")
    assert gpu_hlo.program_ops(text(8, 8)) == gpu_hlo.program_ops(text(8, 16))
    with pytest.raises(ValueError, match="public func.func"):
        gpu_hlo.program_ops("module {}")


def test_analyze_rejects_text_without_entry():
    with pytest.raises(ValueError, match="ENTRY"):
        gpu_hlo.analyze("HloModule m\n")


def test_unknown_spec_is_a_value_error():
    with pytest.raises(ValueError, match="unknown GPU spec"):
        gc.gpu_target("no-such-gpu")
    assert {"h200", "gh200"} <= set(gc.available_specs())


# ---- real compiles ------------------------------------------------------------------------


@needs_plugin
def test_real_compile_loops_and_host_dma():
    import jax
    import jax.numpy as jnp

    host = gc.host_struct((64, 128), jnp.float32)
    x = gc.device_struct((128,), jnp.float32)
    n = gc.device_struct((), jnp.int32)
    dev = gc.cpu_sharding("device")

    def fixed(x):  # static trip count: no sync, body counted 7 times
        return jax.lax.fori_loop(0, 7, lambda i, x: jnp.sin(x) * x + i, x)

    def dynamic(x, n):  # traced trip count: a host sync per iteration
        return jax.lax.fori_loop(0, n, lambda i, x: jnp.sin(x) * x + i, x)

    def fetch(h, x):  # a whole host array to the device: one DMA
        return jax.device_put(h, dev).sum(0) + x

    a_fixed = gc.compile_for_gpu(fixed, x).analysis
    a_dyn = gc.compile_for_gpu(dynamic, x, n).analysis
    a_fetch = gc.compile_for_gpu(fetch, host, x).analysis
    assert a_fixed["unknown_trip_loops"] == 0 and a_fixed["host_syncs"] == 0
    assert a_fixed["gpu_ops"] >= 7
    assert a_dyn["unknown_trip_loops"] == 1 and a_dyn["host_syncs"] == 1
    assert a_fetch["h2d"] == 1 and a_fetch["d2h"] == 0
    m = gc.compile_for_gpu(fetch, host, x)
    assert "S(5)" in m.hlo_text and m.compile_seconds > 0


@needs_plugin
def test_cost_analysis_counts_every_iteration_of_a_known_loop():
    """`cost_analysis` counts a scan's body its trip count times (XLA's counts it once): a scan
    over 8 layers of [1024, 1024] f32 weights reads each layer's once, about 32 MB in all."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def f(w, x):
        return jax.lax.scan(lambda x, wl: (jnp.tanh(x @ wl), None), x, w)[0]

    m = gc.compile_for_gpu(
        f, gc.device_struct((8, 1024, 1024), np.float32), gc.device_struct((4, 1024), np.float32)
    )
    weights = 8 * 1024 * 1024 * 4
    assert weights <= m.cost["bytes accessed"] < 1.2 * weights, m.cost["bytes accessed"]
    assert gc._xla_cost(m.hlo_text)["bytes accessed"] < 0.3 * weights  # XLA's own: one layer
    assert m.memory["temp_bytes"] >= 0 and m.memory["argument_bytes"] >= weights


@needs_plugin
def test_host_struct_compiles_as_host_memory():
    import jax.numpy as jnp

    m = gc.compile_for_gpu(lambda h: h, gc.host_struct((16, 8), jnp.bfloat16))
    layout = m.hlo_text.split("entry_computation_layout={")[1].split("}")[0]
    assert "S(5)" in layout


@needs_plugin
def test_gh200_spec_compiles():
    import jax.numpy as jnp

    dev = gc.gpu_target("gh200")
    assert "GH200" in dev.device_kind
    m = gc.compile_for_gpu(lambda x: x * 2, gc.device_struct((8,), jnp.float32), target="gh200")
    assert m.analysis["gpu_ops"] >= 1


# ---- the decode loop's must-holds (small shape) -------------------------------------------

LAYERS = 2
CONTEXTS = (256, 1024)
POLICIES = ("static", "lru-plan", "anneal", "anneal+reuse+follow", "lrfu")
MODES = ("exact", "sparse")


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_ops.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _bench()


def _rows(bench, mode, policy, what, **kw):
    rows = {}
    for ctx in CONTEXTS:
        res = bench.compile_cases(
            LAYERS, ctx, 1, mode, policy, shape=bench.SMALL, target="h200", what=what, **kw
        )
        rows[ctx] = {fn: _with_program(m, a) for fn, (m, a) in res.items()}
    return rows


def _with_program(module, analysis):
    """`analysis` plus the lowered program's operation list (`jaxkv.gpu.gpu_hlo.program_ops`)."""
    return {**analysis, "program": gpu_hlo.program_ops(module.stablehlo_text)}


def _assert_must_hold(rows, fn, bench, plan_loops=None):
    """plan_loops: {trip count: loops} the window step's plan may add (fixed by the policy).
    With it the lowered program may differ between the contexts (the annealer specializes on
    the block count at trace time when a layer holds few blocks: a static choice, no loop); its
    loops, checked above at each context, may not."""
    a0, a1 = (rows[c][fn] for c in CONTEXTS)
    for ctx, a in zip(CONTEXTS, (a0, a1), strict=True):
        assert a["host_syncs"] == 0, f"{fn} at {ctx} tokens: {a['host_syncs']} host syncs"
        # the one loop allowed: the scan over the layers of a step (known trip count)
        allowed = {LAYERS: 1} if fn in ("step", "window_step") else {}
        allowed.update(plan_loops or {})
        assert dict(a["loop_trips"]) == allowed and a["loops"] == len(allowed), (
            f"{fn} at {ctx} tokens: loops {dict(a['loop_trips'])} (expected {allowed})"
        )
        assert a["unknown_trip_loops"] == 0, (
            f"{fn} at {ctx} tokens: {a['unknown_trip_loops']} unknown-trip loops"
        )
        row = {"fn": fn, "host_reads": a["scope_h2d"], "h2d": a["h2d"], "d2h": a["d2h"]}
        assert not bench.transfer_failures(row, LAYERS), bench.transfer_failures(row, LAYERS)
    if plan_loops:
        return
    # the program itself is the same at every context, op for op (only shapes differ) ...
    p0, p1 = (rows[c][fn]["program"] for c in CONTEXTS)
    assert p0 == p1, (
        f"{fn}: the lowered program has {len(p0)} ops at {CONTEXTS[0]} tokens, {len(p1)} at "
        f"{CONTEXTS[1]} (or a different list): a shape-dependent branch"
    )
    # ... and XLA's kernel choices for it may differ only within the band
    assert bench.ops_context_free({c: rows[c][fn]["gpu_ops"] for c in CONTEXTS}), (
        f"{fn}: gpu_ops {a0['gpu_ops']} at {CONTEXTS[0]} vs {a1['gpu_ops']} at {CONTEXTS[1]} "
        "tokens (per-block work in the program)"
    )


@needs_plugin
@pytest.mark.parametrize("fp8", [("host", 0), ("age", 32)])
@pytest.mark.parametrize("mode", MODES)
def test_fp8_step_must_hold_and_reads_fp8_over_the_link(bench, mode, fp8):
    """fp8="host" / "age": the same must-holds, and the host pools the step reads are float8
    buffers in host memory (S(5)): the link carries one byte an element. Under "age" the HBM
    pools are float8 device buffers too, next to the bf16 ring."""
    rows = {}
    for ctx in CONTEXTS:
        res = bench.compile_cases(
            LAYERS, ctx, 1, mode, "lru-plan", shape=bench.SMALL, target="h200", what=["step"],
            fp8=fp8[0], fp8_age=fp8[1],
        )  # fmt: skip
        rows[ctx] = {"step": _with_program(*res["step"])}
        text = res["step"][0].hlo_text
        assert re.search(r"f8e4m3fn\[[^\]]*\]\{[^}]*S\(5\)", text), "no FP8 host buffer"
        # an FP8 device pool [layers, slots, block, kv_heads, head_dim]: no memory space
        device_fp8 = re.search(r"f8e4m3fn\[\d+,\d+,16,\d+,\d+\]\{[\d,]+\}[ ,)]", text)
        assert bool(device_fp8) == (fp8[0] == "age"), "FP8 HBM pool"
    _assert_must_hold(rows, "step", bench)


@needs_plugin
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_decode_step_must_hold(bench, mode, policy):
    rows = _rows(bench, mode, policy, ["step"])
    for ctx in CONTEXTS:  # the host read is there (25% HBM): the scope check is not vacuous
        assert rows[ctx]["step"]["scope_h2d"] >= 1, (
            f"no host read inside named_scope({bench.READ_SCOPE!r}) at {ctx} tokens"
        )
    _assert_must_hold(rows, "step", bench)


@needs_plugin
def test_lrfu_prefill_with_the_prompts_prior_compiles_for_the_h200(bench):
    """lrfu's prefill recomputes the prompt's last positions (`jaxkv.decode.prompt`): a second
    scan over the layers beside the forward's, and a third loop over the layers, the prior's
    selection one layer at a time (`lax.map`: its vmapped working set over every layer was 18
    GB at batch 16 x 8k), each of known trip count; no host sync; the same program at both
    contexts. Static's prefill drops the unread queries: one scan. (lrfu at its defaults keeps
    128 queries, in `lax.map` chunks: the adaptive estimator's test below; here without it,
    32.)"""
    for policy, scans in (("static", 1), ("lrfu", 3)):
        kw = {"policy_kwargs": {"steady_queries": 0}} if policy == "lrfu" else {}
        rows = _rows(bench, "sparse", policy, ["prefill"], **kw)
        for ctx in CONTEXTS:
            a = rows[ctx]["prefill"]
            assert a["host_syncs"] == 0 and a["unknown_trip_loops"] == 0, (policy, ctx)
            want = {LAYERS: scans}  # and each layer's scan over the attention's block pairs
            pairs = bench.prefill_pairs(ctx)
            if pairs > 1:
                want[pairs] = want.get(pairs, 0) + LAYERS
            assert dict(a["loop_trips"]) == want, (policy, ctx, a["loop_trips"])
        assert rows[CONTEXTS[0]]["prefill"]["program"] == rows[CONTEXTS[1]]["prefill"]["program"]


@needs_plugin
def test_lrfu_with_the_adaptive_estimator_must_hold(bench):
    """`Lrfu(steady_queries=64)`: its step (two top-k per layer, the estimators' hit counts)
    keeps the must-holds; its prefill recomputes the prompt's last 64 positions and selects
    their blocks in chunks of 32 (`lax.map`: loops of known trip count), no host sync, the same
    program at both contexts; so does the default's prefill (128 queries, chunks of 4 trips)."""
    kw = {"policy_kwargs": {"steady_queries": 64}}
    rows = _rows(bench, "sparse", "lrfu", ["step", "prefill"], **kw)
    _assert_must_hold(rows, "step", bench)
    default = _rows(bench, "sparse", "lrfu", ["prefill"])  # 128 queries: chunks of 4 trips
    for ctx in CONTEXTS:
        a = rows[ctx]["prefill"]
        assert a["host_syncs"] == 0 and a["unknown_trip_loops"] == 0, (ctx, a["loop_trips"])
        assert dict(a["loop_trips"]).get(2, 0) >= 2, (ctx, a["loop_trips"])  # the chunks
        d = default[ctx]["prefill"]
        assert d["host_syncs"] == 0 and d["unknown_trip_loops"] == 0, (ctx, d["loop_trips"])
        assert dict(d["loop_trips"]).get(128 // 32, 0) >= 2, (ctx, d["loop_trips"])
    assert rows[CONTEXTS[0]]["prefill"]["program"] == rows[CONTEXTS[1]]["prefill"]["program"]


@needs_plugin
def test_lrfu_with_the_lookahead_must_hold(bench):
    """`Lrfu(lookahead=True)`: after sampling, layer 0's next queries (`first_query`), its
    selection and its re-decided moves from the staged copies the scan kept add no host sync,
    no loop and no link transfer: the step keeps every must-hold (64 h2d: the layers' reads)."""
    rows = _rows(bench, "sparse", "lrfu", ["step"], policy_kwargs={"lookahead": True})
    _assert_must_hold(rows, "step", bench)
    plain = _rows(bench, "sparse", "lrfu", ["step"])
    for ctx in CONTEXTS:
        a, b = rows[ctx]["step"], plain[ctx]["step"]
        assert (a["h2d"], a["d2h"], a["scope_h2d"]) == (b["h2d"], b["d2h"], b["scope_h2d"]), ctx


@needs_plugin
@pytest.mark.parametrize("fn", ["migrate", "compact"])
def test_migrate_and_compact_must_hold(bench, fn):
    rows = _rows(bench, "exact", "static", [fn])
    _assert_must_hold(rows, fn, bench)


@needs_plugin
@pytest.mark.parametrize("policy", ["static", "lru-plan", "anneal"])
def test_window_step_must_hold(bench, policy):
    """The step that ends a window (plan, bulk migration) keeps no host sync and no loop but
    the layer scan, under (static, LRU); the annealer adds its own loop of `max_iters` trips
    at every context (compiled for a GPU it never exits early: `jaxkv.placement.anneal.run`'s
    loop), where it used to converge in a loop of unknown trip count (a host sync per
    iteration) and its certificate's binary search grew with the context."""
    from jaxkv.config import AnnealConfig

    plan = {AnnealConfig().max_iters: 1} if policy == "anneal" else None
    rows = _rows(bench, "sparse", policy, ["window_step"])
    _assert_must_hold(rows, "window_step", bench, plan)


@needs_plugin
def test_host_reads_are_zero_copy_kernels_on_gpu(bench):
    """Under fetch="auto" the GPU build reads host blocks with the Pallas gather (a custom call
    on the pinned_host pool, one per layer for K and one for V), not XLA host compute."""
    res = bench.compile_cases(
        LAYERS, CONTEXTS[0], 1, "sparse", "static", shape=bench.SMALL, target="h200", what=["step"]
    )
    _, a = res["step"]
    assert a["host_compute"] == 0
    assert a["scope_h2d"] == 2 * LAYERS


def test_overlap_counts_ops_between_a_side_stream_start_and_its_done():
    hlo = """
ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %s = ((f32[8]{0}), f32[8]{0}) call-start(%p), async_execution_thread="parallel", to_apply=%c, frontend_attributes={_xla_stream_annotation="1"}
  %a = f32[8]{0} fusion(%p), kind=kLoop, calls=%f
  %b = f32[8]{0} fusion(%a), kind=kLoop, calls=%f
  %d = f32[8]{0} call-done(%s), frontend_attributes={_xla_stream_annotation="1"}
  ROOT %r = f32[8]{0} fusion(%d, %b), kind=kLoop, calls=%f
}
"""
    assert gpu_hlo.overlap(hlo) == [2]


@needs_plugin
def test_host_reads_overlap_compute_in_the_schedule(bench):
    """Each host read runs on its own stream and the compiled schedule puts compute of the
    compute stream (the layer's HBM part, the token write) between its start and its done:
    one K and one V read in the body of the scan over layers."""
    res = bench.compile_cases(
        LAYERS, CONTEXTS[0], 1, "sparse", "static", shape=bench.SMALL, target="h200", what=["step"]
    )
    m, _ = res["step"]
    ov = gpu_hlo.overlap(m.hlo_text)
    assert len(ov) == 2, ov
    assert min(ov) >= 1, ov


def test_parse_closes_a_computation_with_attributes_after_its_brace():
    """XLA closes an async thread's computation with '}, execution_thread="parallel"': the
    next computation must still be parsed (the decode step's layer scan follows one)."""
    hlo = """
%side (p: f32[8]) -> f32[8] {
  ROOT %p = f32[8]{0} parameter(0)
}, execution_thread="parallel"

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %y = f32[8]{0} fusion(%x), kind=kLoop, calls=%f
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %y)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[8]{0}) tuple(%z, %p)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %o = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    comps, entry = gpu_hlo.parse_hlo(hlo)
    assert entry == "main" and set(comps) == {"side", "body", "cond", "main"}
    a = gpu_hlo.analyze(hlo)
    assert a["gpu_ops"] == 4 and dict(a["loop_trips"]) == {4: 1}


# ---- the Llama-3.1-8B shape: bytes against the cost model, the prefill's memory -------------


@needs_plugin
@pytest.mark.parametrize("mode", MODES)
def test_step_bytes_accessed_match_the_cost_model(bench, mode):
    """The decode step of the full Llama-3.1-8B shape at 32k (32 layers, batch 1, HBM 25%),
    compiled for an H200: XLA's cost analysis of the optimized module (bytes accessed, every
    layer of the scan counted) within `BYTES_BAND` of the cost model's bytes for that step
    (`modeled_step_bytes`: weights, KV from each tier, the token writes, the host blocks'
    staged copy, the sparse selection's summaries), and not below 0.8 of them."""
    res = bench.compile_cases(
        32, 32768, 1, mode, "static", shape=bench.LLAMA_8B, target="h200", what=["step"]
    )
    module, analysis = res["step"]
    modeled = analysis["modeled_bytes"]
    got = module.cost["bytes accessed"]
    ratio = got / modeled["total"]
    parts = {k: round(v / 1e9, 3) for k, v in modeled.items()}
    assert 0.8 <= ratio <= bench.BYTES_BAND, (mode, got / 1e9, parts)
    # the weights alone are most of it: the analysis counted every layer, not one
    assert got > modeled["weights"], (got / 1e9, parts)


@needs_plugin
def test_8b_prefill_at_32k_fits_in_a_tenth_of_hbm(bench):
    """The Llama-3.1-8B shape's prefill (32 layers, 32k tokens, batch 1, the decoder's whole
    prefill: forward, cache fill, first token) compiled for an H200: its temporary memory (XLA's
    buffer assignment) under `PREFILL_TEMP_SHARE` of the H200's HBM. The scores of a dense
    softmax would be 137 GB a layer; the blocked attention's are one block pair's."""
    res = bench.compile_cases(
        32, 32768, 1, "exact", "static", shape=bench.LLAMA_8B, target="h200", what=["prefill"]
    )
    module, analysis = res["prefill"]
    fields = bench.byte_fields(module, analysis, "h200")
    assert fields["temp_share"] <= bench.PREFILL_TEMP_SHARE, fields
    assert analysis["host_syncs"] == 0 and analysis["unknown_trip_loops"] == 0
    assert dict(analysis["loop_trips"]) == {32: 1, bench.prefill_pairs(32768): 32}
