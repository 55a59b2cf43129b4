import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_cache

from jaxkv import cache as kvc
from jaxkv.attention.select import select_blocks, window_starts
from jaxkv.attention.tiered import tiered_attention
from jaxkv.attention.xla import dense_attention_reference
from jaxkv.config import CacheConfig, PlacementConfig

TOL = {"float32": 2e-5, "bfloat16": 2e-2}


@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("which", ["one", "block+1", "full"])
def test_exact_attention_matches_dense(gqa, block_size, which):
    max_len = 4 * block_size
    length = {"one": 1, "block+1": block_size + 1, "full": max_len}[which]
    cache, dk, dv = random_cache(
        jax.random.key(gqa * 100 + block_size),
        block_size=block_size,
        max_len=max_len,
        lengths=(length, max(1, length - 3)),
        hbm_fraction=0.5,
    )
    lengths = cache.lengths
    q = jax.random.normal(jax.random.key(1), (2, 2 * gqa, 8))
    fn = jax.jit(lambda q, c, n: tiered_attention(q, c, 1, n, PlacementConfig()))
    out, stats = fn(q, cache, lengths)
    ref = dense_attention_reference(q, dk[1], dv[1], lengths)
    np.testing.assert_allclose(out, ref, atol=TOL["float32"], rtol=1e-5)
    n_blocks = -(-np.asarray(lengths) // block_size)
    assert (np.asarray(stats.read_hbm | stats.read_host).sum(1) == n_blocks).all()
    assert not np.any(np.asarray(stats.read_hbm & stats.read_host))
    np.testing.assert_allclose(stats.mass.sum(1), 2 * gqa, rtol=1e-4)  # sums to q_heads


def test_exact_attention_bf16():
    cache, dk, dv = random_cache(jax.random.key(2), dtype="bfloat16", hbm_fraction=0.5)
    q = jax.random.normal(jax.random.key(1), (2, 8, 8)).astype(jnp.bfloat16)
    out, _ = tiered_attention(q, cache, 0, cache.lengths, PlacementConfig())
    ref = dense_attention_reference(q, dk[0], dv[0], cache.lengths)
    np.testing.assert_allclose(out, ref, atol=TOL["bfloat16"], rtol=2e-2)


def test_all_hbm_and_all_host_agree():
    cache, dk, dv = random_cache(jax.random.key(3), hbm_fraction=1.0, shuffle_moves=0)
    c = cache.config
    demoted, _ = kvc.migrate(
        cache, kvc.plan_moves(cache, jnp.zeros((2, c.total_blocks), bool), c.total_blocks)
    )
    q = jax.random.normal(jax.random.key(4), (2, 4, 8))
    a, sa = tiered_attention(q, cache, 0, cache.lengths, PlacementConfig())
    b, sb = tiered_attention(q, demoted, 0, demoted.lengths, PlacementConfig())
    np.testing.assert_allclose(a, b, atol=2e-6)
    assert int(sa.read_host.sum()) == 0 and int(sb.read_host.sum()) > 0


def test_sparse_selects_sink_recent_and_topk():
    cache, dk, dv = random_cache(jax.random.key(5), lengths=(40, 21), max_len=64, block_size=4)
    q = jax.random.normal(jax.random.key(6), (2, 4, 8))
    p = PlacementConfig(attention="sparse", topk=5, sink_blocks=1, recent_blocks=2)
    sel = np.asarray(select_blocks(q, cache, 0, cache.lengths, p))
    assert sel.sum(1).tolist() == [5, 5]
    assert sel[:, 0].all()  # sink
    assert sel[0, 8:10].all() and sel[1, 4:6].all()  # the two most recent blocks
    out, stats = tiered_attention(q, cache, 0, cache.lengths, p)
    assert (np.asarray(stats.read_hbm | stats.read_host) == sel).all()
    # sparse output equals dense attention restricted to the selected tokens
    tok_sel = np.repeat(sel, 4, axis=1)[:, : dk.shape[2]]
    keep = jnp.asarray(tok_sel)[:, :, None, None]
    big = jnp.where(keep, 0.0, -1e30)
    B, H, D = q.shape
    qg = q.reshape(B, 2, 2, D)
    logits = jnp.einsum("bkgd,btkd->bkgt", qg, dk[0]) / np.sqrt(D) + big[:, None, None, :, 0, 0]
    valid = jnp.arange(dk.shape[2])[None] < cache.lengths[:, None]
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    ref = jnp.einsum("bkgt,btkd->bkgd", jax.nn.softmax(logits, -1), dv[0]).reshape(B, H, D)
    np.testing.assert_allclose(out, ref, atol=2e-5)


def test_sparse_fraction_counts_written_blocks():
    cache, _, _ = random_cache(jax.random.key(7), lengths=(40, 21), max_len=64, block_size=4)
    q = jax.random.normal(jax.random.key(6), (2, 4, 8))
    p = PlacementConfig(attention="sparse", topk=0.5, sink_blocks=0, recent_blocks=0)
    sel = np.asarray(select_blocks(q, cache, 0, cache.lengths, p))
    assert sel.sum(1).tolist() == [5, 3]  # ceil(0.5 * 10), ceil(0.5 * 6)


def test_error_query_shape():
    cache, _, _ = random_cache(jax.random.key(0), shuffle_moves=0)
    with pytest.raises(ValueError, match=r"q has shape \(2, 3, 8\), expected \(2, a multiple"):
        tiered_attention(jnp.zeros((2, 3, 8)), cache, 0, cache.lengths, PlacementConfig())


def test_error_unknown_impl():
    cache, _, _ = random_cache(jax.random.key(0), shuffle_moves=0)
    with pytest.raises(ValueError, match=r"unknown attention impl 'cuda'; expected one of"):
        tiered_attention(
            jnp.zeros((2, 4, 8)), cache, 0, cache.lengths, PlacementConfig(), impl="cuda"
        )


def test_error_pallas_needs_kernel_geometry():
    cache, _, _ = random_cache(jax.random.key(0), shuffle_moves=0)  # block_size 4, head_dim 8
    match = r"impl='pallas' needs block_size and head_dim multiples of 16 .*got block_size=4, "
    with pytest.raises(ValueError, match=match):
        tiered_attention(
            jnp.zeros((2, 4, 8)), cache, 0, cache.lengths, PlacementConfig(), impl="pallas"
        )


@pytest.mark.parametrize(
    "dtype,tol", [("bfloat16", 2e-2), pytest.param("float32", 5e-5, marks=pytest.mark.slow)]
)
def test_pallas_attention_matches_xla_in_interpreter(dtype, tol):
    cache, dk, dv = random_cache(
        jax.random.key(9),
        dtype=dtype,
        block_size=16,
        head_dim=16,
        max_len=128,
        lengths=(100, 37),
        hbm_fraction=0.5,
        host_memory_kind="device",
    )
    q = jax.random.normal(jax.random.key(1), (2, 8, 16)).astype(dtype)
    p = PlacementConfig(attention="sparse", topk=4)
    a, sa = tiered_attention(q, cache, 1, cache.lengths, p, impl="pallas")
    b, sb = tiered_attention(q, cache, 1, cache.lengths, p, impl="xla")
    np.testing.assert_allclose(a, b, atol=tol, rtol=tol)
    assert (np.asarray(sa.read_host) == np.asarray(sb.read_host)).all()
    assert int(sa.read_host.sum()) > 0 and int(sa.read_hbm.sum()) > 0


@pytest.mark.parametrize("form", ["dot", "reduce"])
def test_pool_attention_matches_the_gathering_reference(form):
    """The XLA path reads only the blocks a part reads, where they lie (`compact_ids`,
    `attend_pool`), in both formulations (CPU's dot, GPU's reduce): the same output,
    log-sum-exp and per-block log-sum-exp as the kernel's pure-jnp reference, which gathers
    every column of the block table."""
    from jaxkv.attention.xla import attend_pool, compact_ids
    from pallas_kernels.blocked_attention import blocked_attention_reference

    rng = np.random.default_rng(0)
    B, H, KV, D, M, bs, S = 3, 8, 2, 16, 12, 4, 40
    q = jnp.asarray(rng.standard_normal((B, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((S, bs, KV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((S, bs, KV, D)), jnp.float32)
    table = jnp.asarray(rng.permutation(S)[: B * M].reshape(B, M), jnp.int32)
    mask = rng.random((B, M)) < 0.5
    mask[2] = False  # a sequence that attends nothing
    mask = jnp.asarray(mask)
    lengths = jnp.asarray([M * bs, 5 * bs + 1, 7], jnp.int32)
    want = blocked_attention_reference(
        q, k, v, table, mask, lengths, scale=0.25, return_block_lse=True
    )
    ids = compact_ids(mask, M)
    at = jnp.take_along_axis(table, jnp.maximum(ids, 0), axis=1)
    got = jax.jit(lambda q, at: attend_pool(q, k[at], v[at], ids, lengths, 0.25, M, form=form))(
        q, at
    )
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert (np.isfinite(g) == np.isfinite(w)).all()
        np.testing.assert_allclose(
            np.where(np.isfinite(w), g, 0), np.where(np.isfinite(w), w, 0), atol=2e-5, rtol=1e-5
        )
    # each row lists its set columns in order, then -1
    for b in range(B):
        cols = np.flatnonzero(np.asarray(mask[b]))
        assert np.asarray(ids[b, : len(cols)]).tolist() == cols.tolist()
        assert (np.asarray(ids[b, len(cols) :]) == -1).all()


@pytest.mark.parametrize("window", [1, 6, 8, 13, 100])
def test_window_reads_only_blocks_inside_it(window):
    """A sliding window (Mistral): exact tiered attention equals dense attention over the
    last `window` tokens, and reads only the blocks holding one of them (block size 4:
    windows on and off block boundaries, of one token and wider than the sequence)."""
    cache, dk, dv = random_cache(jax.random.key(11), lengths=(21, 13), hbm_fraction=0.5)
    q = jax.random.normal(jax.random.key(12), (2, 4, 8))
    fn = jax.jit(lambda q, c, w: tiered_attention(q, c, 1, c.lengths, PlacementConfig(), window=w))
    out, stats = fn(q, cache, jnp.int32(window))
    ref = dense_attention_reference(q, dk[1], dv[1], cache.lengths, window=window)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)
    read = np.asarray(stats.read_hbm | stats.read_host)
    for b, n in enumerate((21, 13)):
        first = max(n - window, 0)
        assert np.flatnonzero(read[b]).tolist() == list(range(first // 4, -(-n // 4)))
    if window < 13:  # the window changes the result
        full = dense_attention_reference(q, dk[1], dv[1], cache.lengths)
        assert not np.allclose(out, full, atol=1e-3)


def test_window_zero_is_full_attention():
    """window <= 0 marks a layer without a window (Qwen2's first max_window_layers)."""
    cache, dk, dv = random_cache(jax.random.key(13))
    q = jax.random.normal(jax.random.key(14), (2, 4, 8))
    a, _ = tiered_attention(q, cache, 0, cache.lengths, PlacementConfig(), window=0)
    b, _ = tiered_attention(q, cache, 0, cache.lengths, PlacementConfig())
    np.testing.assert_array_equal(a, b)
    assert window_starts(cache.lengths, None) is None
    assert np.asarray(window_starts(cache.lengths, 5)).tolist() == [16, 8]


def test_window_sparse_selects_inside_it():
    """Sparse mode under a window: sink blocks outside the window are not read, the top-k is
    taken among the blocks inside it, and the output equals dense attention over the
    selected tokens of the window."""
    cache, dk, dv = random_cache(jax.random.key(5), lengths=(40, 21), max_len=64, block_size=4)
    q = jax.random.normal(jax.random.key(6), (2, 4, 8))
    p = PlacementConfig(attention="sparse", topk=3, sink_blocks=1, recent_blocks=1)
    sel = np.asarray(select_blocks(q, cache, 0, cache.lengths, p, window=18))
    assert sel.sum(1).tolist() == [3, 3]
    assert not sel[0, :5].any()  # 40 - 18 = 22: block 5 on; the sink lies outside the window
    assert sel[1, 0]  # 21 - 18 = 3: block 0 holds token 3, the sink is forced
    assert sel[0, 9] and sel[1, 5]  # the recent block
    out, stats = tiered_attention(q, cache, 0, cache.lengths, p, window=18)
    assert (np.asarray(stats.read_hbm | stats.read_host) == sel).all()
    starts = np.asarray([22, 3])
    tok = np.repeat(sel, 4, axis=1)[:, : dk.shape[2]]
    tok &= np.arange(dk.shape[2])[None] >= starts[:, None]
    B, H, D = q.shape
    qg = q.reshape(B, 2, 2, D)
    logits = jnp.einsum("bkgd,btkd->bkgt", qg, dk[0]) / np.sqrt(D)
    valid = jnp.asarray(tok) & (jnp.arange(dk.shape[2])[None] < cache.lengths[:, None])
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    ref = jnp.einsum("bkgt,btkd->bkgd", jax.nn.softmax(logits, -1), dv[0]).reshape(B, H, D)
    np.testing.assert_allclose(out, ref, atol=2e-5)


def test_window_pallas_matches_xla_in_interpreter():
    cache, _, _ = random_cache(
        jax.random.key(9),
        block_size=16,
        head_dim=16,
        max_len=128,
        lengths=(100, 37),
        hbm_fraction=0.5,
        host_memory_kind="device",
    )
    q = jax.random.normal(jax.random.key(1), (2, 8, 16))
    for p in (PlacementConfig(), PlacementConfig(attention="sparse", topk=3)):
        a, sa = tiered_attention(q, cache, 1, cache.lengths, p, impl="pallas", window=41)
        b, sb = tiered_attention(q, cache, 1, cache.lengths, p, impl="xla", window=41)
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5)
        assert (np.asarray(sa.read_host) == np.asarray(sb.read_host)).all()
        assert not np.asarray(sa.read_hbm | sa.read_host)[0, :3].any()  # 100 - 41 = 59


def test_quest_scores_upper_bound_every_key():
    """The Quest bound of a block is >= the best logit of any of its keys, per sequence (GQA:
    4 query heads over 2 KV heads), and equal to it for a block of one token."""
    from jaxkv.attention.select import quest_scores

    rng = np.random.default_rng(0)
    B, M, T, KV, G, D = 2, 5, 4, 2, 2, 8
    keys = rng.normal(size=(B, M, T, KV, D)).astype(np.float32)
    q = rng.normal(size=(B, KV * G, D)).astype(np.float32)
    bound = np.asarray(quest_scores(jnp.asarray(q), keys.min(2), keys.max(2)))
    qg = q.reshape(B, KV, G, D)
    exact = np.einsum("bmtkd,bkgd->bmtkg", keys, qg).max(2).sum((-1, -2))  # [B, M]
    assert bound.shape == (B, M)
    assert (bound >= exact - 1e-4).all()
    one = keys[:, :, :1]
    np.testing.assert_allclose(
        np.asarray(quest_scores(jnp.asarray(q), one.min(2), one.max(2))),
        np.einsum("bmtkd,bkgd->bmtkg", one, qg).max(2).sum((-1, -2)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_auto_takes_the_implementation_measured_on_the_device(monkeypatch):
    """`impl="auto"` reads `jaxkv.attention.measured` by device kind: the XLA path on CPU and
    on any device not measured; a kernel entry is taken only where the kernel can run."""
    from jaxkv.attention import measured, tiered

    cfg = CacheConfig(
        num_layers=1, kv_heads=2, head_dim=16, batch=1, max_len=64, block_size=16,
        hbm_fraction=1.0,
    )  # fmt: skip
    assert measured.measured_impl("cpu") == "xla"
    assert measured.measured_impl("NVIDIA B300 (not measured)") == measured.DEFAULT == "xla"
    assert tiered.resolve_impl("auto", cfg) == "xla"
    entry = measured.Measured("pallas", "test", "a test entry")
    monkeypatch.setitem(measured.MEASURED, "cpu", entry)
    assert measured.measured_impl() == "pallas"
    assert tiered.resolve_impl("auto", cfg) == "xla"  # no Hopper GPU here: not the kernel
    monkeypatch.setattr(tiered, "hopper_available", lambda: True)
    assert tiered.resolve_impl("auto", cfg) == "pallas"


def test_host_part_runs_under_a_conditional_off_gpu():
    """Off GPU the host part (fetch and attention) is a `lax.cond` branch on whether the step
    reads a host block: the compiled program branches, and a step with every block in HBM
    gives the dense result, as one with host blocks does."""
    cache, k, v = random_cache(jax.random.key(3), hbm_fraction=1.0, shuffle_moves=0)
    q = jax.random.normal(jax.random.key(4), (2, 4, 8))
    p = PlacementConfig()
    f = jax.jit(lambda q, cache: tiered_attention(q, cache, 1, cache.lengths, p, impl="xla"))
    assert "conditional(" in f.lower(q, cache).compile().as_text()
    out, st = f(q, cache)
    assert int(st.read_host.sum()) == 0
    want = dense_attention_reference(q, k[1], v[1], cache.lengths)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)
