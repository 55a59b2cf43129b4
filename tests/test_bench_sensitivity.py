"""bench/sensitivity.py: the --quick run writes a JSON of finite results and a PNG; every knob's
table, guide line and panel are built (from made-up cells, without simulating)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "bench" / "sensitivity.py"
_spec = importlib.util.spec_from_file_location("sensitivity", SCRIPT)
sens = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("sensitivity", sens)  # its dataclasses look their module up
_spec.loader.exec_module(sens)

CELL_FIELDS = ("latency_s", "vs_unlimited", "hbm_hit_rate", "unlimited_s", "plans")


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _run_quick(out: Path, knobs: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(SCRIPT), "--quick", "--quiet", "--knobs", knobs, "--out-dir"]
    proc = subprocess.run(
        [*cmd, str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "device cpu" in proc.stdout and "jax " in proc.stdout
    assert "compaction: not modeled" in proc.stdout
    return json.loads((out / "sensitivity_quick.json").read_text())


def _check_doc(doc: dict, knobs: list[str], out: Path) -> None:
    for field in ("device", "jax", "sizes", "base", "traces", "knobs", "skipped", "notes"):
        assert field in doc, field
    assert math.isfinite(doc["wall_s"]) and doc["runs"] >= 1
    assert doc["traces"] == ["recency-low"]
    assert list(doc["knobs"]) == knobs
    for k, knob in doc["knobs"].items():
        assert knob["verdict"] and knob["table"].startswith(f"| {k} |")
        assert len(knob["rows"]) >= 2, k  # every knob at 2 values at least
        for row in knob["rows"]:
            cell = row["cells"]["recency-low"]
            for f in CELL_FIELDS:
                assert math.isfinite(cell[f]), (k, row["label"], f)
            assert cell["vs_unlimited"] >= 1.0 - 1e-6, (k, row["label"])  # Unlimited bounds all
            assert 0.0 <= cell["hbm_hit_rate"] <= 1.0
    if _has_matplotlib():
        assert (out / "sensitivity_quick.png").stat().st_size > 0


@pytest.mark.slow  # default suite: about 25 s (CI runs make test-slow)
def test_quick_run_json_and_png(tmp_path):
    # a subset that takes every path (several policies per pool, the +ec overrides, two
    # profiles) within the test's time; the full --quick run is the slow test below
    knobs = ["capacity", "ec", "r"]
    doc = _run_quick(tmp_path, ",".join(knobs))
    _check_doc(doc, knobs, tmp_path)
    ec = {r["label"]: r for r in doc["knobs"]["ec"]["rows"]}
    assert ec["+ec 0.15, rollback 5"]["policy"] == "anneal+ec"
    assert {r["group"] for r in doc["knobs"]["r"]["rows"]} == {"gh200", "h200-pcie"}


@pytest.mark.slow
def test_quick_run_every_knob(tmp_path):
    doc = _run_quick(tmp_path, ",".join(sens.KNOBS))
    _check_doc(doc, list(sens.KNOBS), tmp_path)


def _fake(rows, traces):
    """Rows with made-up cells: latency / Unlimited and hit rate from the row's position."""
    out = []
    for i, r in enumerate(rows):
        cells = {
            t: dict(
                vs_unlimited=1.0 + 0.1 * ((i * 7 + j * 3) % 5), hbm_hit_rate=0.1 * (i % 10), plans=i
            )
            for j, t in enumerate(traces)
        }
        out.append(sens.dataclasses.replace(r, cells=cells))
    return out


@pytest.mark.parametrize("quick", [False, True])
def test_every_knob_table_verdict_and_panel(tmp_path, quick):
    traces = list(sens.TRACES)
    stats = dict(zip(traces, (0.1, 0.6, 0.15, 0.3), strict=True))
    measured = {
        k: _fake(knob.rows(sens.Setting(), quick), traces) for k, knob in sens.KNOBS.items()
    }
    for k, rows in measured.items():
        assert len(rows) >= 2, k
        assert len({(r.label, r.policy) for r in rows}) == len(rows), k  # rows are distinct
        md = sens.table(k, rows, traces).splitlines()
        assert len(md) == len(rows) + 2 and md[0].count("|") == len(traces) + 3
        line = sens.verdict(k, rows, traces, stats)
        assert line and "\n" not in line
        assert line.startswith(f"{k}: guide "), line
    # every value level: a knob says so; one value far ahead: a guide value is judged by it
    level = {t: dict(vs_unlimited=1.0, hbm_hit_rate=0.5, plans=1) for t in traces}
    flat = [sens.dataclasses.replace(r, cells=level) for r in measured["t0"]]
    assert "insensitive" in sens.verdict("t0", flat, traces, stats)
    ahead = [
        sens.dataclasses.replace(r, cells={t: dict(level[t], vs_unlimited=v) for t in traces})
        for r, v in zip(flat, (2.0, 1.0, 2.0, 2.0) if not quick else (1.0, 2.0), strict=True)
    ]
    assert "agrees (4/4 traces)" in sens.verdict("t0", ahead, traces, stats)  # T0 quantile 0.1 best
    if quick and _has_matplotlib():  # every knob's panel (seconds: once is enough)
        assert sens.plot(list(sens.KNOBS), measured, traces, tmp_path / "p.png")
        assert (tmp_path / "p.png").stat().st_size > 0


def test_settings_reach_the_policy():
    """The knobs simulate does not expose reach Anneal through simulate(policy_kwargs=), and
    bad policy_kwargs are refused before any work."""
    from jaxkv.config import PROFILES
    from jaxkv.placement.pricing import AdaptiveWindow, Compensate
    from jaxkv.sim import simulate as sim

    setup = sim.Setup(64, 16, 1, 8, 4, 16384, 1.6e8, PROFILES["gh200-paper"])
    s = sens.Setting(budget=16, threshold=0.3, rollback=0, window=50)
    aw = sim.make_policy("anneal+aw+ec", setup, **{"window": s.window, **s.overrides()})
    assert aw.adaptive == AdaptiveWindow(20, 100, 10) and aw.window == 50
    assert (aw.interval, aw.budget, aw.compensate) == (0, 16, Compensate(0.3, 0))
    trace = sens.tr.SyntheticTrace("recency-low", 64, 4, 1, 16, 0)
    kw = dict(profile=PROFILES["gh200-paper"], geometry=sens.cost.get_geometry("paper"))
    with pytest.raises(
        ValueError, match=r"policy_kwargs\['lru-plan'\]: expected one of the anneal"
    ):
        sim.simulate(trace, ["lru-plan"], sparsity=0.5, policy_kwargs={"lru-plan": {}}, **kw)
    with pytest.raises(ValueError, match=r"\['nope'\] are not anneal knobs"):
        sim.simulate(trace, ["anneal"], sparsity=0.5, policy_kwargs={"anneal": {"nope": 1}}, **kw)


def test_bad_knob_is_refused():
    with pytest.raises(SystemExit):
        sens.parse_args(["--knobs", "capacity,compaction"])
