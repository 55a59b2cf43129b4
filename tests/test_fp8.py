"""FP8 host tier (`CacheConfig(fp8="host")`, `jaxkv.cache.quant`): quantization error within the
format's bound at any scale, attention over FP8 blocks within a derived bound of full precision
(and identical across placements and mechanisms for the quantized values), real bytes in the
cost model, the decode loop and the simulator, and nothing changed with FP8 off."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import demote_then_promote_all, fp8_config, prefilled
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import Decoder
from jaxkv import attention as att
from jaxkv import cache as kvc
from jaxkv.cache import quant
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.cost import CostModel, link_profile


@settings(max_examples=40, deadline=None)
@given(
    exponent=st.integers(-40, 40),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_quantize_error_within_format_bound_at_any_scale(exponent, seed, dtype):
    """|x - dq(q(x))| <= max(2^-4 |x|, 2^-10 scale) for every element, whatever the blocks'
    magnitude (1e-12 to 1e12) and with heads of very different scales inside one block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 4, 3, 8)) * 2.0**exponent
    x[:, :, 1] *= 1e3  # an outlier head: its scale must not flatten the others
    x[0, :, 2] = 0.0  # an all-zero head
    x = jnp.asarray(x, dtype)
    q, scale = quant.quantize(x)
    assert q.dtype == quant.FP8 and scale.shape == (5, 3) and scale.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(q.astype(jnp.float32))))
    back = quant.dequantize(q, scale, jnp.float32)
    err = jnp.abs(back - x.astype(jnp.float32))
    assert bool(jnp.all(err <= quant.error_bound(x))), float(jnp.max(err / quant.error_bound(x)))
    assert bool(jnp.all(back[0, :, 2] == 0))
    # the bound is tight enough to mean something: at most 1/16 of the largest value
    assert float(jnp.max(err)) <= 2.0**-4 * float(jnp.max(jnp.abs(x.astype(jnp.float32))))


