"""jaxkv.cache.transfer: bulk block reads and writes under every mechanism and memory kind, and the
cache paths built on them (property tests: no block lost, duplicated or altered; kinds kept)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxkv import cache as kvc
from jaxkv.cache import transfer as tr
from jaxkv.config import CacheConfig
from pallas_kernels import common

KINDS = ("pinned_host", "unpinned_host", "device")


def _pool(kind, seed=0, shape=(3, 6, 4, 2, 8)):
    x = jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
    return jax.device_put(x, common.single_device_sharding(jax.devices()[0], memory_kind=kind))


@pytest.mark.parametrize("fetch", ["xla", "pallas"])
@pytest.mark.parametrize("kind", KINDS)
def test_read_and_write_blocks(fetch, kind):
    pool = _pool(kind)
    ref = np.array(pool)
    layer = jnp.asarray([0, 2, 1, 2, 0], jnp.int32)
    slot = jnp.asarray([5, 0, 3, 3, 1], jnp.int32)
    valid = jnp.asarray([True, True, False, True, True])
    rows = tr.rows_of(layer, slot, valid, 6)
    got = jax.jit(lambda p, r: tr.read_blocks(p, r, fetch, pool_kind=kind))(pool, rows)
    for i in range(5):
        want = ref[layer[i], slot[i]] if valid[i] else np.zeros_like(ref[0, 0])
        np.testing.assert_array_equal(got[i], want)
    blocks = jnp.full((5, 4, 2, 8), 7.0)
    for i in range(5):
        if valid[i]:
            ref[layer[i], slot[i]] = 7.0
    # outside jit the result keeps the pool's kind (an eager Pallas write into a pinned_host
    # pool used to abort the process); inside, where out_shardings name it (unpinned_host)
    eager = tr.write_blocks(pool, rows, blocks, fetch, pool_kind=kind)
    assert eager.sharding.memory_kind == kind
    np.testing.assert_array_equal(eager, ref)
    write = jax.jit(
        lambda p, r, b: tr.write_blocks(p, r, b, fetch, pool_kind=kind),
        out_shardings=tr.kind_sharding(kind),
        donate_argnums=(0,),
    )
    out = write(pool, rows, blocks)
    assert out.sharding.memory_kind == kind
    np.testing.assert_array_equal(out, ref)


def test_resolve_fetch_and_compile_target():
    assert tr.resolve_fetch("auto") == "xla"  # CPU
    with common.compile_target("gpu"):
        assert tr.resolve_fetch("auto") == tr.GPU_AUTO
        assert common.target_platform() == "gpu"
    assert tr.resolve_fetch("pallas") == "pallas"
    with pytest.raises(ValueError, match=r"unknown fetch mechanism 'dma'"):
        tr.resolve_fetch("dma")


def test_after_leaves_rows_unchanged():
    rows = jnp.asarray([3, -1, 7], jnp.int32)
    out = jax.jit(tr.after)(rows, (jnp.asarray([jnp.nan, 1.0]), jnp.ones((2,), jnp.int32)))
    np.testing.assert_array_equal(out, rows)


def test_error_unknown_fetch_in_config():
    with pytest.raises(ValueError, match=r"fetch must be one of \('auto', 'xla', 'pallas'\)"):
        CacheConfig(num_layers=1, kv_heads=1, head_dim=8, fetch="loop")


def test_host_pool_over_the_gpu_limit_fails_before_allocating(monkeypatch):
    cfg = CacheConfig(
        num_layers=32,
        kv_heads=8,
        head_dim=128,
        max_len=131072,
        dtype="bfloat16",
        batch=8,
        hbm_fraction=0.25,
        host_tier="exclusive",
    )  # 8 x 128k tokens, 75% on host: 96 GiB of K+V
    monkeypatch.delenv(kvc.GPU_HOST_LIMIT_VAR, raising=False)
    with pytest.raises(
        ValueError,
        match=r"need 96\.0 GiB .* limit of 64\.0 GiB: raise "
        r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
    ):
        kvc.check_host_pool(cfg, platform="gpu")
    wt = dataclasses.replace(cfg, host_tier="write-through")  # every block on host: 128 GiB
    with pytest.raises(ValueError, match=r"need 128\.0 GiB .* host_tier='exclusive'"):
        kvc.check_host_pool(wt, platform="gpu")
    kvc.check_host_pool(cfg, platform="cpu")  # no such limit off GPU
    monkeypatch.setenv(kvc.GPU_HOST_LIMIT_VAR, "128")
    kvc.check_host_pool(cfg, platform="gpu")
    monkeypatch.setenv(kvc.GPU_HOST_LIMIT_VAR, "lots")
    with pytest.raises(ValueError, match=r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB='lots' is not"):
        kvc.check_host_pool(cfg, platform="gpu")
    with common.compile_target("gpu"), pytest.raises(ValueError, match=r"pinned host memory"):
        monkeypatch.delenv(kvc.GPU_HOST_LIMIT_VAR)
        kvc.TieredKVCache.create(cfg)


# ---- property test: the bulk paths never lose, duplicate or alter a block --------------------

BUDGETS = (0, 1, 3)  # max_moves of a migration

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 3)),
        st.tuples(st.just("migrate"), st.integers(0, 2**31 - 1)),
        st.tuples(st.just("compact"), st.just(0)),
    ),
    min_size=1,
    max_size=16,
)


def _cfg(fetch, kind, host_tier="write-through", fp8="off"):
    # 16 blocks per layer: 5 in HBM (2 of them tails); the host pool holds every block
    # (write-through) or exactly the other 11 (exclusive)
    return CacheConfig(
        num_layers=2,
        kv_heads=2,
        head_dim=8,
        batch=2,
        max_len=24,
        block_size=3,
        hbm_blocks=5,
        fetch=fetch,
        host_memory_kind=kind,
        host_tier=host_tier,
        fp8=fp8,
    )


_JITS = {}


def _ops(cfg):
    """(append, migrate (max_moves static), compact), jitted with the cache donated and its
    kinds named in out_shardings, as a caller's jit must for an unpinned_host cache."""
    if cfg not in _JITS:
        out = kvc.cache_shardings(cfg)

        def append(cache, key, active):
            L, B = cfg.num_layers, cfg.batch
            new = jax.random.normal(key, (L, B, cfg.kv_heads, cfg.head_dim))
            for layer in range(L):
                cache = kvc.write_token(cache, layer, new[layer], new[layer] * 2, active)
            return kvc.advance(cache, active), new

        def migrate(cache, target, max_moves):
            return kvc.migrate(cache, kvc.plan_moves(cache, target, max_moves))

        def jit(fn, out_shardings, **kw):
            return jax.jit(fn, out_shardings=out_shardings, donate_argnums=(0,), **kw)

        _JITS[cfg] = (
            jit(append, (out, None)),
            jit(migrate, (out, None), static_argnames=("max_moves",)),
            jit(kvc.compact, out),
        )
    return _JITS[cfg]


