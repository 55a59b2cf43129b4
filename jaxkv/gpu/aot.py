"""Compile jitted functions for an NVIDIA GPU on a machine without one, and count what the
optimized program does per call.

XLA's GPU compiler runs on the CPU: `jax[cuda13-local]` (or `cuda12-local`) brings the CUDA PJRT
plugin, which exposes *compile-only* devices described by a GpuTargetConfigProto (the text specs
in `jaxkv/gpu/specs/*.txtpb`). The plugin only registers when JAX runs with JAX_PLATFORMS=cpu
(otherwise its CUDA check fails), so functions are traced with CPU arrays and shardings, lowered
for the "cuda" platform and the StableHLO is compiled on the compile-only client. The result is
the real optimized, scheduled HLO for sm_90a (autotuning skipped: structure, not speed).

Compile-only devices drop memory kinds, so arguments that live in host memory are traced as
CPU `pinned_host` values: `host_struct` / `abstract` build `jax.ShapeDtypeStruct`s whose aval
carries `jax.memory.Space.Host`, allocating nothing. In the compiled HLO those buffers have
layouts ending in `S(5)` (host memory space).

`jaxkv.gpu.hlo.analyze(hlo_text)` counts, per call of the optimized program, its GPU
operations, host<->device transfers, host compute and the points where the host waits for the
device (its rules: `jaxkv.gpu.hlo`); `CompiledModule.analyze` applies it to a compiled module.

`CompiledModule.cost` is XLA's cost analysis (`HloCostAnalysis`: flops, bytes accessed) of the
optimized GPU module and `CompiledModule.memory` its compiled memory statistics (argument,
output and temporary bytes). The compile-only GPU client does not implement cost analysis, so
it is run through the CPU client on the GPU's optimized module: the same analysis XLA applies
to any module, over the GPU's fusions. `HloCostAnalysis` counts a while loop's body once;
`cost_analysis` counts it its known trip count times (the scan over layers: every layer).

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
from pathlib import Path

import jax
import numpy as np

from jaxkv.gpu.hlo import analyze
from pallas_kernels.common import single_device_sharding

SPEC_DIR = Path(__file__).parent / "specs"
_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
_INSTALL_HINT = (
    "compiling for a GPU without one needs the CUDA PJRT plugin: `pip install -e .[gpu-compile]` "
    "(jax[cuda13-local]) and JAX_PLATFORMS=cpu set before jax is imported"
)


# ---- target -----------------------------------------------------------------------------------


def available_specs() -> list[str]:
    """Names of the shipped GPU target specs (`jaxkv/gpu/specs/<name>.txtpb`)."""
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


def gpu_target(spec: str = "h200", topology: str = "1x1x1"):
    """The first compile-only GPU device of `topology` built from GPU spec `spec` (a name in
    `available_specs()` or a .txtpb path)."""
    return gpu_devices(spec, topology)[0]


@functools.cache
def gpu_devices(spec: str = "h200", topology: str = "1x1x1") -> tuple:
    """Every compile-only GPU device of `topology` ("1x1x8": one host with 8 GPUs) built from
    GPU spec `spec` (a name in `available_specs()` or a .txtpb path). Cached per (spec,
    topology).

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
    return tuple(topo.devices)


def cpu_sharding(memory_kind: str = "device"):
    """SingleDeviceSharding on the first CPU device with `memory_kind` (tracing shardings)."""
    return single_device_sharding(jax.devices("cpu")[0], memory_kind=memory_kind)


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
    stablehlo_text: str = ""  # the lowered program, before XLA optimizes it
    # XLA's HloCostAnalysis of the optimized module ("flops", "bytes accessed", ...); {} where
    # the CPU client cannot parse the module's text (a sharded program's collectives)
    cost: dict = dataclasses.field(default_factory=dict)
    # compiled memory statistics: argument, output, alias and temp bytes (device and host)
    memory: dict = dataclasses.field(default_factory=dict)

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
    partitions: int = 1,
    mesh=None,
) -> CompiledModule:
    """Traces `fn(*args)` with CPU shardings, lowers it for CUDA and compiles it for the
    compile-only GPU `gpu_target(target, topology)`.

    Args:
      fn: a python function (jitted here with the given options) or an already jitted one
        (then donate_argnums / static_argnums / out_shardings must be left empty).
      args: arrays or ShapeDtypeStructs (see `host_struct`, `abstract`); static arguments as
        python values.
      out_shardings: CPU shardings (they may name memory kinds), as for `jax.jit`.
      partitions: SPMD partitions (devices of `topology`): a function jitted over a mesh of that
        many CPU devices (its shardings' mesh, e.g. `jaxkv.decode.sharded`) compiles for as many
        GPUs; `mesh`: that mesh, when `fn` has a shard_map over it.
    Returns:
      CompiledModule with the optimized HLO text and the lowering / compile seconds.
    """
    from jax._src import compiler
    from jax._src import mesh as mesh_lib
    from jax._src.lib import xla_client as xc

    gpus = gpu_devices(target, topology)[:partitions]
    if len(gpus) != partitions:
        raise ValueError(f"topology {topology!r} has {len(gpus)} GPUs, not partitions={partitions}")
    gpu = gpus[0]
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
    from pallas_kernels.common import compile_target

    t0 = time.perf_counter()
    # compile_target: jaxkv's own platform switches (transfer mechanism, kernel interpreter)
    # choose the GPU's branch although the default backend is the CPU
    # (a shard_map names its own mesh, which must then be the context: `mesh`)
    ctx = jax.set_mesh(mesh) if mesh is not None else jax.sharding.use_abstract_mesh(abstract_mesh)
    with ctx, compile_target("gpu"):
        lowered = jitted.trace(*args).lower(lowering_platforms=("cuda",))
    module = lowered.compiler_ir("stablehlo")
    t1 = time.perf_counter()
    opts = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=partitions,
        device_assignment=np.array([list(gpus)]),
        backend=gpu.client,
    )
    exe = compiler.backend_compile_and_load(gpu.client, module, xc.DeviceList(gpus), opts, [])
    hlo_module = exe.hlo_modules()[0]
    text = hlo_module.to_string()
    t2 = time.perf_counter()
    return CompiledModule(
        name=name,
        hlo_text=text,
        lower_seconds=t1 - t0,
        compile_seconds=t2 - t1,
        target=target,
        stablehlo_text=str(module),
        cost=_cost_where_parsed(text),
        memory=memory_stats(exe),
    )


