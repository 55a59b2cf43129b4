"""The one table of model shapes (`jaxkv.cost.ARCHITECTURES`): the cost geometries and the
benchmarks' model shapes come from it, with the values they had when typed out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jaxkv import cost

ROOT = Path(__file__).resolve().parents[1]


def test_llama3_8b_geometry_is_the_one_typed_before():
    """The geometry derived from the table equals the literal it replaced (bit-identical cost
    figures): 2 x (2 d^2 + 2 d x 1024 + 3 d x 14336) bytes of weights per layer, 2 x 8.03e9 in
    all."""
    d = 4096
    g = cost.get_geometry("llama3-8b")
    assert g == cost.Geometry(
        "llama3-8b", 32, 8, 128, 2, 2.0 * (2 * d * d + 2 * d * 1024 + 3 * d * 14336), 2.0 * 8.03e9
    )
    assert cost.ARCHITECTURES["llama3-8b"].layer_params == 218_103_808
    assert g.token_bytes == 4096


def test_every_architecture_gives_its_geometry_and_llama_fields():
    for name, arch in cost.ARCHITECTURES.items():
        assert arch.name == name
        g = arch.geometry(4)
        assert (g.num_layers, g.kv_heads, g.head_dim, g.dtype_bytes) == (
            arch.num_layers,
            arch.num_kv_heads,
            arch.head_dim,
            4,
        )
        assert g.weight_bytes == 4.0 * arch.layer_params and g.param_bytes == 4.0 * arch.params
        f = arch.llama_fields()
        assert f["num_layers"] == arch.num_layers and f["vocab_size"] == arch.vocab_size
        assert f.get("tie_embeddings", False) == arch.tie_embeddings
    assert cost.get_geometry("smollm2-135m") == cost.ARCHITECTURES["smollm2-135m"].geometry(2)


@pytest.mark.parametrize("module", ["bench_decode", "gpu_ops"])
def test_the_benchmarks_8b_shape_comes_from_the_table(module, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    mod = __import__(module)
    shape = mod.SHAPES["8b"] if module == "bench_decode" else mod.LLAMA_8B
    want = cost.ARCHITECTURES["llama3-8b"].llama_fields()
    assert {k: v for k, v in shape.items() if k != "dtype"} == {
        k: v for k, v in want.items() if k in shape
    }
    assert "num_layers" in shape or module == "gpu_ops"  # gpu_ops sets the layers per program
    assert sys.modules[module] is mod


def test_no_module_types_a_table_shape_again():
    """The table's widths (ffn 14336 / 28672, vocab 128256) appear as numbers in code only in
    jaxkv/cost.py (docstrings and comments may name them)."""
    import io
    import tokenize

    widths = {14336, 28672, 128256}
    hits = []
    for folder in ("jaxkv", "bench", "models"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "jaxkv" / "cost.py":
                continue
            toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            for tok in toks:
                text = tok.string.replace("_", "")
                if tok.type == tokenize.NUMBER and text.isdigit() and int(text) in widths:
                    hits.append(f"{path.relative_to(ROOT)}:{tok.start[0]}")
    assert hits == [], hits
