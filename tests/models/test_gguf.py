"""GGUF files (models.gguf_io): a tiny random Llama written as GGUF (F16, Q8_0, Q4_1 and F32
tensors, llama.cpp's layout) and as safetensors loads into the same model, its embedded
tokenizer encodes as tokenizer.json does, and each bad file gets its own clear error."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import gguf_io
from models.generate import chat_prompt, check_model_spec, decode_text, load_model
from models.hf import _tensor_names, chat_template, eos_token_ids, save_pretrained
from tests.models.gguf_writer import CHATML, TEXT, tiny_tokenizer, write_gguf

Q = gguf.GGMLQuantizationType
TYPES = {  # every layer tensor quantized as llama.cpp's Q4_1 files are, the rest mixed
    "token_embd.weight": Q.Q8_0,
    "attn_q.weight": Q.Q4_1,
    "attn_k.weight": Q.Q4_1,
    "attn_v.weight": Q.Q8_0,
    "attn_output.weight": Q.Q4_1,
    "ffn_gate.weight": Q.F16,
    "ffn_up.weight": Q.Q4_1,
    "ffn_down.weight": Q.F16,
}


def _config(vocab_size, **kw):
    base = dict(
        vocab_size=vocab_size,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        max_seq_len=256,
        tie_embeddings=True,
        norm_eps=1e-5,
        rope_theta=10000.0,
    )
    return models.LlamaConfig(**(base | kw))


def _with_values(model, values):
    """`model` with its parameters replaced by `values` (Hugging Face name -> array)."""
    graphdef, state = nnx.split(model)
    flat = []
    for p, var in nnx.to_flat_state(state):
        parts = []
        for name, transpose in _tensor_names(p, model.config.num_layers):
            a = values[name]
            parts.append(a.T if transpose else a)
        a = np.stack(parts) if p[0] == "layers" else parts[0]
        flat.append((p, var.replace(jnp.asarray(a, var[...].dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _greedy(model, ids, n=12):
    x = jnp.asarray([ids], jnp.int32)
    for _ in range(n):
        nxt = jnp.argmax(model(x)[0, -1]).astype(jnp.int32)
        x = jnp.concatenate([x, nxt[None, None]], axis=1)
    return np.asarray(x[0, len(ids) :]).tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(GGUF path, safetensors folder, tokenizer) of the same tiny model."""
    d = tmp_path_factory.mktemp("gguf")
    tok = tiny_tokenizer()
    model = models.Llama(_config(tok.get_vocab_size()), rngs=nnx.Rngs(3))
    expected = write_gguf(d / "tiny.gguf", model, tokenizer=tok, types=TYPES)
    folder = d / "hf"
    save_pretrained(_with_values(model, expected), folder, tokenizer=tok, eos_token_id=2)
    return d / "tiny.gguf", folder, tok


def test_gguf_and_safetensors_load_the_same_model(pair):
    path, folder, tok = pair
    a, b = models.load_pretrained(path), models.load_pretrained(folder)
    assert a.config == b.config
    sa, sb = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    for (pa, va), (pb, vb) in zip(sa, sb, strict=True):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(va[...]), np.asarray(vb[...]), err_msg=str(pa))
    ids = tok.encode("def fib(n):").ids
    assert _greedy(a, ids) == _greedy(b, ids)


def test_gguf_tokenizer_matches_tokenizer_json(pair):
    path, folder, tok = pair
    mine = models.load_tokenizer(path)
    sample = TEXT[:400] + "<|im_start|>user\nHi 2024!<|im_end|>\n  indented\ttabs  "
    assert mine.encode(sample).ids == models.load_tokenizer(folder).encode(sample).ids
    assert mine.encode(sample).ids == tok.encode(sample).ids
    assert mine.decode(mine.encode(sample).ids, skip_special_tokens=False) == sample
    assert mine.token_to_id("<|im_end|>") == 2  # a special token, never split


def test_stop_tokens_and_chat_template_come_from_the_file(pair):
    path, _, tok = pair
    assert eos_token_ids(path) == (tok.token_to_id("<|im_end|>"),)
    assert chat_template(path) == CHATML
    check_model_spec(str(path))
    _, tokenizer = load_model(str(path))
    text = chat_prompt(str(path), tokenizer, "Hi")
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("yes it is<|im_end|>more").ids
    assert decode_text(tokenizer, ids, (end,)) == "yes it is"


def test_qk_permutation_is_llama_cpps_and_is_undone():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # 2 heads of head_dim 4
    p = gguf_io.permute_qk(w, 2)
    # llama.cpp interleaves each head's two rotary halves: rows 0, 2, 1, 3 of a head
    np.testing.assert_array_equal(p[:4], w[[0, 2, 1, 3]])
    np.testing.assert_array_equal(gguf_io.unpermute_qk(p, 2), w)


