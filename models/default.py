"""The default model: the trained checkpoint shipped under models/assets/default/ when present
(written by models/train_tiny.py), else the tiny random-init model."""

from __future__ import annotations

from pathlib import Path

from models.hf import load_pretrained, load_tokenizer
from models.llama import Llama
from models.tiny import tiny_model

ASSET_DIR = Path(__file__).resolve().parent / "assets" / "default"


def has_trained_default() -> bool:
    """Whether the trained default checkpoint ships with this install."""
    return (ASSET_DIR / "config.json").is_file()


def default_model(*, dtype: str = "float32"):
    """(model, tokenizer): the shipped trained model and its ``tokenizers.Tokenizer``, or
    ``(tiny_model(), None)`` until the trained checkpoint ships."""
    if has_trained_default():
        return load_pretrained(ASSET_DIR, dtype=dtype), load_tokenizer(ASSET_DIR)
    model: Llama = tiny_model(dtype=dtype)
    return model, None
