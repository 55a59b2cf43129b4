"""The house rules: the runtime imports nothing of the research side nor of `models`, no import
cycles, no module over 600 lines, every package says in one line which room it is, and the
public API is importable from `jaxkv`."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxkv", "pallas_kernels", "models")
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(path: pathlib.Path, name: str, known) -> set[str]:
    """The project modules `path` imports anywhere (module level or inside functions)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph():
    mods = _modules()
    return {name: _imports(path, name, mods) for name, path in mods.items()}


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package(name: str) -> bool:
    return _modules()[name].name == "__init__.py"


def test_no_import_cycles():
    graph = {
        m: {t for t in ts if not _is_package(t)} for m, ts in _graph().items()
    }  # a package's __init__ imports nothing of its modules here
    assert _cycles(graph) == []


def test_the_runtime_imports_nothing_of_the_research_side():
    """No module of jaxkv outside jaxkv.sim imports jaxkv.sim, even inside a function, nor names
    it to importlib or __import__ (the simulator's oracles register themselves from jaxkv.sim,
    `jaxkv.placement.registry`). The `jaxkv` command's entry point (jaxkv/cli.py) may: it
    loads the simulate subcommand by name."""
    bad = {
        m: sorted(t for t in ts if t.startswith("jaxkv.sim"))
        for m, ts in _graph().items()
        if m.startswith("jaxkv") and not m.startswith("jaxkv.sim") and m != "jaxkv.cli"
    }
    assert {m: ts for m, ts in bad.items() if ts} == {}
    named = []
    for name, path in _modules().items():
        if not name.startswith("jaxkv") or name.startswith("jaxkv.sim") or name == "jaxkv.cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                args = [a.value for a in node.args if isinstance(a, ast.Constant)]
                named += [f"{name}: {a}" for a in args if str(a).startswith("jaxkv.sim")]
    assert named == []


def test_the_library_imports_nothing_of_models():
    """jaxkv (runtime and research side) never imports the `models` package, even inside a
    function: a model comes in through the Model protocol (`jaxkv.model_api`)."""
    bad = {
        m: sorted(t for t in ts if t.split(".")[0] == "models")
        for m, ts in _graph().items()
        if m.startswith("jaxkv")
    }
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_every_package_states_its_room_in_one_line():
    """Each package's `__init__` opens with a docstring whose first line is one sentence."""
    missing = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        first = doc.split("\n")[0].strip()
        if not (first.endswith(".") and len(first) > 20):
            missing[name] = first
    assert missing == {}


def test_the_rooms_are_subpackages():
    """The folder list shows the architecture: jaxkv's top level keeps only the configs, the
    cost model, the model protocol and the command; everything else lives in a room (`serve`:
    the serving engine, above `decode`)."""
    top = sorted(
        p.stem for p in (ROOT / "jaxkv").glob("*.py") if p.stem not in ("__init__", "__main__")
    )
    assert top == ["_pytree", "cli", "config", "cost", "model_api"]
    rooms = sorted(p.parent.name for p in (ROOT / "jaxkv").glob("*/__init__.py"))
    assert rooms == ["attention", "cache", "decode", "gpu", "placement", "serve", "sim"]


def test_the_public_api_and_no_library_module_imports_it_from_the_top():
    """`jaxkv` exports the public API; inside the library, names come from their modules (an
    import of the top package's names from a library module would depend on import order)."""
    import jaxkv

    assert set(jaxkv.__all__) >= {
        "Decoder",
        "DecodeState",
        "summarize",
        "CacheConfig",
        "PlacementConfig",
        "HardwareProfile",
        "TieredKVCache",
        "FunctionalModel",
    }
    assert all(getattr(jaxkv, n) is not None for n in jaxkv.__all__)
    mods = _modules()
    bad = []
    for name, path in mods.items():
        if not name.startswith("jaxkv") or name == "jaxkv":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "jaxkv" and not node.level:
                bad += [f"{name}: {a.name}" for a in node.names if f"jaxkv.{a.name}" not in mods]
    assert bad == []


def test_no_module_over_600_lines():
    long = {}
    for folder in (*PACKAGES, "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n >= MAX_LINES:
                long[str(path.relative_to(ROOT))] = n
    assert long == {}


def test_runtime_import_loads_no_scipy_optax_or_research_module():
    """A fresh interpreter imports the decode loop and builds every online preset: neither
    scipy, optax, any module of jaxkv.sim nor `models` is loaded."""
    code = """
import sys
import jaxkv
import jaxkv.decode.decoder, jaxkv.cache, jaxkv.attention, jaxkv.decode.sharded
import jaxkv.placement.presets as pr
from jaxkv.cost import CostModel
import jaxkv.placement.registry as reg
names = ("static", "lru-plan", "lrfu", "anneal", "anneal+reuse", "anneal+reuse+follow")
names += ("anneal+aw+ec", "lru", "arc", "slru", "lfu", "tinylfu")
for name in names:
    pr.resolve(name, CostModel())
reg.describe()
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("scipy", "optax")
             or m.startswith("jaxkv.sim") or m.split(".")[0] == "models")
print(bad)
"""
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_package_data_glob_ships_a_file():
    """pyproject's package-data globs (relative to their package) each match a file, so a
    wheel carries what the code opens (e.g. the GPU target specs after a move)."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    empty = [
        f"{pkg}: {g}"
        for pkg, globs in data["package-data"].items()
        for g in globs
        if not any(p.is_file() for p in (ROOT / pkg).glob(g))
    ]
    assert empty == []


def test_the_gpu_target_specs_are_found():
    """The shipped GPU target specs are where `jaxkv.gpu.aot` looks (the H200 compile check
    needs them; the move once left the path behind)."""
    from jaxkv.gpu import aot

    assert {"h200", "gh200"} <= set(aot.available_specs())
