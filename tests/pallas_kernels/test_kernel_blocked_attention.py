"""blocked_attention (Mosaic GPU kernel; interpreter on CPU) vs blocked_attention_reference,
and the reference vs a dense float64 numpy computation."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels.blocked_attention as ba
from pallas_kernels import paging
from pallas_kernels.blocked_attention import (
    BlockSizes,
    blocked_attention,
    blocked_attention_reference,
    merge_partials,
)
from pallas_kernels.common import hopper_available, race_checked

requires_hopper = pytest.mark.skipif(
    not hopper_available(), reason="needs a Hopper GPU (Mosaic GPU); run by bench/gpu_check.sh"
)

# fp32: the kernel's bf16x3 products carry each operand to ~2^-16 relative; measured max abs
# error 1.5e-05 (out and lse, unit-normal inputs, head_dim 128) against the fp32 reference.
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 5e-5}
REFERENCE_TOL = {jnp.bfloat16: 2e-3, jnp.float32: 1e-6}  # the reference vs float64 numpy


def make_case(
    seed,
    *,
    dtype=jnp.bfloat16,
    block_size=16,
    q_heads=4,
    kv_heads=1,
    head_dim=64,
    max_blocks=3,
    lengths=None,
    slots=None,
    mask=None,
):
    """Random pool and a permuted block table; lengths default to 1, block + 1, full."""
    rng = np.random.default_rng(seed)
    lengths = [1, block_size + 1, max_blocks * block_size] if lengths is None else lengths
    batch = len(lengths)
    slots = slots or batch * max_blocks + 2
    q = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((slots, block_size, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((slots, block_size, kv_heads, head_dim)), dtype)
    table = rng.permutation(slots)[: batch * max_blocks].reshape(batch, max_blocks)
    if mask is None:
        mask = np.ones((batch, max_blocks), bool)
    mask = np.asarray(mask, bool)
    # Entries the mask excludes are garbage (out of range): the kernel must never read them.
    table = np.where(mask, table, 10**6).astype(np.int32)
    return q, k, v, jnp.asarray(table), jnp.asarray(mask), jnp.asarray(lengths, jnp.int32)


def dense_numpy(q, k, v, table, mask, lengths, scale=None, softcap=None, starts=None):
    """float64 attention over the dense token list each row attends (tokens from `starts`)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k.shape
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    group = q_heads // kv_heads
    out = np.zeros((batch, q_heads, head_dim))
    lse = np.full((batch, q_heads), -np.inf)
    for b in range(batch):
        toks = [
            (int(table[b, j]), t)
            for j in range(table.shape[1])
            if mask[b, j]
            for t in range(block_size)
            if (0 if starts is None else starts[b]) <= j * block_size + t < lengths[b]
        ]
        if not toks:
            continue
        kb = np.stack([k[s, t] for s, t in toks])  # [tokens, kv_heads, head_dim]
        vb = np.stack([v[s, t] for s, t in toks])
        for h in range(q_heads):
            logits = kb[:, h // group] @ q[b, h] * scale
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            m = logits.max()
            p = np.exp(logits - m)
            out[b, h] = p @ vb[:, h // group] / p.sum()
            lse[b, h] = m + np.log(p.sum())
    return out, lse


def assert_close(got, want, tol):
    (go, gl), (wo, wl) = got, want
    np.testing.assert_allclose(np.asarray(go), np.asarray(wo), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(gl), np.asarray(wl), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("block_size", [16, 32, 48])
def test_kernel_matches_reference(dtype, block_size):
    # Rows: length 1, block + 1, full; permuted table; GQA 4.
    case = make_case(0, dtype=dtype, block_size=block_size, q_heads=8, kv_heads=2)
    want = blocked_attention_reference(*case)
    assert_close(blocked_attention(*case), want, TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 1), (8, 1)])
def test_gqa(q_heads, kv_heads, dtype):
    case = make_case(1, dtype=dtype, q_heads=q_heads, kv_heads=kv_heads)
    assert_close(blocked_attention(*case), blocked_attention_reference(*case), TOL[dtype])


@pytest.mark.parametrize("head_dim", [16, 48, 128])
def test_head_dims(head_dim):
    case = make_case(14, head_dim=head_dim, q_heads=4, kv_heads=2)
    assert_close(blocked_attention(*case), blocked_attention_reference(*case), TOL[jnp.bfloat16])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_sparse_mask_with_empty_row_and_garbage_table(dtype):
    mask = [[True, False, True, False], [False, False, False, False], [False, True, False, True]]
    case = make_case(2, dtype=dtype, max_blocks=4, lengths=[64, 64, 50], mask=mask)
    out, lse = blocked_attention(*case)
    assert_close((out, lse), blocked_attention_reference(*case), TOL[dtype])
    assert np.all(np.asarray(out[1]) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse[1])))


