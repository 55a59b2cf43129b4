import dataclasses

import numpy as np
import pytest

import models.record
from jaxkv import cli
from jaxkv.config import HardwareProfile
from jaxkv.sim import simulate as sim
from jaxkv.sim import trace as kvtrace
from models import tiny_model
from models.record import check_writable, model_geometry, record_trace, save_atomic

PROMPT = np.arange(40) % 256


@pytest.fixture(scope="module")
def exact(tiny):
    """6 steps of the tiny model after a 40-token prompt, exact attention, blocks of 8."""
    return record_trace(tiny[0], PROMPT, 6, block_size=8, model_name="tiny", progress=False)


def test_exact_trace_covers_context_and_mass_sums_to_one(exact, tmp_path):
    tr = exact
    assert (tr.steps, tr.num_layers, tr.prompt_len, tr.block_size) == (6, 2, 40, 8)
    for t in range(6):
        n = kvtrace.context_blocks(40, t, 8)
        for layer in range(2):
            assert sorted(tr.ids[t, layer][tr.ids[t, layer] >= 0].tolist()) == list(range(n))
    np.testing.assert_allclose(tr.mass_values.sum(-1), 1.0, rtol=1e-4)
    path = tmp_path / "t.npz"
    save_atomic(path, tr)
    back = kvtrace.load(path)
    np.testing.assert_array_equal(back.ids, tr.ids)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


@pytest.mark.slow  # default suite: about 15 s (CI runs make test-slow)
def test_sparse_trace_reads_fewer_blocks(tiny):
    model, _ = tiny
    tr = record_trace(model, np.arange(64) % 256, 4, sparsity=0.5, block_size=8, progress=False)
    counts = (tr.ids >= 0).sum(-1)
    assert counts.max() <= 5  # ceil(0.5 * 9) blocks of the 9 in context
    np.testing.assert_allclose(tr.mass_values.sum(-1), 1.0, rtol=1e-4)


def test_error_bad_sparsity(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"sparsity must lie in \[0, 1\), got 1.0"):
        record_trace(model, np.arange(10), 2, sparsity=1.0)


def test_cli_missing_prompt_file(capsys, tmp_path):
    rc = cli.main(
        ["trace", "--prompt-file", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "x.npz")]
    )
    assert rc == 2
    assert "nope.txt': file not found" in capsys.readouterr().err
    assert not (tmp_path / "x.npz").exists()


def test_check_writable_creates_nothing(tmp_path):
    check_writable(tmp_path / "a" / "b" / "t.npz")  # folders still to make: fine
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"out='.*t.npz': is a directory, expected a file path"):
        (tmp_path / "t.npz").mkdir()
        check_writable(tmp_path / "t.npz")


def test_trace_stores_the_models_geometry_and_its_tokens(tiny, exact, tmp_path):
    """The geometry counted from the tiny model's state (float32, untied head), the greedy
    tokens of its dense forward, both back from the file; a tied or bf16 model counted so."""
    g = exact.geometry
    assert (g.name, g.num_layers, g.kv_heads, g.head_dim, g.dtype_bytes) == ("tiny", 2, 2, 16, 4)
    # a layer: q, o 64 x 64, k, v 64 x 32, MLP 3 x 64 x 128, two norms of 64 = 36,992
    # parameters; once a step the head (64 x 256) and the final norm (64), spread over 2 layers
    assert g.weight_bytes == 4 * (36_992 + (64 * 256 + 64) / 2)
    assert g.param_bytes == 4 * tiny[0].config.num_params() == 4 * (2 * 36_992 + 2 * 16_384 + 64)
    first = int(np.argmax(np.asarray(tiny[0](PROMPT[None])[0, -1])))  # the prefill's token
    seq = np.concatenate([PROMPT, [first], exact.tokens[:-1]])[None]  # [1, 46] teacher forced
    greedy = np.argmax(np.asarray(tiny[0](seq)[0, 40:]), -1)  # what follows 41 .. 46 tokens
    np.testing.assert_array_equal(exact.tokens, greedy)
    save_atomic(tmp_path / "t.npz", exact, compact=True)
    back = kvtrace.load(tmp_path / "t.npz")
    assert back.geometry == g
    np.testing.assert_array_equal(back.tokens, exact.tokens)
    tied = model_geometry(tiny_model(0, tie_embeddings=True, dtype="bfloat16"), "tied")
    assert tied.dtype_bytes == 2 and tied.param_bytes == 2 * (2 * 36_992 + 16_384 + 64)
    assert tied.weight_bytes == 2 * (36_992 + (256 * 64 + 64) / 2)  # the embedding as head


def test_cli_trace_prints_the_geometry_simulate_then_uses(
    tiny, exact, capsys, monkeypatch, tmp_path
):
    """`jaxkv trace` names the geometry after the model spec, prints it and stores it (the
    module's recording stands in for a second one); `simulate` then costs the file in it."""

    def record(model, ids, steps, **kw):
        assert len(ids) == 40 and steps == 6 and kw["block_size"] == 8
        return dataclasses.replace(
            exact, geometry=dataclasses.replace(exact.geometry, name=kw["model_name"])
        )

    monkeypatch.setattr(models.record, "load_model", lambda spec, **kw: (tiny[0], None))
    monkeypatch.setattr(models.record, "record_trace", record)
    monkeypatch.setattr(models.record, "encode", lambda tokenizer, text, vocab: PROMPT)
    (tmp_path / "p.txt").write_text("a prompt")
    out = str(tmp_path / "t.npz")
    argv = ["trace", "--prompt-file", str(tmp_path / "p.txt"), "--steps", "6", "--compact"]
    assert cli.main([*argv, "--block-size", "8", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "geometry default (what jaxkv simulate costs the trace in): 2 layers, 2 KV heads" in (
        printed
    )
    res = sim.simulate(
        kvtrace.load(out),
        ["static"],
        profile=HardwareProfile.preset("gh200-paper"),
        sparsity=0.5,
        progress=False,
        time_plans=False,
    )
    assert (res["setup"]["geometry"], res["setup"]["geometry_source"]) == ("default", "trace")
    assert res["setup"]["block_bytes"] == 8 * 2 * 2 * 16 * 4  # 8 tokens x K, V x 2 heads x 16
