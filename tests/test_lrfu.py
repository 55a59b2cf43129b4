"""The live policy `lrfu` (`jaxkv.placement.policies.Lrfu`): the follow rule with admit="value", run
inside each decode step with no plan (issue 32, item 2)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cost import CostModel
from jaxkv.placement import policies as pol
from jaxkv.placement import presets
from jaxkv.placement import statistics as imp

T, F = True, False


def _moves(in_hbm, reads, value, room, budget=8, valid=None):
    in_hbm, reads = jnp.asarray(in_hbm), jnp.asarray(reads)
    valid = jnp.ones(in_hbm.shape, bool) if valid is None else jnp.asarray(valid)
    p, n_p, d, n_d = pol.follow_moves(
        in_hbm, valid, reads, None, None, jnp.asarray(room), budget, "value", jnp.asarray(value)
    )
    pm, dm = pol.moves_mask(p, n_p, in_hbm.shape[1]), pol.moves_mask(d, n_d, in_hbm.shape[1])
    assert not np.any(np.asarray(pm & dm))
    return [
        (
            [int(i) for i in np.asarray(p[r, : int(n_p[r])])],
            [int(i) for i in np.asarray(d[r, : int(n_d[r])])],
        )
        for r in range(in_hbm.shape[0])
    ]


def test_value_rule_hand_computed():
    # 6 blocks, 0..2 resident; the step reads 1 (in HBM), 3 and 4 (on host). Values: block 0
    # 0.2, 1 0.5 (read now, resident), 2 0.9, 3 0.7, 4 0.4, 5 1.0 (not read: never a candidate)
    in_hbm = [[T, T, T, F, F, F]]
    reads = [[F, T, F, T, T, F]]
    value = [[0.2, 0.5, 0.9, 0.7, 0.4, 1.0]]
    # no room: 3 (0.7) displaces 0 (0.2); 4 (0.4) is not worth 1 (0.5), which the step read
    # from HBM: a victim read at this step is still a victim
    assert _moves(in_hbm, reads, value, [0]) == [([3], [0])]
    # 4 worth more than 1: both promoted, over 0 then 1 (read this step, least valuable left)
    assert _moves(in_hbm, reads, [[0.2, 0.3, 0.9, 0.7, 0.4, 1.0]], [0]) == [([3, 4], [0, 1])]
    # one free slot: the best candidate takes it, the next must beat the least valuable
    assert _moves(in_hbm, reads, value, [1]) == [([3, 4], [0])]
    # room for both: no demotion
    assert _moves(in_hbm, reads, value, [2]) == [([3, 4], [])]
    # budget 1: the best candidate only
    assert _moves(in_hbm, reads, value, [0], budget=1) == [([3], [0])]


def test_value_rule_ties_move_nothing():
    """Exact attention reads every block every step: every value ties and nothing moves (a
    candidate must be strictly more valuable than its victim)."""
    in_hbm = [[T, T, F, F]]
    reads = [[T, T, T, T]]
    assert _moves(in_hbm, reads, [[0.5] * 4], [0]) == [([], [])]
    # invalid blocks are neither candidates nor victims
    got = _moves([[T, T, F, F]], [[F, F, T, T]], [[0.0, 0.1, 0.5, 0.6]], [0], valid=[[F, T, T, F]])
    assert got == [([2], [1])]


def test_value_needed_exactly_with_admit_value():
    z = jnp.zeros((1, 4), bool)
    v = jnp.zeros((1, 4))
    with pytest.raises(ValueError, match='value array exactly when admit="value"'):
        pol.follow_moves(z, z, z, None, None, jnp.asarray([0]), 2, "value")
    with pytest.raises(ValueError, match="value array exactly when"):
        pol.follow_moves(z, z, z, z, v, jnp.asarray([0]), 2, "ranked", value=v)


def test_follow_value_is_the_statistics_read_frequency_one_step_on():
    """The rule ranks by exactly what `update_stats` keeps after the step (`read_ema`)."""
    rng = np.random.default_rng(0)
    stats = imp.init_stats(2, 8)
    for t in range(5):
        reads = jnp.asarray(rng.random((2, 8)) < 0.4)
        got = pol.follow_value(stats.read_ema, reads, stats.decay)
        stats = imp.update_stats(stats, reads, jnp.ones((2, 8)), jnp.int32(t))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(stats.read_ema))


def test_lrfu_preset():
    env = CostModel(block_bytes=1024.0)
    p = presets.resolve("lrfu", env)
    assert isinstance(p, pol.Lrfu) and p.name == "lrfu" and p.follow == pol.Follow("value")
    assert presets.is_online("lrfu") and "lrfu" in presets.names(online_only=True)
    assert p.plans is False and pol.Static().plans is False and pol.LruPlan().plans is True
    presets.check_policy(p)
    with pytest.raises(ValueError, match="Lrfu follow must be Follow\\('value'\\)"):
        pol.Lrfu(follow=pol.Follow("read"))
    with pytest.raises(ValueError, match="are not knobs of 'lrfu'; expected some of"):
        presets.resolve("lrfu", env, budget=4)
    with pytest.raises(ValueError, match="modifiers"):
        presets.split_name("lrfu+follow")


@pytest.mark.slow  # about 21 s; test_sim_loop and test_decode keep lrfu in the loop
def test_lrfu_in_the_decode_loop(tiny):
    """lrfu decodes the tokens of any other placement (sparse: the selection depends on the
    logical blocks only), keeps the cache's invariants at every step, promotes only blocks the
    step read from host, demotes only to make room, never plans a target, and beats Static and
    LRU on modeled time on a link-bound sparse decode."""
    from jaxkv import cache as kvc
    from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
    from jaxkv.decode.decoder import Decoder
    from jaxkv.decode.state import summarize

    model, params = tiny
    slow = HardwareProfile("slow-link", hbm_bandwidth=1e13, link_bandwidth=1e9, hbm_bytes=1e9)
    cfg = CacheConfig.for_model(model.config, batch=2, max_len=96, block_size=8, hbm_fraction=0.25)
    prompts = np.asarray(np.random.default_rng(7).integers(0, 256, (2, 45)), np.int32)
    runs = {}
    for name in ("static", "lru-plan", "lrfu"):
        p = PlacementConfig(policy=name, window=3, attention="sparse", topk=3, max_moves=4)
        dec = Decoder(model, cfg, p, max_new_tokens=16, profile=slow)
        state = dec.prefill(params, prompts, (45, 30))
        if name == "lrfu":
            assert dec.follows and dec.plan_seconds(params, state) == 0.0
            L, N = cfg.num_layers, cfg.batch * cfg.max_blocks
            for _ in range(15):
                before = np.asarray(state.cache.in_hbm).reshape(L, N)
                free = np.asarray(state.cache.hbm_free).sum(1)
                t = int(state.step)
                state = dec.step(params, state)
                after = np.asarray(state.cache.in_hbm).reshape(L, N)
                read = np.asarray(state.stats.last_read == t)
                promoted = after & ~before
                demoted = before & ~after & np.asarray(state.cache.sealed).reshape(L, N)
                assert not (promoted & ~read).any()
                assert (demoted.sum(1) <= np.maximum(promoted.sum(1) - free, 0)).all()
                kvc.check_invariants(state.cache)
        else:
            state = dec.generate(params, state)
        runs[name] = state
    static_tokens = np.asarray(runs["static"].tokens)
    for name in ("lru-plan", "lrfu"):
        np.testing.assert_array_equal(np.asarray(runs[name].tokens), static_tokens)
    got = {n: summarize(s)["modeled_seconds"] for n, s in runs.items()}
    assert summarize(runs["lrfu"])["migrated_blocks"] > 0
    assert got["lrfu"] < min(got["static"], got["lru-plan"])


def test_lrfu_in_the_trace_simulator():
    """`jaxkv simulate` runs lrfu (its rule's admit reported), and it migrates, reads more from
    HBM and models less time than Static on a trace whose reads recur."""
    from jaxkv import cost
    from jaxkv.config import HardwareProfile
    from jaxkv.sim import simulate as sim
    from jaxkv.sim import trace as tr

    trace = tr.SyntheticTrace("recency-low", 40, 16, 2, 4, seed=3)
    prof = HardwareProfile("t", 10.0, 1.0, 1e9)  # bytes per second: HBM 10, link 1
    geo = cost.Geometry("t", 1, 1, 1, 2, 10.0, 0.0)  # 4 bytes per token-layer
    kw = dict(profile=prof, geometry=geo, sparsity=0.5, capacity_blocks=3, chunk=8, steps=16)
    res = sim.simulate(
        trace, ["static", "lru-plan", "lrfu"], progress=False, time_plans=False, **kw
    )
    got = res["policies"]
    assert got["lrfu"]["hbm_hit_rate"] > got["static"]["hbm_hit_rate"]
    assert got["lrfu"]["migrated_bytes"] > 0 and got["lrfu"]["follow_admit"] == "value"
    assert got["lrfu"]["latency_s"] < got["static"]["latency_s"]
