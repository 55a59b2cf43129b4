"""models.causal: blocked causal attention against the dense softmax, and its block pairs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.causal import block_pairs, causal_attention, causal_attention_reference

HI = jax.lax.Precision.HIGHEST


def _qkv(rng, B, T, H, KV, D, dtype=jnp.float32):
    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return draw(B, T, H, D), draw(B, T, KV, D), draw(B, T, KV, D)


@pytest.mark.parametrize(
    "T, H, KV, block, window, band",
    [
        (37, 4, 2, 8, None, None),  # T not a multiple of the block: padded keys never seen
        (1, 2, 1, 8, None, None),  # one token
        (17, 4, 2, 16, None, None),  # block + 1
        (40, 2, 2, 40, None, None),  # one block
        (64, 6, 3, 16, 10, 10),  # a window every layer applies: blocks outside it skipped
        (64, 6, 3, 16, 21, None),  # a window applied token by token only
        (50, 4, 1, 7, 0, None),  # window 0: full attention (MQA)
        (33, 2, 2, 5, 6, 6),  # a window shorter than... a block wider than the window
        (33, 2, 2, 5, 1, 1),  # window 1: each position sees itself
    ],
)
def test_blocked_causal_attention_matches_the_dense_softmax(T, H, KV, block, window, band):
    q, k, v = _qkv(np.random.default_rng(T + H), 2, T, H, KV, 8)
    got = causal_attention(q, k, v, window, band=band, block=block, precision=HI)
    want = causal_attention_reference(q, k, v, window, precision=HI)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_traced_window_under_jit():
    """The window may be a traced per-layer value (the layer scan's)."""
    q, k, v = _qkv(np.random.default_rng(0), 1, 30, 4, 2, 8)
    f = jax.jit(lambda w: causal_attention(q, k, v, w, block=8, precision=HI))
    for w in (0, 3, 12):
        want = causal_attention_reference(q, k, v, w, precision=HI)
        np.testing.assert_allclose(np.asarray(f(jnp.int32(w))), np.asarray(want), atol=2e-6)


def test_bf16_inputs_keep_fp32_softmax():
    q, k, v = _qkv(np.random.default_rng(1), 2, 45, 4, 2, 16, jnp.bfloat16)
    got = causal_attention(q, k, v, block=16)
    want = causal_attention_reference(q, k, v)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
    )


def test_block_pairs_cover_the_causal_triangle_and_the_band():
    qi, kj = block_pairs(4, 8, None)
    assert list(zip(qi.tolist(), kj.tolist(), strict=True)) == [
        (i, j) for i in range(4) for j in range(i + 1)
    ]
    # a band of 9 tokens: block i's first query (8i) sees back to 8i - 8, block i - 1
    qi, kj = block_pairs(4, 8, 9)
    assert list(zip(qi.tolist(), kj.tolist(), strict=True)) == [
        (0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3),
    ]  # fmt: skip
    qi, kj = block_pairs(4, 8, 8)  # 8 tokens: block i's first query sees back to 8i - 7
    assert list(zip(qi.tolist(), kj.tolist(), strict=True)) == [
        (0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3),
    ]  # fmt: skip


def test_memory_is_blocks_not_the_square():
    """XLA's memory analysis of the compiled attention: the temporaries grow with T x block,
    not T^2 (the dense softmax's [T, T] scores alone would be 4 x T^2 bytes per head)."""
    B, H, KV, D, block = 1, 4, 2, 16, 128

    def temp(T):
        args = [jax.ShapeDtypeStruct((B, T, n, D), jnp.float32) for n in (H, KV, KV)]
        f = jax.jit(lambda q, k, v: causal_attention(q, k, v, block=block))
        return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(2048), temp(8192)
    square = 4 * 8192**2 * H  # the dense scores at 8k
    assert large < square / 20, (large, square)
    assert large < 6 * small, (small, large)  # 4x the tokens: about 4x, never 16x


def test_bad_shapes_are_refused():
    q, k, v = _qkv(np.random.default_rng(2), 1, 8, 3, 2, 8)
    with pytest.raises(ValueError, match="kv_heads dividing heads"):
        causal_attention(q, k, v)
    q, k, v = _qkv(np.random.default_rng(2), 1, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="block=0"):
        causal_attention(q, k, v, block=0)
