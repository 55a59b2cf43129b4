"""The cache underneath the serving engine: a paged write-through host pool (`paged_host`) and
one sequence's row inserted and released at a time (`jaxkv.cache.rows`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import cache as kvc
from jaxkv.cache import rows
from jaxkv.config import TIER_HBM, TIER_HOST, CacheConfig


def _config(**kw):
    base = dict(num_layers=2, kv_heads=2, head_dim=8, batch=3, max_len=64, block_size=4)
    base.update(hbm_blocks=8, host_blocks=30, paged_host=True)
    base.update(kw)
    return CacheConfig(**base)


def _kv(seed, T=64):
    k = jax.random.normal(jax.random.key(seed), (2, T, 2, 8))
    v = jax.random.normal(jax.random.key(seed + 1000), (2, T, 2, 8))
    return k, v


def _decode(cache, steps):
    """`steps` tokens written into every row (the same values), sealing blocks as they fill."""
    B = cache.config.batch
    active = jnp.ones((B,), bool)
    for t in range(steps):
        for layer in range(cache.config.num_layers):
            x = jnp.full((B, 2, 8), float(t))
            cache = kvc.write_token(cache, layer, x, -x, active)
        cache = kvc.advance(cache, active)
        kvc.check_invariants(cache, contents=True)
    return cache


def test_insert_writes_both_tiers_and_reads_back_exactly():
    cache = kvc.TieredKVCache.create(_config())
    kvc.check_invariants(cache)
    written = {}
    for b, n in [(0, 21), (2, 9), (1, 30)]:
        k, v = _kv(b)
        cache = rows.insert(cache, b, k, v, n)
        kvc.check_invariants(cache, contents=True)
        written[b] = (n, k, v)
    dk, dv = kvc.to_dense(cache)
    for b, (n, k, v) in written.items():
        assert np.array_equal(np.asarray(dk[:, b, :n]), np.asarray(k[:, :n]))
        assert np.array_equal(np.asarray(dv[:, b, :n]), np.asarray(v[:, :n]))
        assert int(cache.lengths[b]) == n
    # pages: one per sealed block (21 // 4 + 9 // 4 + 30 // 4 = 14 of 30), distinct
    assert int(rows.free_pages(cache)) == 30 - 14
    # HBM: 8 slots, 3 tails, the 5 others to the first sealed blocks inserted (row 0's)
    assert int(jnp.sum(cache.in_hbm[:, 0])) == 2 * 5 and int(jnp.sum(cache.in_hbm[:, 1:])) == 0


def test_release_returns_every_page_and_hbm_slot_but_the_tail():
    cache = kvc.TieredKVCache.create(_config())
    for b, n in [(0, 21), (1, 13)]:
        cache = rows.insert(cache, b, *_kv(b), n)
    cache = _decode(cache, 7)  # blocks seal while decoding: they take pages too
    before = int(rows.free_pages(cache))
    held = int(cache.lengths[0]) // 4
    hbm_held = int(jnp.sum(cache.in_hbm[0, 0]))
    free_hbm = int(jnp.sum(cache.hbm_free[0]))
    cache = rows.release(cache, 0)
    kvc.check_invariants(cache, contents=True)
    assert int(rows.free_pages(cache)) == before + held
    assert int(jnp.sum(cache.hbm_free[0])) == free_hbm + hbm_held
    assert int(cache.lengths[0]) == 0
    assert (np.asarray(cache.tier[:, 0, 0]) == TIER_HBM).all()
    # the row takes a new prompt, ranked by priority, capped
    k, v = _kv(7)
    prio = jnp.tile(jnp.arange(16.0)[None], (2, 1))  # later blocks first
    cache = rows.insert(cache, 0, k, v, 17, priority=prio, hbm_cap=1)
    kvc.check_invariants(cache, contents=True)
    tier = np.asarray(cache.tier[:, 0])
    assert (tier[:, 3] == TIER_HBM).all() and (tier[:, :3] == TIER_HOST).all()  # block 3 best
    assert (tier[:, 4] == TIER_HBM).all()  # the tail
    dk, _ = kvc.to_dense(cache)
    assert np.array_equal(np.asarray(dk[:, 0, :17]), np.asarray(k[:, :17]))


def test_unpaged_insert_equals_the_batch_prefill():
    """Without paging a row's pages are its flat indices: an insert writes what prefill does."""
    c = _config(paged_host=False, host_blocks=None, hbm_fraction=1.0, hbm_blocks=None)
    k, v = _kv(3)
    one = kvc.TieredKVCache.create(c)
    for b, n in [(0, 21), (1, 9), (2, 30)]:
        one = rows.insert(one, b, k, v, n)
    ks = jnp.broadcast_to(k[:, None], (2, 3, 64, 2, 8))
    vs = jnp.broadcast_to(v[:, None], (2, 3, 64, 2, 8))
    batch = kvc.prefill(kvc.TieredKVCache.create(c), ks, vs, jnp.asarray([21, 9, 30]))
    kvc.check_invariants(one, contents=True)
    for a, b in zip(kvc.to_dense(one), kvc.to_dense(batch), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert np.array_equal(np.asarray(one.host_free), np.asarray(batch.host_free))


def test_paged_cache_is_refused_where_it_cannot_be_paged():
    with pytest.raises(ValueError, match="paged_host=True pages the write-through host copies"):
        _config(host_tier="exclusive")
    with pytest.raises(ValueError, match=r"paged_host must be a bool, got 1"):
        _config(paged_host=1)
    with pytest.raises(ValueError, match="or paged_host=True"):
        _config(paged_host=False)
    c = _config()
    k, v = _kv(0)
    with pytest.raises(ValueError, match="a paged_host cache is filled one sequence at a time"):
        kvc.prefill(kvc.TieredKVCache.create(c), k[:, None].repeat(3, 1), v[:, None].repeat(3, 1),
                    jnp.asarray([5, 5, 5]))  # fmt: skip
    with pytest.raises(ValueError, match=r"rows.insert: k \(2, 65, 2, 8\)"):
        rows.insert(kvc.TieredKVCache.create(c), 0, *_kv(0, T=65), 5)


def test_migrations_of_a_paged_cache_keep_the_pages():
    cache = kvc.TieredKVCache.create(_config())
    for b, n in [(0, 21), (1, 13), (2, 30)]:
        cache = rows.insert(cache, b, *_kv(b), n)
    dense = kvc.to_dense(cache)
    target = jax.random.bernoulli(jax.random.key(5), 0.5, (2, 3 * 16))
    cache, _ = kvc.migrate(cache, kvc.plan_moves(cache, target, 8))
    kvc.check_invariants(cache, contents=True)
    for a, b in zip(kvc.to_dense(cache), dense, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=6, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(0, 6)), max_size=6))
def test_inserts_decodes_and_releases_never_leak_a_page(ops):
    """Any sequence of (release row, insert a prompt of n tokens, decode t steps) keeps the
    table, free masks and pages consistent, and a release gives back what the row held."""
    c = _config(host_blocks=48)
    cache = kvc.TieredKVCache.create(c)
    for i, (b, n, t) in enumerate(ops):
        cache = rows.release(cache, b)
        kvc.check_invariants(cache)
        cache = rows.insert(cache, b, *_kv(i), n)
        kvc.check_invariants(cache, contents=True)
        cache = _decode(cache, t)
        held = sum(int(x) // 4 for x in np.asarray(cache.lengths))
        assert int(rows.free_pages(cache)) == 48 - held
    for b in range(3):
        cache = rows.release(cache, b)
    kvc.check_invariants(cache)
    assert int(rows.free_pages(cache)) == 48
    assert int(jnp.sum(cache.hbm_free[0])) == 8 - 3  # the three tails
