"""`jaxkv bench-serve` (models/bench_serve.py) on a tiny configuration: its JSON, its table,
its errors (exit 2, one line) and Ctrl-C (exit 130, one line, no output file)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxkv import cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "default", "--n", "1", "--multiples", "2", "--policies", "lrfu", "--chunk",
        "64", "--prompt-len", "40:80", "--output-len", "6:12", "--no-progress",
        "--requests-per-slot", "2"]  # fmt: skip


@pytest.mark.slow  # about 22 s; its bad options stay in the default suite
def test_bench_serve_tiny_writes_its_report(capsys, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert cli.main(["bench-serve", *TINY, "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "headline: HBM holds the full KV of N=1 requests" in text
    assert "per run, priced at default" in text
    report = json.loads(out.read_text())
    assert set(report) >= {"options", "model", "runs", "headline", "wall_s", "own_sizes"}
    assert [(r["policy"], r["concurrency"]) for r in report["runs"]] == [("all-hbm", 1),
                                                                          ("lrfu", 2)]  # fmt: skip
    run = report["runs"][1]
    assert (
        run["requests"] == 4
        and run["hbm_blocks_per_layer"] == report["runs"][0]["hbm_blocks_per_layer"]
    )  # fmt: skip  (the same HBM)
    priced = run["priced"][report["own_sizes"]]["gh200"]
    for key in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                "hbm_hit_rate", "link_bytes_per_token", "preemptions", "hbm_bound"):  # fmt: skip
        assert key in priced
    assert {r["sizes"] for r in report["headline"]} == {report["own_sizes"], "llama3-8b"}
    assert {r["profile"] for r in report["headline"]} == {"gh200", "h200-pcie"}
    for row in report["headline"]:
        assert row["ceiling"] > 1 and (row["policy"] == "all-hbm") == (row["ratio"] == 1.0)
    assert png.stat().st_size > 0 or "no figure" in text
    q = report["quality"]  # sparse against exact, teacher-forced, beside the headline
    assert q["batch"] == 8 and q["positions"] == 8 * 12 and 0 < q["read_share"] < 1
    assert 0 <= q["top1_agreement"] <= 1 and q["kl_mean"] >= 0 and q["ppl_exact"] > 1
    assert "sparse quality at that fraction (top 25%" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--multiples", "0"], "--multiples=(0,): expected ints >= 1"),
        (["--multiples", "2,x"], "--multiples='2,x': expected comma-separated ints"),
        (["--prompt-len", "50:10"], "--prompt-len=50:10: expected LO:HI with 1 <= LO <= HI"),
        (["--output-len", "a:b"], "--output-len='a:b': expected LO:HI token counts"),
        (["--policies", "belady"], "--policies='belady'"),
        (["--topk", "2"], "--topk=2.0: expected a fraction in (0, 1]"),
        (["--rate", "0"], "--rate=0.0: expected requests per second > 0"),
        (["--profile", "tpu"], "profile 'tpu': expected one of"),
        (["--n", "0"], "--n=0: expected an int >= 1"),
        (["--quality-batch", "-1"], "--quality-batch=-1: expected an int >= 0"),
        (["--prompt-len", "3000:3000"], "exceed the model's context of 2048 tokens"),
    ],
)
def test_bench_serve_bad_options_exit_2_with_one_line(capsys, args, message):
    assert cli.main(["bench-serve", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxkv bench-serve: error: ")
    assert message in err[0]


CHILD = """
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)
import sys
import models.bench_serve as bs
from jaxkv import cli
drive = bs.drive
def announced(*a, **kw):
    print("ready", flush=True)
    return drive(*a, **kw)
bs.drive = announced
sys.exit(cli.main(["bench-serve", *sys.argv[2:], "--json", sys.argv[1],
                   "--output-len", "400:400", "--prompt-len", "40:40"]))