def test_tier_split_merges_to_full_attention():
    """HBM part + staged host part merged by log-sum-exp equals attending every block."""
    q, k, v, table, mask, lengths = make_case(3, max_blocks=4, lengths=[64, 40, 17])
    on_hbm = np.array(
        [[True, False, True, False], [False, True, True, False], [True, True, False, False]]
    )
    host_mask = np.asarray(mask) & ~on_hbm
    # The host blocks sit in a staging pool under their own table (logical block -> staging slot).
    stage_slots = np.where(host_mask, np.arange(table.size).reshape(table.shape), 10**6)
    k_stage = jnp.zeros_like(k, shape=(table.size,) + k.shape[1:])
    v_stage = jnp.zeros_like(v, shape=(table.size,) + v.shape[1:])
    rows, cols = np.nonzero(host_mask)
    src = np.asarray(table)[rows, cols]
    k_stage = k_stage.at[stage_slots[rows, cols]].set(k[src])
    v_stage = v_stage.at[stage_slots[rows, cols]].set(v[src])
    hbm = blocked_attention(q, k, v, table, jnp.asarray(on_hbm), lengths)
    host = blocked_attention(
        q, k_stage, v_stage, jnp.asarray(stage_slots, jnp.int32), jnp.asarray(host_mask), lengths
    )
    merged = merge_partials(jnp.stack([hbm[0], host[0]]), jnp.stack([hbm[1], host[1]]))
    full = blocked_attention_reference(q, k, v, table, mask, lengths)
    assert_close(merged, full, TOL[jnp.bfloat16])


