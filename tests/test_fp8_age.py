"""FP8 by age (`CacheConfig(fp8="age", fp8_age=N)`): every sealed block is FP8 in both tiers,
the tail and the blocks of the last N tokens are read from a full-precision ring. Tokens younger
than N are exact, older ones within the format's bound; placement and mechanism still change
nothing; migrations and compaction move FP8 bytes without loss; the decode loop counts HBM
reads at their FP8 bytes (the simulator's pricing: tests/test_fp8.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import demote_then_promote_all, fp8_config, prefilled

from jaxkv import Decoder, summarize
from jaxkv import attention as att
from jaxkv import cache as kvc
from jaxkv.cache import quant
from jaxkv.cache.layout import ring_ids, ring_window
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig

BS = 16


def _cfg(**kw):
    return fp8_config(**{**dict(hbm_blocks=4, fp8="age", fp8_age=32, fetch="xla"), **kw})


def test_config_checks_and_bytes():
    with pytest.raises(ValueError, match="fp8_age=20 tokens: expected a multiple of block_size=16"):
        _cfg(fp8_age=20)
    with pytest.raises(ValueError, match="fp8_age=16 applies to fp8='age' only"):
        _cfg(fp8="host", fp8_age=16)
    with pytest.raises(ValueError, match="fp8_age must be an integer >= 0"):
        _cfg(fp8_age=-16)
    cfg = _cfg()
    assert cfg.ring_blocks == 3 and _cfg(fp8_age=0).ring_blocks == 1
    assert _cfg(fp8="host", fp8_age=0).ring_blocks == 0
    assert cfg.hbm_dtype == cfg.host_dtype == jnp.float8_e4m3fn
    assert cfg.hbm_block_bytes == cfg.host_block_bytes == cfg.block_bytes // 2 + 2 * 2 * 4
    host = _cfg(fp8="host", fp8_age=0)
    assert host.hbm_dtype == jnp.bfloat16 and host.hbm_block_bytes == host.block_bytes


def test_ring_window_and_ids():
    cfg = _cfg(max_len=64)  # 4 blocks, ring of 3
    lengths = jnp.asarray([0, 33, 64])
    win = np.asarray(ring_window(cfg, lengths))
    np.testing.assert_array_equal(win[0], [1, 0, 0, 0])  # the tail alone
    np.testing.assert_array_equal(win[1], [1, 1, 1, 0])  # tail 2 and the two before it
    np.testing.assert_array_equal(win[2], [0, 1, 1, 1])  # full: its last block is the "tail"
    ids = np.asarray(ring_ids(cfg, lengths, jnp.asarray(win)))
    for b in range(3):
        for e, j in enumerate(ids[b]):
            assert j == -1 or (win[b, j] and j % 3 == e)
        assert sorted(j for j in ids[b] if j >= 0) == list(np.flatnonzero(win[b]))


@pytest.mark.parametrize("age", [0, 32])
@pytest.mark.parametrize("kind", ["pinned_host", "device"])
def test_prefill_keeps_recent_tokens_exact_and_old_ones_within_the_bound(age, kind):
    cfg = _cfg(fp8_age=age, host_memory_kind=kind)
    cache, k, v, lengths = prefilled(cfg)
    kvc.check_invariants(cache)
    for x in (cache.hbm_k, cache.hbm_v, cache.host_k, cache.host_v):
        assert x.dtype == jnp.float8_e4m3fn
    assert cache.host_k.sharding.memory_kind == kind
    assert cache.ring_k.shape == (2, 2, cfg.ring_blocks, BS, 2, 16)
    assert cache.ring_k.dtype == jnp.bfloat16
    assert cache.hbm_ks.shape == (2, cfg.hbm_slots, 2)
    assert int((cache.tier == 1).sum()) > 0  # both tiers hold blocks
    T = k.shape[2]
    for got, want in zip(kvc.to_dense(cache), (k, v), strict=True):
        got = np.asarray(got[:, :, :T], np.float32)
        want = np.asarray(want, np.float32)
        for b, n in enumerate(np.asarray(lengths)):
            young = max(0, (n // BS - age // BS) * BS)  # first token read from the ring
            np.testing.assert_array_equal(got[:, b, young:n], want[:, b, young:n])
            old = want[:, b, :young].reshape(2, -1, BS, 2, 16)
            bound = np.asarray(quant.error_bound(jnp.asarray(old.reshape(-1, BS, 2, 16))))
            err = np.abs(got[:, b, :young] - want[:, b, :young]).reshape(bound.shape)
            assert (err <= bound + 2.0**-8 * np.abs(old.reshape(bound.shape))).all()
            if young >= BS:
                assert err.max() > 0  # old tokens are really FP8


def _dense_attention(q, kd, vd, lengths, sel, scale):
    B, H, D = q.shape
    KV = kd.shape[2]
    tok = jnp.repeat(sel, BS, axis=1)[:, : kd.shape[1]]
    qg = q.astype(jnp.float32).reshape(B, KV, H // KV, D)
    s = jnp.einsum("bkgd,btkd->bkgt", qg, kd.astype(jnp.float32)) * scale
    t = jnp.arange(kd.shape[1])[None]
    ok = (t < lengths[:, None]) & tok
    s = jnp.where(ok[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, -1)
    return jnp.einsum("bkgt,btkd->bkgd", p, vd.astype(jnp.float32)).reshape(B, H, D)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("mode", ["exact", "sparse"])
def test_attention_reads_the_ring_and_the_fp8_pools(impl, mode):
    """Attention over an fp8="age" cache equals attention over what `to_dense` returns (FP8
    old blocks dequantized, recent ones from the ring), whatever the placement: all in HBM,
    or a quarter of it; every part (HBM pool, ring, host) is read."""
    placement = PlacementConfig(attention=mode, topk=0.5)
    fetch = "pallas" if impl == "pallas" else "xla"
    q = jax.random.normal(jax.random.key(5), (2, 4, 16)).astype(jnp.bfloat16)
    outs = []
    for hbm in (dict(hbm_fraction=1.0, hbm_blocks=None), dict(hbm_blocks=4)):
        cfg = _cfg(**hbm, max_len=112, fetch=fetch)
        cache, _, _, lengths = prefilled(cfg, lengths=(100, 77))
        out, stats = att.tiered_attention(q, cache, 1, lengths, placement, impl=impl)
        kd, vd = kvc.to_dense(cache)
        sel = att.select_blocks(q, cache, 1, lengths, placement)
        want = _dense_attention(q, kd[1], vd[1], lengths, sel, 1 / math.sqrt(16))
        tol = 2e-2 if impl == "pallas" else 2e-5
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=tol, rtol=tol)
        ring = stats.read_hbm & ring_window(cfg, cache.lengths)
        assert int(ring.sum()) > 0 and int((stats.read_hbm & ~ring).sum()) > 0
        assert (int(stats.read_host.sum()) > 0) == (cfg.hbm_slots < cfg.total_blocks)
        if impl == "xla":
            np.testing.assert_allclose(np.asarray(stats.mass.sum(-1)), 4.0, rtol=1e-5)
        outs.append(np.asarray(out))
    tol = 2e-2 if impl == "pallas" else 1e-6
    np.testing.assert_allclose(outs[0], outs[1], atol=tol, rtol=tol)


def _decode_tokens(cache, steps, seed=100):
    """Writes `steps` random tokens per sequence through write_token / advance; returns the
    cache and the tokens written, [layers, batch, steps, kv_heads, head_dim] each."""
    c = cache.config
    ks, vs = [], []
    act = jnp.ones((c.batch,), bool)
    for i in range(steps):
        key = jax.random.key(seed + i)
        kt = jax.random.normal(key, (c.num_layers, c.batch, c.kv_heads, c.head_dim))
        vt = 2.0 * jax.random.normal(jax.random.fold_in(key, 1), kt.shape)
        kt, vt = kt.astype(c.jnp_dtype), vt.astype(c.jnp_dtype)
        for layer in range(c.num_layers):
            cache = kvc.write_token(cache, layer, kt[layer], vt[layer], act)
        cache = kvc.advance(cache, act)
        ks.append(kt)
        vs.append(vt)
    return cache, jnp.stack(ks, 2), jnp.stack(vs, 2)


def test_sealing_quantizes_the_ring_block_into_its_tier():
    """Tokens written by the decode loop go to the ring; at sealing the block is quantized
    into its HBM slot or spilled (quantized) to host, and a sequence that fills max_len seals
    its last block in place: every sealed block's pool copy is the quantized tokens."""
    cfg = _cfg(max_len=96, hbm_blocks=5, fp8_age=16)
    cache, k, v, lengths = prefilled(cfg, lengths=(60, 41))
    cache, kt, vt = _decode_tokens(cache, 36)
    kvc.check_invariants(cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [96, 77])
    full_k = np.concatenate([np.asarray(k[:, 0, :60]), np.asarray(kt[:, 0])], axis=1)
    # pool copies of every sealed block of sequence 0 (full: 6 blocks, the last sealed in place)
    for layer in range(2):
        for j in range(6):
            t, s = int(cache.tier[layer, 0, j]), int(cache.slot[layer, 0, j])
            pool, scales = (cache.hbm_k, cache.hbm_ks) if t == 0 else (cache.host_k, cache.host_ks)
            vals = jnp.asarray(np.asarray(pool[layer, s]))[None]  # (host blocks: via numpy)
            got = quant.dequantize(vals, scales[layer, s][None], jnp.float32)
            blk = jnp.asarray(full_k[layer, j * BS : (j + 1) * BS][None])
            # the scale is computed inside the jitted sealing and eagerly here: XLA may round
            # them an ulp apart (jax 0.12.1 on CPU does), and a value at an FP8 rounding
            # boundary then takes the other code. So: the block's own scale, and its values
            # within FP8's rounding of the tokens (a wrong block is far outside it)
            np.testing.assert_allclose(
                np.asarray(scales[layer, s]), np.asarray(quant.block_scales(blk)[0]), rtol=2**-22
            )
            err = np.abs(np.asarray(got) - np.asarray(blk))
            assert (err <= np.asarray(quant.error_bound(blk))).all(), float(err.max())
    assert int((cache.tier[:, 0, :6] == 1).sum()) > 0  # some blocks spilled
    # what attention reads: the last fp8_age tokens (and the tail) exact, the rest FP8
    kd = np.asarray(kvc.to_dense(cache)[0], np.float32)
    np.testing.assert_array_equal(kd[:, 0, 80:96], full_k[:, 80:96].astype(np.float32))
    assert np.abs(kd[:, 0, :80] - full_k[:, :80].astype(np.float32)).max() > 0
    full_k1 = np.concatenate([np.asarray(k[:, 1, :41]), np.asarray(kt[:, 1])], axis=1)
    np.testing.assert_array_equal(kd[:, 1, 48:77], full_k1[:, 48:77].astype(np.float32))


