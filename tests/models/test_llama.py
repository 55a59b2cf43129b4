"""Llama forward / prefill / decode_step consistency and config validation."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Llama, LlamaConfig, RopeScaling, tiny_config, tiny_model
from models.dense import DenseKV, dense_kv_from_prefill, init_dense_kv, make_dense_attend
from models.llama import rope_inv_freq


def _decode_all(model, tokens, max_len):
    """Feed `tokens` [B, T] one step at a time through decode_step; logits [B, T, V]."""
    graphdef, state = nnx.split(model)
    attend = make_dense_attend(model.config)

    @jax.jit
    def step(state, tok, kv):
        return nnx.merge(graphdef, state).decode_step(tok, kv.lengths, attend, kv)

    kv = init_dense_kv(model.config, tokens.shape[0], max_len)
    out = []
    for t in range(tokens.shape[1]):
        logits, kv = step(state, tokens[:, t], kv)
        out.append(logits)
    return jnp.stack(out, axis=1), kv


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def test_shapes_and_prefill_matches_call(model):
    c = model.config
    tokens = jax.random.randint(jax.random.key(0), (2, 11), 0, c.vocab_size, jnp.int32)
    logits = model(tokens)
    assert logits.shape == (2, 11, c.vocab_size) and logits.dtype == jnp.float32
    plogits, k, v = model.prefill(tokens)
    np.testing.assert_array_equal(np.asarray(plogits), np.asarray(logits))
    assert k.shape == v.shape == (c.num_layers, 2, 11, c.num_kv_heads, c.head_dim)


def test_causal(model):
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, 256, jnp.int32)
    other = tokens.at[:, 8:].set((tokens[:, 8:] + 7) % 256)
    a, b = model(tokens), model(other)
    np.testing.assert_allclose(np.asarray(a[:, :8]), np.asarray(b[:, :8]), atol=1e-5)
    assert not np.allclose(np.asarray(a[:, 8:]), np.asarray(b[:, 8:]))


def test_decode_step_matches_forward_and_prefill_kv(model):
    tokens = jax.random.randint(jax.random.key(2), (2, 13), 0, 256, jnp.int32)
    ref, k_ref, v_ref = model.prefill(tokens)
    got, kv = _decode_all(model, tokens, max_len=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-4, rtol=1e-5)
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(ref, -1))
    np.testing.assert_allclose(np.asarray(kv.k[:, :, :13]), np.asarray(k_ref), atol=1e-5)
    np.testing.assert_allclose(np.asarray(kv.v[:, :, :13]), np.asarray(v_ref), atol=1e-5)
    assert kv.lengths.tolist() == [13, 13]


def test_decode_step_per_sequence_positions(model):
    """Sequences at different positions in one batch rotate and attend independently."""
    c = model.config
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 256, jnp.int32)
    ref = model(tokens)
    _, kv = _decode_all(model, tokens[:, :8], max_len=12)
    # sequence 0 continues at position 8; sequence 1 re-does position 5 (its later rows are
    # masked off by the attend's `<= pos`).
    pos = jnp.array([8, 5], jnp.int32)
    kv = DenseKV(kv.k, kv.v, pos)
    logits, kv = model.decode_step(
        jnp.array([tokens[0, 8], tokens[1, 5]]), pos, make_dense_attend(c), kv
    )
    assert kv.lengths.tolist() == [9, 6]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(ref[0, 8]), atol=2e-4)
    np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(ref[1, 5]), atol=2e-4)


def test_jit_split_merge_forward(model):
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    tokens = jnp.arange(10, dtype=jnp.int32)[None]
    np.testing.assert_allclose(np.asarray(fwd(state, tokens)), np.asarray(model(tokens)), atol=1e-4)


def test_tiny_greedy_is_not_degenerate(model):
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    tokens = np.zeros((1, 64), np.int32)
    tokens[0, :16] = np.asarray(jax.random.randint(jax.random.key(4), (16,), 0, 256))
    for t in range(16, 64):  # fixed shape: one compilation; causal so later zeros are unseen
        tokens[0, t] = int(np.argmax(np.asarray(fwd(state, jnp.asarray(tokens)))[0, t - 1]))
    cont = tokens[0, 16:].tolist()
    assert len(set(cont)) >= 24, cont
    logits = np.asarray(fwd(state, jnp.asarray(tokens)))[0]
    top2 = np.sort(logits, -1)[:, -2:]
    assert np.min(top2[:, 1] - top2[:, 0]) > 1e-3  # far above fp32 noise
    assert logits.std() > 1.0


def test_tied_and_biases_and_bf16():
    m = tiny_model(seed=1, tie_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True)
    assert m.lm_head is None and m.layer(0).attn.q.b is not None
    n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert n == m.config.num_params()
    tokens = jnp.arange(6, dtype=jnp.int32)[None]
    assert m(tokens).shape == (1, 6, 256)
    mb = tiny_model(dtype="bfloat16")
    out = mb(tokens)
    assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()
    assert mb.embed[...].dtype == jnp.bfloat16


def test_sliding_window_masks_old_tokens():
    m = tiny_model(sliding_window=4)
    full = tiny_model()
    tokens = jnp.arange(10, dtype=jnp.int32)[None]
    a, b = m(tokens), full(tokens)
    np.testing.assert_allclose(np.asarray(a[:, :4]), np.asarray(b[:, :4]), atol=1e-5)
    assert not np.allclose(np.asarray(a[:, 6:]), np.asarray(b[:, 6:]))


def test_sliding_layers_slide_only_those_layers():
    """sliding_layers=(1,): layer 0 attends everything, layer 1 the window (Qwen2's
    max_window_layers); the dense decode path agrees with the forward on every token."""
    c = tiny_config(sliding_window=3, sliding_layers=(1,))
    assert c.layer_windows() == (0, 3)
    m, every, none = (
        tiny_model(0, sliding_window=3, sliding_layers=(1,)),
        tiny_model(0, sliding_window=3),
        tiny_model(0),
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 12)), jnp.int32)
    a, b, f = (np.asarray(x(tokens)) for x in (m, every, none))
    assert not np.allclose(a[:, 5:], b[:, 5:]) and not np.allclose(a[:, 5:], f[:, 5:])
    attend = make_dense_attend(m.config)
    kv = init_dense_kv(m.config, 1, 12)
    for t in range(12):
        logits, kv = m.decode_step(tokens[:, t], kv.lengths, attend, kv)
        np.testing.assert_allclose(np.asarray(logits)[0], a[0, t], atol=2e-4, rtol=1e-4)


def test_llama3_rope_scaling_frequencies():
    c = tiny_config(
        rope_theta=10000.0,
        rope_scaling=RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    )
    base = rope_inv_freq(dataclasses.replace(c, rope_scaling=None))
    scaled = rope_inv_freq(c)
    wavelen = 2 * np.pi / base
    np.testing.assert_array_equal(scaled[wavelen < 16], base[wavelen < 16])
    np.testing.assert_allclose(scaled[wavelen > 64], base[wavelen > 64] / 8, rtol=1e-6)
    mid = (wavelen >= 16) & (wavelen <= 64)
    assert mid.any() and np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8)
    lin = rope_inv_freq(dataclasses.replace(c, rope_scaling=RopeScaling(2.0, rope_type="linear")))
    np.testing.assert_allclose(lin, base / 2, rtol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(dim=0), "LlamaConfig.dim=0: expected a positive int"),
        (dict(num_kv_heads=3), "not a multiple of num_kv_heads=3"),
        (dict(head_dim=15), "head_dim=15: expected an even number"),
        (dict(dtype="int8"), "dtype='int8': expected one of"),
        (dict(sliding_window=0), "sliding_window=0: expected None or an int > 0"),
        (dict(sliding_layers=(0,)), "sliding_layers=(0,): expected None or distinct"),
        (dict(sliding_window=4, sliding_layers=(0, 9)), "in [0, 2) with a sliding_window"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config(**overrides)


def test_rope_scaling_errors():
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        RopeScaling(rope_type="yarn")
    with pytest.raises(ValueError, match="factor=0: expected > 0"):
        RopeScaling(factor=0)
    with pytest.raises(ValueError, match="expected high > low > 0"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)


def test_tiny_config_unknown_override():
    with pytest.raises(ValueError, match=r"overrides \['dims'\]: expected LlamaConfig fields"):
        tiny_config(dims=3)


def test_input_errors(model):
    with pytest.raises(ValueError, match="Llama tokens: got shape \\(4,\\)"):
        model(jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="Llama tokens: got shape .* dtype float32"):
        model(jnp.zeros((1, 4), jnp.float32))
    attend = make_dense_attend(model.config)
    carry = init_dense_kv(model.config, 2, 4)
    with pytest.raises(ValueError, match="positions shape \\(3,\\): expected \\(2,\\)"):
        model.decode_step(jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32), attend, carry)

    def bad_attend(i, q, k, v, carry):
        return q[:, :1], carry

    with pytest.raises(ValueError, match=r"attend returned shape \(2, 1, 16\)"):
        model.decode_step(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), bad_attend, carry)


def test_llama_is_exported():
    assert Llama is not None and LlamaConfig is not None


def test_prefill_then_greedy_decode_matches_full_forward(model):
    """The lead's scenario: prefill a prompt, decode greedily; same tokens as re-running the
    cache-free forward each step."""
    graphdef, state = nnx.split(model)
    prompt = jax.random.randint(jax.random.key(5), (2, 10), 0, 256, jnp.int32)
    attend = make_dense_attend(model.config)

    @jax.jit
    def step(state, tok, kv):
        return nnx.merge(graphdef, state).decode_step(tok, kv.lengths, attend, kv)

    logits, k, v = model.prefill(prompt)
    kv = dense_kv_from_prefill(k, v, max_len=24)
    tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    cached = [tok]
    for _ in range(13):
        logits, kv = step(state, tok, kv)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        cached.append(tok)
    cached = np.stack(cached, 1)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    seq = np.zeros((2, 24), np.int32)
    seq[:, :10] = np.asarray(prompt)
    for t in range(10, 24):
        seq[:, t] = np.argmax(np.asarray(fwd(state, jnp.asarray(seq)))[:, t - 1], -1)
    np.testing.assert_array_equal(cached, seq[:, 10:])
    with pytest.raises(ValueError, match="max_len=5: expected >= prompt length 10"):
        dense_kv_from_prefill(k, v, max_len=5)


def test_right_padded_prefill_is_exact_on_valid_positions(model):
    a = jnp.arange(7, dtype=jnp.int32)[None] * 5
    b = jnp.arange(4, dtype=jnp.int32)[None] * 3
    batch = jnp.concatenate([a, jnp.pad(b, ((0, 0), (0, 3)), constant_values=9)])
    logits, k, _ = model.prefill(batch)
    lb, kb, _ = model.prefill(b)
    np.testing.assert_allclose(np.asarray(logits[1, :4]), np.asarray(lb[0]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(k[:, 1, :4]), np.asarray(kb[:, 0]), atol=1e-5)


def test_prefill_at_computes_the_asked_positions_only(model):
    """`prefill_at`: the logits of one position per sequence, those of `prefill` there (its
    LM head runs on those rows alone: the compiled program holds no [B, T, vocab] array), and
    the same K and V."""
    c = model.config
    tokens = jax.random.randint(jax.random.key(5), (3, 21), 0, c.vocab_size, jnp.int32)
    at = jnp.asarray([20, 6, 0], jnp.int32)
    logits, k, v = model.prefill(tokens)
    last, k2, v2 = model.prefill_at(tokens, at)
    assert last.shape == (3, c.vocab_size) and last.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(last), np.asarray(logits[jnp.arange(3), at]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(v))
    graphdef, state = nnx.split(model)
    hlo = (
        jax.jit(lambda s, t, p: nnx.merge(graphdef, s).prefill_at(t, p))
        .lower(state, tokens, at)
        .compile()
        .as_text()
    )
    assert f"f32[3,21,{c.vocab_size}]" not in hlo
    with pytest.raises(ValueError, match="one position per sequence"):
        model.prefill_at(tokens, at[:2])


def test_long_prefill_matches_the_dense_softmax_across_blocks(monkeypatch):
    """A prompt longer than one attention block (`models.causal.BLOCK`) with a sliding window
    in some layers: the blocked prefill equals the forward with the dense softmax."""
    from models import causal

    cfg = tiny_config(max_seq_len=2048, sliding_window=300, sliding_layers=(0,))
    m = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(6), (1, causal.BLOCK + 77), 0, 256, jnp.int32)
    got = m(tokens)

    def dense(q, k, v, window, band=None, precision=None):
        return causal.causal_attention_reference(q, k, v, window, precision=precision)

    monkeypatch.setattr("models.llama.causal_attention", dense)
    want = m(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=1e-4)