"""


def test_bench_serve_ctrl_c_exits_130_with_one_line_and_no_file(tmp_path):
    out = tmp_path / "serve.json"
    args = [a for a in TINY if a not in ("6:12", "40:80", "--output-len", "--prompt-len")]
    # on CPU: a CUDA plugin installed beside jax (`make test-gpu-compile`) warns on stderr
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out), *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines == ["jaxkv bench-serve: interrupted (Ctrl-C); no output file was left "
                     "half-written"]  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # no JSON, no temporary file


def test_bench_script_adds_the_result_paths():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_serve
    finally:
        sys.path.pop(0)
    got = bench_serve.argv(["--n", "2"])
    assert got[:3] == ["bench-serve", "--n", "2"] and got[got.index("--json") + 1].endswith(
        "bench_serve.json")  # fmt: skip
    assert bench_serve.argv(["--json", "x.json"]).count("--json") == 1


def test_poisson_arrivals_submit_each_request_once_its_time_comes(tiny):
    """With a rate, request i is submitted at the first iteration whose modeled clock (the
    engine's profile, its own sizes) reached its arrival; an idle engine jumps to the next."""
    import numpy as np

    from jaxkv import CacheConfig, PlacementConfig
    from jaxkv.serve import Engine, timing
    from models import bench_serve as bs

    model, params = tiny
    o = bs.Options(prompt_len=(10, 30), output_len=(3, 8), rate=3e5, chunk=16)
    work = bs.make_workload(np.arange(500) % 256, 6, o, seed=1)
    assert list(work.arrivals) == sorted(work.arrivals) and work.arrivals[0] > 0
    c = CacheConfig.for_model(model.config, batch=2, max_len=o.max_len, block_size=8,
                              paged_host=True, hbm_fraction=0.5)  # fmt: skip
    eng = Engine(model, params, c, PlacementConfig(policy="lrfu"), chunk=16)
    clocks = {}
    bs.drive(eng, work, concurrency=2, clocks=clocks)
    assert all(r.status == "finished" for r in eng.requests.values()) and len(eng.requests) == 6
    prof, sizes = eng.core.decoder.profile, timing.Sizes.of_engine(eng)
    longest = max(timing.prefill_seconds(it, c, prof, sizes) + (float(it.out["latency"]) if
                  it.out is not None else 0.0) for it in eng.log)  # fmt: skip
    for rid, t in clocks.items():  # never early, at most one iteration late
        assert work.arrivals[rid] <= t <= work.arrivals[rid] + longest + 1e-12
    assert len({r.submitted for r in eng.requests.values()}) > 1  # spread over the run


def test_default_model_is_smollm2_fetched_once_else_the_small_model_with_a_note(monkeypatch):
    import models.bench_serve as bs
    from models import named

    notes = []
    monkeypatch.setattr(named, "model_path", lambda name, **kw: Path("/cache") / name)
    assert bs.default_model_spec(notes.append) == "smollm2" and notes == []

    def offline(name, **kw):
        raise named.ModelUnavailable(f"model {name!r}: it is not in the cache")

    monkeypatch.setattr(named, "model_path", offline)
    assert bs.default_model_spec(notes.append) == "default"
    assert notes == ["note: benchmarking the small default model instead of SmolLM2-135M: "
                     "model 'smollm2': it is not in the cache"]  # fmt: skip


def test_quota_runs_both_splits_beside_the_shared_pool(tiny):
    """--quota adds lru-quota and anneal-quota at every multiple; anneal-quota's engine plans
    with `AnnealQuota` over the engine's blocks per request, at bench-serve's window."""
    from jaxkv.placement.policies.anneal_quota import AnnealQuota
    from models.bench_serve import Options, _engine, runs_of

    o = Options(n=1, multiples=(2, 4), policies=("lrfu",), quota=True, prompt_len=(8, 16),
                output_len=(2, 4), block_size=8, window=5)  # fmt: skip
    assert [(p, c) for p, c, _ in runs_of(o)] == [
        ("all-hbm", 1), ("lrfu", 2), ("lrfu", 4), ("lru-quota", 2), ("lru-quota", 4),
        ("anneal-quota", 2), ("anneal-quota", 4),
    ]  # fmt: skip
    model, params = tiny
    with _engine(model, params, o, 2, "anneal-quota", False, None) as eng:
        pol = eng.core.decoder.policy
        assert isinstance(pol, AnnealQuota) and pol.window == 5
        assert pol.seq_blocks == eng.cache_config.max_blocks
