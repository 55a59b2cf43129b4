"""What a simulation costs a trace in (jaxkv.sim.sizing): a recorded trace's own geometry by
default, a batch's step time worked by hand, batch 1 figure for figure as before batches, the
pool as a fraction of the trace, and the hints the table gives when every block fits."""

import json
import re

import numpy as np
import pytest
from conftest import random_block_trace

from jaxkv import cli, cost
from jaxkv.config import HardwareProfile
from jaxkv.sim import simulate as sim
from jaxkv.sim import sizing, trace_fields
from jaxkv.sim import trace as tr
from jaxkv.sim.cli import format_table, pool_hints, regime_line

PROF = HardwareProfile("t", 10.0, 1.0, 1e9)  # bytes per second: HBM 10, link 1
GEO = cost.Geometry("t", 1, 1, 1, 2, 10.0, 0.0)  # 4 bytes per token-layer, 10 bytes of weights


def tiny_trace(geometry=None):
    """test_simulate's tiny trace: prompt 3, block 1, one layer; both steps read blocks 1, 2."""
    ids = np.array([[[1, 2]], [[1, 2]]], np.int32)
    f = dict(version=1, prompt_len=3, block_size=1, ids=ids, mass=np.ones((2, 1, 2), np.float32))
    if geometry is not None:
        f |= dict(version=2, **trace_fields.geometry_fields(geometry))
    return tr.validate(f)


def run(names, trace=None, **kw):
    kw = (
        dict(
            profile=PROF,
            geometry=GEO,
            sparsity=0.0,
            capacity_blocks=1,
            chunk=2,
            progress=False,
            time_plans=False,
        )
        | kw
    )
    return sim.simulate(tiny_trace() if trace is None else trace, names, **kw)


def test_batch_hand_computed():
    """Three sequences each read blocks 1 and 2 (4 bytes a token-layer each): per step the KV
    bytes are 3x one sequence's, the 10 bytes of weights are read once."""
    res = run(["static", "lru-plan", "unlimited"], batch=3)
    out, b = res["policies"], res["bounds"]
    # static: block 0 in HBM; HBM (tail 12 + weights 10 + write 12) / 10 = 3.4 s, link (2 blocks
    # of 12 bytes) 24 / 1 = 24 s, twice
    assert out["static"]["latency_s"] == pytest.approx(48.0)
    # lru: step 1 promotes block 1 riding on its host read, 12 bytes of HBM write: HBM 4.6 s,
    # link 24 s
    assert out["lru-plan"]["latency_s"] == pytest.approx(48.0)
    assert out["lru-plan"]["migrated_bytes"] == pytest.approx(24.0)
    # unlimited: reads 24 + tail 12, fixed 10 + 12: max(22 / 10, 58 / 11) per step
    assert out["unlimited"]["latency_s"] == pytest.approx(2 * 58 / 11, rel=1e-6)
    assert out["static"]["tokens_per_s"] == pytest.approx(2 * 3 / 48.0)  # 2 steps x 3 tokens
    # capacity bound: the pool (one 12-byte block) and the tail in HBM, the ideal share
    # (36 + 22) x 10 / 11 - 22 = 30.7 bytes being more: HBM (24 + 22) / 10, link 12 -> 12 s
    assert b["capacity_s"] == pytest.approx(24.0)
    # cache bound: Belady's 3 crossings (blocks 1, 2 at step 0, one of them at step 1), 12 bytes
    # each over the link
    assert b["cache_crossings"] == [3] and b["cache_s"] == pytest.approx(36.0)
    assert b["best_s"] == pytest.approx(36.0)
    assert res["setup"]["batch"] == 3 and res["setup"]["block_bytes"] == 12.0
    # keep_fetched: step 1's promotion is the HBM write alone and block 1's read an HBM read:
    # HBM (12 + 12 + 10 + 12 + 12) / 10 = 5.8 s, link (block 2) 12 s; step 0 24 s
    kept = run(["lru-plan"], batch=3, keep_fetched=True)["policies"]["lru-plan"]
    assert kept["latency_s"] == pytest.approx(36.0)


# simulate(...) figures of this case as the simulator gave them before it had a batch
# (commit c935386), float for float: static, lru, unlimited (latency_s, hbm_hit_rate,
# migrated_bytes, tokens_per_s), then the bounds (unlimited, capacity, cache, best, crossings).
# Re-pinned on 2026-12-04, when traces began to refuse a block listed twice at one (step, layer)
# and random_block_trace began to keep such a block once: static, lru and the cache bound
# moved (before: static 2.4178e-08 s, lru 3.5556e-08 s, 29 crossings at layer 1); unlimited,
# the capacity bound and layer 0's crossings did not. Both runs below must still agree.
BEFORE_BATCHES = {
    "static": [2.3324444597960792e-08, 0.3643410852713178, 0.0, 514481703.9308681],
    "lru-plan": [3.356444366886535e-08, 0.24031007751937986, 10240.0, 357521194.7019785],
    "unlimited": [3.875887832904823e-09, 0.9158878504672897, 0.0, 3096064828.8437386],
    "bounds": [
        3.875887832904823e-09,
        9.898400765706583e-09,  # capacity bound in float64 since issue 45 (was 9.8984008767e-09)
        1.5644444444444444e-08,
        1.5644444444444444e-08,
        [27, 28],
    ],
}


