"""lrfu's adaptive estimator (`Lrfu.steady_queries`): per layer, the decayed read frequency or
the prompt's prior held steady, whichever's top blocks held more of the recent reads
(`jaxkv.placement.statistics.estimator_hits` / `steady_choice`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import Decoder
from jaxkv._pytree import replace
from jaxkv.attention.select import select_blocks
from jaxkv.config import STEADY_QUERIES, CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.decode import prompt as pp
from jaxkv.model_api import bind
from jaxkv.placement import policies as pol
from jaxkv.placement import statistics as imp
from jaxkv.sim import loop

PROMPTS_LEN = (45, 30)
SLOW_LINK = HardwareProfile("slow-link", hbm_bandwidth=1e13, link_bandwidth=1e9, hbm_bytes=1e9)


def _prompts():
    return jax.random.randint(jax.random.key(7), (2, 45), 0, 256).astype(jnp.int32)


def _decoder(model, policy="lrfu", **kw):
    cfg = CacheConfig.for_model(model.config, batch=2, max_len=96, block_size=8, hbm_fraction=0.25)
    p = PlacementConfig(policy=policy, window=3, attention="sparse", topk=3, max_moves=4)
    return Decoder(model, cfg, p, max_new_tokens=24, profile=SLOW_LINK, policy_kwargs=kw or None)


def _hits(x, reads, valid, room):
    """numpy: the reads that x's `room` highest valid blocks of each row hold (ties: lower
    index first)."""
    out = []
    for row in range(x.shape[0]):
        key = np.where(valid[row], -x[row], np.inf)
        top = np.lexsort((np.arange(x.shape[1]), key))[:room]
        out.append(float((reads[row] & valid[row])[top].sum()))
    return np.asarray(out, np.float32)


def test_the_hit_counts_and_the_choice():
    rng = np.random.default_rng(0)
    L, N, room = 3, 10, 3
    ema = rng.random((L, N)).astype(np.float32)
    steady = rng.random((L, N)).astype(np.float32)
    ema[0, :4] = 0.5  # ties, broken by index in both
    valid = np.ones((L, N), bool)
    valid[:, -2:] = False  # unsealed blocks never count, however valuable
    ema[1, -1] = steady[1, -1] = 9.0
    stats = imp.with_steady(imp.init_stats(L, N), steady.copy(), room)
    stats = replace(stats, read_ema=jnp.asarray(ema.copy()))
    for step in range(3):
        reads = rng.random((L, N)) < 0.4
        e, s = imp.estimator_hits(stats, jnp.asarray(reads), jnp.asarray(valid))
        want_e = stats.decay * np.asarray(stats.ema_hits) + _hits(ema, reads, valid, room)
        want_s = stats.decay * np.asarray(stats.steady_hits) + _hits(steady, reads, valid, room)
        np.testing.assert_allclose(e, want_e, rtol=1e-6)
        np.testing.assert_allclose(s, want_s, rtol=1e-6)
        rows, pick = imp.steady_choice(stats, jnp.asarray(reads), jnp.asarray(valid))
        np.testing.assert_array_equal(pick, want_s > want_e)
        np.testing.assert_array_equal(rows, steady)
        for layer in range(L):  # one row, as a layer of the decode step asks (traced or not)
            r1, p1 = imp.steady_choice(
                stats, jnp.asarray(reads[layer][None]), jnp.asarray(valid[layer][None]), layer
            )
            np.testing.assert_array_equal(r1, steady[layer][None])
            assert bool(p1[0]) == bool(want_s[layer] > want_e[layer])
        value = pol.Follow("value").inputs(None, ema, reads, 0.9, steady=(rows, pick))[2]
        base = pol.follow_value(jnp.asarray(ema), jnp.asarray(reads), 0.9)
        np.testing.assert_allclose(value, np.where(want_s[:, None] > want_e[:, None], steady, base))
        stats = imp.update_stats(stats, jnp.asarray(reads), jnp.ones((L, N)), step, valid)
        np.testing.assert_allclose(stats.ema_hits, want_e, rtol=1e-6)
        np.testing.assert_allclose(stats.steady_hits, want_s, rtol=1e-6)
        np.testing.assert_array_equal(stats.steady, steady)  # held steady
        ema = np.asarray(stats.read_ema)
    assert imp.steady_choice(imp.init_stats(L, N), jnp.asarray(reads), jnp.asarray(valid)) is None
    with pytest.raises(ValueError, match=r"with_steady room=0: expected an int >= 1"):
        imp.with_steady(imp.init_stats(L, N), steady, 0)


def test_more_prompt_queries_run_in_chunks_with_the_same_rows(tiny):
    model, params = tiny
    m = bind(nnx.split(model)[0], params)
    prompts, lengths = _prompts(), jnp.asarray(PROMPTS_LEN, jnp.int32)
    _, k, v = m.prefill(prompts)
    pos, _ = pp.observed_positions(lengths, 64)
    chunked = pp.prompt_queries(m, prompts, lengths, k, v, n=64)
    direct = pp._queries_at(m, prompts, k, v, None, pos)  # all 64 rows at once
    assert chunked.shape == direct.shape == (model.config.num_layers, 2, 64) + direct.shape[3:]
    np.testing.assert_allclose(chunked, direct, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(  # the last 32 are the default window's
        chunked[:, :, -32:], pp.prompt_queries(m, prompts, lengths, k, v), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match=r"prompt_queries n=48: expected a multiple of 32"):
        pp.prompt_queries(m, prompts, lengths, k, v, n=48)


def test_the_prior_of_more_queries_selects_in_chunks_with_the_same_shares(tiny):
    """`prompt_prior` of 64 queries (two chunks of 32) equals the shares counted query by
    query; the prompt of 30 tokens has 30 valid rows, the one of 45 has 45."""
    model, params = tiny
    dec = _decoder(model, steady_queries=64)
    pre = dec.model_prefill(params, _prompts(), PROMPTS_LEN)
    cache = dec.prefill(params, _prompts(), PROMPTS_LEN, prefilled=pre).cache
    got = np.asarray(pp.prompt_prior(pre.queries, cache, dec.placement))
    pos, valid = (np.asarray(x) for x in pp.observed_positions(cache.lengths, 64))
    np.testing.assert_array_equal(valid.sum(1), PROMPTS_LEN)
    count = np.zeros(got.shape)
    for i in range(64):
        at = jnp.asarray(pos[:, i] + 1)
        for layer in range(got.shape[0]):
            sel = select_blocks(pre.queries[layer, :, i], cache, layer, at, dec.placement)
            count[layer] += np.asarray(sel) * valid[:, i, None]
    want = count / valid.sum(1)[None, :, None] * np.asarray(cache.sealed)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.max() > 0
    with pytest.raises(ValueError, match=r"prompt_prior: 48 queries, expected a multiple of 32"):
        pp.prompt_prior(pre.queries[:, :, :48], cache, dec.placement)


def _host_reads(rec):
    return int(np.sum(rec.decoded.reads) - np.sum(rec.decoded.hbm_reads))


@pytest.mark.slow  # 26 s; the default suite keeps the hit counts' unit test and lrfu's replay
def test_lrfu_starts_the_estimator_from_the_prompt_and_replays_exactly(tiny):
    """The state after prefill: read_ema the prior of the last 32 queries, `steady` that of the
    last 64, the room a layer's HBM pool. On the tiny model the decayed frequency wins; with
    the run's own read frequency as the steady one (an oracle) the steady one wins and saves
    host reads. Either way the simulator's replay of the decode (`jaxkv.sim.loop`) equals it
    step by step, and the tokens equal plain lrfu's."""
    model, params = tiny
    prompts = _prompts()
    dec, plain = _decoder(model, steady_queries=64), _decoder(model, steady_queries=0)
    pre = dec.model_prefill(params, prompts, PROMPTS_LEN)
    assert pre.queries.shape[2] == STEADY_QUERIES  # model_prefill serves any decoder
    st = dec.prefill(params, prompts, PROMPTS_LEN, prefilled=pre)
    s, c = st.statistics.blocks, dec.cache_config
    L = c.num_layers
    for n, got in ((32, s.read_ema), (64, s.steady)):
        want = pp.prompt_prior(pre.queries[:, :, -n:], st.cache, dec.placement)
        np.testing.assert_allclose(got, np.asarray(want).reshape(L, -1), rtol=1e-6)
    assert s.room == c.hbm_pool_slots and not np.asarray(s.ema_hits).any()
    p0 = plain.prefill(params, prompts, PROMPTS_LEN, prefilled=pre)  # 64 queries: the last 32
    np.testing.assert_array_equal(p0.cache.in_hbm, st.cache.in_hbm)
    assert p0.statistics.blocks.steady is None
    np.testing.assert_allclose(p0.stats.read_ema, s.read_ema)
    setup = loop.LoopSetup.of(dec)
    rec0, end0 = loop.record(dec, params, st, 20)
    hind = np.asarray(rec0.reads, np.float32).reshape(20, L, -1).mean(0)
    st = dec.prefill(params, prompts, PROMPTS_LEN, prefilled=pre)  # the first was donated
    s = replace(st.statistics.blocks, steady=jnp.asarray(hind))
    st = replace(st, statistics=replace(st.statistics, blocks=s))
    rec, end = loop.record(dec, params, st, 20)
    for r, e, steady_wins in ((rec0, end0, False), (rec, end, True)):
        b = e.statistics.blocks
        assert (np.asarray(b.steady_hits) > np.asarray(b.ema_hits)).all() == steady_wins
        got = loop.replay(setup, r)
        for f in ("moved", "hbm_reads", "reads"):
            np.testing.assert_array_equal(getattr(got.metrics, f), getattr(r.decoded, f), f)
        np.testing.assert_allclose(got.metrics.latency, r.decoded.latency, rtol=1e-6)
        np.testing.assert_array_equal(got.in_hbm, np.asarray(e.cache.in_hbm))
        assert int(np.sum(r.decoded.moved)) > 0
    assert _host_reads(rec) < _host_reads(rec0)  # 18 against 34
    tokens = np.asarray(dec.generate(params, end).tokens)
    want = plain.generate(params, plain.prefill(params, prompts, PROMPTS_LEN))
    np.testing.assert_array_equal(tokens, np.asarray(want.tokens))


