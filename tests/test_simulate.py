"""Simulator: hand-computed latencies, no policy beats unlimited, the CLI."""

import dataclasses
import inspect
import json
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_block_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv import cli, cost
from jaxkv.config import AnnealConfig, HardwareProfile
from jaxkv.placement import policies as pol
from jaxkv.placement.forecasts import Now, Reuse
from jaxkv.placement.pricing import Ride, Spread
from jaxkv.sim import simulate as sim
from jaxkv.sim import trace as tr

PROF = HardwareProfile("t", 10.0, 1.0, 1e9)  # bytes per second: HBM 10, link 1
GEO = cost.Geometry("t", 1, 1, 1, 2, 10.0, 0.0)  # 4 bytes per token-layer, 10 bytes of weights


def tiny_trace():
    # prompt 3 tokens, block 1: step 0 has sealed blocks 0..2, step 1 has 0..3
    ids = np.array([[[1, 2]], [[1, 2]]], np.int32)
    return tr.validate(
        dict(version=1, prompt_len=3, block_size=1, ids=ids, mass=np.ones((2, 1, 2), np.float32))
    )


def run(names, trace=None, **kw):
    return sim.simulate(
        trace or tiny_trace(),
        names,
        profile=PROF,
        geometry=GEO,
        sparsity=0.0,
        capacity_blocks=1,
        chunk=2,
        progress=False,
        **kw,
    )["policies"]


def test_hand_computed_static_lru_and_unlimited():
    out = run(["static", "lru-plan", "unlimited"])
    # static: block 0 in HBM, reads 1, 2 from host each step: HBM (tail 4 + weights 10 + write 4)
    # / 10 = 1.8 s vs link 8 / 1 = 8 s, twice.
    assert out["static"]["latency_s"] == pytest.approx(16.0)
    assert out["static"]["hbm_hit_rate"] == 0.0
    # lru: step 0 as static; step 1 promotes block 1 (missed at step 0, the most recent read;
    # ties broken by lower index) and drops block 0 (host keeps a copy). Block 1 crosses the link
    # again: it is read at step 1, so the promotion rides on that read (a host read, no separate
    # link transfer) plus an HBM write: HBM (4 + 10 + 4 + 4) / 10 = 2.2, link 8 -> 8 s.
    # No gain on this two-step trace (the promotion would pay off at a third step).
    assert out["lru-plan"]["latency_s"] == pytest.approx(16.0)
    assert out["lru-plan"]["hbm_hit_rate"] == 0.0
    assert out["lru-plan"]["migrated_bytes"] == pytest.approx(8.0)
    # unlimited: reads 8 + tail 4, fixed 14: (12 + 14) / 11 per step
    assert out["unlimited"]["latency_s"] == pytest.approx(2 * 26 / 11, rel=1e-6)
    assert out["static"]["speedup_vs_static"] == 1.0
    assert out["lru-plan"]["vs_unlimited"] == pytest.approx(16.0 / (52 / 11), rel=1e-6)


def test_hand_computed_keep_fetched():
    out = run(["lru-plan"], keep_fetched=True)
    # step 1 promotes block 1, read from host at step 0: with the fetched copy kept, only the
    # HBM write, and its read at step 1 is an HBM read: HBM (4 + 4 + 10 + 4 + 4) / 10 = 2.6,
    # link (block 2) 4 -> 4 s; step 0 as static, 8 s.
    assert out["lru-plan"]["latency_s"] == pytest.approx(12.0)
    assert out["lru-plan"]["hbm_hit_rate"] == pytest.approx(0.25)


def test_hand_computed_exclusive_demotion_cost():
    out = run(["lru-plan"], demote_cost=1.0)
    # the demotion of block 0 now costs 4 bytes on each side: at step 1 HBM (22 + 4) / 10 = 2.6,
    # link 8 (reads of 1, 2) + 4 = 12 s; with step 0's 8 s, 20 s
    assert out["lru-plan"]["latency_s"] == pytest.approx(20.0)


