"""lrfu's lookahead (`Lrfu.lookahead`): layer 0's queries depend on the token and its position
only, so once a step has sampled the next token the decode loop knows the blocks layer 0 reads
at the next step and re-decides layer 0's admission with them (`jaxkv.decode.follow.look_ahead`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_adaptive_estimator import PROMPTS_LEN, SLOW_LINK, _prompts

from jaxkv import Decoder, FunctionalModel
from jaxkv.config import CacheConfig, PlacementConfig
from jaxkv.model_api import bind, check_model
from jaxkv.placement import policies as pol
from jaxkv.placement import presets, registry
from jaxkv.sim import loop

STEPS = 16


def _decoder(model, attention="sparse", **kw):
    cfg = CacheConfig.for_model(model.config, batch=2, max_len=96, block_size=8, hbm_fraction=0.25)
    p = PlacementConfig(policy="lrfu", window=3, attention=attention, topk=3, max_moves=4)
    return Decoder(model, cfg, p, max_new_tokens=24, profile=SLOW_LINK, policy_kwargs=kw or None)


def test_first_query_is_layer_0s_query(tiny):
    """`Llama.first_query` equals the q that `decode_step` passes to `attend` for layer 0."""
    model, params = tiny
    m = bind(nnx.split(model)[0], params)
    tokens, positions = jnp.asarray([3, 200], jnp.int32), jnp.asarray([45, 30], jnp.int32)
    got = jax.jit(m.first_query)(tokens, positions)
    q0 = jax.jit(lambda t, p: model.decode_step(t, p, _capture_layer0, jnp.zeros_like(got))[1])(
        tokens, positions
    )
    assert got.shape == (2, model.config.num_heads, model.config.head_dim)
    np.testing.assert_allclose(got, q0, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"token id 999 at \(1,\)"):
        model.first_query(jnp.asarray([3, 999]), positions)


def _capture_layer0(layer, q, k, v, carry):
    """An `attend` that keeps layer 0's q (a traced layer: selected, not branched)."""
    return q, jnp.where(layer == 0, q, carry)


@pytest.mark.slow  # about 19 s
def test_the_lookahead_knows_layer_0s_next_reads_and_replays_exactly(tiny):
    """Decoded with the lookahead: at every step but the last, the mask the statistics keep is
    exactly layer 0's reads of the next step; the simulator's replay of the decode
    (`jaxkv.sim.loop`) equals it step by step (hits, moves, latency, placement); a replay of the
    plain lrfu record with the lookahead takes the next step's reads as the mask; the tokens
    equal plain lrfu's. On the tiny model the lookahead reads fewer blocks over the link."""
    model, params = tiny
    dec, plain = _decoder(model), _decoder(model, lookahead=False)  # lrfu's default: with it
    assert dec.lookahead and not plain.lookahead and dec.policy == pol.Lrfu(lookahead=True)
    st = dec.prefill(params, _prompts(), PROMPTS_LEN)
    assert not np.asarray(st.statistics.ahead).any() and st.statistics.ahead.shape == (2, 12)
    rec, end = loop.record(dec, params, st, STEPS)
    reads0 = np.asarray(rec.reads)[:, 0]
    np.testing.assert_array_equal(rec.ahead[:-1], reads0[1:])
    assert rec.ahead.sum() > 0
    got = loop.replay(loop.LoopSetup.of(dec), rec)
    for f in ("moved", "hbm_reads", "reads"):
        np.testing.assert_array_equal(getattr(got.metrics, f), getattr(rec.decoded, f), f)
    np.testing.assert_allclose(got.metrics.latency, rec.decoded.latency, rtol=1e-6)
    np.testing.assert_array_equal(got.in_hbm, np.asarray(end.cache.in_hbm))
    rec0, end0 = loop.record(plain, params, plain.prefill(params, _prompts(), PROMPTS_LEN), STEPS)
    assert rec0.ahead is None
    np.testing.assert_array_equal(np.asarray(loop._ahead(rec0))[:-1], np.asarray(rec0.reads)[1:, 0])
    np.testing.assert_array_equal(np.asarray(end.tokens), np.asarray(end0.tokens))
    host = [int(np.sum(r.decoded.reads - r.decoded.hbm_reads)) for r in (rec, rec0)]
    assert host[0] < host[1], host
    # the plain record has the same reads (the tiny model in float32: no near-tie flips), so
    # replayed with the lookahead (the next step's reads as the mask) it gives the same figures
    np.testing.assert_array_equal(np.asarray(rec0.reads), np.asarray(rec.reads))
    other = loop.replay(loop.LoopSetup.of(plain, policy=dec.policy), rec0)
    for f in ("moved", "hbm_reads", "reads"):
        np.testing.assert_array_equal(getattr(other.metrics, f), getattr(rec.decoded, f), f)