def test_batch_1_gives_the_figures_from_before_batches():
    kw = dict(
        profile=HardwareProfile.preset("gh200-paper"),
        geometry=cost.Geometry("small", 2, 1, 8, 2, 64.0, 0.0),
        sparsity=0.5,
        capacity_blocks=4,
        chunk=6,
        progress=False,
        time_plans=False,
    )
    for batch in ({}, {"batch": 1}):
        res = sim.simulate(
            random_block_trace(5), ["static", "lru-plan", "unlimited"], **kw, **batch
        )
        got = {
            n: [v["latency_s"], v["hbm_hit_rate"], v["migrated_bytes"], v["tokens_per_s"]]
            for n, v in res["policies"].items()
        }
        b = res["bounds"]
        got["bounds"] = [b[k] for k in ("unlimited_s", "capacity_s", "cache_s", "best_s")]
        got["bounds"].append(b["cache_crossings"])
        assert got == BEFORE_BATCHES


def test_pool_per_sequence_under_a_batch():
    """The budget holds the batch's pools; capacity_blocks and hbm_fraction are per sequence."""
    g = cost.Geometry("g", 1, 1, 1, 2, 10.0, 100.0)  # 4 bytes a token-layer, 100 of parameters
    trace = random_block_trace(0, steps=2, layers=1, prompt=40, block_size=1)  # 42 blocks
    for batch, expected in ((1, 11), (2, 5), (3, 3)):  # 48 bytes of KV: 12 tokens / batch - 1
        b = cost.batched(g, batch)
        assert sizing.pool_blocks(trace, b, hbm_budget=148.0)[1:] == (expected, "hbm_budget")
        got = sizing.pool_blocks(trace, b, hbm_budget=148.0, capacity_blocks=7)[1:]
        assert got == (7, "capacity_blocks")
        got = sizing.pool_blocks(trace, b, hbm_budget=148.0, hbm_fraction=0.25)[1:]
        assert got == (11, "hbm_fraction")  # ceil(0.25 x 42)
    res = run(["static"], trace, geometry=g, capacity_blocks=None, hbm_fraction=0.25, batch=2)
    assert res["setup"]["capacity_blocks"] == 11 and res["setup"]["pool_from"] == "hbm_fraction"


