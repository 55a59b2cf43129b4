"""Compile jitted functions for an NVIDIA GPU on a machine without one, and count what the
optimized program does per call.

XLA's GPU compiler runs on the CPU: `jax[cuda13-local]` (or `cuda12-local`) brings the CUDA PJRT
plugin, which exposes *compile-only* devices described by a GpuTargetConfigProto (the text specs
in `jaxkv/gpu_specs/*.txtpb`). The plugin only registers when JAX runs with JAX_PLATFORMS=cpu
(otherwise its CUDA check fails), so functions are traced with CPU arrays and shardings, lowered
for the "cuda" platform and the StableHLO is compiled on the compile-only client. The result is
the real optimized, scheduled HLO for sm_90a (autotuning skipped: structure, not speed).

Compile-only devices drop memory kinds, so arguments that live in host memory are traced as
CPU `pinned_host` values: `host_struct` / `abstract` build `jax.ShapeDtypeStruct`s whose aval
carries `jax.memory.Space.Host`, allocating nothing. In the compiled HLO those buffers have
layouts ending in `S(5)` (host memory space).

`analyze(hlo_text)` counts, per call of the optimized program, its GPU operations, host<->device
transfers, host compute and the points where the host waits for the device (rules: `analyze`).

Importing this module needs only jax and numpy; the CUDA plugin is needed when a compile is
requested (`gpu_target`, `compile_for_gpu`), which raises RuntimeError naming the fix otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import numpy as np

SPEC_DIR = Path(__file__).parent / "gpu_specs"
HOST_SPACE = "S(5)"  # XLA's layout memory-space annotation of pinned host memory
_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
_INSTALL_HINT = (
    "compiling for a GPU without one needs the CUDA PJRT plugin: `pip install -e .[gpu-compile]` "
    "(jax[cuda13-local]) and JAX_PLATFORMS=cpu set before jax is imported"
)


# ---- target -----------------------------------------------------------------------------------


def available_specs() -> list[str]:
    """Names of the shipped GPU target specs (`jaxkv/gpu_specs/<name>.txtpb`)."""
    return sorted(p.stem for p in SPEC_DIR.glob("*.txtpb"))


def plugin_available() -> bool:
    """True when a CUDA PJRT plugin (jax_plugins.xla_cuda13 or xla_cuda12) is installed."""
    return any(_find_spec(name) is not None for name in _PLUGINS)


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _spec_text(spec: str) -> str:
    path = Path(spec)
    if path.suffix != ".txtpb":
        path = SPEC_DIR / f"{spec}.txtpb"
    if not path.is_file():
        raise ValueError(
            f"unknown GPU spec {spec!r}: expected one of {available_specs()} or a path to a "
            "GpuTargetConfigProto .txtpb file"
        )
    return path.read_text()


@functools.cache
def gpu_target(spec: str = "h200", topology: str = "1x1x1"):
    """The first compile-only GPU device of `topology` built from GPU spec `spec` (a name in
    `available_specs()` or a .txtpb path). Cached per (spec, topology).

    Raises:
      ValueError: unknown spec.
      RuntimeError: the CUDA plugin is missing or not registered (JAX_PLATFORMS is not "cpu").
    """
    text = _spec_text(spec)
    if not plugin_available():
        raise RuntimeError(_INSTALL_HINT)
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] != "cpu":
        raise RuntimeError(f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}: " + _INSTALL_HINT)
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology=topology)
    except Exception as e:  # the plugin did not register, or rejected the spec
        raise RuntimeError(f"{_INSTALL_HINT}; get_topology_desc failed: {e}") from e
    return topo.devices[0]


def cpu_sharding(memory_kind: str = "device"):
    """SingleDeviceSharding on the first CPU device with `memory_kind` (tracing shardings)."""
    return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0], memory_kind=memory_kind)


def host_struct(shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract pinned_host array: compiles as a host-memory (S(5)) buffer, allocates nothing.

    `ShapeDtypeStruct(..., sharding=pinned_host)` alone leaves the aval's memory space at
    Device; the `_memory_space` field (what `ShapeDtypeStruct.like` sets from a real host array)
    makes in-jit `device_put`s to the device real transfers."""
    return jax.ShapeDtypeStruct(
        tuple(shape),
        dtype,
        sharding=cpu_sharding("pinned_host"),
        _memory_space=jax.memory.Space.Host,
    )