def _cost_where_parsed(hlo_text: str) -> dict:
    """`cost_analysis(hlo_text)`, or {} where the CPU client cannot parse the GPU module: the
    text of a sharded program's collectives carries GPU-only attributes (an all-reduce's
    `output_to_operand_aliasing`) that the HLO text parser does not accept."""
    try:
        return cost_analysis(hlo_text)
    except jax.errors.JaxRuntimeError as e:
        if "Syntax error" not in str(e):
            raise
        return {}


def _xla_cost(hlo_text: str) -> dict:
    """XLA's `HloCostAnalysis` of the module in `hlo_text`, run by the CPU client (the
    compile-only GPU client does not implement it). A while loop's body counts once."""
    from jax._src.lib import _jax
    from jaxlib import _hlo

    module = _hlo.hlo_module_from_text(hlo_text)
    return dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))


def _body_module(hlo_text: str, body: str) -> str:
    """`hlo_text`'s computations with an ENTRY that calls computation `body` once (its
    parameter becomes the ENTRY's), as HLO text."""
    lines, out, header = hlo_text.splitlines(), [], None
    in_entry = False
    for line in lines:
        if line.startswith("HloModule"):
            out.append("HloModule body_cost")
            continue
        if line.startswith("ENTRY"):
            in_entry = True
            continue
        if in_entry:
            in_entry = not line.startswith("}")
            continue
        if line.startswith(f"%{body} ") or line.startswith(f"{body} "):
            header = line
        out.append(line)
    if header is None:
        raise ValueError(f"no computation {body!r} in the module")
    start = header.index("(")
    end = _hlo_balanced(header, start)
    param = header[start + 1 : end - 1]  # "name: type"
    ptype = param.split(":", 1)[1].strip()
    rtype = header[end:].split("->", 1)[1].rsplit("{", 1)[0].strip()
    out += [
        f"ENTRY %body_cost_entry (p: {ptype}) -> {rtype} {{",
        f"  %p = {ptype} parameter(0)",
        f"  ROOT %c = {rtype} call(%p), to_apply=%{body}",
        "}",
    ]
    return "\n".join(out) + "\n"


def cost_analysis(hlo_text: str, computation: str | None = None) -> dict:
    """XLA's `HloCostAnalysis` ("flops", "bytes accessed", ...) of an optimized module's text,
    with the body of every while loop of known trip count n counted n times (XLA's counts it
    once), loops nested in loop bodies included; `computation`: of that computation alone
    (called once), for the recursion. Loops inside other called computations (a conditional's
    branches) count once."""
    from jaxkv.gpu.hlo import _TRIP, parse_hlo

    text = hlo_text if computation is None else _body_module(hlo_text, computation)
    cost = _xla_cost(text)
    comps, entry = parse_hlo(hlo_text)
    top = entry if computation is None else computation
    for inst in comps.get(top, []):
        trip = _TRIP.search(inst.attrs) if inst.opcode == "while" else None
        if trip is None or int(trip.group(1)) <= 1:
            continue
        body = re.search(r"body=%?([^\s,{}]+)", inst.attrs).group(1)
        once, true = _xla_cost(_body_module(hlo_text, body)), cost_analysis(hlo_text, body)
        n = int(trip.group(1))
        for key in ("flops", "bytes accessed", "transcendentals"):
            if key in cost:
                cost[key] += n * true.get(key, 0.0) - once.get(key, 0.0)
    return cost


def _hlo_balanced(s: str, start: int) -> int:
    """Index one past the parenthesis closing the one at s[start]."""
    from jaxkv.gpu.hlo import _balanced

    return _balanced(s, start)


def memory_stats(executable) -> dict:
    """The compiled memory statistics of an executable (XLA's buffer assignment), bytes:
    argument, output, alias and temp sizes, device and host."""
    stats = executable.get_compiled_memory_stats()
    names = ("argument", "output", "alias", "temp")
    out = {f"{n}_bytes": int(getattr(stats, f"{n}_size_in_bytes")) for n in names}
    out.update({f"host_{n}_bytes": int(getattr(stats, f"host_{n}_size_in_bytes")) for n in names})
    return out


__all__ = [
    "CompiledModule",
    "abstract",
    "available_specs",
    "compile_for_gpu",
    "cpu_sharding",
    "device_struct",
    "gpu_devices",
    "gpu_target",
    "host_struct",
    "plugin_available",
]
