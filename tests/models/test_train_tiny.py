"""models.train_tiny: a tiny run end to end, and resuming gives the same model."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from models import load_pretrained, load_tokenizer
from models.train_tiny import main

ARGS = (
    "--max-files 20 --vocab 300 --dim 32 --layers 1 --heads 2 --kv-heads 1 --ffn 64 "
    "--steps 6 --long-steps 2 --seq 32 --long-seq 64 --batch-tokens 256 --micro-tokens 128 "
    "--eval-every 4 --eval-tokens 256 --final-eval-tokens 512 --ckpt-every 3 --warmup 2"
).split()


@pytest.mark.slow  # default suite: about 40 s (CI runs make test-slow)
def test_train_resume_and_load(tmp_path):
    full = main(["--out", str(tmp_path / "a"), *ARGS])
    assert main(["--out", str(tmp_path / "b"), *ARGS, "--stop-after", "5"]) == {"stopped_at": 5}
    resumed = main(["--out", str(tmp_path / "b"), "--resume"])
    assert resumed == full
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["steps"] == 8
    a = load_pretrained(tmp_path / "a" / "model")
    b = load_pretrained(tmp_path / "b" / "model")
    tokens = jnp.asarray(load_tokenizer(tmp_path / "a" / "model").encode("import os\n").ids)[None]
    np.testing.assert_array_equal(np.asarray(a(tokens)), np.asarray(b(tokens)))
    assert np.isfinite(full["seq64"]["heldout_bpb"]) and a.config.max_seq_len == 64


def test_refuses_to_overwrite_and_resume_without_run(tmp_path):
    with pytest.raises(ValueError, match="run.json not found: expected a started run"):
        main(["--out", str(tmp_path), "--resume"])
    (tmp_path / "ckpt.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="ckpt.npz exists: pass --resume"):
        main(["--out", str(tmp_path), *ARGS])