def device_struct(shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract device (HBM) array with a CPU `device` sharding."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=cpu_sharding("device"))


def abstract(tree, host=None):
    """Abstract copy of a pytree of arrays / ShapeDtypeStructs: every leaf becomes a
    `device_struct`, except leaves for which `host(path, leaf)` is true, which become
    `host_struct`s. `host=None` keeps each leaf's own memory kind (from its sharding)."""

    def leaf(path, x):
        if host is None:
            kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
            on_host = kind in ("pinned_host", "unpinned_host")
        else:
            on_host = host(path, x)
        return (host_struct if on_host else device_struct)(x.shape, x.dtype)

    return jax.tree_util.tree_map_with_path(leaf, tree)


# ---- compile ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompiledModule:
    """An optimized GPU program: its HLO text and what compiling it cost on this machine."""

    name: str
    hlo_text: str  # optimized, scheduled HLO (the executable's first module)
    lower_seconds: float  # trace + lower to StableHLO
    compile_seconds: float  # XLA GPU compile (ptxas included)
    target: str

    @functools.cached_property
    def analysis(self) -> dict:
        """`analyze(self.hlo_text)`."""
        return analyze(self.hlo_text)

    def analyze(self, scope: str | None = None) -> dict:
        """`analyze(self.hlo_text, scope)`."""
        return self.analysis if scope is None else analyze(self.hlo_text, scope)


def compile_for_gpu(
    fn,
    *args,
    donate_argnums=(),
    static_argnums=(),
    out_shardings=None,
    target: str = "h200",
    topology: str = "1x1x1",
    name: str | None = None,
) -> CompiledModule:
    """Traces `fn(*args)` with CPU shardings, lowers it for CUDA and compiles it for the
    compile-only GPU `gpu_target(target, topology)`.

    Args:
      fn: a python function (jitted here with the given options) or an already jitted one
        (then donate_argnums / static_argnums / out_shardings must be left empty).
      args: arrays or ShapeDtypeStructs (see `host_struct`, `abstract`); static arguments as
        python values.
      out_shardings: CPU shardings (they may name memory kinds), as for `jax.jit`.
    Returns:
      CompiledModule with the optimized HLO text and the lowering / compile seconds.
    """
    from jax._src import compiler
    from jax._src import mesh as mesh_lib
    from jax._src.lib import xla_client as xc

    gpu = gpu_target(target, topology)
    if hasattr(fn, "trace"):
        if donate_argnums or static_argnums or out_shardings is not None:
            raise ValueError(
                "fn is already jitted: pass donate_argnums / static_argnums / out_shardings to "
                "its jax.jit instead"
            )
        jitted = fn
    else:
        kw = {} if out_shardings is None else {"out_shardings": out_shardings}
        jitted = jax.jit(fn, donate_argnums=donate_argnums, static_argnums=static_argnums, **kw)
    name = name or getattr(fn, "__name__", "fn")
    # Pallas Triton kernels ask for the target GPU while lowering: an abstract GPU mesh
    # (Auto axes: values created inside `fn` stay unsharded, like the traced CPU arguments)
    abstract_mesh = mesh_lib.AbstractMesh(
        (1,),
        ("x",),
        axis_types=(jax.sharding.AxisType.Auto,),
        abstract_device=mesh_lib.AbstractDevice(
            device_kind=gpu.device_kind,
            num_cores=getattr(gpu, "core_count", None) or 132,
            platform="gpu",
        ),
    )
    from jaxkv.transfer import compile_target

    t0 = time.perf_counter()
    # compile_target: jaxkv's own platform switches (transfer mechanism, kernel interpreter)
    # choose the GPU's branch although the default backend is the CPU
    with jax.sharding.use_abstract_mesh(abstract_mesh), compile_target("gpu"):
        lowered = jitted.trace(*args).lower(lowering_platforms=("cuda",))
    module = lowered.compiler_ir("stablehlo")
    t1 = time.perf_counter()
    opts = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=1,
        device_assignment=np.array([[gpu]]),
        backend=gpu.client,
    )
    exe = compiler.backend_compile_and_load(gpu.client, module, xc.DeviceList((gpu,)), opts, [])
    text = exe.hlo_modules()[0].to_string()
    t2 = time.perf_counter()
    return CompiledModule(
        name=name, hlo_text=text, lower_seconds=t1 - t0, compile_seconds=t2 - t1, target=target
    )


