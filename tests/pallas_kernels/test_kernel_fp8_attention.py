"""blocked_attention on float8_e4m3fn pools with per-(slot, kv head) fp32 scales: the kernel
(Mosaic GPU interpreter on CPU) vs the reference, the reference vs the reference on explicitly
dequantized pools, the validation messages, and the lowering / deviceless H200 compile."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.blocked_attention as ba
from pallas_kernels import paging
from pallas_kernels.blocked_attention import (
    BlockSizes,
    blocked_attention,
    blocked_attention_reference,
)
from pallas_kernels.common import hopper_available, race_checked

F8 = jnp.float8_e4m3fn
# Relative to the largest |out| (out scales with v_scale); lse absolute. bf16 / fp16: p is
# rounded to the WGMMA dtype as in the unquantized kernel; fp32: bf16 (hi, lo) q and p against
# the exact bf16 K / V.
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 5e-5}


def fp8_case(
    seed,
    *,
    dtype=jnp.bfloat16,
    block_size=16,
    q_heads=4,
    kv_heads=2,
    head_dim=32,
    max_blocks=3,
    lengths=None,
    mask=None,
    layers=None,
    v_decades=(-3, 1),
):
    """Random fp8 pools (values up to ~100) with scales spanning decades across slots and kv
    heads, a permuted block table (garbage where masked); lengths default to 1, block + 1,
    full."""
    rng = np.random.default_rng(seed)
    lengths = [1, block_size + 1, max_blocks * block_size] if lengths is None else lengths
    batch = len(lengths)
    slots = batch * max_blocks + 2
    lead = () if layers is None else (layers,)
    shape = (*lead, slots, block_size, kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal(shape) * 24, F8)
    v = jnp.asarray(rng.standard_normal(shape) * 24, F8)
    k_scale = jnp.asarray(10.0 ** rng.uniform(-3.5, -0.5, (*lead, slots, kv_heads)), jnp.float32)
    v_scale = jnp.asarray(10.0 ** rng.uniform(*v_decades, (*lead, slots, kv_heads)), jnp.float32)
    table = rng.permutation(slots)[: batch * max_blocks].reshape(batch, max_blocks)
    mask = np.ones((batch, max_blocks), bool) if mask is None else np.asarray(mask, bool)
    table = np.where(mask, table, 10**6).astype(np.int32)
    args = (q, k, v, jnp.asarray(table), jnp.asarray(mask), jnp.asarray(lengths, jnp.int32))
    return args, dict(k_scale=k_scale, v_scale=v_scale)


def dequantized(k, v, k_scale, v_scale):
    """fp32 pools holding what the scaled fp8 pools mean."""
    return (
        k.astype(jnp.float32) * k_scale[..., None, :, None],
        v.astype(jnp.float32) * v_scale[..., None, :, None],
    )


def assert_close(got, want, tol):
    (go, gl), (wo, wl) = (np.asarray(x) for x in got[:2]), (np.asarray(x) for x in want[:2])
    np.testing.assert_allclose(go, wo, atol=tol * max(1.0, np.abs(wo).max()), rtol=0)
    np.testing.assert_allclose(gl, wl, atol=tol, rtol=tol)


MASK = [[True, True, True], [True, False, True], [False, True, True]]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "sizes", [BlockSizes(), BlockSizes(num_splits=2, num_stages=1, blocks_per_step=2)]
)
def test_kernel_matches_reference(dtype, sizes):
    """GQA 2, lengths 1 / block + 1 / full, a masked block in rows 1 and 2; tiles of 1 and
    2 blocks (per-column scales across a tile's blocks), one and two splits."""
    args, scales = fp8_case(0, dtype=dtype, mask=MASK)
    want = blocked_attention_reference(*args, **scales)
    assert_close(blocked_attention(*args, block_sizes=sizes, **scales), want, TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_multi_layer_pool(dtype):
    """A [layers, ...] fp8 pool and [layers, slots, kv_heads] scales, with a traced layer."""
    args, scales = fp8_case(1, dtype=dtype, layers=3, q_heads=8, kv_heads=2)
    q, k, v, table, mask, lengths = args
    one = dict(k_scale=scales["k_scale"][2], v_scale=scales["v_scale"][2])
    want = blocked_attention_reference(q, k[2], v[2], table, mask, lengths, **one)
    ref = blocked_attention_reference(*args, layer=2, **scales)
    assert_close(ref, want, 1e-6)
    attend = jax.jit(lambda layer: blocked_attention(*args, layer=layer, **scales))
    assert_close(attend(jnp.int32(2)), want, TOL[dtype])


def test_window_starts_and_softcap():
    """A sliding window's starts (inside a block, on a boundary, past a row's only block) and a
    soft-cap, with 2-block tiles over 2 splits."""
    mask = np.ones((3, 5), bool)
    mask[2] = [True, False, False, False, False]
    args, scales = fp8_case(2, max_blocks=5, lengths=[80, 75, 70], mask=mask)
    starts = jnp.asarray([37, 48, 20], jnp.int32)
    kw = dict(starts=starts, softcap=3.0, **scales)
    want = blocked_attention_reference(*args, **kw)
    sizes = BlockSizes(num_splits=2, blocks_per_step=2)
    got = blocked_attention(*args, block_sizes=sizes, **kw)
    assert_close(got, want, TOL[jnp.bfloat16])
    assert np.all(np.isneginf(np.asarray(got[1][2])))
    assert np.all(np.asarray(got[0][2]) == 0.0)


def test_fp16_huge_and_tiny_v_scales():
    """fp16 q: v scales from 1e-6 to 1e6 within a tile (p times a raw 1e6 scale would overflow
    fp16; the kernel scales p by v_scale relative to the tile's largest)."""
    args, scales = fp8_case(3, dtype=jnp.float16, v_decades=(-6, 6), max_blocks=4)
    args_l = (*args[:5], jnp.asarray([64, 50, 33], jnp.int32))
    want = blocked_attention_reference(*args_l, **scales)
    got = blocked_attention(*args_l, block_sizes=BlockSizes(blocks_per_step=4), **scales)
    assert np.all(np.isfinite(np.asarray(got[0])))
    assert_close(got, want, TOL[jnp.float16])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reference_equals_reference_on_dequantized_pools(dtype):
    """The reference on fp8 pools + scales is the reference on fp32 pools holding k * k_scale,
    v * v_scale (q as fp32: the reference computes in fp32), block_lse and softcap included,
    one-layer and multi-layer."""
    mask = [[True, False, True], [True, True, True], [False, False, False]]
    args, scales = fp8_case(4, dtype=dtype, mask=mask, q_heads=8, kv_heads=4)
    q, k, v, table, mask, lengths = args
    kd, vd = dequantized(k, v, **scales)
    kw = dict(softcap=2.0, return_block_lse=True)
    got = blocked_attention_reference(*args, **kw, **scales)
    want = blocked_attention_reference(q.astype(jnp.float32), kd, vd, table, mask, lengths, **kw)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    args3, scales3 = fp8_case(5, dtype=dtype, layers=2)
    kd3, vd3 = dequantized(args3[1], args3[2], **scales3)
    got = blocked_attention_reference(*args3, layer=1, **scales3)
    q3 = args3[0].astype(jnp.float32)
    want = blocked_attention_reference(q3, kd3, vd3, *args3[3:], layer=1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_no_races_detected():
    """The race detector over the scales' SMEM copy (a second arrival on the meta barrier) and
    the converted K / V buffer shared by both products of a step."""
    args, scales = fp8_case(6, mask=MASK)
    sizes = BlockSizes(num_splits=2, num_stages=2, blocks_per_step=1)
    got = race_checked(lambda p: blocked_attention(*args, block_sizes=sizes, interpret=p, **scales))
    assert_close(got, blocked_attention_reference(*args, **scales), TOL[jnp.bfloat16])


def test_plan_scales_sections():
    """k scales times the softmax scale, v scales relative to their tile's largest, the tile's
    largest; zero past the list's end."""
    table = jnp.asarray([[3, 1, 2]], jnp.int32)
    mask = jnp.asarray([[True, False, True]])
    meta = paging.plan_blocks(
        table, mask, jnp.asarray([48], jnp.int32), block_size=16, num_slots=4, num_splits=1,
        per_split=4,
    )  # fmt: skip
    ks = jnp.asarray([[1.0], [2.0], [3.0], [4.0]])
    vs = jnp.asarray([[10.0], [20.0], [-40.0], [5.0]])
    row = np.asarray(paging.plan_scales(meta, ks, vs, 0, per_split=4, step=2, scale=0.5))
    length = paging.scale_row_len(4)
    assert row.shape == (1, 1, 1, 3 * length)
    row = row[0, 0, 0]
    np.testing.assert_allclose(row[:4], [2.0, 1.5, 0.0, 0.0])  # slots 3, 2 listed
    np.testing.assert_allclose(row[length : length + 4], [5 / 40, -1.0, 0.0, 0.0])
    np.testing.assert_allclose(row[2 * length : 2 * length + 2], [40.0, 1.0])


def _errors():
    args, scales = fp8_case(7, lengths=[5, 6])
    q, k, v, table, mask, lengths = args
    ks, vs = scales["k_scale"], scales["v_scale"]
    kb, vb = k.astype(q.dtype), v.astype(q.dtype)
    return [
        ("scaled pools must both be float8_e4m3fn", (q, kb, vb, table, mask, lengths), scales),
        ("float8_e4m3fn k_pool/v_pool", args, {}),
        ("k_scale and v_scale must be given together", args, dict(k_scale=ks)),
        (r"k_scale must be float32 of shape \(8, 2\)", args, dict(k_scale=ks[:, :1], v_scale=vs)),
        (r"v_scale must be float32 of shape", args, dict(k_scale=ks, v_scale=vs[None])),
        ("v_scale must be float32", args, dict(k_scale=ks, v_scale=vs.astype(jnp.bfloat16))),
    ]


@pytest.mark.parametrize("fn", [blocked_attention, blocked_attention_reference])
@pytest.mark.parametrize("message,args,kw", _errors(), ids=[m for m, _, _ in _errors()])
def test_validation_errors(message, args, kw, fn):
    with pytest.raises(ValueError, match=message):
        fn(*args, **kw)


def test_fp8_tiles_and_smem():
    """Default fp8 tiles 64 / 64 / 32 tokens at head_dim 64 / 128 / 256 (any q dtype), and the
    pipeline keeps 3-4 stages with the longest block list and its scales."""
    meta_len = paging.meta_row_len(paging.MAX_BLOCKS_PER_SPLIT)
    scales = 3 * paging.scale_row_len(paging.MAX_BLOCKS_PER_SPLIT)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        for head_dim, tile in ((64, 64), (128, 64), (256, 32)):
            step = paging.tile_blocks(None, 16, 10**6, dtype, head_dim, F8)
            assert step * 16 == tile
            stages = paging.pipeline_stages(4, 10**6, tile, head_dim, dtype, meta_len + scales, F8)
            assert stages >= 3, (dtype, head_dim, stages)


def _abstract_args(dtype, head_dim, block_size, layers=None):
    s = jax.ShapeDtypeStruct
    lead = () if layers is None else (layers,)
    pool = s((*lead, 512, block_size, 2, head_dim), F8)
    scale = s((*lead, 512, 2), jnp.float32)
    ints = (s((4, 300), jnp.int32), s((4, 300), jnp.bool_), s((4,), jnp.int32))
    layer = None if layers is None else s((), jnp.int32)
    return (s((4, 8, head_dim), dtype), pool, pool, *ints, layer, s((4,), jnp.int32), scale, scale)


@pytest.mark.parametrize(
    "dtype,head_dim,block_size,layers",
    [
        (jnp.bfloat16, 128, 16, None),
        (jnp.float16, 64, 48, 3),
        (jnp.bfloat16, 16, 32, None),  # 16-byte fp8 rows: plain (unswizzled) stages
        (jnp.float32, 48, 16, 3),
        (jnp.float32, 256, 16, None),
    ],
)
def test_lowers_for_cuda(dtype, head_dim, block_size, layers):
    """The compiled path lowers to a Mosaic GPU custom call (its layout / SMEM passes run)."""
    fn = functools.partial(
        ba._blocked_attention, scale=0.1, softcap=30.0, block_sizes=BlockSizes(), interpret=False
    )
    args = _abstract_args(dtype, head_dim, block_size, layers)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu_compile
@pytest.mark.skipif(
    os.environ.get("JAX_PLATFORMS", "").split(",")[0] != "cpu",
    reason="needs JAX_PLATFORMS=cpu and the CUDA plugin",
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_compiles_for_h200(dtype):
    """ptxas accepts the fp8 kernel for sm_90a (deviceless H200 compile)."""
    from jaxkv.gpu import aot as gc

    if not gc.plugin_available():
        pytest.skip("needs the CUDA PJRT plugin (pip install -e .[gpu-compile])")
    fn = jax.jit(
        functools.partial(
            ba._blocked_attention, scale=0.1, softcap=None, block_sizes=BlockSizes(),
            interpret=False,
        )
    )  # fmt: skip
    m = gc.compile_for_gpu(fn, *_abstract_args(dtype, 128, 16, 2))
    assert "mosaic_gpu" in m.hlo_text


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_available(), reason="needs a Hopper GPU (compiled kernel)")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_gpu_compiled_matches_reference(dtype):
    """The compiled kernel on a GPU (bench/gpu_check.sh): Llama-3.1-8B heads, 300 blocks a row
    at 50% selected, FP8 pools, against the reference."""
    rng = np.random.default_rng(12)
    mask = rng.random((4, 300)) < 0.5
    mask[3] = False
    args, scales = fp8_case(
        12, dtype=dtype, q_heads=32, kv_heads=8, head_dim=128, max_blocks=300,
        lengths=[1, 17, 300 * 16, 3000], mask=mask,
    )  # fmt: skip
    with jax.default_matmul_precision("float32"):  # XLA's GPU default for fp32 dots is tf32
        want = blocked_attention_reference(*args, **scales)
    assert_close(blocked_attention(*args, interpret=False, **scales), want, TOL[dtype])
