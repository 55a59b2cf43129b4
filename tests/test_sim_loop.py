"""The simulator's replay of the decode loop (`jaxkv.sim.loop`) against the decode loop itself:
a decode's recorded reads, replayed through the simulator with the same policy and settings,
give the same hit counts and migrations exactly and the same modeled latency (issue 32)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import Decoder
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.sim import loop

# a link 10^4 times slower than HBM: the tiny model's steps are link-bound, placement matters
SLOW_LINK = HardwareProfile("slow-link", hbm_bandwidth=1e13, link_bandwidth=1e9, hbm_bytes=1e9)
WT, EX = "write-through", "exclusive"
STEPS = 20


def _decoder(model, policy, host_tier, attention="sparse", **placement):
    cfg = CacheConfig.for_model(
        model.config, batch=2, max_len=96, block_size=8, hbm_fraction=0.25, host_tier=host_tier
    )
    kw = dict(policy=policy, window=3, attention=attention, topk=3, max_moves=4) | placement
    return Decoder(model, cfg, PlacementConfig(**kw), max_new_tokens=24, profile=SLOW_LINK)


def _record(tiny, policy, host_tier, **kw):
    model, params = tiny
    dec = _decoder(model, policy, host_tier, **kw)
    prompts = jax.random.randint(jax.random.key(7), (2, 45), 0, 256).astype(jnp.int32)
    state = dec.prefill(params, prompts, (45, 30))
    rec, state = loop.record(dec, params, state, STEPS)
    return dec, rec, state


def _assert_same(decoded, replayed):
    """Hit counts and migrations exactly, bytes and latency to 1e-6 relative."""
    for f in ("moved", "hbm_reads", "reads"):
        np.testing.assert_array_equal(getattr(replayed, f), getattr(decoded, f), err_msg=f)
    for f in ("latency", "hbm_bytes", "host_bytes"):
        np.testing.assert_allclose(getattr(replayed, f), getattr(decoded, f), rtol=1e-6, err_msg=f)


@pytest.fixture(scope="module")
def static_wt(tiny):
    return _record(tiny, "static", WT)


@pytest.mark.parametrize(
    "policy,host_tier",
    [
        ("static", WT),
        ("lru-plan", WT),
        pytest.param("lru-plan", EX, marks=pytest.mark.slow),
        # the field's rules in the step: the decoder runs the simulators' admission function
        ("lru", WT),
        ("tinylfu", EX),
        *(pytest.param(p, WT, marks=pytest.mark.slow) for p in ("arc", "slru", "lfu")),
        ("lrfu", WT),
        # the default suite holds the live policy's write-through case; these run in make test-slow
        pytest.param("lrfu", EX, marks=pytest.mark.slow),
        pytest.param("anneal+reuse+follow", WT, marks=pytest.mark.slow),
        pytest.param("anneal+reuse+follow", EX, marks=pytest.mark.slow),
        pytest.param("anneal", EX, marks=pytest.mark.slow),
    ],
)
def test_replay_equals_the_decode_loop(tiny, static_wt, policy, host_tier):
    """Per step: the replay of the decode's own reads equals its metrics, and the replay of
    Static's reads under this policy equals them too (a sparse selection depends on the logical
    blocks only); the placement after the last step is the cache's."""
    dec, rec, state = _record(tiny, policy, host_tier)
    setup = loop.LoopSetup.of(dec)
    got = loop.replay(setup, rec)
    _assert_same(rec.decoded, got.metrics)
    np.testing.assert_array_equal(got.in_hbm, np.asarray(state.cache.in_hbm))
    assert got.plans == int(state.metrics.windows)
    if policy != "static":  # the migrations are the policy's, not a trivial zero
        assert int(np.sum(rec.decoded.moved)) > 0
    np.testing.assert_array_equal(static_wt[1].reads, rec.reads)  # same reads, any placement
    other = static_wt[1]
    if dec.policy.prompt_prior:  # its start (the prompt's prior) is its own, not Static's
        assert not np.array_equal(np.asarray(rec.start.in_hbm), np.asarray(other.start.in_hbm))
        other = dataclasses.replace(other, start=rec.start)
    if rec.ahead is not None:  # Static's record knows no lookahead after its last step
        np.testing.assert_array_equal(loop._ahead(other)[:-1], rec.ahead[:-1])
        other = dataclasses.replace(other, ahead=rec.ahead)
    _assert_same(rec.decoded, loop.replay(setup, other).metrics)