def test_llama31_rope_freqs_become_rope_scaling(tmp_path):
    scaling = models.RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    cfg = _config(300, rope_scaling=scaling)
    plain = models.llama.rope_inv_freq(_config(300))
    freqs = plain / models.llama.rope_inv_freq(cfg)
    model = models.Llama(_config(300), rngs=nnx.Rngs(0))
    write_gguf(tmp_path / "m.gguf", model, extra_tensors={"rope_freqs.weight": freqs})
    with pytest.raises(ValueError, match="is not Llama 3.1's rope scaling"):
        models.load_pretrained(tmp_path / "m.gguf")  # original context 8192 assumed, not 64
    bad = freqs * 1.5
    write_gguf(tmp_path / "b.gguf", model, extra_tensors={"rope_freqs.weight": bad})
    with pytest.raises(ValueError, match="rope_freqs.weight is not Llama 3.1"):
        models.load_pretrained(tmp_path / "b.gguf")


def test_rope_freqs_with_the_stated_context_load(tmp_path):
    scaling = models.RopeScaling(factor=8.0, original_max_position_embeddings=8192)
    plain = models.llama.rope_inv_freq(_config(300, head_dim=64, dim=256))
    freqs = plain / models.llama.rope_inv_freq(
        _config(300, head_dim=64, dim=256, rope_scaling=scaling)
    )
    model = models.Llama(_config(300, head_dim=64, dim=256), rngs=nnx.Rngs(0))
    write_gguf(tmp_path / "m.gguf", model, extra_tensors={"rope_freqs.weight": freqs})
    assert models.load_pretrained(tmp_path / "m.gguf").config.rope_scaling == scaling


# -- one test per error message ---------------------------------------------------------------


def test_truncated_file_is_refused(pair, tmp_path):
    path, _, _ = pair
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut.gguf: truncated or corrupt GGUF file"):
        models.load_pretrained(cut)


def test_unknown_architecture_is_refused(tmp_path):
    model = models.Llama(_config(300), rngs=nnx.Rngs(0))
    write_gguf(tmp_path / "m.gguf", model, arch="mamba")
    with pytest.raises(ValueError, match=r"unsupported architecture 'mamba': expected one of"):
        models.load_pretrained(tmp_path / "m.gguf")


def test_unsupported_quantization_is_refused(tmp_path):
    model = models.Llama(_config(256), rngs=nnx.Rngs(0))
    write_gguf(tmp_path / "m.gguf", model, types={"ffn_up.weight": Q.MXFP4})
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight' has quantization type MXFP4"):
        models.load_pretrained(tmp_path / "m.gguf")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_text("hello")
    with pytest.raises(ValueError, match=r"x.gguf: not a GGUF file"):
        gguf_io.GGUFFile(f)
    with pytest.raises(
        ValueError, match=r"a file that is not GGUF; expected 'default', a named model"
    ):
        check_model_spec(str(f))


def test_unexpected_tensors_are_refused(tmp_path):
    model = models.Llama(_config(300), rngs=nnx.Rngs(0))
    write_gguf(tmp_path / "m.gguf", model, extra_tensors={"blk.0.ssm_a": np.ones(4)})
    with pytest.raises(ValueError, match=r"unexpected tensors \['blk.0.ssm_a'\]"):
        models.load_pretrained(tmp_path / "m.gguf")


def test_missing_metadata_is_named(tmp_path, monkeypatch):
    model = models.Llama(_config(300), rngs=nnx.Rngs(0))
    write_gguf(tmp_path / "m.gguf", model)
    g = gguf_io.GGUFFile(tmp_path / "m.gguf")
    del g.reader.fields["llama.block_count"]
    with pytest.raises(ValueError, match=r"metadata key 'llama.block_count' is missing"):
        gguf_io.config_from_gguf(g)


def test_unsupported_tokenizers_are_refused(pair, tmp_path):
    model = models.Llama(_config(300), rngs=nnx.Rngs(0))
    write_gguf(tmp_path / "m.gguf", model)
    with pytest.raises(ValueError, match=r"no embedded tokenizer"):
        gguf_io.tokenizer_from_gguf(gguf_io.GGUFFile(tmp_path / "m.gguf"))
    tok = tiny_tokenizer()
    model = models.Llama(_config(tok.get_vocab_size()), rngs=nnx.Rngs(0))
    write_gguf(tmp_path / "p.gguf", model, tokenizer=tok, pre="tekken")
    with pytest.raises(ValueError, match=r"pre-tokenizer 'tekken': expected one of"):
        gguf_io.tokenizer_from_gguf(gguf_io.GGUFFile(tmp_path / "p.gguf"))


def test_qwen2_files_keep_their_rows(tmp_path):
    """llama.cpp permutes Q/K rows of llama models only: a qwen2 file is read as stored."""
    cfg = _config(300, qkv_bias=True)
    model = models.Llama(cfg, rngs=nnx.Rngs(1))
    expected = write_gguf(tmp_path / "q.gguf", model, arch="qwen2")
    loaded = models.load_pretrained(tmp_path / "q.gguf")
    assert loaded.config.qkv_bias
    ids = [5, 9, 2, 7]
    ref = _with_values(models.Llama(cfg, rngs=nnx.Rngs(0)), expected)
    np.testing.assert_allclose(
        np.asarray(loaded(jnp.asarray([ids]))), np.asarray(ref(jnp.asarray([ids]))), atol=1e-5
    )
    assert jax.tree.structure(nnx.state(loaded)) == jax.tree.structure(nnx.state(ref))