def test_the_knob_and_its_errors(tiny):
    from jaxkv.cost import CostModel
    from jaxkv.placement import presets

    env = CostModel(block_bytes=1024.0)
    assert (
        presets.resolve("lrfu", env).steady_queries == STEADY_QUERIES == 128
    )  # the default, with the prior
    assert pol.Lrfu(prompt_prior=False).steady_queries == 0  # none without it
    assert pol.Lrfu(steady_queries=None) == pol.Lrfu(steady_queries=128) == pol.Lrfu()
    assert presets.resolve("lrfu", env, steady_queries=0) == pol.Lrfu(steady_queries=0)
    for bad in (48, -32, True, 64.0):
        with pytest.raises(ValueError, match=rf"Lrfu steady_queries={bad!r}: expected 0 \(off\)"):
            pol.Lrfu(steady_queries=bad)
    with pytest.raises(ValueError, match="steady_queries=64 needs prompt_prior=True"):
        pol.Lrfu(steady_queries=64, prompt_prior=False)
    model, params = tiny
    pre = _decoder(model).model_prefill(params, _prompts(), PROMPTS_LEN)  # 128 queries
    pre = replace(pre, queries=pre.queries[:, :, -32:])  # as a decoder of 32 would keep
    with pytest.raises(ValueError, match=r"prefilled.queries has shape \(2, 2, 32, .*\(2, 2, 64,"):
        _decoder(model, steady_queries=64).prefill(params, _prompts(), PROMPTS_LEN, prefilled=pre)
