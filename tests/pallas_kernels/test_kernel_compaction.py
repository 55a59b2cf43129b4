"""compaction (Mosaic GPU kernel; interpreter on CPU) vs compaction_reference, and
compaction_moves vs a Python loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels.compaction as cp
from pallas_kernels.common import hopper_available, race_checked
from pallas_kernels.compaction import (
    CompactionBlockSizes,
    compaction,
    compaction_moves,
    compaction_reference,
)

requires_hopper = pytest.mark.skipif(
    not hopper_available(), reason="needs a Hopper GPU (Mosaic GPU); run by bench/gpu_check.sh"
)


def make_pool(seed, layers=2, slots=8, block_size=16, kv_heads=2, head_dim=64, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((layers, slots, block_size, kv_heads, head_dim)), dtype)


def bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def moves_loop(occupied):
    """The dense-prefix move list written as the obvious Python loop."""
    out = []
    for row in np.asarray(occupied):
        src, dst, new = [], [], np.full(row.shape, -1)
        for k, s in enumerate(np.flatnonzero(row)):
            new[s] = k
            if s != k:
                src.append(s)
                dst.append(k)
        out.append((src, dst, new))
    return out


def test_compaction_moves_matches_loop():
    # Property test; hypothesis is a dev dependency the GPU machine may lack.
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=25, deadline=None)
    @hypothesis.given(st.lists(st.booleans(), min_size=3 * 12, max_size=3 * 12))
    def check(flags):
        check_moves(np.asarray(flags).reshape(3, 12))

    check()
    check_moves(np.zeros((3, 12), bool))
    check_moves(np.ones((3, 12), bool))


def check_moves(occupied):
    src, dst, num_moves, new = (np.asarray(x) for x in compaction_moves(jnp.asarray(occupied)))
    for layer, (s, d, n) in enumerate(moves_loop(occupied)):
        assert num_moves[layer] == len(s)
        np.testing.assert_array_equal(src[layer, : len(s)], s)
        np.testing.assert_array_equal(dst[layer, : len(d)], d)
        np.testing.assert_array_equal(new[layer], n)
        assert np.all(dst[layer, : len(d)] <= src[layer, : len(s)])


@pytest.mark.parametrize(
    "dtype,block_size,head_dim",
    [(jnp.bfloat16, 16, 64), (jnp.float32, 32, 64), (jnp.float16, 33, 128)],
)
def test_dense_prefix_preserves_blocks_bit_for_bit(dtype, block_size, head_dim):
    pool = make_pool(0, block_size=block_size, head_dim=head_dim, dtype=dtype)
    occupied = jnp.asarray(np.random.default_rng(1).random(pool.shape[:2]) < 0.5)
    src, dst, num_moves, new = compaction_moves(occupied)
    before = np.asarray(pool)
    got = np.asarray(compaction(jnp.array(pool), src, dst, num_moves))
    want = np.asarray(compaction_reference(jnp.array(pool), src, dst, num_moves))
    np.testing.assert_array_equal(bits(got), bits(want))
    new, occ = np.asarray(new), np.asarray(occupied)
    for layer in range(pool.shape[0]):
        for old in np.flatnonzero(occ[layer]):  # every occupied block lands on its new slot
            np.testing.assert_array_equal(
                bits(got[layer, new[layer, old]]), bits(before[layer, old])
            )
        written = set(np.asarray(dst)[layer, : int(num_moves[layer])])
        for slot in set(range(pool.shape[1])) - written:  # slots not written are untouched
            np.testing.assert_array_equal(bits(got[layer, slot]), bits(before[layer, slot]))


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_sequential_semantics_with_chains(num_buffers):
    """Overlapping moves (read after write, write after write) apply in order."""
    pool = make_pool(2, slots=6)
    src = jnp.asarray([[1, 0, 3, 2, 0, 5], [2, 2, 2, 4, 1, 0]], jnp.int32)
    dst = jnp.asarray([[0, 1, 1, 3, 4, 4], [0, 1, 3, 3, 3, 2]], jnp.int32)
    num_moves = jnp.asarray([6, 5], jnp.int32)
    sizes = CompactionBlockSizes(num_buffers=num_buffers, moves_per_call=4 - num_buffers)
    got = compaction(jnp.array(pool), src, dst, num_moves, block_sizes=sizes)
    want = compaction_reference(jnp.array(pool), src, dst, num_moves)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_no_smem_races_detected():
    """Race detector on the staging-buffer reuse (double buffering). The moves touch disjoint
    slots: the interpreter (jax 0.12.0.1) flags a GMEM read by a completed, waited-for TMA
    load followed by a TMA store to the same slot as a race, which it is not on hardware."""
    pool = make_pool(8, slots=12)
    src = jnp.asarray([[1, 3, 5, 7, 9], [0, 2, 4, 6, 8]], jnp.int32)
    dst = jnp.asarray([[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]], jnp.int32)
    n = jnp.asarray([5, 4], jnp.int32)
    got = race_checked(lambda p: compaction(jnp.array(pool), src, dst, n, interpret=p))
    want = compaction_reference(jnp.array(pool), src, dst, n)
    np.testing.assert_array_equal(bits(got), bits(want))


def test_zero_moves_leaves_pool_untouched():
    pool = make_pool(3)
    src = jnp.full((2, 4), 7, jnp.int32)
    got = compaction(jnp.array(pool), src, src * 0, jnp.zeros((2,), jnp.int32))
    np.testing.assert_array_equal(bits(got), bits(pool))


def test_kernel_body_executes(monkeypatch):
    calls = []
    body = cp.compaction_kernel

    def spy(*args, **kwargs):
        calls.append(kwargs["max_moves"])
        return body(*args, **kwargs)

    monkeypatch.setattr(cp, "compaction_kernel", spy)
    pool = make_pool(4, slots=5)
    src = jnp.asarray([[4, 3, 2], [1, 2, 3]], jnp.int32)
    dst = jnp.asarray([[0, 1, 4], [0, 1, 2]], jnp.int32)
    n = jnp.asarray([3, 2], jnp.int32)
    got = compaction(jnp.array(pool), src, dst, n)
    assert calls == [3]
    np.testing.assert_array_equal(
        bits(got), bits(compaction_reference(jnp.array(pool), src, dst, n))
    )


@pytest.mark.parametrize("semantics", ["Warpgroup", "Lane"])
def test_lowers_for_cuda_with_alias(semantics, monkeypatch):
    """The compiled path lowers to an in-place Mosaic GPU custom call (operand aliased), under
    both Mosaic GPU lowering semantics (the default differs between jax versions)."""
    sem = getattr(plgpu.LoweringSemantics, semantics)
    monkeypatch.setattr(
        cp, "compiler_params", lambda **kw: plgpu.CompilerParams(lowering_semantics=sem, **kw)
    )
    s = jax.ShapeDtypeStruct
    fn = functools.partial(cp._compaction, block_sizes=CompactionBlockSizes(), interpret=False)
    # 1,000 moves: the move table is longer than a bounds-checked TMA copy allows (256)
    args = (s((32, 4096, 16, 8, 128), jnp.bfloat16), s((32, 1000), jnp.int32))
    lowered = jax.jit(fn, donate_argnums=0).trace(args[0], args[1], args[1], s((32,), jnp.int32))
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "output_operand_alias" in text


def _errors():
    pool = make_pool(5)
    src = jnp.zeros((2, 3), jnp.int32)
    n = jnp.zeros((2,), jnp.int32)
    return [
        ("pool must be", (pool[0], src, src, n)),
        ("src must be", (pool, src[0], src, n)),
        ("dst shape", (pool, src, src[:, :1], n)),
        ("num_moves must be", (pool, src, src, n[:1])),
        ("src dtype", (pool, src.astype(jnp.int16), src, n)),
        ("dst dtype", (pool, src, src.astype(jnp.uint32), n)),
        ("num_moves dtype", (pool, src, src, n.astype(jnp.int16))),
        ("multiple of 16 bytes", (pool[..., :4], src, src, n)),
        ("multiple of 128 bytes", (jnp.zeros((2, 4, 3, 1, 8), jnp.float32), src, src, n)),
        ("at most 256", (jnp.zeros((2, 4, 320, 1, 8), jnp.bfloat16), src, src, n)),
    ]


@pytest.mark.parametrize("message,args", _errors(), ids=[m for m, _ in _errors()])
def test_validation_errors(message, args):
    with pytest.raises(ValueError, match=message):
        compaction(*args)


def test_block_sizes_validation():
    with pytest.raises(ValueError, match="num_buffers"):
        CompactionBlockSizes(num_buffers=3)
    with pytest.raises(ValueError, match="moves_per_call"):
        CompactionBlockSizes(moves_per_call=0)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_compiled_matches_reference(dtype):
    pool = make_pool(6, layers=8, slots=512, block_size=16, kv_heads=8, head_dim=128, dtype=dtype)
    occupied = jnp.asarray(np.random.default_rng(7).random(pool.shape[:2]) < 0.4)
    src, dst, n = compaction_moves(occupied)[:3]
    want = compaction_reference(jnp.array(pool), src, dst, n)
    got = compaction(jnp.array(pool), src, dst, n, interpret=False)
    np.testing.assert_array_equal(bits(got), bits(want))
