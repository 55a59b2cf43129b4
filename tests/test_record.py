import numpy as np
import pytest

from jaxkv import cli
from jaxkv.sim import trace as kvtrace
from models.record import check_writable, record_trace, save_atomic


def test_exact_trace_covers_context_and_mass_sums_to_one(tiny, tmp_path):
    model, _ = tiny
    prompt = np.arange(40) % 256
    tr = record_trace(model, prompt, 6, block_size=8, progress=False)
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