def _check_migration(was, now, target, moved, max_moves):
    """The count is the blocks copied, each once: those whose tier changed (exclusive), the
    promotions (write-through); where the budget and HBM allow (each promotion within
    max_moves, free slots plus demotable blocks enough), every sealed block of the target ends
    in HBM."""
    sealed = np.asarray(was.sealed).reshape(2, -1)
    before = np.asarray(was.in_hbm).reshape(2, -1)
    after = np.asarray(now.in_hbm).reshape(2, -1)
    copied = (after & ~before) if was.config.write_through else (before != after)
    assert np.asarray(moved).tolist() == copied.sum(axis=1).tolist()
    want = np.asarray(target) & sealed
    promote = (want & ~before).sum(axis=1)
    demotable = (before & ~want).sum(axis=1)
    free = np.asarray(was.hbm_free).sum(axis=1)
    needed = np.maximum(promote - free, 0)  # demotions to make room
    room = (promote <= max_moves) & (needed <= np.minimum(demotable, max_moves))
    for layer in np.flatnonzero(room):
        assert after[layer][want[layer]].all(), f"layer {layer}: target not reached"


@pytest.mark.parametrize(
    "fetch,kind,host_tier",
    [
        ("xla", "pinned_host", "write-through"),
        ("xla", "pinned_host", "exclusive"),
        ("pallas", "pinned_host", "write-through"),
        pytest.param("pallas", "pinned_host", "exclusive", marks=pytest.mark.slow),
        pytest.param("xla", "unpinned_host", "write-through", marks=pytest.mark.slow),  # 10 s
        pytest.param("auto", "device", "exclusive", marks=pytest.mark.slow),
    ],
)
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_OPS,
    lengths=st.tuples(st.integers(1, 24), st.integers(1, 24)),
    budget=st.lists(st.sampled_from(BUDGETS), min_size=16, max_size=16),
)
@example(ops=[("migrate", 1), ("append", 3), ("migrate", 2)], lengths=(24, 22), budget=[1] * 16)
@example(ops=[("migrate", 3), ("compact", 0), ("migrate", 5)], lengths=(20, 21), budget=[0, 1] * 8)
def test_bulk_paths_keep_every_block(fetch, kind, host_tier, ops, lengths, budget):
    """Random appends, migrations (max_moves 0, 1 or 3; targets of every density) and
    compactions, from prompts up to a full cache (an exclusive host pool exactly sized, often
    nearly full): no block lost, duplicated or altered, the kinds kept, the counts and targets
    right; under write-through every sealed block has its host copy and every HBM copy is
    bit-identical to it."""
    cfg = _cfg(fetch, kind, host_tier)
    append, migrate, compact = _ops(cfg)
    k = jax.random.normal(jax.random.key(sum(lengths)), (2, 2, cfg.max_len, 2, 8))
    cache = kvc.prefill(kvc.TieredKVCache.create(cfg), k, k * 2, jnp.asarray(lengths))
    ref = np.array(kvc.to_dense(cache)[0])
    for i, (op, arg) in enumerate(ops):
        if op == "append":
            active = jnp.array([bool(arg & 1), bool(arg & 2)])
            before = np.asarray(cache.lengths)
            if (before + np.asarray(active) > cfg.max_len).any():
                continue
            cache, new = append(cache, jax.random.key(i), active)
            for b in range(2):
                if active[b]:
                    ref[:, b, before[b]] = np.asarray(new[:, b])
        elif op == "migrate":
            density = (arg % 4) / 4  # 0, 1/4, 1/2, 3/4 of the blocks
            target = jax.random.bernoulli(jax.random.key(arg), density, (2, cfg.total_blocks))
            was = jax.tree.map(np.array, cache)  # copied: the cache is donated
            cache, moved = migrate(cache, target, max_moves=budget[i])
            _check_migration(was, cache, target, moved, budget[i])
        else:
            cache = compact(cache)
        kvc.check_invariants(cache, contents=True)
        kinds = {x.sharding.memory_kind for x in (cache.host_k, cache.host_v)}
        assert kinds == {kind} and cache.hbm_k.sharding.memory_kind == "device"
        dk, dv = kvc.to_dense(cache)
        np.testing.assert_array_equal(dk, ref)
        np.testing.assert_array_equal(dv, ref * 2)