def test_hbm_fraction_with_capacity_blocks():
    with pytest.raises(ValueError, match=r"hbm_fraction=0.5 and capacity_blocks=1 both size the"):
        run(["static"], hbm_fraction=0.5)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(batch=0), "batch=0: expected an integer >= 1"),
        (dict(hbm_fraction=0.0), "hbm_fraction=0.0: expected a finite number in (0, 1]"),
    ],
)
def test_batch_and_fraction_checked(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        run(["static"], capacity_blocks=None, **kw)


def test_a_recorded_trace_is_costed_in_its_own_geometry():
    own = cost.Geometry("rec", 1, 1, 1, 2, 10.0, 0.0)  # GEO under the recording model's name
    trace = tiny_trace(own)
    for choice in (None, "trace"):
        res = run(["static"], trace, geometry=choice)
        assert (res["setup"]["geometry"], res["setup"]["geometry_source"]) == ("rec", "trace")
        assert res["policies"]["static"]["latency_s"] == pytest.approx(16.0)  # GEO's figure
    res = run(["static"], trace, geometry="paper")
    assert (res["setup"]["geometry"], res["setup"]["geometry_source"]) == ("paper", "given")
    res = run(["static"], tiny_trace(), geometry=None)  # none of its own: the paper's
    assert (res["setup"]["geometry"], res["setup"]["geometry_source"]) == ("paper", "default")


def test_geometry_trace_on_a_trace_without_one():
    with pytest.raises(ValueError, match=r"geometry='trace': the trace 'file' carries no geo"):
        run(["static"], geometry="trace")


def test_geometry_of_other_depth_takes_the_traces_layers():
    """As before: a preset of 32 layers costs a 2-layer trace with 2 layers of its sizes."""
    paper = cost.get_geometry("paper")
    trace = random_block_trace(0)
    g, cap, _ = sizing.pool_blocks(trace, paper, hbm_budget=17e9)
    assert g.num_layers == 2 and g.token_bytes == paper.token_bytes
    assert cap == cost.pool_capacity(paper, 17e9, 2, trace.block_size)[1]


def _setup(trace, geometry, **kw):
    """result["setup"] of a one-step simulation of `trace` (static only)."""
    kw = dict(profile=HardwareProfile.preset("gh200-paper"), sparsity=0.5, steps=1) | kw
    return sim.simulate(trace, ["static"], geometry=geometry, progress=False, **kw)["setup"]


def _hint_pool(setup, trace, hint, geometry):
    """(pool blocks, pool blocks of the same run with one option less) under `hint`."""
    option, value = hint.split()[:2]
    g, budget, more = cost.batched(geometry, setup["batch"]), setup["hbm_budget"], {}
    if option == "--hbm-fraction":
        more["hbm_fraction"] = float(value)
    elif option == "--hbm-gb":
        budget = float(value) * 1e9
    elif option == "--batch":
        return [
            sizing.pool_blocks(trace, cost.batched(geometry, b), hbm_budget=budget)[1]
            for b in (int(value), int(value) - 1)
        ]
    elif option == "--geometry":
        g = cost.batched(cost.get_geometry(value), setup["batch"])
    return [sizing.pool_blocks(trace, g, hbm_budget=budget, **more)[1]] * 2


def test_every_block_fits_hints_what_would_help():
    """A small model's KV fits in 24 GB whole: each hint, applied, leaves HBM part of it (the
    --batch one is the smallest that does); --geometry paper only where its pool is smaller."""
    smol = cost.Geometry("smol", 30, 3, 64, 2, 9.0e6, 2.7e8)
    trace = random_block_trace(1, steps=2, layers=30, k=4, prompt=4000, block_size=16)
    setup = _setup(trace, smol)
    blocks = setup["blocks"]
    assert setup["capacity_blocks"] >= blocks
    hints = pool_hints(setup)
    assert [h.split()[0] for h in hints] == ["--hbm-fraction", "--hbm-gb", "--batch"]
    for hint in hints:  # the paper's 30-layer pool in 24 GB (1,016 blocks) holds all 251 too
        pool, fewer = _hint_pool(setup, trace, hint, smol)
        assert 1 <= pool < blocks <= fewer if hint.startswith("--batch") else 1 <= pool < blocks
    line = regime_line({"setup": setup})
    assert "every block fits: placement cannot matter (try --hbm-fraction 0.5, --hbm-gb" in line
    assert "geometry smol (given)" in line
    # a longer context: the paper's pool would not hold it
    long = random_block_trace(1, steps=2, layers=30, k=4, prompt=31_299, block_size=16)
    setup = _setup(long, smol)
    assert setup["capacity_blocks"] == setup["blocks"] == 1_957
    hint = pool_hints(setup)[-1]
    assert hint == "--geometry paper (a pool of 1,016 blocks)"
    assert _hint_pool(setup, long, hint, smol)[0] == 1_016
    # the paper's geometry itself on two layers: never suggested again
    setup = _setup(random_block_trace(0), None)
    assert setup["geometry"] == "paper" and setup["capacity_blocks"] >= setup["blocks"]
    assert not any("--geometry" in h for h in pool_hints(setup))
    assert "geometry paper (the default: the trace carries none)" in regime_line({"setup": setup})
    # a pool given in blocks: a smaller one, or the fraction
    setup = _setup(random_block_trace(0), None, capacity_blocks=99)
    assert setup["capacity_blocks"] == setup["blocks"] == 13
    assert pool_hints(setup) == ["--hbm-fraction 0.5", "--capacity-blocks below 13"]
    # no pool at all: every read crosses the link, which placement cannot change
    setup = _setup(random_block_trace(0), None, capacity_blocks=0)
    assert setup["capacity_blocks"] == 0
    line = regime_line({"setup": setup})
    assert line.startswith("HBM holds 0% of the KV blocks") and "placement decides" not in line
    assert "every read crosses the link, so placement cannot matter" in line


def test_cli_costs_a_recorded_trace_in_its_geometry(tmp_path, capsys):
    path = tmp_path / "rec.npz"
    tr.save(path, tiny_trace(cost.Geometry("smol", 1, 3, 64, 2, 9.0e6, 2.7e8)))
    argv = ["simulate", "--trace", str(path), "--policies", "static,unlimited", "--no-progress"]
    assert cli.main([*argv, "--batch", "2", "--hbm-fraction", "0.5"]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith("HBM holds 60% of the KV blocks per layer (3 of 5, per sequence of")
    assert "geometry smol (from the trace)  batch 2" in second
    assert cli.main([*argv, "--geometry", "paper", "--json"]) == 0
    setup = json.loads(capsys.readouterr().out)["setup"]
    assert (setup["geometry"], setup["geometry_source"], setup["batch"]) == ("paper", "given", 1)
    assert "geometry paper (given)" in format_table(
        dict(
            setup=setup,
            policies={},
            bounds=dict(unlimited_s=1.0, capacity_s=1.0, cache_s=None, cache_note=""),
        )
    )
