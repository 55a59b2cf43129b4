"""bench/forecast_recall.py on a small synthetic trace: every recall is a share of the window's
reads, and no forecaster beats the oracle's choice of the same number of blocks."""

import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "forecast_recall", Path(__file__).parents[1] / "bench" / "forecast_recall.py"
)
fr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fr)


def test_recall_is_bounded_by_the_oracle(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["synthetic:patterns", "--steps", "96", "--prompt-len", "512", "--layers", "2"]
    assert fr.main([*argv, "--window", "16", "--budget", "0.25", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["recall"]["synthetic:patterns"]
    assert row["windows"] == 3  # 5 windows after the first: 2 train the learned model
    for f in fr.FORECASTERS:
        assert 0.0 <= row[f] <= row["oracle"] + 1e-9 <= 1.0 + 1e-9, f
    assert "oracle" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sparsity", "1.0"], "--sparsity=1.0: expected a number in [0, 1)"),
        (["--budget", "0"], "--budget=0.0: expected a fraction in (0, 1)"),
        (["--window", "0"], "--window=0: expected an integer >= 1"),
    ],
)
def test_bad_options_are_refused(capsys, args, message):
    with pytest.raises(SystemExit):
        fr.main(["synthetic:patterns", *args])
    assert message in capsys.readouterr().err


def test_a_missing_trace_is_refused(capsys):
    with pytest.raises(SystemExit):
        fr.main(["nope.npz"])
    assert "'nope.npz': not a file" in capsys.readouterr().err


def test_a_trace_given_twice_is_refused(capsys):
    # rows are keyed by file name: two models' traces of one text share the trace's own name
    trace = str(Path(__file__).parents[1] / "bench" / "traces" / "default_gpl3.npz")
    with pytest.raises(SystemExit):
        fr.main([trace, trace])
    assert "given twice" in capsys.readouterr().err
