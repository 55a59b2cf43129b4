"""The prompt's observation window (`jaxkv.decode.prompt`): the last prompt queries' selections
as the live policy's starting read frequency and prefill placement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import Decoder
from jaxkv import cache as kvc
from jaxkv.attention.select import select_blocks
from jaxkv.cache import ops as cache_ops
from jaxkv.config import STEADY_QUERIES, CacheConfig, PlacementConfig
from jaxkv.decode import prompt as pp
from jaxkv.model_api import bind

PROMPTS_LEN = (45, 30)


def _prompts():
    return jax.random.randint(jax.random.key(7), (2, 45), 0, 256).astype(jnp.int32)


def _decoder(model, policy="lrfu", attention="sparse", host_tier="write-through", **kw):
    cfg = CacheConfig.for_model(
        model.config, batch=2, max_len=96, block_size=8, hbm_fraction=0.25, host_tier=host_tier
    )
    p = PlacementConfig(policy=policy, window=3, attention=attention, topk=3, max_moves=4)
    return Decoder(model, cfg, p, max_new_tokens=24, policy_kwargs=kw or None)


def test_observed_positions():
    pos, valid = pp.observed_positions(jnp.asarray([5, 40]), 8)
    np.testing.assert_array_equal(pos[0], [0, 0, 0, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(valid[0], [False] * 3 + [True] * 5)
    np.testing.assert_array_equal(pos[1], np.arange(32, 40))
    assert valid[1].all()


def test_the_queries_follow_the_prefills_residual_stream(tiny):
    """The recomputed rows pass each layer the K the prefill computed at their positions (the
    residual stream, which the queries are projected from, is the prefill's), and their
    queries are what `attend` receives."""
    model, params = tiny
    m = bind(nnx.split(model)[0], params)
    prompts, lengths = _prompts(), jnp.asarray(PROMPTS_LEN, jnp.int32)
    _, k, v = m.prefill(prompts)
    seen = []

    class Spy:
        config = m.config

        def decode_step(self, tokens, positions, attend, carry):
            def spy(layer, q, k_new, v_new, c):
                jax.debug.callback(
                    lambda *a: seen.append([np.asarray(x) for x in a]), layer, q, k_new
                )
                return attend(layer, q, k_new, v_new, c)

            return m.decode_step(tokens, positions, spy, carry)

    qs = pp.prompt_queries(Spy(), prompts, lengths, k, v, n=8)
    seen = seen[-model.config.num_layers :]  # the run after the shape probe
    pos, _ = pp.observed_positions(lengths, 8)
    for layer, q, k_new in seen:
        want = np.take_along_axis(np.asarray(k[layer]), np.asarray(pos)[..., None, None], axis=1)
        np.testing.assert_allclose(k_new.reshape(want.shape), want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(qs[layer]).reshape(q.shape), q)
    assert qs.shape[:3] == (model.config.num_layers, 2, 8)


def test_the_prior_is_the_share_of_the_queries_that_select_each_block(tiny):
    model, params = tiny
    dec = _decoder(model)
    pre = dec.model_prefill(params, _prompts(), PROMPTS_LEN)
    cache = dec.prefill(params, _prompts(), PROMPTS_LEN, prefilled=pre).cache
    prior = np.asarray(pp.prompt_prior(pre.queries, cache, dec.placement))
    L, n = pre.queries.shape[0], pre.queries.shape[2]
    pos, valid = (np.asarray(x) for x in pp.observed_positions(cache.lengths, n))
    for layer in range(L):
        for b, length in enumerate(PROMPTS_LEN):
            picks = []
            for i in range(n):
                if valid[b, i]:
                    got = select_blocks(
                        pre.queries[layer, :, i],
                        cache,
                        layer,
                        jnp.asarray(pos[:, i] + 1),
                        dec.placement,
                    )
                    picks.append(np.asarray(got)[b])
            want = np.mean(picks, 0) * (np.arange(cache.config.max_blocks) < length // 8)
            np.testing.assert_allclose(prior[layer, b], want, rtol=1e-6)
    assert 0 < prior.max() <= 1 and prior.min() >= 0


@pytest.mark.parametrize("host_tier", ["write-through", "exclusive"])
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), 2])
def test_prefill_by_priority_keeps_every_block_and_places_the_highest(host_tier, seed):
    """Per layer the sealed blocks of highest priority fill HBM (ties in write order), the
    tails keep their HBM slots, and the cache holds the prompt exactly: every block once on
    host (write-through: every sealed block) and its HBM copy equal."""
    rng = np.random.default_rng(seed)
    cfg = CacheConfig(
        num_layers=3,
        kv_heads=2,
        head_dim=8,
        batch=2,
        max_len=64,
        block_size=4,
        hbm_fraction=0.25,
        dtype="float32",
        host_tier=host_tier,
    )
    lengths = jnp.asarray([37, 22], jnp.int32)
    k = jnp.asarray(rng.normal(size=(3, 2, 40, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(3, 2, 40, 2, 8)), jnp.float32)
    prio = jnp.asarray(rng.integers(0, 3, (3, 2, cfg.max_blocks)) / 2.0, jnp.float32)
    cache = cache_ops._prefill(kvc.TieredKVCache.create(cfg), k, v, lengths, priority=prio)
    kvc.check_invariants(cache, contents=True)
    dk, dv = kvc.to_dense(cache)
    for b, n in enumerate([37, 22]):
        np.testing.assert_array_equal(np.asarray(dk)[:, b, :n], np.asarray(k)[:, b, :n])
        np.testing.assert_array_equal(np.asarray(dv)[:, b, :n], np.asarray(v)[:, b, :n])
    sealed = np.arange(cfg.max_blocks)[None] < (np.asarray(lengths) // 4)[:, None]
    in_hbm = np.asarray(cache.in_hbm)
    room = int(in_hbm[0].sum())
    assert room > 0 and all(int(x.sum()) == room for x in in_hbm)
    write_order = np.arange(cfg.max_blocks)[:, None] * 2 + np.arange(2)[None]  # [M, B]
    for layer in range(3):
        p = np.where(sealed, np.asarray(prio[layer]), -np.inf).T.reshape(-1)
        order = np.lexsort((write_order.reshape(-1), -p))
        want = np.zeros(p.shape, bool)
        want[order[:room]] = True
        np.testing.assert_array_equal(in_hbm[layer].T.reshape(-1), want)
    # without a priority: write order in every layer, as before
    plain = cache_ops._prefill(kvc.TieredKVCache.create(cfg), k, v, lengths)
    flat = np.zeros(p.shape, bool)
    flat[np.argsort(np.where(sealed.T.reshape(-1), write_order.reshape(-1), 999))[:room]] = True
    np.testing.assert_array_equal(np.asarray(plain.in_hbm)[0].T.reshape(-1), flat)


@pytest.mark.slow  # about 25 s
def test_lrfu_starts_from_the_prior_and_decodes_the_same_tokens(tiny):
    """lrfu's state after prefill: read frequency = the prior, HBM = its highest blocks; the
    tokens equal Static's (sparse: the selection reads logical blocks); prompt_prior=False,
    other policies and exact attention start in write order with no read frequency."""
    model, params = tiny
    prompts = _prompts()
    states = {}
    for name, kw in [("static", {}), ("lrfu", {}), ("lrfu-off", {"prompt_prior": False})]:
        dec = _decoder(model, name.split("-")[0], **kw)
        states[name] = (dec, dec.prefill(params, prompts, PROMPTS_LEN))
    dec, st = states["lrfu"]
    pre = dec.model_prefill(params, prompts, PROMPTS_LEN)
    assert pre.queries.shape[2] == STEADY_QUERIES  # for any decoder: lrfu's estimator's
    prior = np.asarray(pp.prompt_prior(pre.queries[:, :, -32:], st.cache, dec.placement))
    L = dec.cache_config.num_layers
    np.testing.assert_allclose(np.asarray(st.stats.read_ema), prior.reshape(L, -1), rtol=1e-6)
    in_hbm = np.asarray(st.cache.in_hbm) & np.asarray(st.cache.sealed)
    for layer in range(L):  # every resident block is worth at least every host one
        res, host = (
            prior[layer][in_hbm[layer]],
            prior[layer][~in_hbm[layer] & np.asarray(st.cache.sealed)[layer]],
        )
        assert res.min() >= host.max()
    static_hbm = np.asarray(states["static"][1].cache.in_hbm)
    assert not np.array_equal(np.asarray(st.cache.in_hbm), static_hbm)
    np.testing.assert_array_equal(np.asarray(states["lrfu-off"][1].cache.in_hbm), static_hbm)
    assert not np.asarray(states["lrfu-off"][1].stats.read_ema).any()
    tokens = {n: np.asarray(d.generate(params, s).tokens) for n, (d, s) in states.items()}
    np.testing.assert_array_equal(tokens["lrfu"], tokens["static"])
    np.testing.assert_array_equal(tokens["lrfu-off"], tokens["static"])
    exact = _decoder(model, "lrfu", attention="exact")
    st = exact.prefill(params, prompts, PROMPTS_LEN)
    np.testing.assert_array_equal(np.asarray(st.cache.in_hbm), static_hbm)
    assert not np.asarray(st.stats.read_ema).any()


def test_lrfu_prompt_prior_knob():
    from jaxkv.cost import CostModel
    from jaxkv.placement import policies as pol
    from jaxkv.placement import presets

    env = CostModel(block_bytes=1024.0)
    assert presets.resolve("lrfu", env).prompt_prior is True
    assert presets.resolve("lrfu", env, prompt_prior=False) == pol.Lrfu(prompt_prior=False)
    assert pol.Static().prompt_prior is False and pol.LruPlan().prompt_prior is False
    with pytest.raises(ValueError, match="Lrfu prompt_prior must be a bool, got 'no'"):
        pol.Lrfu(prompt_prior="no")
    with pytest.raises(ValueError, match="are not knobs of 'lrfu'; expected some of"):
        presets.resolve("lrfu", env, budget=4)


def test_a_prefilled_without_queries_is_refused(tiny):
    model, params = tiny
    dec = _decoder(model)
    pre = dec.model_prefill(params, _prompts(), PROMPTS_LEN)
    bad = pre.__class__(pre.last_logits, pre.k, pre.v, pre.lengths, pre.queries[:, :, :4])
    with pytest.raises(ValueError, match=r"prefilled.queries has shape .*: expected \(2, 2, 128,"):
        dec.prefill(params, _prompts(), PROMPTS_LEN, prefilled=bad)