def test_read_mask_takes_top_fraction_of_sealed_blocks():
    mass = jnp.asarray([[[0.1, 0.9, 0.5, 0.7, 0.0, 3.0]]], jnp.float32)  # [1, 1, 6]
    # prompt 5, block 1, step 0: 5 sealed blocks; s = 0.5 -> ceil(2.5) = 3 reads; block 5 unsealed
    r = np.asarray(sim.read_mask(mass, 5, 1, 0.5, 0))
    np.testing.assert_array_equal(r[0, 0], [False, True, True, True, False, False])
    r = np.asarray(sim.read_mask(mass, 5, 1, 0.0, 0))  # zero mass is never read
    np.testing.assert_array_equal(r[0, 0], [True, True, True, True, False, False])


FAST = AnnealConfig(chains=4, max_iters=100)
NAMES = [
    "static",
    "lru-plan",
    "page",
    "paper-sa",
    "anneal",
    "anneal-oracle",
    "anneal-oracle+visits",
    "anneal-oracle+dual",
    "anneal+aw+ec",
    "anneal+reuse",
    "anneal+reuse+now",
    "anneal+reuse+follow",
]


@pytest.mark.slow  # about 125 s; one fixed case runs in the default suite (below)
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**16),
    sparsity=st.sampled_from([0.0, 0.5, 0.8]),
    cap=st.sampled_from([0, 5]),
)
def test_no_policy_beats_unlimited(seed, sparsity, cap):
    check_no_policy_beats_unlimited(seed, sparsity, cap)


# one fixed case in the default suite, over a policy of each kind (every policy: the slow
# property test above, and test_no_policy_beats_unlimited_on_one_case_every_policy)
ONE_CASE = ["static", "lru-plan", "paper-sa", "anneal", "anneal-oracle+dual", "anneal+reuse+follow"]


@pytest.mark.slow  # about 23 s; the property over every policy is slow too
def test_no_policy_beats_unlimited_on_one_case():
    check_no_policy_beats_unlimited(11, 0.5, 5, names=ONE_CASE)


@pytest.mark.slow  # about 70 s
def test_no_policy_beats_unlimited_on_one_case_every_policy():
    check_no_policy_beats_unlimited(11, 0.5, 5)


def check_no_policy_beats_unlimited(seed, sparsity, cap, names=NAMES):
    trace = random_block_trace(seed)
    res = sim.simulate(
        trace,
        names + ["unlimited"],
        profile=HardwareProfile.preset("gh200-paper"),
        geometry=cost.get_geometry("paper"),
        sparsity=sparsity,
        capacity_blocks=cap,
        chunk=6,
        window=4,
        anneal_config=FAST,
        paper_sa_grid=((2,), (1.0,)),
        progress=False,
        time_plans=False,
    )
    unl = res["policies"]["unlimited"]["latency_s"]
    assert res["bounds"]["capacity_s"] >= unl * (1 - 1e-6)
    for name in names:
        v = res["policies"][name]
        assert v["latency_s"] >= unl * (1 - 1e-6), name
        assert v["latency_s"] >= res["bounds"]["capacity_s"] * (1 - 1e-5), name
        assert 0.0 <= v["hbm_hit_rate"] <= 1.0