def test_migrations_and_compaction_move_fp8_bytes_without_loss():
    """Demote everything, promote it back, compact (XLA and the Pallas kernel): the FP8 bytes
    and scales of every block are unchanged, the table consistent at each step."""
    # the host tier in device memory: Pallas interpret mode cannot lower a jit with pinned_host
    # operands (ARCHITECTURE.md), and compaction's kernel runs interpreted here
    cfg = _cfg(
        hbm_fraction=1.0, hbm_blocks=None, host_fraction=1.0, fp8_age=0, host_memory_kind="device"
    )
    cache, _, _, _ = prefilled(cfg)
    cache, _, _ = _decode_tokens(cache, 7)

    def blocks(c):
        out = []
        for layer in range(cfg.num_layers):
            for b in range(cfg.batch):
                for j in range(int(c.lengths[b]) // BS):
                    t, s = int(c.tier[layer, b, j]), int(c.slot[layer, b, j])
                    if t == 0:
                        pools = (c.hbm_k, c.hbm_v, c.hbm_ks, c.hbm_vs)
                    else:
                        pools = (c.host_k, c.host_v, c.host_ks, c.host_vs)
                    out.append([np.asarray(p[layer, s]).view(np.uint8) for p in pools])
        return out

    before = blocks(cache)
    down, up = demote_then_promote_all(cache)
    for c in (down, up, kvc.compact(up, "xla"), kvc.compact(up, "pallas")):
        kvc.check_invariants(c)
        for x, y in zip(blocks(c), before, strict=True):
            for a, b in zip(x, y, strict=True):
                np.testing.assert_array_equal(a, b)
    assert float(kvc.fragmentation(kvc.compact(up)).max()) == 0.0


@pytest.fixture(scope="module")
def age_runs(tiny):
    """Greedy decodes of the tiny model under fp8 off / host / age 0 / age 16, static policy,
    HBM a quarter of the KV, and fp8="age" with everything in HBM."""
    model, params = tiny
    prompts = jax.random.randint(jax.random.key(7), (2, 45), 0, 256).astype(jnp.int32)
    runs = {}
    for name, fp8, age, hbm in (
        ("off", "off", 0, 0.25),
        ("host", "host", 0, 0.25),
        ("age0", "age", 0, 0.25),
        ("age16", "age", 16, 0.25),
        ("age16_hbm", "age", 16, 1.0),
    ):
        cfg = CacheConfig.for_model(
            model.config,
            batch=2,
            max_len=96,
            block_size=8,
            hbm_fraction=hbm,
            fp8=fp8,
            fp8_age=age,
            dtype="float32",
        )
        dec = Decoder(
            model,
            cfg,
            PlacementConfig(policy="static", window=4),
            max_new_tokens=16,
            profile=HardwareProfile.preset("h200-pcie"),
        )
        state = dec.generate(params, dec.prefill(params, prompts, (45, 30)))
        runs[name] = (cfg, summarize(state), state)
    return runs


def test_decode_with_fp8_host_counts_real_bytes(age_runs):
    """The decode loop runs with an FP8 host tier (jit, donation, spills, migrations), keeps
    the pools in their kinds and dtypes, and its metrics count a host block at its FP8 bytes:
    the same reads cost fewer link bytes and less modeled time than with FP8 off."""
    (c0, s0, st0), (c1, s1, st1) = age_runs["off"], age_runs["host"]
    for cfg, state in ((c0, st0), (c1, st1)):
        kvc.check_invariants(state.cache)
        assert state.cache.host_k.dtype == cfg.host_dtype
        assert state.cache.host_k.sharding.memory_kind == "pinned_host"
    # static placement: the same blocks are read from each tier in both runs
    assert s0["hbm_hit_rate"] == s1["hbm_hit_rate"]
    host0 = float(np.asarray(st0.metrics.host_bytes).sum())
    host1 = float(np.asarray(st1.metrics.host_bytes).sum())
    assert host0 > 0
    assert host1 / host0 == pytest.approx(c1.host_block_bytes / c0.block_bytes)
    assert s1["modeled_seconds"] < s0["modeled_seconds"]


def test_decode_with_fp8_age_counts_real_bytes(age_runs):
    """The decode loop runs with fp8="age" (jit, donation, spills, migrations), and counts a
    sealed HBM block at its FP8 bytes, a ring block at full precision: with the same static
    placement, the HBM bytes drop below fp8="host"'s, and a larger ring moves reads of recent
    blocks from the link to HBM."""
    for name in ("age0", "age16"):
        cfg, _, state = age_runs[name]
        kvc.check_invariants(state.cache)
        assert state.cache.hbm_k.dtype == jnp.float8_e4m3fn
        assert state.cache.host_k.sharding.memory_kind == "pinned_host"
        assert state.cache.ring_k.shape[2] == cfg.ring_blocks
    (_, s_off, _), (_, s_host, _) = age_runs["off"], age_runs["host"]
    (c0, s0, st0), (_, s16, _) = age_runs["age0"], age_runs["age16"]
    assert s0["hbm_hit_rate"] == s_host["hbm_hit_rate"] == s_off["hbm_hit_rate"]
    assert s0["host_bytes"] == pytest.approx(s_host["host_bytes"])
    assert s0["hbm_bytes"] < s_host["hbm_bytes"]
    # the ring serves the recent blocks, which static placement left on host: fewer link bytes,
    # more HBM bytes (full precision), a higher hit rate
    assert s16["host_bytes"] < s0["host_bytes"] and s16["hbm_bytes"] > s0["hbm_bytes"]
    assert s16["hbm_hit_rate"] > s0["hbm_hit_rate"]
    # age 0: the tail alone at full precision, every other HBM read at FP8 bytes
    reads = float(np.asarray(st0.metrics.hbm_bytes).sum())
    tails = s0["steps"] * c0.num_layers * c0.batch * c0.block_bytes  # a tail a sequence, step
    n_sealed = (s_host["hbm_bytes"] - tails) / c0.block_bytes
    assert reads == pytest.approx(tails + n_sealed * c0.hbm_block_bytes)
    assert s0["modeled_seconds"] < s_host["modeled_seconds"] < s_off["modeled_seconds"]


def test_fp8_age_placement_changes_nothing(age_runs):
    """Exact attention over an fp8="age" cache: the same tokens whether a quarter of the
    blocks or all of them live in HBM (quantization belongs to the block, not its tier)."""
    a, b = age_runs["age16"][2], age_runs["age16_hbm"][2]
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert float(summarize(a)["hbm_hit_rate"]) < 1.0 == float(summarize(b)["hbm_hit_rate"])
