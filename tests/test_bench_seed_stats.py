"""bench/seed_stats.py: where the mass sits (sink share, blocks holding 90%) on hand-made mass,
and the side-by-side table on a recorded and a synthetic trace."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import load_bench

BENCH = Path(__file__).parents[1] / "bench"


@pytest.fixture(scope="module")
def ss():
    return load_bench("seed_stats")


def test_concentration_of_a_sink_and_of_uniform_mass(ss):
    mass = np.zeros((4, 2, 10), np.float32)  # steps, layers, blocks
    mass[:, 0, 0] = 1.0  # layer 0: every step's mass on block 0 (8 more live, tiny)
    mass[:, 0, 1:9] = 1e-6
    mass[:, 1, :] = 1.0  # layer 1: uniform over 10 blocks
    trace = SimpleNamespace(mass=lambda t0, n: mass[t0 : t0 + n])
    c = ss.concentration(trace, 4)
    assert c["blocks_for_90pct_by_layer"] == pytest.approx([1 / 9, 9 / 10])
    assert c["blocks_for_90pct_first_layer"] == pytest.approx(1 / 9)
    assert c["blocks_for_90pct_last_layer"] == pytest.approx(0.9)
    assert c["sink_share_median"] == pytest.approx((1.0 + 0.1) / 2, rel=1e-4)  # median of 2 layers


def test_table_of_a_recorded_and_a_synthetic_trace(ss, capsys, tmp_path):
    out = tmp_path / "s.json"
    argv = [str(BENCH / "traces/default_gpl3.npz"), "synthetic:patterns", "--steps", "64"]
    assert ss.main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| re-read within 50 steps" in table and "default_gpl3.npz" in table
    res = json.loads(out.read_text())["traces"]
    assert [r["steps"] for r in res] == [64, 64]
    assert res[1]["prompt_len"] == res[0]["prompt_len"] == 1520  # synthetic takes the file's
    for r in res:
        assert sum(r["class_fractions"].values()) == pytest.approx(1.0)
        assert 0.0 < r["blocks_for_90pct"] <= 1.0
