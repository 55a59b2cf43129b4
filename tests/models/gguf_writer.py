"""Test helpers: a tiny byte-level BPE tokenizer and a writer of `models.Llama` as GGUF, laid
out as llama.cpp's convert_hf_to_gguf.py lays it out (Q/K rows permuted, [out, in] rows)."""

from __future__ import annotations

import json

import gguf
import numpy as np
from flax import nnx

from models import gguf_io
from models.hf import _tensor_names

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant"
    "\n' }}{% endif %}"
)
TEXT = (
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nThe 3 quick brown foxes "
    "jumped over 12,345 lazy dogs; they're fast, aren't they? Ünïcödé and emoji 🦊 too.\n"
) * 20


def tiny_tokenizer(vocab_size: int = 400):
    """A byte-level BPE (digits split one by one, as SmolLM's) trained on TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    return tok


def write_gguf(
    path,
    model,
    *,
    tokenizer=None,
    types: dict | None = None,
    arch: str = "llama",
    extra_tensors: dict | None = None,
    pre: str = "smollm",
) -> dict:
    """Writes `model` as GGUF; `types` maps a GGUF tensor-name suffix ("attn_q.weight",
    "token_embd.weight", ...) to a GGMLQuantizationType (default F32). Returns the Hugging Face
    name -> the values a faithful reader must give back (dequantized, unpermuted)."""
    Q = gguf.GGMLQuantizationType
    types = types or {}
    mc = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(mc.num_layers)
    w.add_context_length(mc.max_seq_len)
    w.add_embedding_length(mc.dim)
    w.add_feed_forward_length(mc.ffn_dim)
    w.add_head_count(mc.num_heads)
    w.add_head_count_kv(mc.num_kv_heads)
    w.add_layer_norm_rms_eps(mc.norm_eps)
    w.add_rope_freq_base(mc.rope_theta)
    w.add_vocab_size(mc.vocab_size)
    if mc.head_dim != mc.dim // mc.num_heads:
        w.add_key_length(mc.head_dim)
        w.add_value_length(mc.head_dim)
    if tokenizer is not None:
        spec = json.loads(tokenizer.to_str())
        vocab = spec["model"]["vocab"]
        tokens = [None] * len(vocab)
        for t, i in vocab.items():
            tokens[i] = t
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(vocab["<|im_start|>"])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    expected = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        a = np.asarray(var[...], np.float32)
        for i, (name, transpose) in enumerate(_tensor_names(p, mc.num_layers)):
            x = a[i] if p[0] == "layers" else a
            x = np.ascontiguousarray(x.T if transpose else x)  # Hugging Face [out, in]
            gname = gguf_io.hf_to_gguf_name(name)
            qtype = next((t for s, t in types.items() if gname.endswith(s)), Q.F32)
            if arch == "llama" and gname.endswith("attn_q.weight"):
                stored = gguf_io.permute_qk(x, mc.num_heads)
            elif arch == "llama" and gname.endswith("attn_k.weight"):
                stored = gguf_io.permute_qk(x, mc.num_kv_heads)
            else:
                stored = x
            q = gguf.quants.quantize(stored, qtype)
            back = gguf.quants.dequantize(q, qtype).reshape(x.shape).astype(np.float32)
            if arch == "llama" and gname.endswith("attn_q.weight"):
                back = gguf_io.unpermute_qk(back, mc.num_heads)
            elif arch == "llama" and gname.endswith("attn_k.weight"):
                back = gguf_io.unpermute_qk(back, mc.num_kv_heads)
            expected[name] = back
            w.add_tensor(gname, q, raw_dtype=qtype)
    for gname, arr in (extra_tensors or {}).items():
        w.add_tensor(gname, np.asarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