def test_exact_attention_with_the_lookahead_gives_the_all_hbm_tokens(tiny):
    """Exact attention reads every block at every step: the lookahead marks them all, nothing
    moves on its account, and the tokens are the all-HBM cache's."""
    model, params = tiny
    dec = _decoder(model, attention="exact", lookahead=True)
    cfg = CacheConfig.for_model(model.config, batch=2, max_len=96, block_size=8, hbm_fraction=1)
    full = Decoder(model, cfg, PlacementConfig(), max_new_tokens=24)
    want = full.generate(params, full.prefill(params, _prompts(), PROMPTS_LEN))
    state = dec.generate(params, dec.prefill(params, _prompts(), PROMPTS_LEN))
    np.testing.assert_array_equal(np.asarray(state.tokens), np.asarray(want.tokens))
    assert float(state.metrics.hbm_reads) < float(state.metrics.total_reads)


def test_the_knob_and_a_model_without_first_query(tiny):
    from jaxkv.cost import CostModel

    env = CostModel(block_bytes=1024.0)
    assert presets.resolve("lrfu", env, lookahead=True) == pol.Lrfu(lookahead=True)
    assert "lookahead" in registry.entry("lrfu").knob_defaults()
    with pytest.raises(ValueError, match=r"Lrfu lookahead must be a bool, got 1"):
        pol.Lrfu(lookahead=1)
    model, params = tiny
    assert pol.Lrfu().lookahead and not _decoder(model, lookahead=False).lookahead
    # a FunctionalModel without first_query decodes without the lookahead
    m = bind(nnx.split(model)[0], params)
    fm = FunctionalModel(
        model.config,
        prefill=lambda p, t: m.prefill(t),
        decode_step=lambda p, *a: m.decode_step(*a),
        weight_bytes=1.0,
    )
    dec = _decoder(fm, lookahead=True)
    assert not dec.lookahead
    assert dec.prefill(params, _prompts(), PROMPTS_LEN).statistics.ahead is None
    with_q = dataclasses.replace(fm, first_query=lambda p, t, pos: m.first_query(t, pos))
    assert _decoder(with_q, lookahead=True).lookahead
    with pytest.raises(TypeError, match=r"first_query.*cannot be called as first_query\(params"):
        check_model(dataclasses.replace(fm, first_query=lambda t: t))
    with pytest.raises(TypeError, match=r"FunctionalModel.first_query is not callable"):
        check_model(dataclasses.replace(fm, first_query=3))
    bad = bind(dataclasses.replace(fm, first_query=lambda p, t, pos: jnp.zeros((2, 5))), params)
    with pytest.raises(ValueError, match=r"first_query returned shape \(2, 5\): expected"):
        bad.first_query(jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"has no first_query\(tokens, positions\)"):
        bind(fm, params).first_query(jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32))


def test_the_trace_simulator_looks_one_step_ahead_in_layer_0():
    """`jaxkv.sim.replay` on a hand-made trace: one layer, two sealed blocks, an HBM pool of
    one, the reads alternating 1, 0, 1, 0, ... Plain lrfu promotes each host read over the
    block it displaces, which the next step reads: every read misses. With the lookahead the
    resident block, read at the next step, is worth more: every other read hits. A read buffer
    without the next step's row is refused."""
    from jaxkv.config import HardwareProfile
    from jaxkv.sim import replay as sim

    setup = sim.Setup(32, 16, 1, 2, 1, 1024, 1e6, HardwareProfile.preset("gh200-paper"))
    T = 8
    reads = np.zeros((T + 1, 1, 2), bool)
    reads[np.arange(T), 0, (np.arange(T) + 1) % 2] = True
    mass = jnp.asarray(reads, jnp.float32)
    hits = {}
    for ahead in (False, True):
        # slack off: the rule admits where its step is HBM-bound too (weights dominate here)
        policy = pol.Lrfu(prompt_prior=False, lookahead=ahead, slack=False)
        st = sim.run_chunk(setup, T, sim.init_state(policy, setup), jnp.asarray(reads), mass, 0)
        assert float(st.reads) == T
        hits[ahead] = float(st.hbm_reads)
    assert hits == {False: 0.0, True: T / 2}, hits
    policy = pol.Lrfu(prompt_prior=False)
    with pytest.raises(ValueError, match=r"expected reads_buf of more than chunk=8 steps, got 8"):
        sim.run_chunk(setup, T, sim.init_state(policy, setup), jnp.asarray(reads[:T]), mass[:T], 0)