def test_empty_host_part_merge_is_exact():
    case = make_case(4)
    none = jnp.zeros_like(case[4])
    empty = blocked_attention(*case[:4], none, case[5])
    part = blocked_attention(*case)
    merged = merge_partials(jnp.stack([part[0], empty[0]]), jnp.stack([part[1], empty[1]]))
    np.testing.assert_array_equal(np.asarray(merged[0]), np.asarray(part[0]))
    np.testing.assert_array_equal(np.asarray(merged[1]), np.asarray(part[1]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_split_k_and_pipeline_depth(dtype):
    """Several splits, a pipeline shallower and deeper than a split's list, sparse rows;
    tiles of 16, 32 and 48 tokens."""
    mask = np.random.default_rng(5).random((2, 7)) < 0.7
    mask[0, 0] = True
    case = make_case(5, dtype=dtype, max_blocks=7, lengths=[112, 90], mask=mask)
    want = blocked_attention_reference(*case)
    for sizes in (
        BlockSizes(num_splits=3, num_stages=1, blocks_per_step=1),
        BlockSizes(num_splits=2, num_stages=3, blocks_per_step=2),
        BlockSizes(num_splits=1, num_stages=2, blocks_per_step=3),
    ):
        assert_close(blocked_attention(*case, block_sizes=sizes), want, TOL[dtype])


@pytest.mark.parametrize(
    "sizes,dtype",
    [
        (BlockSizes(num_splits=2, num_stages=2, blocks_per_step=2), jnp.bfloat16),
        (BlockSizes(num_stages=1, blocks_per_step=1), jnp.bfloat16),
        (BlockSizes(num_splits=2, num_stages=2, blocks_per_step=2), jnp.float32),
        (BlockSizes(num_stages=1, blocks_per_step=1), jnp.float32),
    ],
)
def test_no_races_detected(sizes, dtype):
    """The interpreter's happens-before race detector (TMA threads, barriers, SMEM reuse of
    the pipeline buffers, of fp32's split buffer and of the epilogue's aliased output buffers)
    finds no race."""
    mask = np.random.default_rng(5).random((2, 7)) < 0.7
    mask[0, 0] = True
    case = make_case(5, dtype=dtype, max_blocks=7, lengths=[112, 90], mask=mask)
    got = race_checked(lambda p: blocked_attention(*case, block_sizes=sizes, interpret=p))
    assert_close(got, blocked_attention_reference(*case), TOL[dtype])


def test_plan_compacts_attended_blocks_in_order():
    table = jnp.asarray([[7, 6, 5, 4, 3], [9, 9, 9, 9, 9]], jnp.int32)
    mask = jnp.asarray([[True, False, True, True, False], [False] * 5])
    lengths = jnp.asarray([50, 80], jnp.int32)  # row 0: block 3 starts at 48 < 50, 2 tokens
    meta = np.asarray(
        paging.plan_blocks(
            table, mask, lengths, block_size=16, num_slots=8, num_splits=2, per_split=4
        )
    )
    assert meta.shape == (2, 2, paging.meta_row_len(4))
    np.testing.assert_array_equal(meta[0, :, 0], [3, 0])  # blocks per split
    np.testing.assert_array_equal(meta[0, 0, 4:8], [7, 5, 4, 0])  # slots, logical order
    np.testing.assert_array_equal(meta[0, 0, 8:12], [16, 16, 2, 0])  # valid tokens
    np.testing.assert_array_equal(meta[0, 0, 12:16], [0, 0, 0, 0])  # from each block's start
    np.testing.assert_array_equal(meta[1, :, 0], [0, 0])  # nothing attended: no loads


def test_plan_skips_blocks_before_the_window():
    """A sliding window's start: blocks wholly before it are not listed, the boundary block's
    valid tokens start past 0."""
    table = jnp.asarray([[7, 6, 5, 4, 3]], jnp.int32)
    mask = jnp.ones((1, 5), bool)
    lengths, starts = jnp.asarray([70], jnp.int32), jnp.asarray([37], jnp.int32)
    meta = np.asarray(
        paging.plan_blocks(
            table,
            mask,
            lengths,
            block_size=16,
            num_slots=8,
            num_splits=1,
            per_split=5,
            starts=starts,
        )
    )
    assert meta[0, 0, 0] == 3  # blocks 2, 3, 4 (tokens 32-79); 0 and 1 end before 37
    np.testing.assert_array_equal(meta[0, 0, 4:7], [5, 4, 3])
    np.testing.assert_array_equal(meta[0, 0, 9:12], [16, 16, 6])  # ends
    np.testing.assert_array_equal(meta[0, 0, 14:17], [5, 0, 0])  # firsts: 37 - 32 = 5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("sizes", [BlockSizes(), BlockSizes(num_splits=2, blocks_per_step=2)])
def test_window_starts_match_reference_and_dense(dtype, sizes):
    """Rows attend [starts, lengths): a start inside a block (token-masked), on a block
    boundary, at 0, and past a sparse mask's only block (nothing attended)."""
    mask = np.ones((4, 5), bool)
    mask[3] = [True, False, False, False, False]
    case = make_case(6, dtype=dtype, max_blocks=5, lengths=[80, 75, 33, 70], mask=mask)
    starts = jnp.asarray([37, 48, 0, 20], jnp.int32)
    want = blocked_attention_reference(*case, starts=starts)
    assert_close(blocked_attention(*case, starts=starts, block_sizes=sizes), want, TOL[dtype])
    dense = dense_numpy(*case, starts=np.asarray(starts))
    assert_close(want, dense, REFERENCE_TOL[dtype])
    assert np.all(np.isneginf(np.asarray(want[1][3])))
    # the window changes the result: row 0 without it attends 37 more tokens
    full = blocked_attention_reference(*case)
    assert not np.allclose(np.asarray(full[0][0]), np.asarray(want[0][0]), atol=1e-3)


def test_error_starts_shape():
    case = make_case(0)
    with pytest.raises(ValueError, match=r"starts must be None or int32 \[batch=3\]"):
        blocked_attention_reference(*case, starts=jnp.zeros((2,), jnp.int32))


def test_jit_composes_without_retracing():
    case = make_case(15, lengths=[20, 30])
    fn = jax.jit(lambda *a: blocked_attention(*a))
    fn(*case)
    before = ba._blocked_attention._cache_size()
    other = make_case(16, lengths=[5, 40])
    assert_close(fn(*other), blocked_attention_reference(*other), TOL[jnp.bfloat16])
    assert ba._blocked_attention._cache_size() == before


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_layer_of_a_multi_layer_pool(dtype):
    """A [layers, ...] pool with a (traced) layer index equals passing that layer's pool."""
    q, k, v, table, mask, lengths = make_case(17, dtype=dtype, q_heads=4, kv_heads=2)
    k3 = jnp.stack([k * 0.5, k, -k])
    v3 = jnp.stack([v * 2.0, v, -v])
    want = blocked_attention_reference(q, k3[2], v3[2], table, mask, lengths)
    assert_close(blocked_attention_reference(q, k3, v3, table, mask, lengths, layer=2), want, 1e-6)
    attend = jax.jit(lambda layer: blocked_attention(q, k3, v3, table, mask, lengths, layer=layer))
    assert_close(attend(jnp.int32(2)), want, TOL[dtype])
    want0 = blocked_attention_reference(q, k3[0], v3[0], table, mask, lengths)
    assert_close(attend(jnp.int32(0)), want0, TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_scale_and_softcap(dtype):
    case = make_case(6, dtype=dtype)
    kw = dict(scale=0.3, softcap=2.0)
    assert_close(
        blocked_attention(*case, **kw), blocked_attention_reference(*case, **kw), TOL[dtype]
    )


def test_kernel_body_executes(monkeypatch):
    """The interpreted kernel body, not a fallback, produces the result."""
    calls = []
    body = ba.blocked_attention_kernel

    def spy(*args, **kwargs):
        calls.append(kwargs["block_size"])
        return body(*args, **kwargs)

    monkeypatch.setattr(ba, "blocked_attention_kernel", spy)
    # A shape no other test uses, so the jitted wrapper traces afresh.
    case = make_case(7, block_size=64, lengths=[70], max_blocks=2)
    got = blocked_attention(*case)
    assert calls == [64]
    assert_close(got, blocked_attention_reference(*case), TOL[jnp.bfloat16])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
def test_reference_matches_dense_numpy(dtype, block_size):
    mask = [[True, False, True], [True, True, True], [False, False, False]]
    case = make_case(
        8, dtype=dtype, block_size=block_size, q_heads=4, kv_heads=2, lengths=[3, 9, 15], mask=mask
    )
    for kw in ({}, {"scale": 0.2, "softcap": 1.5}):
        want = dense_numpy(*case, **kw)
        assert_close(blocked_attention_reference(*case, **kw), want, REFERENCE_TOL[dtype])


@pytest.mark.parametrize(
    "config",
    [
        dict(head_dim=128, block_size=16, dtype=jnp.bfloat16, q_heads=32, kv_heads=8),
        dict(head_dim=64, block_size=48, dtype=jnp.float16, q_heads=8, kv_heads=8),
        dict(head_dim=16, block_size=32, dtype=jnp.bfloat16, q_heads=4, kv_heads=2),
        dict(head_dim=256, block_size=64, dtype=jnp.bfloat16, q_heads=4, kv_heads=1),
        # fp32 (bf16x3): tiles of 32, 48 and 16 tokens; head_dim 48 takes the unoptimized
        # (bank-conflicted) fp32 load, head_dim 256 three pipeline stages.
        dict(head_dim=128, block_size=16, dtype=jnp.float32, q_heads=32, kv_heads=8),
        dict(head_dim=48, block_size=48, dtype=jnp.float32, q_heads=8, kv_heads=2),
        dict(head_dim=256, block_size=16, dtype=jnp.float32, q_heads=4, kv_heads=1),
    ],
)
@pytest.mark.parametrize(
    "semantics",
    ["Warpgroup", pytest.param("Lane", marks=pytest.mark.slow)],  # Lane: test-slow
)
def test_lowers_for_cuda(config, semantics, monkeypatch):
    """The compiled (non-interpreted) path lowers to a Mosaic GPU custom call on CPU too, under
    both Mosaic GPU lowering semantics (the default differs between jax versions). Lowering runs
    Mosaic GPU's passes (layouts, SMEM transfers, SMEM size), which the interpreter skips."""
    sem = getattr(plgpu.LoweringSemantics, semantics)
    monkeypatch.setattr(
        ba, "compiler_params", lambda **kw: plgpu.CompilerParams(lowering_semantics=sem, **kw)
    )
    # The semantics is read when the jitted wrapper traces: drop traces made under the other.
    ba._blocked_attention.clear_cache()
    dt, bs, d = config["dtype"], config["block_size"], config["head_dim"]
    s = jax.ShapeDtypeStruct
    args = (
        s((4, config["q_heads"], d), dt),
        s((512, bs, config["kv_heads"], d), dt),
        s((512, bs, config["kv_heads"], d), dt),
        s((4, 300), jnp.int32),
        s((4, 300), jnp.bool_),
        s((4,), jnp.int32),
    )
    fn = functools.partial(
        ba._blocked_attention, scale=0.1, softcap=30.0, block_sizes=BlockSizes(), interpret=False
    )
    text = jax.jit(fn).trace(*args, None).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    pools = [s((3, *a.shape), a.dtype) for a in args[1:3]]
    layered = (args[0], *pools, *args[3:], s((), jnp.int32))
    text = jax.jit(fn).trace(*layered).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    windowed = (*layered, s((4,), jnp.int32))  # a sliding window's starts
    text = jax.jit(fn).trace(*windowed).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_cuda_long_tables(dtype):
    """131k tokens x batch 8 (8,192 blocks a row): the per-split block table is longer than a
    bounds-checked TMA copy allows (256 elements), so it must take the in-bounds bulk copy."""
    s = jax.ShapeDtypeStruct
    args = (
        s((8, 32, 128), dtype),
        s((65536, 16, 8, 128), dtype),
        s((65536, 16, 8, 128), dtype),
        s((8, 8192), jnp.int32),
        s((8, 8192), jnp.bool_),
        s((8,), jnp.int32),
    )
    fn = functools.partial(
        ba._blocked_attention, scale=0.1, softcap=None, block_sizes=BlockSizes(), interpret=False
    )
    text = jax.jit(fn).trace(*args, None).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _errors():
    q, k, v, table, mask, lengths = make_case(9, q_heads=4, kv_heads=2, lengths=[5, 6])
    i = jnp.int32
    return [
        ("q must be", (q[0], k, v, table, mask, lengths)),
        ("k_pool must be", (q, k[0], v, table, mask, lengths)),
        ("v_pool shape", (q, k, v[:1], table, mask, lengths)),
        ("k_pool head_dim", (q, k[..., :32], v[..., :32], table, mask, lengths)),
        ("must be a multiple of kv_heads", (q[:, :3], k, v, table, mask, lengths)),
        ("q dtype int32 unsupported", (q.astype(jnp.int32), k, v, table, mask, lengths)),
        ("k_pool/v_pool dtypes", (q, k.astype(jnp.float16), v, table, mask, lengths)),
        ("block_table must be", (q, k, v, table[:1], mask, lengths)),
        ("block_table dtype", (q, k, v, table.astype(jnp.int16), mask, lengths)),
        ("block_mask shape", (q, k, v, table, mask[:, :1], lengths)),
        ("block_mask dtype", (q, k, v, table, mask.astype(i), lengths)),
        ("lengths must be", (q, k, v, table, mask, lengths[:1])),
        ("block_size=8 unsupported", (q, k[:, :8], v[:, :8], table, mask, lengths)),
        ("head_dim=40 unsupported", (q[..., :40], k[..., :40], v[..., :40], table, mask, lengths)),
        (
            "max 256",
            (
                jnp.zeros((2, 4, 320), q.dtype),
                jnp.zeros((4, 16, 2, 320), q.dtype),
                jnp.zeros((4, 16, 2, 320), q.dtype),
                table,
                mask,
                lengths,
            ),
        ),
        ("pool needs the layer index", (q, k[None], v[None], table, mask, lengths)),
        (
            "query heads per kv head",
            (jnp.zeros((2, 256, 64), q.dtype), k, v, table, mask, lengths),
        ),
    ]


@pytest.mark.parametrize("message,args", _errors(), ids=[m for m, _ in _errors()])
def test_validation_errors(message, args):
    with pytest.raises(ValueError, match=message):
        blocked_attention(*args)


def test_layer_validation_errors():
    q, k, v, table, mask, lengths = make_case(9, lengths=[5, 6])
    with pytest.raises(ValueError, match="one-layer pool takes none"):
        blocked_attention(q, k, v, table, mask, lengths, layer=0)
    with pytest.raises(ValueError, match="layer must be a scalar"):
        blocked_attention(q, k[None], v[None], table, mask, lengths, layer=jnp.zeros(2, jnp.int32))


def test_reference_accepts_fp32_and_any_block_size():
    case = make_case(10, dtype=jnp.float32, block_size=5, head_dim=24)
    out, lse = blocked_attention_reference(*case)
    assert out.dtype == jnp.float32 and lse.shape == case[0].shape[:2]


def test_smem_budget_error():
    with pytest.raises(ValueError, match="SMEM"):
        paging.pipeline_stages(4, 8, 256, 256, jnp.bfloat16, 64)
    # fp32 stages are twice as large, plus the bf16 split buffers: 64-token blocks at
    # head_dim 256 do not fit even one stage.
    case = make_case(18, dtype=jnp.float32, block_size=64, head_dim=256, lengths=[5], max_blocks=1)
    with pytest.raises(ValueError, match=r"64 tokens with head_dim=256 \(float32\) needs"):
        blocked_attention(*case)


@pytest.mark.parametrize("head_dim,stages", [(64, 4), (128, 4), (256, 3)])
def test_fp32_defaults_keep_the_pipeline(head_dim, stages):
    """Default fp32 tiles (64 / 32 / 16 tokens) leave room for 3-4 K/V stages even with the
    longest per-split block list."""
    step = paging.tile_blocks(None, 16, 10**6, jnp.float32, head_dim)
    meta_len = paging.meta_row_len(paging.MAX_BLOCKS_PER_SPLIT)
    assert paging.pipeline_stages(4, 10**6, step * 16, head_dim, jnp.float32, meta_len) == stages


def test_block_sizes_validation():
    with pytest.raises(ValueError, match="num_stages"):
        BlockSizes(num_stages=0)
    with pytest.raises(ValueError, match="num_splits"):
        BlockSizes(num_splits=0)
    with pytest.raises(ValueError, match="min_blocks_per_split"):
        BlockSizes(min_blocks_per_split=0)
    with pytest.raises(ValueError, match="blocks_per_step"):
        BlockSizes(blocks_per_step=0)


def test_tile_too_wide_error():
    case = make_case(13, block_size=64, lengths=[200], max_blocks=8)
    with pytest.raises(ValueError, match="tokens per tile"):
        blocked_attention(*case, block_sizes=BlockSizes(blocks_per_step=8))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block_size", [16, 32, 48, 64])
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 2), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sweep_slow(dtype, block_size, q_heads, kv_heads, head_dim):
    mask = np.random.default_rng(11).random((3, 5)) < 0.6
    case = make_case(
        11,
        dtype=dtype,
        block_size=block_size,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_blocks=5,
        mask=mask,
    )
    want = blocked_attention_reference(*case, softcap=20.0)
    got = blocked_attention(*case, softcap=20.0, block_sizes=BlockSizes(num_splits=2))
    assert_close(got, want, TOL[dtype])


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_compiled_matches_reference(dtype, block_size):
    rng = np.random.default_rng(12)
    max_blocks = 300
    mask = rng.random((4, max_blocks)) < 0.5
    mask[3] = False
    case = make_case(
        12,
        dtype=dtype,
        block_size=block_size,
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        max_blocks=max_blocks,
        lengths=[1, block_size + 1, max_blocks * block_size, 7000],
        mask=mask,
    )
    with jax.default_matmul_precision("float32"):  # XLA's GPU default for fp32 dots is tf32
        want = blocked_attention_reference(*case, softcap=30.0)
    got = blocked_attention(*case, softcap=30.0, interpret=False)
    assert_close(got, want, TOL[dtype])
