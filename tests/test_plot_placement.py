"""bench/plot_placement.py: merging bench_simulate tables, refusing runs that do not compare."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "plot_placement", Path(__file__).parents[1] / "bench" / "plot_placement.py"
)
pp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pp)

SETUP = dict(
    steps=64,
    prompt_len=512,
    layers=2,
    capacity_blocks=16,
    profile="gh200-paper",
    geometry="paper",
    demote_cost=0.0,
    keep_fetched=False,
    block_size=16,
)


def cell(trace, s, ratios, unl=2.0, cap=2.2, cache=None, **setup):
    return {
        "policies": {n: {"vs_unlimited": r, "latency_s": r * unl} for n, r in ratios.items()},
        "bounds": {"unlimited_s": unl, "capacity_s": cap, "cache_s": cache},
        "setup": {**SETUP, **setup, "trace": f"synthetic:{trace}", "sparsity": s},
    }


def write(path, cells):
    path.write_text(json.dumps({"args": {}, "results": cells}))
    return path


def test_merge_later_file_replaces_a_policy_and_bounds_are_the_larger(tmp_path):
    a = write(
        tmp_path / "a.json",
        [
            cell("patterns", 0.5, {"page": 1.2, "anneal": 1.1, "unlimited": 1.0}),
            cell("patterns", 0.8, {"page": 1.05, "anneal": 1.3}, cap=1.0, cache=2.4),
        ],
    )
    b = write(tmp_path / "b.json", [cell("patterns", 0.5, {"anneal": 1.04, "oracle": 1.01})])
    cells, setup, names = pp.load([a, b])
    assert names == ["page", "anneal", "unlimited", "oracle"]
    assert cells[("synthetic:patterns", 16, 0.5)]["policies"] == {
        "page": 1.2,
        "anneal": 1.04,
        "unlimited": 1.0,
        "oracle": 1.01,
    }
    assert cells[("synthetic:patterns", 16, 0.5)]["bound"] == pytest.approx(1.1)  # capacity
    assert cells[("synthetic:patterns", 16, 0.8)]["bound"] == pytest.approx(1.2)  # cache
    md = pp.table(cells, names).splitlines()
    assert md[0] == "| trace | block | s | page | anneal | oracle | bound |"
    assert md[2] == "| patterns | 16 | 0.5 | 1.200 | 1.040 | **1.010** | 1.100 |"
    assert md[3] == "| patterns | 16 | 0.8 | **1.050** | 1.300 |  | 1.200 |"  # best of those run
    assert setup["steps"] == 64


def test_refuses_runs_that_do_not_compare_and_malformed_files(tmp_path):
    a = write(tmp_path / "a.json", [cell("patterns", 0.5, {"page": 1.2})])
    b = write(tmp_path / "b.json", [cell("patterns", 0.5, {"anneal": 1.1}, steps=128)])
    with pytest.raises(ValueError, match=r"first file's in \{'steps': \(64, 128\)"):
        pp.load([a, b])
    bad = write(tmp_path / "bad.json", [{"policies": {}, "setup": SETUP}])
    with pytest.raises(ValueError, match=r"results\[0\]: missing field 'bounds'"):
        pp.load([bad])
    with pytest.raises(ValueError, match="no such file"):
        pp.load([tmp_path / "nope.json"])
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="expected a 'results' list"):
        pp.load([tmp_path / "x.json"])


def test_end_to_end_writes_the_figure(tmp_path):
    a = write(
        tmp_path / "a.json",
        [
            cell(t, s, {"page": 1.0 + s, "anneal": 1.0 + s / 2, "unlimited": 1.0})
            for t in ("patterns", "recency-low")
            for s in (0.5, 0.8)
        ],
    )
    out = tmp_path / "fig.png"
    md = pp.main([str(a), "--policies", "anneal,page", "--out", str(out)])
    assert out.stat().st_size > 10_000
    assert md.splitlines()[0] == "| trace | block | s | anneal | page | bound |"
    with pytest.raises(ValueError, match=r"--policies \['lru-plan'\] not in the files"):
        pp.main([str(a), "--policies", "lru-plan", "--out", str(out)])