@pytest.mark.slow  # default suite: about 10 s (CI runs make test-slow)
def test_exact_attention_replays_too(tiny):
    dec, rec, state = _record(tiny, "lru-plan", EX, attention="exact", window=2)
    assert rec.reads[:, :, 0, : 45 // 8 + 1].all()  # every block read
    _assert_same(rec.decoded, loop.replay(loop.LoopSetup.of(dec), rec).metrics)


def test_bounds_hold_for_every_policy(tiny, static_wt):
    """The loop-accounting bounds are below every replayed policy's modeled time, and ordered."""
    dec, rec, _ = static_wt
    b = loop.bounds(loop.LoopSetup.of(dec), rec)
    assert b["unlimited"] <= b["capacity"] <= b["best"] and b["unlimited"] <= b["cache"]
    assert b["cache"] <= b["best"]
    for policy in ("static", "lru-plan", "lrfu"):
        setup = loop.LoopSetup.of(_decoder(tiny[0], policy, WT))
        seconds = loop.replay(setup, rec).summary()["modeled_seconds"]
        assert b["best"] <= seconds * (1 + 1e-6), policy


def test_the_bounds_start_from_the_best_prefill_placement(tiny, static_wt):
    """The crossings count from the HBM content the prefill could have chosen (the blocks read
    first, as many as the recorded start holds), never more than from the recorded start."""
    from jaxkv.sim.bounds import min_link_crossings

    reads = np.zeros((4, 1, 6), bool)
    reads[0, 0, 3] = reads[1, 0, [1, 5]] = reads[2, 0, 0] = True
    sealed = np.array([True] * 5 + [False])
    start = np.array([[True, True, False, False, False, False]])
    np.testing.assert_array_equal(loop.best_start(reads, sealed, start)[0], [0, 1, 0, 1, 0, 0])
    # a block never read is not placed, even with room for it
    three = np.array([[True, True, True, False, False, False]])
    np.testing.assert_array_equal(loop.best_start(reads, sealed, three)[0], [1, 1, 0, 1, 0, 0])
    dec, rec, _ = static_wt
    c = dec.cache_config
    L, N = c.num_layers, c.batch * c.max_blocks
    placed = np.asarray(rec.reads).reshape(-1, L, N)
    recorded = np.asarray(rec.start.in_hbm).reshape(L, N)
    sealed = np.arange(c.max_blocks)[None] < (np.asarray(rec.start.lengths) // 8)[:, None]
    placed = placed & sealed.reshape(1, 1, N)
    fresh = np.zeros((placed.shape[0], N), bool)
    best = loop.best_start(placed, sealed.reshape(N), recorded)
    assert (best.sum(1) <= recorded.sum(1)).all()
    f_best = min_link_crossings(placed, best, fresh, c.hbm_pool_slots)
    f_rec = min_link_crossings(placed, recorded, fresh, c.hbm_pool_slots)
    assert (f_best <= f_rec).all() and f_rec.sum() > f_best.sum()
    assert loop.bounds(loop.LoopSetup.of(dec), rec)["crossings"] == f_best.tolist()


def test_record_refuses_steps_past_the_token_buffer(tiny, static_wt):
    model, params = tiny
    dec = _decoder(model, "lru-plan", WT)
    prompts = jnp.zeros((2, 45), jnp.int32)
    state = dec.prefill(params, prompts, (45, 30))
    with pytest.raises(ValueError, match=r"record: 30 steps .* steps <= 23"):
        loop.record(dec, params, state, 30)
    with pytest.raises(ValueError, match="steps=0: expected a positive int"):
        loop.record(dec, params, state, 0)


def test_replay_refuses_another_geometry(tiny, static_wt):
    model, _ = tiny
    cfg = CacheConfig.for_model(model.config, batch=1, max_len=96, block_size=8, hbm_fraction=0.25)
    dec = Decoder(model, cfg, PlacementConfig(policy="lru-plan"), max_new_tokens=24)
    with pytest.raises(ValueError, match=r"expected \[steps, 2, 1, 12\]"):
        loop.replay(loop.LoopSetup.of(dec), static_wt[1])


def test_bounds_refuse_fp8(tiny, static_wt):
    model, _ = tiny
    cfg = CacheConfig.for_model(
        model.config, batch=2, max_len=96, block_size=8, hbm_fraction=0.25, fp8="host"
    )
    dec = Decoder(model, cfg, PlacementConfig(policy="lru-plan"), max_new_tokens=24)
    with pytest.raises(ValueError, match="fp8='host': expected fp8='off'"):
        loop.bounds(loop.LoopSetup.of(dec), static_wt[1])


def test_a_trace_replays_in_the_loops_accounting():
    """`jaxkv.sim.loop_trace`: a trace's reads (top 20% by mass and the tail) from write-order
    placement; Static's hits are exactly the reads of the first pool blocks, every policy is
    above the bounds."""
    from jaxkv.cost import GEOMETRIES
    from jaxkv.sim import loop_trace
    from jaxkv.sim.trace import SyntheticTrace

    tr = SyntheticTrace("patterns", prompt_len=640, steps=24, num_layers=2, block_size=16)
    kw = dict(hbm_blocks=8, steps=24, window=4, profile="h200-pcie", geometry=GEOMETRIES["paper"])
    setups = {p: loop_trace.trace_setup(tr, p, **kw) for p in ("static", "lru-plan", "anneal")}
    rec = loop_trace.trace_record(tr, setups["static"], 0.8)
    assert rec.reads.shape == (24, 2, 1, 42)
    want = np.ceil(0.2 * ((640 + np.arange(24)) // 16)) + 1  # top 20% of the sealed, the tail
    np.testing.assert_array_equal(rec.reads[:, :, 0].sum(-1), np.stack([want, want], 1))
    got = {p: loop.replay(s, rec) for p, s in setups.items()}
    static = got["static"].metrics
    first = np.arange(42) < 8
    np.testing.assert_array_equal(static.hbm_reads, (rec.reads[:, :, 0] & first).sum((1, 2)) + 2)
    assert int(np.sum(static.moved)) == 0
    b = loop.bounds(setups["static"], rec)
    for p, r in got.items():
        assert b["best"] <= r.summary()["modeled_seconds"] * (1 + 1e-6), p
    assert got["lru-plan"].summary()["migrated_blocks"] > 0 and got["anneal"].plans == 6
    with pytest.raises(ValueError, match="stores no geometry: pass geometry="):
        loop_trace.trace_setup(tr, "lru-plan", hbm_blocks=8, steps=24)
    with pytest.raises(ValueError, match="steps=25: expected at most the trace's 24"):
        loop_trace.trace_setup(tr, "lru-plan", **(kw | {"steps": 25}))


def test_replay_under_another_window_and_an_oracle(tiny, static_wt):
    """Another W restarts the window (a plan every W steps from the record's start); an oracle,
    which the decode loop refuses, plans on the recorded reads after each plan and stays above
    the bound."""
    from jaxkv.placement import presets

    dec, rec, _ = static_wt
    lru2 = _decoder(tiny[0], "lru-plan", WT, window=2)
    assert loop.replay(loop.LoopSetup.of(lru2), rec).plans == STEPS // 2
    oracle = presets.resolve("anneal-oracle", dec.env, presets.Settings(window=2))
    got = loop.replay(loop.LoopSetup.of(lru2, policy=oracle), rec)
    assert got.plans == STEPS // 2
    assert loop.bounds(loop.LoopSetup.of(dec), rec)["best"] <= got.summary()["modeled_seconds"]


def test_record_refuses_a_decoder_that_collects_no_mass(tiny):
    """The Pallas kernel returns no per-block log-sum-exp, so its mass statistics stay zero:
    a record (whose mass an oracle reads) refuses it before any step, naming the impl."""
    model, params = tiny
    if model.config.head_dim % 16:
        pytest.skip("the kernel's geometry needs head_dim a multiple of 16")
    cfg = CacheConfig.for_model(model.config, batch=1, max_len=64, block_size=16, hbm_fraction=0.5)
    dec = Decoder(model, cfg, PlacementConfig(policy="lru-plan"), max_new_tokens=8, impl="pallas")
    assert not dec.collects_mass
    assert _decoder(model, "lru-plan", WT).collects_mass
    with pytest.raises(ValueError, match="impl 'pallas' is the Pallas kernel, which collects no"):
        loop.record(dec, params, None, 4)


def test_belady_is_the_fewest_crossings_priced_and_the_limit_of_every_rule(tiny, static_wt):
    """Belady's MIN with bypass replayed from the best prefill placement (`loop.limit`) makes
    exactly the fewest host reads `bounds` counts, its modeled time is at or above the best
    bound, and no in-step rule of the same pool reads fewer blocks from host; one pool for all
    layers reads still fewer."""
    dec, rec, _ = static_wt
    setup = loop.LoopSetup.of(dec)
    got = loop.limit(setup, rec)
    b = loop.bounds(setup, rec)
    _, sealed, placed = loop._sealed_reads(dec.cache_config, rec)
    tails = int(np.sum(np.asarray(rec.reads))) - int(placed.sum())
    host = int(np.sum(got.metrics.reads)) - int(np.sum(got.metrics.hbm_reads))
    assert host == sum(b["crossings"]) and tails >= 0
    assert b["best"] <= got.summary()["modeled_seconds"] * (1 + 1e-6)
    for policy in ("lru", "lfu", "lrfu"):
        other = loop.replay(loop.LoopSetup.of(_decoder(tiny[0], policy, WT)), rec)
        assert int(np.sum(other.metrics.reads - other.metrics.hbm_reads)) >= host, policy
    shared = loop.limit(setup, rec, shared=True)
    assert int(np.sum(shared.metrics.reads - shared.metrics.hbm_reads)) <= host