@pytest.mark.parametrize("fp8", ["host", "age"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, lengths=st.tuples(st.integers(1, 24), st.integers(1, 24)))
def test_write_through_fp8_copies_agree(fp8, ops, lengths):
    """Under a write-through host tier with FP8 blocks every HBM copy is bit-identical to its
    host copy (FP8 values and scales; under fp8="host" the dequantized copy), so migrations
    and compactions never change what the cache holds."""
    cfg = _cfg("xla", "pinned_host", "write-through", fp8=fp8)
    append, migrate, compact = _ops(cfg)
    k = jax.random.normal(jax.random.key(sum(lengths)), (2, 2, cfg.max_len, 2, 8))
    cache = kvc.prefill(kvc.TieredKVCache.create(cfg), k, k * 2, jnp.asarray(lengths))
    for i, (op, arg) in enumerate(ops):
        dense = [np.asarray(x) for x in kvc.to_dense(cache)]
        if op == "append":
            active = jnp.array([bool(arg & 1), bool(arg & 2)])
            if (np.asarray(cache.lengths) + np.asarray(active) > cfg.max_len).any():
                continue
            cache, _ = append(cache, jax.random.key(i), active)
        else:
            if op == "migrate":
                target = jax.random.bernoulli(jax.random.key(arg), 0.5, (2, cfg.total_blocks))
                cache, _ = migrate(cache, target, max_moves=3)
            else:
                cache = compact(cache)
            for a, b in zip(kvc.to_dense(cache), dense, strict=True):
                np.testing.assert_array_equal(np.asarray(a), b)
        kvc.check_invariants(cache, contents=True)


def test_first_kernel_trace_recompiles_nothing():
    """Tracing the first Pallas kernel must not change the jit key of functions compiled
    before it (pallas_kernels registers the fuser's config option at import); run in a fresh
    process, where no earlier test has traced a kernel."""
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp, jaxkv.cache.transfer\n"
        "f = jax.jit(lambda x: x * 2); f(jnp.ones(3))\n"
        "from pallas_kernels.host_transfer import gather_rows\n"
        "gather_rows(jnp.ones((4, 8)), jnp.arange(2, dtype=jnp.int32), interpret=True)\n"
        "f(jnp.ones(3)); print(f._cache_size())\n"
    )
    env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1", "a jit compiled before the kernel recompiled"
