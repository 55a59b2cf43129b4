"""Hugging Face loader: logits and greedy tokens against transformers fixtures, and errors."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import (
    Llama,
    eos_token_ids,
    init_dense_kv,
    load_config,
    load_pretrained,
    load_tokenizer,
    make_dense_attend,
    save_pretrained,
    tiny_model,
)

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ["llama2", "llama3", "llama31", "llama32", "mistral", "qwen2", "qwen2_sliding"]


def _reference(name):
    with np.load(FIXTURES / name / "reference.npz") as z:
        return {k: z[k] for k in z.files}


def _greedy_forward(model, prompt, n):
    """Greedy continuation with the cache-free forward at one fixed padded shape."""
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    seq = np.zeros((1, len(prompt) + n), np.int32)
    seq[0, : len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        seq[0, t] = np.argmax(np.asarray(fwd(state, jnp.asarray(seq)))[0, t - 1])
    return seq[0, len(prompt) :], np.asarray(fwd(state, jnp.asarray(seq)))[0, :-1]


def _greedy_decode(model, prompt, n):
    """Greedy continuation through decode_step with the dense reference attend."""
    graphdef, state = nnx.split(model)
    attend = make_dense_attend(model.config)
    step = jax.jit(
        lambda s, tok, kv: nnx.merge(graphdef, s).decode_step(tok, kv.lengths, attend, kv)
    )
    kv = init_dense_kv(model.config, 1, len(prompt) + n)
    out = []
    for tok in prompt:
        logits, kv = step(state, jnp.array([tok], jnp.int32), kv)
    for _ in range(n):
        tok = int(np.argmax(np.asarray(logits)[0]))
        out.append(tok)
        logits, kv = step(state, jnp.array([tok], jnp.int32), kv)
    return np.array(out)


@pytest.mark.parametrize("name", NAMES)
def test_matches_transformers(name):
    ref = _reference(name)
    model = load_pretrained(FIXTURES / name)
    tokens, logits = _greedy_forward(model, ref["prompt"], len(ref["continuation"]))
    np.testing.assert_array_equal(tokens, ref["continuation"])
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(
        _greedy_decode(model, ref["prompt"], len(ref["continuation"])), ref["continuation"]
    )


def test_configs_translate():
    c = load_config(FIXTURES / "llama31")
    assert c.rope_scaling is not None and c.rope_scaling.original_max_position_embeddings == 64
    assert load_config(FIXTURES / "llama32").tie_embeddings
    q = load_config(FIXTURES / "qwen2")
    assert q.qkv_bias and not q.o_bias and q.tie_embeddings and q.rope_theta == 1e6
    assert load_config(FIXTURES / "llama2").num_kv_heads == 4
    assert load_pretrained(FIXTURES / "llama32").lm_head is None


def test_transformers4_style_config(tmp_path):
    """rope_theta + rope_scaling at top level (transformers 4) loads the same model."""
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama31", folder)
    cfg = json.loads((folder / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_config(folder) == load_config(FIXTURES / "llama31")


def test_tokenizer_and_eos():
    tok = load_tokenizer(FIXTURES / "llama3")
    assert tok.encode("w1 w5 w95").ids == [1, 5, 95]
    assert eos_token_ids(FIXTURES / "llama3") == (2,)
    assert eos_token_ids(FIXTURES / "qwen2") == ()


def test_save_load_roundtrip_bf16(tmp_path):
    m = tiny_model(seed=3, dtype="bfloat16")
    save_pretrained(m, tmp_path, eos_token_id=7)
    m2 = load_pretrained(tmp_path, dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(nnx.state(m)), jax.tree.leaves(nnx.state(m2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert eos_token_ids(tmp_path) == (7,)


# ------------------------------------------------------------------------------------- errors
def _copy(tmp_path, name="llama3"):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    return folder


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_error_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="nope: not found .expected a Hugging Face checkpoint"):
        load_pretrained(tmp_path / "nope")
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(ValueError, match="file.bin: not a directory or a GGUF file"):
        load_pretrained(tmp_path / "file.bin")


def test_error_missing_config(tmp_path):
    folder = _copy(tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json: file not found"):
        load_pretrained(folder)


def test_error_missing_weights(tmp_path):
    folder = _copy(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors file found"):
        load_pretrained(folder)


def test_error_missing_shard(tmp_path):
    folder = _copy(tmp_path, "llama2")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: file not found"):
        load_pretrained(folder)


def test_error_corrupt_tokenizer(tmp_path):
    folder = _copy(tmp_path, "llama3")
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a readable tokenizer \("):
        load_tokenizer(folder)


def test_error_missing_tokenizer(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer\.json: file not found"):
        load_tokenizer(FIXTURES / "qwen2")


def test_error_unsupported_architecture(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        load_pretrained(folder)


def test_error_unsupported_rope(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        load_pretrained(folder)


def test_error_activation(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu': expected 'silu'"):
        load_pretrained(folder)


def test_sliding_windows_translate(tmp_path):
    """Mistral slides in every layer; Qwen2 only with use_sliding_window, in the layers its
    layer_types mark (by default from max_window_layers on)."""
    m = load_config(FIXTURES / "mistral")
    assert m.sliding_window == 14 and m.layer_windows() == (14, 14)
    q = load_config(FIXTURES / "qwen2_sliding")
    assert q.sliding_window == 5 and q.layer_windows() == (0, 5)
    assert load_config(FIXTURES / "qwen2").sliding_window is None
    folder = _copy(tmp_path, "qwen2_sliding")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["layer_types"]  # a transformers 4 config: max_window_layers decides
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_config(folder).layer_windows() == (0, 5)
    _edit_config(folder, max_window_layers=0)
    assert load_config(folder).layer_windows() == (5, 5)
    _edit_config(folder, use_sliding_window=False)
    assert load_config(folder).sliding_window is None
    _edit_config(folder, use_sliding_window=True, layer_types=["full_attention", "local"])
    with pytest.raises(ValueError, match=r"layer_types=\['full_attention', 'local'\]: expect"):
        load_config(folder)


@pytest.mark.parametrize("name", ["mistral", "qwen2_sliding"])
def test_the_window_matters(name):
    """The sliding-window fixtures' sequences outgrow their windows: without the window the
    greedy tokens differ from transformers' (so the window tests above can fail)."""
    ref = _reference(name)
    model = load_pretrained(FIXTURES / name)
    graphdef, state = nnx.split(model)
    c = dataclasses.replace(model.config, sliding_window=None, sliding_layers=None)
    unwindowed = nnx.merge(nnx.split(Llama(c, rngs=nnx.Rngs(0)))[0], state)
    tokens, _ = _greedy_forward(unwindowed, ref["prompt"], len(ref["continuation"]))
    assert (tokens != ref["continuation"]).any()


