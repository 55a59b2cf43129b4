"""bench/plot_importance.py: classification rules and an end-to-end run on a synthetic trace."""

import importlib.util
import json
from pathlib import Path

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "plot_importance", Path(__file__).parents[2] / "bench" / "plot_importance.py"
)
pi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pi)


def test_classify_rules():
    steps = 90
    reads = np.zeros((steps, 4), bool)
    reads[:, 0] = True  # steady-hot
    reads[::10, 1] = True  # bursts: 9 separate runs, 10% of steps
    reads[60:, 2] = True  # late-long-tail
    got = [pi.CLASSES[c] for c in pi.classify(reads)]
    assert got == ["steady-hot", "intermittent-burst", "late-long-tail", "cold"]


def test_swings():
    mass = np.ones((20, 2)) * 0.01
    mass[::2, 1] = 0.2
    pct, step = pi.swings(mass)
    np.testing.assert_allclose(pct, [1.0, 20.0])
    np.testing.assert_allclose(step, [1.0, 20.0])


def test_end_to_end_synthetic(tmp_path):
    out, js = tmp_path / "imp.png", tmp_path / "imp.json"
    numbers = pi.main(
        [
            "synthetic:patterns",
            "--steps",
            "120",
            "--layers",
            "2",
            "--prompt-len",
            "256",
            "--out",
            str(out),
            "--json",
            str(js),
        ]
    )
    assert out.stat().st_size > 10_000
    assert json.loads(js.read_text()) == numbers
    assert 0 < numbers["reread_within_50"] <= 1
    assert abs(sum(numbers["class_fractions"].values()) - 1) < 1e-9
