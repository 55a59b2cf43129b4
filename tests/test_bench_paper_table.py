"""bench/paper_table.py: the --quick smoke run writes a complete JSON (finite values), a PNG."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "paper_table", Path(__file__).parents[1] / "bench" / "paper_table.py"
)
pt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pt)

POLICY_FIELDS = ("latency_s", "vs_unlimited", "hbm_hit_rate", "ms_per_step", "scaled_s")
# --quick with every policy spends about 45 s of CPU compiling the three annealers' simulations;
# one online annealer keeps the test near 20 s and every code path of the script still runs
POLICIES = ("static", "lru-plan", "page", "paper-sa", "anneal+reuse", "unlimited")


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper_table")
    argv = ["--quick", "--quiet", "--out-dir", str(out), "--policies", ",".join(POLICIES)]
    assert pt.main(argv) == 0
    return out, json.loads((out / "paper_table_quick.json").read_text())


@pytest.mark.slow  # default suite: the quick table takes about 30 s (CI runs make test-slow)
def test_quick_json_has_every_cell_with_finite_values(quick):
    _, doc = quick
    assert [r["sparsity"] for r in doc["latency"]] == [0.6, 0.9]
    for r in doc["latency"]:
        assert set(r["policies"]) == set(POLICIES)
        for n, v in r["policies"].items():
            for f in POLICY_FIELDS:
                assert finite(v[f]), (r["sparsity"], n, f, v[f])
        for n in pt.PAPER_COLS:  # the paper's figure beside ours, and our ratio to it
            assert finite(r["policies"][n]["paper_s"]), n
            assert finite(r["policies"][n]["ratio_to_paper"]), n
        assert doc["online"] == ["anneal+reuse"]
        for n in doc["online"]:  # every cell: the online policy against the paper's oracle SA
            assert finite(r["online"][n]["vs_paper_sa"])
            assert finite(r["online"][n]["vs_paper_published_sa"])
        assert isinstance(r["ordering"]["holds"], bool)
        assert len(r["ordering"]["pairs"]) == 4
        assert all(finite(p["ratio"]) for p in r["ordering"]["pairs"])
    assert [v["trace"] for v in doc["variation"]] == list(pt.VARIATION)
    for v in doc["variation"]:
        assert all(finite(x) and x > 0 for x in v["ours"].values())
        assert set(v["ratio_to_paper"]) == {"static", "lru-plan", "page", "paper-sa"}
        assert all(finite(x) for x in v["ratio_to_paper"].values())
    assert doc["best_online"] == "anneal+reuse"
    assert finite(doc["online_stats"]["anneal+reuse"]["geomean_vs_paper_sa"])
    assert doc["setup"]["planning_charged"] is False
    assert doc["device"] and doc["jax"]


@pytest.mark.slow  # default suite: the quick table takes about 30 s (CI runs make test-slow)
def test_quick_writes_the_figure(quick):
    pytest.importorskip("matplotlib")
    out, doc = quick
    png = out / "paper_table_quick.png"
    assert doc["figure"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ordering_names_the_pair_that_fails():
    lat = dict(static=5.0, **{"lru-plan": 2.0}, page=3.0, **{"paper-sa": 1.2}, unlimited=1.0)
    o = pt.ordering({n: {"latency_s": x} for n, x in lat.items()})
    assert not o["holds"]
    assert [p["holds"] for p in o["pairs"]] == [True, False, True, True]
    assert "Page is 50.0% slower" in pt.describe_order(o)
    assert pt.sa_grid("2,10:0.5,1") == ((2, 10), (0.5, 1.0))


def test_no_figure_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert pt.plot(tmp_path / "x.png", [], [], [], "") is None
    assert not (tmp_path / "x.png").exists()