def test_requantizing_a_dequantized_block_is_exact():
    """A block promoted (dequantized to bf16) and demoted again gets the same FP8 values and
    scale back: migrations do not compound the error."""
    x = jax.random.normal(jax.random.key(0), (16, 16, 4, 64)).astype(jnp.bfloat16) * 3
    q, s = quant.quantize(x)
    q2, s2 = quant.quantize(quant.dequantize(q, s, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(q2.astype(jnp.float32)), q.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(s2), np.asarray(s), rtol=2**-8)


_cfg = fp8_config


def test_config_and_bytes():
    with pytest.raises(ValueError, match="fp8 must be one of"):
        _cfg(fp8="e4m3")
    off, on = _cfg(fp8="off"), _cfg()
    assert on.host_dtype == jnp.float8_e4m3fn and off.host_dtype == jnp.bfloat16
    assert off.host_block_bytes == off.block_bytes
    # one byte an element instead of two, plus 4 bytes per (pool, KV head)
    assert on.host_block_bytes == on.block_bytes // 2 + 2 * on.kv_heads * 4
    # Llama-3.1-8B geometry: 0.5 + 2 / (block x head_dim) of a bf16 block
    big = _cfg(kv_heads=8, head_dim=128, num_layers=1)
    assert big.host_block_bytes / big.block_bytes == pytest.approx(0.5 + 2 / (16 * 128))


def test_cost_model_prices_real_link_bytes():
    prof = HardwareProfile.preset("h200-pcie")
    bf16 = CostModel(profile=prof, block_bytes=65536.0)
    fp8 = CostModel(profile=prof, block_bytes=65536.0, host_block_bytes=32832.0)
    assert fp8.link_seconds / bf16.link_seconds == pytest.approx(32832 / 65536)
    assert bf16.priced_profile is prof
    # a block counted at bf16 bytes over the priced link costs its real FP8 bytes
    p = fp8.priced_profile
    assert 65536.0 / p.link_bandwidth == pytest.approx(32832.0 / prof.link_bandwidth)
    assert p.hbm_bandwidth == prof.hbm_bandwidth
    assert link_profile(prof, 1.0, None) is prof


@pytest.mark.parametrize(
    "fetch,kind,host_tier",
    [
        ("xla", "pinned_host", "write-through"),
        ("xla", "pinned_host", "exclusive"),
        ("pallas", "pinned_host", "write-through"),
        ("xla", "device", "exclusive"),
        ("pallas", "device", "write-through"),
    ],
)
def test_host_tier_is_fp8_and_round_trips_within_the_bound(fetch, kind, host_tier):
    cfg = _cfg(fetch=fetch, host_memory_kind=kind, host_tier=host_tier)
    cache, k, v, lengths = prefilled(cfg)
    assert cache.host_k.dtype == jnp.float8_e4m3fn and cache.host_v.dtype == jnp.float8_e4m3fn
    assert cache.host_k.sharding.memory_kind == kind
    assert cache.hbm_k.dtype == jnp.bfloat16
    assert cache.host_ks.shape == (cfg.num_layers, cfg.host_slots, cfg.kv_heads)
    kd, _ = kvc.to_dense(cache)
    T, Tp = k.shape[2], kd.shape[2]
    live = (jnp.arange(T)[None, :] < lengths[:, None])[None, :, :, None, None]
    want = jnp.where(live, k, 0).astype(jnp.float32)
    want = jnp.pad(want, ((0, 0), (0, 0), (0, Tp - T), (0, 0), (0, 0)))
    got = kd.astype(jnp.float32)
    # FP8 where a block has a host copy: every sealed block under write-through (its HBM copy
    # is the dequantized host copy), the host blocks under exclusive
    host = np.asarray(cache.sealed if cfg.write_through else cache.tier == 1).repeat(16, axis=2)
    assert host.any() and not host.all()
    err = np.abs(np.asarray(got - want))
    np.testing.assert_array_equal(err[~host], 0)  # the rest (tails; exclusive: HBM) untouched
    blocks = want.reshape(-1, 16, cfg.kv_heads, cfg.head_dim)
    bound = quant.error_bound(blocks).reshape(want.shape)
    # + one bf16 rounding of the dequantized value
    bound = np.asarray(bound + 2.0**-8 * jnp.abs(want))
    assert (err <= bound).all()


def test_migrations_move_fp8_blocks_without_loss_or_duplication():
    """Demoting everything, promoting it back and demoting it again: every block is where the
    table says, and the values after the second demotion equal the first's bit for bit."""
    cfg = _cfg(hbm_blocks=12, host_fraction=1.0)
    cache, _, _, _ = prefilled(cfg)
    none = jnp.zeros((cfg.num_layers, cfg.total_blocks), bool)
    first, back = demote_then_promote_all(cache)
    again, _ = kvc.migrate(back, kvc.plan_moves(back, none, 16))
    kvc.check_invariants(again)
    d1, d2 = kvc.to_dense(first), kvc.to_dense(again)
    for a, b in zip(d1, d2, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _attention_bound(q, k, v, dk, dv, scale):
    """Bound on |attn(q, k', v') - attn(q, k, v)| with |k' - k| <= dk, |v' - v| <= dv
    elementwise: logits move by at most d = scale |q| . dk, so each probability by a factor in
    [e^-2d, e^2d], and the output by at most max dv + (e^2d - 1) max |v|."""
    B, H, D = q.shape
    KV = k.shape[2]
    qg = jnp.abs(q.astype(jnp.float32)).reshape(B, KV, H // KV, D)
    d = scale * jnp.einsum("bkgd,btkd->bkgt", qg, dk).max(-1)  # [B, KV, G]
    vmax = jnp.abs(v.astype(jnp.float32)).max(axis=(1, 3))  # [B, KV]
    bound = dv.max(axis=(1, 3))[..., None] + jnp.expm1(2 * d) * vmax[..., None]
    return bound.reshape(B, H)[..., None]


TOL = {"xla": 2e-5, "pallas": 2e-2}  # the kernel's bf16 products (test_attention's tolerance)


@pytest.mark.parametrize("host_tier", ["write-through", "exclusive"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("mode", ["exact", "sparse"])
def test_attention_over_fp8_blocks(impl, mode, host_tier):
    """(1) Every placement and mechanism gives the attention of the quantized cache
    (`to_dense`) to fp32 rounding: placement still changes nothing. (2) That is within the
    derived bound of full-precision attention (stated tolerance: `_attention_bound`, from the
    FP8 error bound), and in practice far inside it."""
    placement = PlacementConfig(attention=mode, topk=0.5)
    fetch = "pallas" if impl == "pallas" else "xla"
    cfg = _cfg(hbm_blocks=4, max_len=112, fetch=fetch, host_tier=host_tier)
    cache, k, v, lengths = prefilled(cfg, lengths=(100, 77))
    q = jax.random.normal(jax.random.key(5), (2, 4, 16)).astype(jnp.bfloat16)
    layer = 1
    out, stats = att.tiered_attention(q, cache, layer, lengths, placement, impl=impl)
    assert int(stats.read_host.sum()) > 0
    kd, vd = kvc.to_dense(cache)
    sel = att.select_blocks(q, cache, layer, lengths, placement)
    tok = jnp.repeat(sel, 16, axis=1)[:, : kd.shape[2]]
    lens_mask = jnp.where(tok, 0, -1)  # unselected tokens are dropped below
    kq, vq = kd[layer], vd[layer]
    scale = 1 / math.sqrt(16)

    def dense(kk, vv):
        B, H, D = q.shape
        qg = q.astype(jnp.float32).reshape(B, 2, 2, D)
        s = jnp.einsum("bkgd,btkd->bkgt", qg, kk.astype(jnp.float32)) * scale
        t = jnp.arange(kk.shape[1])[None]
        ok = (t < lengths[:, None]) & (lens_mask == 0)
        s = jnp.where(ok[:, None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, -1)
        return jnp.einsum("bkgt,btkd->bkgd", p, vv.astype(jnp.float32)).reshape(B, H, D)

    tol = TOL[impl]
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense(kq, vq)), atol=tol, rtol=tol)
    T = k.shape[2]
    full = dense(
        jnp.pad(k[layer], ((0, 0), (0, kq.shape[1] - T), (0, 0), (0, 0))),
        jnp.pad(v[layer], ((0, 0), (0, kq.shape[1] - T), (0, 0), (0, 0))),
    )
    pad = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kq.shape[1] - T), (0, 0), (0, 0)))
    dk = jnp.abs(kq.astype(jnp.float32) - pad(k[layer]))
    dv = jnp.abs(vq.astype(jnp.float32) - pad(v[layer]))
    err = jnp.abs(out - full)
    bound = _attention_bound(q, pad(k[layer]), pad(v[layer]), dk, dv, scale)
    assert bool(jnp.all(err <= bound + tol)), float(jnp.max(err - bound))
    # in practice far inside the bound (write-through: every sealed block is FP8, not only
    # the host ones)
    assert 0 < float(jnp.max(err)) < (0.5 if cfg.write_through else 0.1)


def test_fp8_off_keeps_the_pools_and_program_unchanged():
    """With FP8 off the host pools keep the cache dtype and the scale arrays are empty, so an
    fp8-off cache carries no extra bytes (the decode tests check its tokens equal all-HBM)."""
    cfg = _cfg(fp8="off")
    cache = kvc.TieredKVCache.create(cfg)
    assert cache.host_k.dtype == jnp.bfloat16
    assert cache.host_ks.size == 0 and cache.host_vs.size == 0


@pytest.mark.parametrize(
    "lo, hi, profile, capacity",
    [("off", "host", "h200-pcie", 4), ("host", "age", "gh200", 64)],
)
def test_simulator_prices_fp8_blocks(lo, hi, profile, capacity):
    """simulate(fp8=...): under "host" a host block costs its FP8 bytes over the link, under
    "age" every placed block costs them in HBM too. The same placements (static, LRU) are then
    faster than with the cheaper setting's predecessor, and still no faster than the run's
    Unlimited bound."""
    from jaxkv.cost import get_geometry
    from jaxkv.sim import simulate as sim
    from jaxkv.sim import trace as tr

    trace = tr.SyntheticTrace("recency-low", prompt_len=8192, steps=48, num_layers=2, block_size=16)
    kw = dict(
        profile=HardwareProfile.preset(profile),
        geometry=get_geometry("llama3-8b"),
        sparsity=0.5,
        capacity_blocks=capacity,
        chunk=16,
        progress=False,
        time_plans=False,
    )
    names = ["static", "lru-plan", "unlimited"]
    off = sim.simulate(trace, names, fp8=lo, **kw)
    on = sim.simulate(trace, names, fp8=hi, **kw)
    bf16 = off["setup"]["block_bytes"] if lo == "off" else 2 * off["setup"]["host_block_bytes"]
    assert on["setup"]["host_block_bytes"] < 0.51 * bf16
    if hi == "age":
        assert on["setup"]["block_bytes"] == on["setup"]["host_block_bytes"]
    on_p, off_p = on["policies"], off["policies"]
    for n in ("static", "lru-plan"):
        assert on_p[n]["latency_s"] < off_p[n]["latency_s"]
        assert on_p[n]["latency_s"] >= on_p["unlimited"]["latency_s"]
        # the same placement: FP8 changes what a read costs, not which blocks are read
        assert on_p[n]["hbm_hit_rate"] == off_p[n]["hbm_hit_rate"]
    # the bound with a cheaper link is lower; cheaper HBM blocks may leave it (link-bound)
    if hi == "host":
        assert on_p["unlimited"]["latency_s"] < off_p["unlimited"]["latency_s"]
    assert on_p["unlimited"]["latency_s"] <= off_p["unlimited"]["latency_s"]


@pytest.mark.slow  # default suite: about 20 s (CI runs make test-slow)
def test_score_teacher_forces_like_greedy_decoding(tiny):
    """`Decoder.score` fed the tokens greedy decoding chose gives logits whose argmax are the
    next ones it chose; bad token shapes and too many steps are refused up front."""
    model, params = tiny
    cfg = CacheConfig.for_model(model.config, batch=2, max_len=96, block_size=8, hbm_fraction=0.25)
    dec = Decoder(model, cfg, PlacementConfig(policy="lru-plan", window=3), max_new_tokens=12)
    prompts = jax.random.randint(jax.random.key(3), (2, 40), 0, 256).astype(jnp.int32)
    toks = np.asarray(dec.generate(params, dec.prefill(params, prompts)).tokens)
    state = dec.prefill(params, prompts)
    with pytest.raises(ValueError, match="expected \\(2, steps\\)"):
        dec.score(params, state, jnp.zeros((3, 4), jnp.int32))
    with pytest.raises(ValueError, match="exceed max_new_tokens=12"):
        dec.score(params, state, jnp.zeros((2, 12), jnp.int32))
    state, logits = dec.score(params, state, toks[:, :10])
    assert logits.shape == (10, 2, model.config.vocab_size)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits, -1)).T, toks[:, 1:11])