# ---- analysis ---------------------------------------------------------------------------------

# opcodes that launch nothing: aliases, views and control structure (their bodies are counted)
_NOT_OPS = frozenset(
    {
        "parameter",
        "constant",
        "bitcast",
        "tuple",
        "get-tuple-element",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "partition-id",
        "replica-id",
        "domain",
        "while",
        "conditional",
        "call",
    }
)
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INST = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_NAME = re.compile(r"%([^\s,(){}]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_HOST_COMPUTE = re.compile(r'_xla_compute_type="host"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FUSION_KIND = re.compile(r"kind=(k\w+)")


def _balanced(s: str, start: int) -> int:
    """Index one past the parenthesis closing the one at s[start]."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "(":
            depth += 1
        elif s[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced parentheses in HLO text: {s[start : start + 80]!r}")


def _split_tuple(t: str) -> list[str]:
    """Top-level elements of a tuple type string "(a, (b, c), d)"; [t] for an array type."""
    t = t.strip()
    if not t.startswith("("):
        return [t]
    inner, parts, depth, cur = t[1:-1], [], 0, []
    for ch in inner:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur).strip())
    return parts


def _leaves(t: str) -> list[str]:
    """Array types of a (possibly nested) tuple type."""
    parts = _split_tuple(t)
    if len(parts) == 1 and parts[0] == t.strip():
        return parts
    return [x for p in parts for x in _leaves(p)]


def _is_host(t: str) -> bool:
    return HOST_SPACE in t


def _is_scalar(t: str) -> bool:
    return "[]" in t.split("{")[0]


@dataclasses.dataclass
class _Inst:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str


def parse_hlo(hlo_text: str) -> tuple[dict[str, list[_Inst]], str | None]:
    """Splits HLO text into {computation name: instructions} and returns the ENTRY's name."""
    comps: dict[str, list[_Inst]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.startswith("}"):  # "}" or e.g. '}, execution_thread="parallel"'
            current = None
            continue
        m = _INST.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        if rest.startswith("("):
            end = _balanced(rest, 0)
            type_str, tail = rest[:end], rest[end:]
        else:
            sp = rest.find(" ")
            type_str, tail = (rest, "") if sp < 0 else (rest[:sp], rest[sp:])
        mo = _OPCODE.match(tail)
        if not mo:
            continue
        open_at = mo.end() - 1
        close = _balanced(tail, open_at)
        operands = _NAME.findall(tail[open_at:close])
        comps[current].append(_Inst(name, type_str, mo.group(1), operands, tail[close:]))
    return comps, entry


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    if m:
        return _NAME.findall(m.group(1))
    m = re.search(key + r"=%?([^\s,{}]+)", attrs)
    return [m.group(1)] if m else []


_FIELDS = (
    "gpu_ops",
    "h2d",
    "d2h",
    "host_kernels",
    "host_compute",
    "loops",
    "unknown_trip_loops",
    "conditionals",
    "host_syncs",
    "command_buffers",
    "scope_gpu_ops",
    "scope_h2d",
    "scope_d2h",
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def analyze(hlo_text: str, scope: str | None = None) -> dict:
    """Counts what one call of an optimized (scheduled) XLA GPU HLO module executes.

    Computations reached from ENTRY through `while` (body, and condition when the trip count is
    unknown), `conditional` (branches) and `call` (to_apply) are walked; fusion, reduce, sort,
    async-wrapped and other called computations are the op that calls them and are not walked.

    Counting rules (each count multiplied by the known trip counts of the enclosing loops):
      gpu_ops: every instruction except parameter, constant, bitcast, tuple, get-tuple-element,
        after-all, add-dependency, opt-barrier, partition-id, replica-id, domain and the control
        ops while / conditional / call themselves (their bodies are counted). Each fusion,
        custom call, copy, copy-start, copy-done, async *-start and *-done, collective is one.
      while: with `"known_trip_count":{"n":N}` in its backend_config the body counts N times
        (XLA's WhileThunk then runs the body N times without evaluating the condition).
        Without it the condition and the body count once each and the loop adds 1 to
        `unknown_trip_loops` and to `host_syncs`: WhileThunk copies the predicate to the host
        and blocks on the stream every iteration (xla/backends/gpu/runtime/while_thunk.cc);
        the real number of syncs is that times the trip count, unknown here.
      conditional: each branch is counted on its own and the elementwise maximum over branches
        is taken (the worst branch per metric); the conditional adds 1 to `conditionals` and to
        `host_syncs`: ConditionalThunk copies the branch index to the host and calls
        BlockHostUntilDone (xla/backends/gpu/runtime/conditional_thunk.cc). Only a command
        buffer (CUDA graph) would avoid that, and XLA's default command buffer types include
        neither CONDITIONAL nor WHILE (xla/debug_options_flags.cc); jax 0.12 forms command
        buffers on thunks after the HLO (command_buffer_conversion_pass.cc), so the optimized
        HLO shows none. A conditional inside a `command_buffer*` computation (XLA's older
        HLO-level outlining, reached by a `call`) is not counted as a sync.
      h2d / d2h: transfers between host memory (layouts with S(5)) and the device, one per op:
        copy-start (result tuple element 0 is the destination), async *-start (element 1 is the
        output; e.g. an async dynamic-slice reading a host array on the H2D stream), and any
        other op (fusion, custom call, copy, dynamic-slice, ...) whose operands include a host
        buffer while it outputs a device buffer (h2d), or whose output is a host buffer while a
        non-scalar operand is a device buffer (d2h). *-done ops and host-compute ops are not
        transfers. `transfers` breaks them down by opcode.
      host_kernels: custom calls (Pallas Triton / Mosaic GPU kernels, FFI) that read a host
        operand or write a host output (also counted in h2d / d2h).
      host_compute: instructions with `_xla_compute_type="host"` (host compute offloading).
      command_buffers: `call`s to a `command_buffer*` computation.
      scope_gpu_ops / scope_h2d / scope_d2h: the same counts restricted to instructions whose
        metadata op_name contains the path segment `scope` (a `jax.named_scope`, e.g.
        "host_part" for the attention's host read); 0 when `scope` is None.
    Returns:
      dict with the fields above, `ops_by_kind` (a Counter of opcode, fusion kind or custom call
      target), `transfers` ({"h2d:<opcode>": n, "d2h:<opcode>": n}) and `loop_trips` (a
      Counter of the known trip counts of the loops: {trip count: loops}, e.g. {32: 1} for a
      scan over 32 layers).
    """
    comps, entry = parse_hlo(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation found: expected the text of an HLO module")
    types = {i.name: i.type for insts in comps.values() for i in insts}

    def empty():
        return {f: 0 for f in _FIELDS} | {
            "ops_by_kind": Counter(),
            "transfers": Counter(),
            "loop_trips": Counter(),
        }

    def add(dst, src, k=1):
        for f in _FIELDS:
            dst[f] += k * src[f]
        for key in ("ops_by_kind", "transfers", "loop_trips"):
            for name, n in src[key].items():
                dst[key][name] += k * n

    memo: dict[tuple[str, bool], dict] = {}

    def walk(comp: str, in_cmdbuf: bool, stack=()) -> dict:
        key = (comp, in_cmdbuf)
        if key in memo:
            return memo[key]
        if comp in stack:
            raise ValueError(f"recursive computation {comp!r} in HLO text")
        if comp not in comps:
            raise ValueError(f"computation {comp!r} is called but not defined in the HLO text")
        r = empty()
        for inst in comps[comp]:
            op = inst.opcode
            if op == "while":
                body = _called(inst.attrs, "body")[0]
                cond = _called(inst.attrs, "condition")[0]
                m = _TRIP.search(inst.attrs)
                sub = walk(body, in_cmdbuf, stack + (comp,))
                r["loops"] += 1
                if m:
                    add(r, sub, int(m.group(1)))
                    r["loop_trips"][int(m.group(1))] += 1
                else:
                    add(r, sub)
                    add(r, walk(cond, in_cmdbuf, stack + (comp,)))
                    r["unknown_trip_loops"] += 1
                    r["host_syncs"] += 1
                continue
            if op == "conditional":
                branches = _called(inst.attrs, "branch_computations") or (
                    _called(inst.attrs, "true_computation")
                    + _called(inst.attrs, "false_computation")
                )
                subs = [walk(b, in_cmdbuf, stack + (comp,)) for b in branches]
                worst = empty()
                for f in _FIELDS:
                    worst[f] = max(s[f] for s in subs)
                for key2 in ("ops_by_kind", "transfers", "loop_trips"):
                    for s in subs:
                        for name, n in s[key2].items():
                            worst[key2][name] = max(worst[key2][name], n)
                add(r, worst)
                r["conditionals"] += 1
                r["host_syncs"] += 0 if in_cmdbuf else 1
                continue
            if op == "call":
                for callee in _called(inst.attrs, "to_apply"):
                    cb = callee.startswith("command_buffer")
                    r["command_buffers"] += int(cb)
                    add(r, walk(callee, in_cmdbuf or cb, stack + (comp,)))
                continue
            if op in _NOT_OPS:
                continue
            r["gpu_ops"] += 1
            kind = op
            if op == "fusion":
                m = _FUSION_KIND.search(inst.attrs)
                kind = f"fusion:{m.group(1)}" if m else op
            elif op == "custom-call":
                m = _TARGET.search(inst.attrs)
                kind = f"custom-call:{m.group(1)}" if m else op
            r["ops_by_kind"][kind] += 1
            m = _OP_NAME.search(inst.attrs) if scope else None
            scoped = bool(m) and f"/{scope}/" in m.group(1) + "/"
            r["scope_gpu_ops"] += int(scoped)
            if _HOST_COMPUTE.search(inst.attrs):
                r["host_compute"] += 1
                continue
            if op.endswith("-done"):
                continue
            in_types = [types.get(o, "") for o in inst.operands]
            in_host = any(_is_host(t) for t in in_types)
            in_dev = any(t and not _is_host(t) and not _is_scalar(t) for t in in_types)
            if op == "copy-start":
                outs = [_split_tuple(inst.type)[0]]
            elif op.endswith("-start"):
                parts = _split_tuple(inst.type)
                outs = _leaves(parts[1]) if len(parts) > 1 else _leaves(inst.type)
            else:
                outs = _leaves(inst.type)
            out_host = any(_is_host(t) for t in outs)
            out_dev = any(not _is_host(t) for t in outs)
            h2d = in_host and out_dev
            d2h = out_host and in_dev
            r["h2d"] += int(h2d)
            r["d2h"] += int(d2h)
            r["scope_h2d"] += int(h2d and scoped)
            r["scope_d2h"] += int(d2h and scoped)
            if h2d:
                r["transfers"][f"h2d:{op}"] += 1
            if d2h:
                r["transfers"][f"d2h:{op}"] += 1
            if op == "custom-call" and (in_host or out_host):
                r["host_kernels"] += 1
        memo[key] = r
        return r

    out = walk(entry, False)
    return {
        **{f: out[f] for f in _FIELDS},
        "ops_by_kind": out["ops_by_kind"],
        "transfers": out["transfers"],
        "loop_trips": out["loop_trips"],
    }


def overlap(hlo_text: str) -> list[int]:
    """Per async computation on a side stream (a `call-start` with `_xla_stream_annotation`,
    e.g. `jaxkv.transfer`'s host reads), the GPU operations the schedule runs on the compute
    stream between its start and its done: what the transfer overlaps. ENTRY's first, then
    those of the other computations (e.g. a while body), each in schedule order.

    The optimized module is scheduled: instruction order within a computation is the order
    the ops are launched, so ops between a start and its done run while it is in flight."""
    comps, entry = parse_hlo(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    out = []
    # ENTRY first, then the other computations (a while body: the decode step's layer scan)
    for name in [entry] + [c for c in comps if c != entry]:
        insts = comps[name]
        where = {i.name: n for n, i in enumerate(insts)}
        for n, inst in enumerate(insts):
            if inst.opcode != "call-done" or "_xla_stream_annotation" not in inst.attrs:
                continue
            start = where.get(inst.operands[0]) if inst.operands else None
            if start is None:
                continue
            between = insts[start + 1 : n]
            out.append(
                sum(
                    1
                    for i in between
                    if i.opcode not in _NOT_OPS and not i.opcode.endswith(("-start", "-done"))
                )
            )
    return out


def summary(analysis: dict) -> dict[str, Any]:
    """The scalar fields of an `analyze` result (drops the per-kind breakdowns)."""
    return {f: analysis[f] for f in _FIELDS}
