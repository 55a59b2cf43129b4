"""bench/seed_table.py --quick: every field of its JSON present and finite, the PNG written."""

import contextlib
import importlib.util
import io
import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
pytestmark = pytest.mark.slow  # the quick table takes about 40 s (CI runs make test-slow)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(JSON document, out dir, markdown printed) of one `--quick` run."""
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(BENCH))  # the script imports bench/_progress.py
    spec = importlib.util.spec_from_file_location("seed_table", BENCH / "seed_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("seed_table")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert mod.main(["--quick", "--out-dir", str(out)]) == 0
    mp.undo()
    doc = json.loads((out / "seed_table_quick.json").read_text())
    return doc, out, buf.getvalue(), mod


def test_table_fields_are_finite(quick):
    doc, _, _, mod = quick
    assert doc["table"]
    for r in doc["table"]:
        for k in ("tokens_per_s", "tokens_per_s_layers_only", "hbm_hit_rate", "speedup_vs_static"):
            assert finite(r[k]), (k, r)
        assert r["tokens_per_s"] > 0 and 0.0 <= r["hbm_hit_rate"] <= 1.0
        assert r["tokens_per_s"] < r["tokens_per_s_layers_only"]  # the LM head is charged
        if r["policy"] == "static":
            assert r["speedup_vs_static"] == 1.0
    assert doc["best_online"] in mod.ONLINE
    assert all(finite(v) for v in doc["online_geomean_speedup"].values())
    assert set(doc["seed_table"]) == {"static", "lru-plan", "paper-sa", "improved SA"}
    assert finite(doc["wall_s"]) and doc["device"] and doc["jax"]
    assert all(finite(v) for v in doc["weight_ceiling_tokens_per_s"].values())
    for r in doc["table"]:  # no policy passes the weight-bound ceiling
        assert r["tokens_per_s"] <= doc["weight_ceiling_tokens_per_s"][r["profile"]] * (1 + 1e-6)


def test_static_hit_is_the_searched_one(quick):
    """The pool search computes Static's hit rate exactly: the simulator reports the same."""
    doc, _, _, _ = quick
    for ctx, cap in doc["capacities"].items():
        assert 0 <= cap["capacity_blocks"] <= cap["blocks"]
        assert finite(cap["hbm_gb_equivalent"]) and finite(cap["static_hit"])
        for r in doc["table"]:
            if r["policy"] == "static" and r["context"] == int(ctx):
                assert r["hbm_hit_rate"] == pytest.approx(cap["static_hit"], abs=1e-6)


def test_claim_rows(quick):
    doc, _, out, _ = quick
    devices = {r["devices"] for r in doc["claim"]}
    assert devices == {1, 8}
    for r in doc["claim"]:
        assert finite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
        assert finite(r["hbm_hit_rate"]) and finite(r["weights_gb"]) and finite(r["kv_gb"])
        assert r["policy"] in ("static", doc["best_online"])
        # 141 GB of bf16 weights do not fit one gh200's 96 GB: the closed form
        assert r["closed_form"] == (r["devices"] == 1)
    assert "seed's (theirs)" in out and "best online policy" in out


def test_png_written(quick):
    pytest.importorskip("matplotlib")
    doc, out, _, _ = quick
    png = out / "seed_table_quick.png"
    assert png.exists() and png.stat().st_size > 0 and doc["png"] == str(png)