def test_cli_json(capsys):
    rc = cli.main(
        [
            "simulate",
            "--trace",
            "synthetic:patterns",
            "--prompt-len",
            "300",
            "--steps",
            "30",
            "--layers",
            "2",
            "--geometry",
            "paper",
            "--capacity-blocks",
            "8",
            "--policies",
            "static,lru-plan,unlimited",
            "--json",
            "--no-progress",
            "--chunk",
            "15",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    keys = {
        "latency_s",
        "tokens_per_s",
        "speedup_vs_static",
        "vs_unlimited",
        "hbm_hit_rate",
        "migrated_bytes",
        "plan_seconds",
    }
    assert set(out["policies"]) == {"static", "lru-plan", "unlimited"}
    for v in out["policies"].values():
        assert set(v) == keys


def test_cli_defaults_show_the_papers_regime():
    """`jaxkv simulate` with no options: the paper's geometry (a synthetic trace has none of its
    own), where the 24 GB budget leaves HBM about half the KV at the 31,299-token prompt
    (Llama-3.1-8B's KV fits whole: one flag away), and the table's first line says so."""
    from jaxkv import cost
    from jaxkv.sim.cli import DEFAULT_HBM_GB, TRACE_SIZE, regime_line
    from jaxkv.sim.sizing import DEFAULT_GEOMETRY

    args = cli.build_parser().parse_args(["simulate"])
    assert args.geometry is None and DEFAULT_GEOMETRY == "paper" and args.hbm_gb is None
    assert DEFAULT_HBM_GB == cost.PAPER_HBM_BUDGET / 1e9
    tokens = TRACE_SIZE["prompt_len"] + TRACE_SIZE["steps"]
    for name, low, high in (("paper", 0.3, 0.7), ("llama3-8b", 1.0, 10.0)):
        share = cost.get_geometry(name).hbm_capacity_tokens(DEFAULT_HBM_GB * 1e9) / tokens
        assert low <= share <= high, (name, share)
    setup = dict(capacity_blocks=990, blocks=2085, geometry="paper")
    assert regime_line({"setup": setup}).startswith("HBM holds 47% of the KV blocks per layer")
    setup.update(capacity_blocks=3000)
    assert "every block fits: placement cannot matter" in regime_line({"setup": setup})


def test_cli_table(capsys):
    rc = cli.main(
        [
            "simulate",
            "--trace",
            "synthetic:recency-low",
            "--prompt-len",
            "200",
            "--steps",
            "10",
            "--layers",
            "1",
            "--policies",
            "static,unlimited",
            "--no-progress",
            "--chunk",
            "10",
        ]
    )
    assert rc == 0
    assert "static" in capsys.readouterr().out


def test_cli_unknown_profile_lists_names(capsys):
    assert cli.main(["simulate", "--profile", "tpu", "--no-progress"]) == 2
    assert "unknown hardware profile 'tpu'" in capsys.readouterr().err


def test_cli_unknown_policy_lists_names(capsys):
    rc = cli.main(
        [
            "simulate",
            "--policies",
            "static,fifo",
            "--prompt-len",
            "50",
            "--steps",
            "4",
            "--layers",
            "1",
            "--no-progress",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown policy 'fifo'" in err and "anneal-oracle" in err


def test_unknown_modifier():
    with pytest.raises(
        ValueError,
        match=r"unknown modifier 'xx'; expected 'aw', 'ec', 'reuse', 'now', 'follow', 'visits' "
        r"or 'dual'",
    ):
        run(["anneal+xx"])
    for bad in ("anneal+dual", "anneal-oracle+visits+dual", "anneal-oracle+aw+dual"):
        with pytest.raises(ValueError, match=r"\+dual .*anneal-oracle only"):
            run([bad])
    with pytest.raises(ValueError, match=r"\+reuse \(the re-read law .*\) applies to anneal only"):
        run(["anneal-oracle+reuse"])
    with pytest.raises(ValueError, match=r"\+visits \(.*\) applies to anneal-oracle only, not"):
        run(["anneal+visits"])
    with pytest.raises(ValueError, match=r"\+now \(.*\) applies to anneal only, not 'anneal-o"):
        run(["anneal-oracle+now"])
    with pytest.raises(ValueError, match=r"\+follow \(.*\) applies to anneal only, not"):
        run(["anneal-oracle+follow"])
    with pytest.raises(ValueError, match=r"choose one"):
        run(["anneal+reuse+now+follow"])


@pytest.mark.slow  # default suite: about 60 s each (CI runs make test-slow)
def test_dual_oracle_runs_on_the_dual_values_and_reports_their_time():
    trace = tr.SyntheticTrace("recency-low", 40, 12, 2, 4, seed=1)
    kw = dict(
        profile=HardwareProfile.preset("gh200-paper"),
        geometry=cost.get_geometry("paper"),
        sparsity=0.5,
        capacity_blocks=3,
        chunk=5,
        anneal_config=FAST,
        progress=False,
        time_plans=True,
    )
    res = sim.simulate(trace, ["anneal-oracle+dual", "unlimited"], **kw)["policies"]
    d = res["anneal-oracle+dual"]
    assert d["dual_seconds"] > 0 and d["plan_seconds"] > 0
    assert d["latency_s"] >= res["unlimited"]["latency_s"] * (1 - 1e-6)
    # the plans see the values (no tail, so no whole-visit values either): priced at zero, the
    # oracle plans as with no terminal value;
    # priced far above a step on the blocks the prompt left in HBM (0 .. 2), it keeps them and
    # moves fewer blocks
    from jaxkv.sim import lp as lpb

    def patched(scale):
        def values(*a, **k):
            v = np.zeros_like(orig(*a, **k))
            v[:, :, :3] = scale
            return v

        return values

    orig = lpb.trace_dual_values
    out = {}
    try:
        for scale in (0.0, 1.0):
            lpb.trace_dual_values = patched(scale)
            out[scale] = sim.simulate(trace, ["anneal-oracle+dual"], oracle_tail=0, **kw)[
                "policies"
            ]
    finally:
        lpb.trace_dual_values = orig
    plain = sim.simulate(trace, ["anneal-oracle"], oracle_window=2, oracle_tail=0, **kw)
    zero, kept = out[0.0]["anneal-oracle+dual"], out[1.0]["anneal-oracle+dual"]
    assert zero["latency_s"] == pytest.approx(plain["policies"]["anneal-oracle"]["latency_s"])
    assert kept["migrated_bytes"] < zero["migrated_bytes"]


def test_now_promotes_a_visit_at_its_first_read():
    # block 5 (never read before) is read at every step: anneal reads it from host at step 0,
    # unforeseen, and promotes it on its second read (a host read too); anneal+now knows step 0's
    # reads and promotes it as it is first read: 4 of 5 reads from HBM instead of 3
    ids = np.full((5, 1, 1), 5, np.int32)
    mass = np.ones((5, 1, 1), np.float32)
    trace = tr.validate(dict(version=1, prompt_len=8, block_size=1, ids=ids, mass=mass))
    out = sim.simulate(
        trace,
        ["anneal", "anneal+now"],
        profile=PROF,
        geometry=GEO,
        sparsity=0.0,
        capacity_blocks=2,
        chunk=5,
        anneal_config=AnnealConfig(chains=4, max_iters=100),
        progress=False,
        time_plans=False,
    )["policies"]
    assert out["anneal"]["hbm_hit_rate"] == pytest.approx(3 / 5)
    assert out["anneal+now"]["hbm_hit_rate"] == pytest.approx(4 / 5)
    assert out["anneal+now"]["latency_s"] < out["anneal"]["latency_s"]
    setup = sim.Setup(8, 1, 1, 13, 2, 4, 10.0, PROF)
    p = sim.make_policy("anneal+reuse+now", setup, window=3)
    assert p.forecast == Now(Reuse()) and p.horizon == 1 and p.needs_forecast
    assert Ride(1.0) in p.terms and Spread(sim.NOW_SPREAD) in p.terms and sim.NOW_SPREAD > 0
    assert not any(isinstance(t, Spread) for t in sim.make_policy("anneal+reuse", setup).terms)


# the rule as the target follows it literally (`follow_moves` may take other admit rules)
LITERAL = {"admit": "target"} if "admit" in inspect.signature(pol.follow_moves).parameters else {}


def test_follow_moves_hand_computed():
    # 8 blocks, blocks 0..3 resident; the step reads 1, 4, 5, 6; the target marks 1, 3, 4, 5, 7
    # (row 0) or also 0 (row 1). Candidates (read, on host, in the target): 5 (priority 4) then
    # 4 (priority 1); block 6 is read but not in the target. Victims (resident, out of the
    # target, unread): row 0 blocks 2 (priority 0.1) then 0 (0.5); row 1 block 2 only
    T, F = True, False
    in_hbm = jnp.asarray([[T, T, T, T, F, F, F, F]] * 2)
    valid = jnp.ones((2, 8), bool)
    reads = jnp.asarray([[F, T, F, F, T, T, T, F]] * 2)
    target = jnp.asarray([[F, T, F, T, T, T, F, T], [T, T, F, T, T, T, F, T]])
    pri = jnp.asarray([[0.5, 3.0, 0.1, 2.0, 1.0, 4.0, 9.0, 5.0]] * 2)

    def moves(room, budget):
        p, n_p, d, n_d = pol.follow_moves(
            in_hbm, valid, reads, target, pri, jnp.asarray(room), budget, **LITERAL
        )
        pm, dm = pol.moves_mask(p, n_p, 8), pol.moves_mask(d, n_d, 8)
        assert not np.any(np.asarray(pm & dm))
        got = []
        for r in range(2):
            got.append(
                (
                    [int(i) for i in np.asarray(p[r, : int(n_p[r])])],
                    [int(i) for i in np.asarray(d[r, : int(n_d[r])])],
                )
            )
        return got

    # room 0: a demotion per promotion; row 1 has a single victim, so it promotes the best only
    assert moves([0, 0], 8) == [([5, 4], [2, 0]), ([5], [2])]
    # room 1: one promotion takes the free slot, the other needs the least-expected victim
    assert moves([1, 1], 8) == [([5, 4], [2]), ([5, 4], [2])]
    # room 2: no demotion at all
    assert moves([2, 2], 8) == [([5, 4], []), ([5, 4], [])]
    # budget 1 below the 2 candidates: the best candidate, and a victim only without room
    assert moves([0, 1], 1) == [([5], [2]), ([5], [])]
    # budget 0: nothing moves
    p, n_p, d, n_d = pol.follow_moves(
        in_hbm, valid, reads, target, pri, jnp.asarray([0, 3]), 0, **LITERAL
    )
    assert p.shape == d.shape == (2, 0)
    assert np.asarray(n_p).tolist() == np.asarray(n_d).tolist() == [0, 0]
    assert not np.any(np.asarray(pol.moves_mask(p, n_p, 8)))


def _follow_trace():
    return tr.SyntheticTrace("recency-low", 40, 16, 2, 4, seed=3)


def test_follow_policy_step_by_step():
    """At every step a follow policy holds at most capacity blocks per layer, promotes only
    blocks read at that step and in the target, demotes only when it promotes, and moves nothing
    at its plan steps beyond that rule; the promoted block's read is a host read."""
    trace, cap, sparsity, W = _follow_trace(), 3, 0.5, 4
    # the toy model's slow link makes placement matter (with the paper's weights the plan sees
    # the step HBM-bound whatever it places, and leaves its target empty)
    prof, geo = PROF, GEO
    setup = sim.Setup(
        trace.prompt_len,
        trace.block_size,
        trace.num_layers,
        trace.num_blocks,
        cap,
        geo.token_bytes,
        float(geo.weight_bytes),
        prof,
    )
    lit = {"follow_admit": "target"} if LITERAL else {}
    policy = sim.make_policy(
        "anneal+reuse+follow", setup, anneal_config=FAST, window=W, interval=0, **lit
    )
    assert policy.follow is not None and policy.forecast == Reuse() and not policy.needs_forecast
    steps = trace.steps
    mass = trace.mass(0, steps + 1)
    reads = np.asarray(sim.read_mask(mass, trace.prompt_len, trace.block_size, sparsity, 0))
    state = sim.init_state(policy, setup)
    blk = np.arange(trace.num_blocks)
    promoted = demoted = plans = 0
    for t in range(steps):
        before = np.asarray(state.in_hbm)
        sealed = (trace.prompt_len + t) // trace.block_size
        new = t > 0 and sealed > (trace.prompt_len + t - 1) // trace.block_size
        free = before.sum(-1) < cap
        before = before | ((blk == sealed - 1)[None] & new & free[:, None])
        state = sim.run_chunk(
            setup, 1, state, jnp.asarray(reads[t : t + 2]), mass[t : t + 2], jnp.int32(t)
        )
        after, target = np.asarray(state.in_hbm), np.asarray(state.pstate.target)
        pro, dem = after & ~before, before & ~after
        assert (after.sum(-1) <= cap).all(), t  # (a)
        assert (dem.sum(-1) <= pro.sum(-1)).all(), t  # (b) a demotion only for a promotion
        assert not (pro & ~(reads[t] & target)).any(), t  # (c)
        assert not (dem & (reads[t] | target)).any(), t
        assert int(state.plans) == (t % W == 0), t
        assert float(state.migrated) == pro.sum() + dem.sum()
        # a promoted block is read from host at this step: HBM reads are those resident before
        assert float(state.hbm_reads) == (reads[t] & before).sum()
        promoted, demoted, plans = promoted + pro.sum(), demoted + dem.sum(), plans + state.plans
    assert promoted > 0 and demoted > 0  # the trace exercises both moves
    assert plans == math.ceil(steps / W)


@pytest.mark.parametrize(
    "W, chunk",
    [
        pytest.param(4, 5, marks=pytest.mark.slow),
        (3, 16),
        pytest.param(16, 6, marks=pytest.mark.slow),
    ],
)
def test_follow_plans_every_window(W, chunk):
    steps = 14
    res = sim.simulate(
        _follow_trace(),
        ["anneal+reuse+follow", "unlimited"],
        profile=PROF,
        geometry=GEO,
        sparsity=0.5,
        capacity_blocks=3,
        chunk=chunk,
        steps=steps,
        follow_window=W,
        anneal_config=FAST,
        progress=False,
        time_plans=False,
    )["policies"]
    f = res["anneal+reuse+follow"]
    assert f["plans"] == math.ceil(steps / W)  # (d)
    assert f["latency_s"] >= res["unlimited"]["latency_s"] * (1 - 1e-6)
    assert f["rule_seconds"] == 0.0 and f["plan_seconds"] == 0.0


@pytest.mark.skipif(not LITERAL, reason="follow_moves has no admit rule")
def test_follow_admit_read_promotes_every_host_read():
    """admit="read": every block a step reads from host is promoted while the pool has room
    (no demotion then); beyond it each promotion displaces an unread resident block, so all are
    promoted while such victims last, and a layer never holds more than capacity blocks: on
    random rows of follow_moves, then step by step in the simulator (whose pool, filled in write
    order and demoted only for a promotion, stays full: the displacing case)."""
    rng = np.random.default_rng(0)
    n, rows = 12, 64
    valid = np.arange(n)[None] < rng.integers(1, n + 1, (rows, 1))
    in_hbm = valid & (rng.random((rows, n)) < 0.5)
    reads = valid & (rng.random((rows, n)) < 0.4)
    target = rng.random((rows, n)) < 0.5
    pri = rng.random((rows, n)).astype(np.float32)
    cap = in_hbm.sum(-1) + rng.integers(0, 5, rows)
    room = cap - in_hbm.sum(-1)
    p, n_p, d, n_d = pol.follow_moves(
        *map(jnp.asarray, (in_hbm, valid, reads, target, pri, room)), n, admit="read"
    )
    pm, dm = np.asarray(pol.moves_mask(p, n_p, n)), np.asarray(pol.moves_mask(d, n_d, n))
    cand = reads & valid & ~in_hbm
    victims = (in_hbm & valid & ~reads).sum(-1)
    after = (in_hbm | pm) & ~dm
    assert (after.sum(-1) <= cap).all()
    assert not (pm & ~cand).any() and not (dm & ~(in_hbm & ~reads)).any()
    assert (pm.sum(-1) == np.minimum(cand.sum(-1), room + victims)).all()
    fits = room >= cand.sum(-1)
    assert fits.any() and (cand.sum(-1)[fits] > 0).any()  # the draw has roomy rows that read
    assert (pm[fits] == cand[fits]).all() and not dm[fits].any()

    trace, sparsity, W, cap = _follow_trace(), 0.5, 4, 5
    setup = sim.Setup(
        trace.prompt_len,
        trace.block_size,
        trace.num_layers,
        trace.num_blocks,
        cap,
        GEO.token_bytes,
        float(GEO.weight_bytes),
        PROF,
    )
    policy = sim.make_policy(
        "anneal+reuse+follow", setup, anneal_config=FAST, window=W, interval=0, follow_admit="read"
    )
    assert policy.follow.admit == "read"
    steps = trace.steps
    mass = trace.mass(0, steps + 1)
    reads = np.asarray(sim.read_mask(mass, trace.prompt_len, trace.block_size, sparsity, 0))
    state = sim.init_state(policy, setup)
    blk = np.arange(trace.num_blocks)
    promoted = 0
    for t in range(steps):
        before = np.asarray(state.in_hbm)
        sealed = (trace.prompt_len + t) // trace.block_size
        new = t > 0 and sealed > (trace.prompt_len + t - 1) // trace.block_size
        free = before.sum(-1) < cap
        before = before | ((blk == sealed - 1)[None] & new & free[:, None])
        valid = blk[None] < sealed
        state = sim.run_chunk(
            setup, 1, state, jnp.asarray(reads[t : t + 2]), mass[t : t + 2], jnp.int32(t)
        )
        after = np.asarray(state.in_hbm)
        pro, dem = after & ~before, before & ~after
        cand = reads[t] & valid & ~before  # host blocks read now
        room = cap - before.sum(-1)
        victims = (before & valid & ~reads[t]).sum(-1)
        want = np.minimum(cand.sum(-1), room + victims)
        assert (after.sum(-1) <= cap).all(), t
        assert not (pro & ~cand).any() and not (dem & reads[t]).any(), t
        assert (pro.sum(-1) == want).all(), t
        assert (dem.sum(-1) == np.maximum(want - room, 0)).all(), t
        # the promoted blocks' reads are host reads
        assert float(state.hbm_reads) == (reads[t] & before).sum()
        promoted += pro.sum()
    assert promoted > 0


@pytest.mark.slow  # default suite: about 60 s each (CI runs make test-slow)
def test_simulate_follow_admit_and_ride():
    """simulate passes follow_admit to the +follow policies, and ride=0.0 is a real value
    (None: each policy's default)."""
    kw = dict(
        profile=PROF,
        geometry=GEO,
        sparsity=0.5,
        capacity_blocks=3,
        chunk=8,
        steps=8,
        follow_window=4,
        anneal_config=FAST,
        progress=False,
        time_plans=False,
    )
    names = ["anneal+reuse+follow", "anneal+reuse+now", "anneal"]
    res = sim.simulate(_follow_trace(), names, **kw)["policies"]
    assert [res[n]["ride"] for n in names] == [1.0, 1.0, 0.0]
    res = sim.simulate(_follow_trace(), names, ride=0.0, **kw)["policies"]
    assert [res[n]["ride"] for n in names] == [0.0, 0.0, 0.0]
    if LITERAL:
        assert res["anneal+reuse+follow"]["follow_admit"] == pol.Follow().admit
        for a in ("read", "ranked", "target"):
            got = sim.simulate(_follow_trace(), names[:1], follow_admit=a, **kw)["policies"]
            assert got[names[0]]["follow_admit"] == a
        with pytest.raises(ValueError, match="follow_admit must be one of"):
            sim.simulate(_follow_trace(), names[:1], follow_admit="all", **kw)


def test_modifier_on_wrong_policy():
    with pytest.raises(ValueError, match=r"modifiers \(\+aw\) apply to anneal"):
        run(["lru-plan+aw"])


def test_bad_sparsity():
    with pytest.raises(ValueError, match=r"sparsity must lie in \[0, 1\), got 1.5"):
        sim.simulate(tiny_trace(), ["static"], profile=PROF, geometry=GEO, sparsity=1.5)


@pytest.mark.paper_scale  # 32 layers x 2,048 steps: tens of minutes per case on 2 cores
@pytest.mark.parametrize(
    "kind, block_size",
    [
        ("real-like", 16),
        ("real-like", 1),
        ("recency-low", 16),
        pytest.param(
            "recency-low",
            1,
            marks=pytest.mark.xfail(
                strict=False,
                reason="measured (bench/RESULTS.md): recency-low's token reads barely flicker "
                "(2% of leavers back within two steps, 45% in real-like and the recorded trace), "
                "so token-level LRU pays little for them, while Page's half-unread pages (page "
                "fill 0.52) halve its pool",
            ),
        ),
    ],
)
def test_paper_shape_at_60_percent(kind, block_size):
    """Static > Reactive > Page > paper-sa >= Unlimited on a paper-sized synthetic trace."""
    trace = tr.SyntheticTrace(kind, 31_299, 2_048, 32, block_size)
    res = sim.simulate(
        trace,
        ["static", "lru-plan", "page", "paper-sa", "unlimited"],
        profile=HardwareProfile.preset("gh200-paper"),
        geometry=cost.get_geometry("paper"),
        sparsity=0.6,
        chunk=64 if block_size == 1 else 128,
        progress=False,
    )["policies"]
    lat = [res[n]["latency_s"] for n in ["static", "lru-plan", "page", "paper-sa", "unlimited"]]
    assert lat[0] > lat[1] > lat[2] > lat[3] >= lat[4], lat


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(discount=float("nan")), "discount=nan: expected a finite number in (0, 1]"),
        (dict(demote_cost=-1.0), "demote_cost=-1.0: expected a finite number >= 0"),
        (dict(interval=0), "interval=0: expected an integer >= 1"),
        (dict(window=0), "window=0: expected an integer >= 1"),
        (dict(steps=0), "steps=0: expected an integer >= 1"),
        (dict(seed=-1), "seed=-1: expected an integer in [0, 4294967295]"),
        (dict(hbm_budget=float("inf")), "hbm_budget=inf: expected a finite number > 0"),
        (dict(ride=float("nan")), "ride=nan: expected a finite number in [0, 1]"),
    ],
)
def test_library_arguments_checked_like_the_cli(kw, message):
    """discount nan annealed and migrated nothing; demote_cost < 0 was a negative cost."""
    with pytest.raises(ValueError, match=re.escape(message)):
        run(["static"], **kw)


def test_policies_must_be_a_nonempty_list():
    with pytest.raises(ValueError, match=r"policies=\[\]: expected a non-empty list"):
        run([])
    with pytest.raises(ValueError, match=r"policies='static': expected a non-empty list"):
        run("static")


def test_budget_below_one_block_is_named():
    geo = cost.Geometry("t", 1, 1, 1, 2, 10.0, 0.0)
    with pytest.raises(ValueError, match="leaves no room after the .* for one block"):
        cost.pool_capacity(geo, geo.param_bytes + 1.0, 1, tiny_trace().block_size)


def test_memory_check_names_both_figures(monkeypatch):
    setup = sim.Setup(0, 16, 32, 10**8, 10, 4, 0.0, PROF)
    monkeypatch.setattr(sim, "available_memory", lambda: 8 * 10**9)
    with pytest.raises(ValueError, match=r"needs at least 4,729\.6 GB .* has 8\.0 GB"):
        sim.check_memory(setup, 100, 1, 2)
    sim.check_memory(dataclasses.replace(setup, num_blocks=100), 100, 1, 2)  # fits
