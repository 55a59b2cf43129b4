import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_cache

from jaxkv import cache as kvc
from jaxkv.config import TIER_HBM, TIER_HOST, CacheConfig, PlacementConfig


def kinds(cache):
    return (
        cache.hbm_k.sharding.memory_kind,
        cache.hbm_v.sharding.memory_kind,
        cache.host_k.sharding.memory_kind,
        cache.host_v.sharding.memory_kind,
    )


def _cfg(**kw):
    """The tests' cache; HBM 25% of the footprint unless `kw` gives another hbm_* capacity."""
    capacity = {} if any(k.startswith("hbm_") for k in kw) else dict(hbm_fraction=0.25)
    base = dict(num_layers=2, kv_heads=2, head_dim=8, batch=2, max_len=64, block_size=4)
    return CacheConfig(**{**base, **capacity, **kw})


def _append(cache, key, active):
    c = cache.config
    k = jax.random.normal(key, (c.num_layers, c.batch, c.kv_heads, c.head_dim))
    for layer in range(c.num_layers):
        cache = kvc.write_token(cache, layer, k[layer], -k[layer], active)
    return kvc.advance(cache, active), k


@pytest.mark.parametrize("tier", ["write-through", "exclusive"])
@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_memory_kinds_kept_by_every_op(kind, tier):
    """Every op keeps the configured kinds outside jit by itself; inside a jit, pinned_host by
    itself and unpinned_host where the jit passes `cache_shardings` (and may then donate the
    cache). The property test in test_transfer.py checks the kinds under every mechanism."""
    cfg = _cfg(batch=2, max_len=24, hbm_blocks=4, host_memory_kind=kind, host_tier=tier)
    want = ("device", "device", kind, kind)
    cache = kvc.TieredKVCache.create(cfg)
    assert kinds(cache) == want
    k = jax.random.normal(jax.random.key(0), (2, 2, 13, 2, 8))
    cache = kvc.prefill(cache, k, -k, jnp.array([13, 6]))
    assert kinds(cache) == want
    active = jnp.array([True, True])
    appended, _ = _append(cache, jax.random.key(1), active)  # write_token, advance
    assert kinds(appended) == want
    target = jnp.zeros((2, cfg.total_blocks), bool)  # demote every sealed block
    moved, n = kvc.migrate(appended, kvc.plan_moves(appended, target, 4))
    assert kinds(moved) == want
    assert int(moved.in_hbm.sum()) < int(appended.in_hbm.sum())  # the demotions happened
    assert int(n.sum()) == (0 if tier == "write-through" else int(appended.in_hbm.sum()))
    assert kinds(kvc.compact(moved)) == want

    def ops(cache):
        cache, _ = _append(cache, jax.random.key(1), active)
        cache, _ = kvc.migrate(cache, kvc.plan_moves(cache, target, 4))
        return kvc.compact(cache)

    if kind == "unpinned_host":  # jax types a traced unpinned_host value "device"
        ops = jax.jit(ops, out_shardings=kvc.cache_shardings(cfg), donate_argnums=(0,))
    else:
        ops = jax.jit(ops)
    out = ops(cache)
    assert kinds(out) == want
    for a, b in zip(kvc.to_dense(out), kvc.to_dense(kvc.compact(moved)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_prefill_fills_hbm_in_write_order_and_reconstructs():
    cfg = _cfg(batch=1, hbm_blocks=4)  # 4 HBM blocks: 3 sealed + the tail
    T = 22  # 5 sealed blocks of 4, tail holds 2 tokens
    k = jax.random.normal(jax.random.key(0), (2, 1, T, 2, 8))
    cache = kvc.prefill(kvc.TieredKVCache.create(cfg), k, -k, jnp.array([T]))
    kvc.check_invariants(cache)
    tier = np.asarray(cache.tier[0, 0])
    assert tier[:6].tolist() == [TIER_HBM] * 3 + [TIER_HOST] * 2 + [TIER_HBM]
    dk, dv = kvc.to_dense(cache)
    np.testing.assert_array_equal(dk[:, :, :T], k)
    np.testing.assert_array_equal(dv[:, :, :T], -k)
    assert float(jnp.abs(dk[:, :, T:]).max()) == 0.0


def test_append_seals_and_spills_then_matches_dense():
    cfg = _cfg(batch=2, hbm_blocks=3)
    k = jax.random.normal(jax.random.key(0), (2, 2, 7, 2, 8))
    cache = kvc.prefill(kvc.TieredKVCache.create(cfg), k, -k, jnp.array([7, 3]))
    ref_k = np.array(kvc.to_dense(cache)[0])
    step = jax.jit(_append)
    active = jnp.array([True, False])
    for i in range(9):
        lengths = np.asarray(cache.lengths)
        cache, new = step(cache, jax.random.key(10 + i), active)
        kvc.check_invariants(cache)
        for layer in range(2):
            ref_k[layer, 0, lengths[0]] = new[layer, 0]
    assert cache.lengths.tolist() == [16, 3]
    np.testing.assert_allclose(kvc.to_dense(cache)[0], ref_k)
    # with HBM full, later sealed blocks went to host
    assert (np.asarray(cache.tier[0, 0, 1:4]) == TIER_HOST).all()


def test_migrate_preserves_contents_and_capacity():
    cache, dk, dv = random_cache(jax.random.key(3), shuffle_moves=0)
    c = cache.config
    target = jax.random.bernoulli(jax.random.key(4), 0.7, (c.num_layers, c.total_blocks))
    moves = kvc.plan_moves(cache, target, 8)
    new, moved = jax.jit(kvc.migrate)(cache, moves)
    kvc.check_invariants(new)
    assert int(moved.sum()) > 0
    for a, b in zip(kvc.to_dense(new), (dk, dv), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int((~new.hbm_free).sum(axis=1).max()) <= c.hbm_slots


@pytest.mark.parametrize("tier", ["write-through", "exclusive"])
def test_migrate_swaps_when_hbm_full(tier):
    cache, dk, _ = random_cache(jax.random.key(5), shuffle_moves=0, host_tier=tier)
    assert int(cache.hbm_free.sum()) == 0  # prefill filled HBM
    host_blocks = np.flatnonzero(np.asarray(cache.tier[0]).reshape(-1) == TIER_HOST)[:2]
    n = cache.config.num_layers
    moves = kvc.Moves(
        demote=jnp.zeros((n, 2), jnp.int32),
        promote=jnp.broadcast_to(jnp.asarray(host_blocks, jnp.int32), (n, 2)),
        num_demote=jnp.zeros((n,), jnp.int32),
        num_promote=jnp.full((n,), 2, jnp.int32),
    )
    new, moved = kvc.migrate(cache, moves)
    kvc.check_invariants(new, contents=True)
    # two promotions, each with a swapped-out victim (a copy only under an exclusive tier)
    assert moved.tolist() == ([2, 2] if tier == "write-through" else [4, 4])
    assert (np.asarray(new.tier[0]).reshape(-1)[host_blocks] == TIER_HBM).all()
    np.testing.assert_array_equal(kvc.to_dense(new)[0], dk)


def test_migrate_one_layer_leaves_the_others():
    cache, dk, dv = random_cache(jax.random.key(3), shuffle_moves=0)
    c = cache.config
    target = jax.random.bernoulli(jax.random.key(4), 0.7, (c.num_layers, c.total_blocks))
    moves = kvc.plan_moves(cache, target, 8)
    new, moved = kvc.migrate(cache, moves, layers=(1,))
    kvc.check_invariants(new)
    assert int(moved[0]) == 0 and int(moved[1]) > 0
    np.testing.assert_array_equal(np.asarray(new.tier[0]), np.asarray(cache.tier[0]))
    np.testing.assert_array_equal(np.asarray(new.slot[0]), np.asarray(cache.slot[0]))
    _, both = kvc.migrate(cache, moves)
    assert int(moved[1]) == int(both[1])
    for a, b in zip(kvc.to_dense(new), (dk, dv), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"migrate layers \[2\] out of range"):
        kvc.migrate(cache, moves, layers=(2,))


def test_compact_makes_dense_prefix():
    cache, dk, dv = random_cache(jax.random.key(6), hbm_fraction=0.5)
    c = cache.config
    target = jnp.zeros((c.num_layers, c.total_blocks), bool)  # demote everything sealed
    holes, _ = kvc.migrate(cache, kvc.plan_moves(cache, target, c.total_blocks))
    assert float(kvc.fragmentation(holes).max()) > 0
    packed = kvc.compact(holes)
    kvc.check_invariants(packed)
    assert float(kvc.fragmentation(packed).max()) == 0.0
    used = np.asarray(~packed.hbm_free)
    for row in used:
        n = row.sum()
        assert row[:n].all() and not row[n:].any()
    for a, b in zip(kvc.to_dense(packed), (dk, dv), strict=True):
        np.testing.assert_array_equal(a, b)


def test_plan_moves_respects_budget_and_capacity():
    cache, _, _ = random_cache(jax.random.key(7), shuffle_moves=0)
    c = cache.config
    target = jnp.ones((c.num_layers, c.total_blocks), bool)
    moves = kvc.plan_moves(cache, target, 3)
    assert moves.promote.shape == (c.num_layers, 3)
    # HBM is full and nothing leaves the target: no promotion can be made
    assert moves.num_promote.tolist() == [0, 0]


def test_plan_moves_demotes_marked_blocks_first():
    """demote_first (blocks a sliding window has passed) leave HBM before any other surplus
    block, whatever their place in block order."""
    cache, _, _ = random_cache(jax.random.key(7), shuffle_moves=0)
    c = cache.config
    in_hbm = np.asarray(cache.in_hbm).reshape(c.num_layers, -1)
    target = jnp.zeros((c.num_layers, c.total_blocks), bool)  # everything is surplus
    plain = kvc.plan_moves(cache, target, 2)
    last = np.zeros_like(in_hbm)
    for layer in range(c.num_layers):  # mark the last resident block of each layer
        last[layer, np.flatnonzero(in_hbm[layer])[-1]] = True
    first = kvc.plan_moves(cache, target, 2, demote_first=jnp.asarray(last))
    for layer in range(c.num_layers):
        marked = int(np.flatnonzero(last[layer])[0])
        assert int(plain.demote[layer, 0]) != marked
        assert int(first.demote[layer, 0]) == marked
        assert int(first.num_demote[layer]) == int(plain.num_demote[layer])


def test_error_prefill_wrong_shape():
    cache = kvc.TieredKVCache.create(_cfg())
    k = jnp.zeros((2, 2, 5, 2, 7))
    with pytest.raises(
        ValueError, match=r"k has shape \(2, 2, 5, 2, 7\), expected \(2, 2, 5, 2, 8\)"
    ):
        kvc.prefill(cache, k, k, jnp.array([5, 5]))


def test_error_prefill_wrong_dtype():
    cache = kvc.TieredKVCache.create(_cfg())
    k = jnp.zeros((2, 2, 5, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"k has dtype bfloat16, expected float32"):
        kvc.prefill(cache, k, k, jnp.array([5, 5]))


def test_error_prefill_lengths_out_of_range():
    cache = kvc.TieredKVCache.create(_cfg())
    k = jnp.zeros((2, 2, 5, 2, 8))
    with pytest.raises(ValueError, match=r"prompt lengths \[0\] out of range"):
        kvc.prefill(cache, k, k, jnp.array([5, 0]))


def test_error_prefill_fractional_lengths():
    cache = kvc.TieredKVCache.create(_cfg())
    k = jnp.zeros((2, 2, 5, 2, 8))
    with pytest.raises(ValueError, match=r"^lengths=\[5.0, 3.5\]: expected whole numbers of tok"):
        kvc.prefill(cache, k, k, [5, 3.5])


def test_error_prefill_longer_than_cache():
    cache = kvc.TieredKVCache.create(_cfg(max_len=8, hbm_blocks=2))
    k = jnp.zeros((2, 2, 9, 2, 8))
    with pytest.raises(ValueError, match=r"prompt length T=9 exceeds max_len=8"):
        kvc.prefill(cache, k, k, jnp.array([9, 9]))


# The property test of random append / migrate / compact sequences (no block lost, duplicated
# or altered, memory kinds kept) is tests/test_transfer.py::test_bulk_paths_keep_every_block,
# under every transfer mechanism.


def test_compact_with_pallas_kernel_matches():
    cache, dk, dv = random_cache(
        jax.random.key(11),
        dtype="bfloat16",
        block_size=16,
        head_dim=16,
        max_len=128,
        lengths=(100, 77),
        hbm_fraction=0.5,
        host_memory_kind="device",
    )
    c = cache.config
    holes, _ = kvc.migrate(cache, kvc.plan_moves(cache, jnp.zeros((2, c.total_blocks), bool), 6))
    assert float(kvc.fragmentation(holes).max()) > 0
    a, b = kvc.compact(holes, impl="pallas"), kvc.compact(holes, impl="xla")
    kvc.check_invariants(a)
    for x, y in ((a.hbm_k, b.hbm_k), (a.hbm_v, b.hbm_v), (a.slot, b.slot)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(kvc.to_dense(a)[0], dk)


def test_error_write_token_layer_out_of_range():
    cache = kvc.TieredKVCache.create(_cfg(num_layers=1))
    x, active = jnp.ones((2, 2, 8)), jnp.array([True, True])
    for layer in (5, -1, jnp.int32(1)):
        with pytest.raises(ValueError, match=r"write_token: layer=-?\d: expected 0 <= layer < 1"):
            kvc.write_token(cache, layer, x, x, active)
    with pytest.raises(ValueError, match=r"write_token: layer=0\.5: expected an int scalar"):
        kvc.write_token(cache, 0.5, x, x, active)
    # traced, it cannot be checked: out of range writes nothing
    write = jax.jit(kvc.write_token)
    for layer in (1, -1):
        out = write(cache, jnp.int32(layer), x, x, active)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(cache), strict=True):
            np.testing.assert_array_equal(a, b)
    out = write(cache, jnp.int32(0), x, x, active)
    assert float(out.hbm_k.sum()) == 2 * 2 * 8  # one token per sequence


def test_error_prefill_into_a_cache_holding_tokens():
    cfg = _cfg()
    k = jax.random.normal(jax.random.key(0), (2, 2, 9, 2, 8))
    empty = kvc.TieredKVCache.create(cfg)
    for lengths, seqs in (([9, 5], r"\[0, 1\] have length\(s\) \[9, 5\]"), ([0, 1], r"\[1\] have")):
        held = dataclasses.replace(empty, lengths=jnp.array(lengths, jnp.int32))
        with pytest.raises(
            ValueError, match=r"prefill: the cache already holds tokens: sequence\(s\) " + seqs
        ):
            kvc.prefill(held, k, k, jnp.array([9, 9]))
    # under jit the lengths are not checked: the result is the prompts alone
    prefill = jax.jit(kvc.prefill)
    full = prefill(empty, k, k, jnp.array([9, 5]))
    again, fresh = (prefill(c, -k, k, jnp.array([4, 9])) for c in (full, empty))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_zero_migration_budget_moves_nothing():
    cache, dk, _ = random_cache(jax.random.key(8), shuffle_moves=0)
    c = cache.config
    budget = PlacementConfig(max_moves=0).max_moves
    moves = kvc.plan_moves(cache, jnp.ones((c.num_layers, c.total_blocks), bool), budget)
    assert moves.promote.shape == moves.demote.shape == (c.num_layers, 0)
    for migrate in (kvc.migrate, jax.jit(kvc.migrate)):
        new, moved = migrate(cache, moves)
        assert moved.tolist() == [0, 0]
        np.testing.assert_array_equal(new.tier, cache.tier)
        np.testing.assert_array_equal(kvc.to_dense(new)[0], dk)


@pytest.mark.parametrize("host_tier", ["write-through", "exclusive"])
def test_migrate_without_demotions_evicts_only_resident_blocks(host_tier):
    """An empty demotion list: promotions beyond the free HBM slots evict blocks that were
    resident before the call, never one promoted by it; only as many as can be evicted go."""
    cache, dk, dv = random_cache(
        jax.random.key(5), lengths=(40, 30), shuffle_moves=0, host_tier=host_tier
    )
    c = cache.config
    tier = np.asarray(cache.tier[0]).reshape(-1)
    resident = np.flatnonzero(np.asarray(cache.in_hbm[0]).reshape(-1))
    host = np.flatnonzero(tier == TIER_HOST)
    assert int(cache.hbm_free.sum()) == 0 and len(host) > len(resident) > 0
    P = len(resident) + 2  # more promotions than blocks to evict
    n = c.num_layers
    moves = kvc.Moves(
        demote=jnp.zeros((n, 0), jnp.int32),
        promote=jnp.broadcast_to(jnp.asarray(host[:P], jnp.int32), (n, P)),
        num_demote=jnp.zeros((n,), jnp.int32),
        num_promote=jnp.full((n,), P, jnp.int32),
    )
    new, moved = kvc.migrate(cache, moves)
    kvc.check_invariants(new)
    now = np.asarray(new.tier[0]).reshape(-1)
    promoted = host[:P][now[host[:P]] == TIER_HBM]
    assert len(promoted) == len(resident)  # one per evicted block
    assert (now[resident] == TIER_HOST).all()
    copies = len(resident) * (1 if host_tier == "write-through" else 2)  # promotions (+ victims)
    assert moved.tolist() == [copies] * n
    for a, b in zip(kvc.to_dense(new), (dk, dv), strict=True):
        np.testing.assert_array_equal(a, b)