def test_error_shape_mismatch(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, intermediate_size=48)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has shape "
        r"\(32, 64\): expected \(32, 48\) from config\.json",
    ):
        load_pretrained(folder)


def test_error_missing_tensor(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.2\.[a-z_.]+' not found"):
        load_pretrained(folder)


def test_error_unexpected_tensors(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.1\."):
        load_pretrained(folder)


def test_error_truncated_safetensors(tmp_path):
    folder = _copy(tmp_path)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated safetensors file: tensor"):
        load_pretrained(folder)


def test_error_truncated_header(tmp_path):
    folder = _copy(tmp_path)
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:50])
    with pytest.raises(ValueError, match="truncated or corrupt safetensors file: header length"):
        load_pretrained(folder)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=r"truncated safetensors file \(2 bytes\)"):
        load_pretrained(folder)


def test_error_corrupt_header(tmp_path):
    folder = _copy(tmp_path)
    f = folder / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8] = ord("!")
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        load_pretrained(folder)


def test_default_model_falls_back_or_loads():
    from models import default_model, has_trained_default

    model, tok = default_model()
    if has_trained_default():
        assert tok is not None and model.config.max_seq_len >= 2048
    else:
        assert tok is None and model.config == tiny_model().config


def test_llama3_rope_without_original_context_uses_max_position_embeddings(tmp_path):
    """As transformers: a llama3 rope_scaling without original_max_position_embeddings falls
    back to the config's max_position_embeddings (it was a bare KeyError)."""
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama31", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"].pop("original_max_position_embeddings")
    (folder / "config.json").write_text(json.dumps(cfg))
    c = load_config(folder)
    assert c.rope_scaling.original_max_position_embeddings == cfg["max_position_embeddings"]
    cfg.pop("max_position_embeddings")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'llama3' needs 'original_max_position_embeddings'"):
        load_config(folder)
    cfg["rope_parameters"].pop("low_freq_factor")
    cfg["max_position_embeddings"] = 128
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"rope type 'llama3' needs 'low_freq_factor'"):
        load_config(folder)
