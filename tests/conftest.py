"""Shared fixtures. Tests run on CPU; CPU devices expose `device` and `pinned_host` memory."""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import settings

from jaxkv import cache as kvc
from jaxkv.config import CacheConfig

# property tests draw the same examples on every machine (CI reruns what passed here)
settings.register_profile("jaxkv", derandomize=True, database=None)
settings.load_profile("jaxkv")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled():
    """Drop jax's compiled executables after each test module: a pytest-xdist worker otherwise
    keeps every program the suite ever compiled (CI's workers ran for 20+ minutes)."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny():
    """(model, params) of the tiny random-init Llama."""
    from flax import nnx

    from models import tiny_model

    model = tiny_model(0)
    return model, nnx.split(model)[1]


def random_cache(
    key,
    *,
    layers=2,
    kv_heads=2,
    head_dim=8,
    batch=2,
    max_len=64,
    block_size=4,
    hbm_fraction=0.25,
    lengths=(21, 13),
    dtype="float32",
    shuffle_moves=16,
    host_memory_kind="pinned_host",
    host_tier="write-through",
):
    """A cache holding random prompts, then migrated toward a random target placement (so HBM
    and host slots are permuted relative to logical order). Returns (cache, dense k, dense v)."""
    cfg = CacheConfig(
        num_layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        batch=batch,
        max_len=max_len,
        block_size=block_size,
        hbm_fraction=hbm_fraction,
        dtype=dtype,
        host_memory_kind=host_memory_kind,
        host_tier=host_tier,
    )
    T = max(lengths)
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (layers, batch, T, kv_heads, head_dim)
    k = jax.random.normal(k1, shape).astype(cfg.jnp_dtype)
    v = jax.random.normal(k2, shape).astype(cfg.jnp_dtype)
    cache = kvc.prefill(kvc.TieredKVCache.create(cfg), k, v, jnp.asarray(lengths))
    if shuffle_moves:
        target = jax.random.bernoulli(k3, 0.5, (layers, batch * cfg.max_blocks))
        cache, _ = kvc.migrate(cache, kvc.plan_moves(cache, target, shuffle_moves))
        cache = kvc.compact(cache)
        target = jax.random.bernoulli(jax.random.fold_in(k3, 1), 0.5, target.shape)
        cache, _ = kvc.migrate(cache, kvc.plan_moves(cache, target, shuffle_moves))
    dk, dv = kvc.to_dense(cache)
    return cache, dk, dv


def random_block_trace(seed, steps=12, layers=2, k=10, prompt=40, block_size=4):
    """A small validated block-level trace: k random block ids per (step, layer) within the
    context, exponential attention mass (the simulator's property tests)."""
    import numpy as np

    from jaxkv.sim import trace as tr

    rng = np.random.default_rng(seed)
    ids = np.full((steps, layers, k), -1, np.int32)
    for t in range(steps):
        ids[t] = rng.integers(0, tr.context_blocks(prompt, t, block_size), (layers, k))
    mass = rng.exponential(1.0, (steps, layers, k)).astype(np.float32)
    srt = np.sort(ids, axis=-1)  # a block drawn twice at a (step, layer) is kept once
    ids = np.where(np.diff(srt, axis=-1, prepend=-1) == 0, -1, srt).astype(np.int32)
    mass = np.where(ids < 0, 0.0, mass).astype(np.float32)
    return tr.validate(
        dict(version=1, prompt_len=prompt, block_size=block_size, ids=ids, mass=mass)
    )


def prefilled(cfg, lengths=(70, 41), seed=0):
    """A cache of config `cfg` holding random prompts of `lengths`, KV head 1's keys 8x the
    others' (heads of different scales, for the FP8 scales): (cache, k, v, lengths)."""
    T = max(lengths)
    shape = (cfg.num_layers, cfg.batch, T, cfg.kv_heads, cfg.head_dim)
    k = jax.random.normal(jax.random.key(seed), shape).astype(cfg.jnp_dtype)
    v = jax.random.normal(jax.random.key(seed + 1), shape).astype(cfg.jnp_dtype)
    k = k.at[:, :, :, 1].multiply(8.0)
    cache = kvc.prefill(kvc.TieredKVCache.create(cfg), k, v, jnp.asarray(lengths))
    return cache, k, v, jnp.asarray(lengths, jnp.int32)


def demote_then_promote_all(cache, budget=16):
    """Every sealed block demoted to host, then every one promoted back, the table checked
    after each and the moves complete: (demoted cache, promoted cache)."""
    L = cache.config.num_layers
    none = jnp.zeros((L, cache.config.total_blocks), bool)
    down, n = kvc.migrate(cache, kvc.plan_moves(cache, none, budget))
    kvc.check_invariants(down, contents=True)
    assert int(down.in_hbm.sum()) == 0 < int(cache.in_hbm.sum())
    assert int(n.sum()) == (0 if cache.config.write_through else int(cache.in_hbm.sum()))
    up, _ = kvc.migrate(down, kvc.plan_moves(down, cache.sealed.reshape(L, -1), budget))
    kvc.check_invariants(up, contents=True)
    assert int(up.in_hbm.sum()) == int(cache.sealed.sum())
    return down, up


def fp8_config(**kw):
    """The FP8 tests' small bf16 cache (2 layers, 2 KV heads x 16, block 16, 2 x 96 tokens,
    3 HBM blocks, fp8="host"), with `kw` overriding any CacheConfig field."""
    base = dict(
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        batch=2,
        max_len=96,
        block_size=16,
        hbm_blocks=3,
        dtype="bfloat16",
        fp8="host",
    )
    return CacheConfig(**{**base, **kw})


def load_bench(name: str):
    """bench/NAME.py imported as a module, bench/ on sys.path while it loads (the scripts import
    their siblings, such as bench/_progress.py)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).parents[1] / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(bench))
    return mod
