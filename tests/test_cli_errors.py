"""The command line's error messages: one test per message, each checked before any model is
loaded, any trace is read or any step is run (exit status 2, the message on its own line)."""

import json
import os

import numpy as np
import pytest

import models.demo
import models.generate
import models.record
from jaxkv import cli
from jaxkv.placement import presets
from jaxkv.sim import cli as simulate_cli
from jaxkv.sim import trace as tr


@pytest.fixture
def no_work(monkeypatch):
    """Every way a command could start real work fails the test."""

    def fail(*args, **kwargs):
        pytest.fail("the command started work before checking its options")

    monkeypatch.setattr(simulate_cli, "simulate", fail)
    monkeypatch.setattr(tr, "load", fail)
    monkeypatch.setattr(models.generate, "load_model", fail)
    monkeypatch.setattr(models.record, "load_model", fail)
    monkeypatch.setattr(models.demo, "load_model", fail)


def error(capsys, argv) -> str:
    """Runs `jaxkv argv`, asserts exit status 2, returns the error line."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"jaxkv {argv[0]}: error: "), err
    return line


# --------------------------------------------------------------------------- jaxkv simulate


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--window", "0", "--window=0: expected an integer >= 1"),
        ("--oracle-window", "0", "--oracle-window=0: expected an integer >= 1"),
        ("--now-window", "0", "--now-window=0: expected an integer >= 1"),
        ("--dual-window", "0", "--dual-window=0: expected an integer >= 1"),
        ("--follow-window", "0", "--follow-window=0: expected an integer >= 1"),
        ("--chunk", "0", "--chunk=0: expected an integer >= 1"),
        ("--chunk", "-1", "--chunk=-1: expected an integer >= 1"),
        ("--interval", "0", "--interval=0: expected an integer >= 1"),
        ("--seed", "-1", "--seed=-1: expected an integer in [0, 4294967295]"),
        ("--hbm-gb", "nan", "--hbm-gb=nan: expected a finite number > 0"),
        ("--hbm-gb", "inf", "--hbm-gb=inf: expected a finite number > 0"),
        ("--discount", "nan", "--discount=nan: expected a finite number in (0, 1]"),
        ("--oracle-discount", "0", "--oracle-discount=0.0: expected a finite number in (0, 1]"),
        ("--demote-cost", "-1", "--demote-cost=-1.0: expected a finite number >= 0"),
        ("--now-spread", "inf", "--now-spread=inf: expected a finite number >= 0"),
        ("--oracle-tail", "-1", "--oracle-tail=-1: expected an integer >= 0"),
        ("--ride", "2", "--ride=2.0: expected a finite number in [0, 1]"),
        ("--capacity-blocks", "-1", "--capacity-blocks=-1: expected an integer >= 0"),
        ("--hbm-fraction", "0", "--hbm-fraction=0.0: expected a finite number in (0, 1]"),
        ("--batch", "0", "--batch=0: expected an integer >= 1"),
        ("--sparsity", "nan", "--sparsity=nan: expected a finite number in [0, 1)"),
        ("--chains", "0", "--chains=0: expected an integer >= 1"),
        ("--prompt-len", "-5", "--prompt-len=-5: expected an integer >= 0"),
        ("--layers", "0", "--layers=0: expected an integer >= 1"),
        ("--block-size", "0", "--block-size=0: expected an integer >= 1"),
        ("--profile", "tpu", "--profile='tpu': unknown hardware profile 'tpu'"),
        ("--geometry", "gpt", "--geometry='gpt': unknown geometry 'gpt'; expected one of"),
        ("--geometry", "trace", "--geometry='trace': a synthetic trace carries no geometry"),
        ("--policies", ",", "--policies=',': expected comma-separated policy names"),
        ("--policies", "lru-plan+aw", "--policies: policy 'lru-plan+aw': modifiers (+aw) apply to"),
        ("--policies", "static,paper-sa[10,0.5", "--policies='static,paper-sa[10,0.5': unbalanced"),
        ("--policies", "lru-plan,paper-sa[0,0.5]", "policy 'paper-sa[0,0.5]': expected paper-sa[W,R]"),
        ("--trace", "synthetic:zipf", "--trace='synthetic:zipf': unknown synthetic trace 'zipf'"),
    ],
)
def test_simulate_option_checked_first(capsys, no_work, option, value, expected):
    line = error(capsys, ["simulate", "--no-progress", option, value])
    assert expected in line


def test_simulate_refuses_sizes_with_a_file_trace(capsys, no_work, tmp_path):
    """--prompt-len / --steps / --layers / --block-size size synthetic traces only: with a file
    trace they were silently ignored."""
    argv = ["simulate", "--trace", str(tmp_path / "t.npz"), "--steps", "10", "--layers", "2"]
    assert "--steps, --layers size synthetic traces only; drop them" in error(capsys, argv)
    argv = ["simulate", "--trace", str(tmp_path / "t.npz"), "--block-size", "4"]
    assert "--block-size sizes synthetic traces only; drop it" in error(capsys, argv)


@pytest.mark.parametrize(
    "other, named",
    [(["--capacity-blocks", "8"], "--capacity-blocks=8"), (["--hbm-gb", "24"], "--hbm-gb=24.0")],
)
def test_simulate_hbm_fraction_alone_sizes_the_pool(capsys, no_work, other, named):
    line = error(capsys, ["simulate", "--hbm-fraction", "0.5", *other])
    assert f"--hbm-fraction=0.5 and {named} both size the HBM pool: expected one of" in line


def test_simulate_geometry_trace_needs_one_in_the_file(capsys, monkeypatch, tmp_path):
    """--geometry trace on a version-1 file: named once the file is read, before any step."""
    monkeypatch.setattr(simulate_cli, "simulate", lambda *a, **k: pytest.fail("simulated"))
    argv = ["simulate", "--trace", _write_npz(tmp_path / "t.npz"), "--geometry", "trace"]
    assert "--geometry='trace': the trace 'file' carries no geometry" in error(capsys, argv)


def test_simulate_refuses_what_cannot_fit_in_memory(capsys, monkeypatch):
    """A prompt of 2e9 tokens ran for seconds and ended in XLA's out-of-memory error."""
    monkeypatch.setattr("jaxkv.sim.simulate.init_state", lambda *a: pytest.fail("allocated"))
    line = error(capsys, ["simulate", "--no-progress", "--prompt-len", "2000000000"])
    assert "the simulation needs at least" in line
    assert "32 layers x 125,000,016 blocks" in line and "but this machine has" in line


def _write_npz(path, **over):
    f = dict(
        version=np.int64(1),
        prompt_len=np.int64(8),
        block_size=np.int64(4),
        ids=np.tile(np.arange(2, dtype=np.int32), (3, 2, 1)),  # blocks 0 and 1 at each step
        mass=np.ones((3, 2, 2), np.float32),
    )
    f.update(over)
    np.savez(path, **f)
    return str(path)


def test_simulate_trace_file_problems(capsys, tmp_path):
    """Each way a --trace file can be unreadable is one clear line (they were tracebacks)."""
    good = _write_npz(tmp_path / "good.npz")
    data = open(good, "rb").read()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    np.save(tmp_path / "arr.npy", np.zeros(3))
    (tmp_path / "dir.npz").mkdir()
    (text := tmp_path / "text.npz").write_text("hello world\n")  # read as pickled data
    (empty := tmp_path / "empty.npz").write_bytes(b"")
    cases = {
        str(tmp_path / "none.npz"): "none.npz': file not found",
        str(tmp_path / "dir.npz"): "dir.npz': is a directory, expected a .npz file",
        str(tmp_path / "cut.npz"): "cut.npz': not a readable .npz archive (BadZipFile",
        str(tmp_path / "arr.npy"): "arr.npy': holds a single array (.npy), expected a .npz",
        _write_npz(tmp_path / "s.npz", mass=np.full((3, 2, 2), "1.0")): (
            "field 'mass' has dtype <U3, expected a real floating-point dtype"
        ),
        _write_npz(tmp_path / "c.npz", mass=np.ones((3, 2, 2), np.complex64)): (
            "field 'mass' has dtype complex64, expected a real floating-point dtype"
        ),
        _write_npz(tmp_path / "p.npz", prompt_len=np.array([8, 9])): (
            "field 'prompt_len' has shape (2,), expected a scalar"
        ),
        _write_npz(tmp_path / "f.npz", prompt_len=np.float64(40.7)): (
            "field 'prompt_len' is 40.7 of dtype float64, expected an integer"
        ),
        _write_npz(tmp_path / "v.npz", version=np.str_("one")): (
            "field 'version' is 'one' of dtype <U3, expected an integer"
        ),
        _write_npz(tmp_path / "o.npz", name=np.array(["a", None], object)): (
            "field 'name' is an object array (pickled Python objects)"
        ),
        str(text): "text.npz': not an .npz archive (the file starts with b'hello ', not a zip",
        str(empty): "empty.npz': not an .npz archive (the file is empty): expected a .npz of",
        _write_npz(tmp_path / "big.npz", prompt_len=np.int64(10**12)): (
            "field 'prompt_len' is 1000000000000: with 3 steps the positions pass 2147483647"
        ),
    }
    for path, expected in cases.items():
        argv = ["simulate", "--no-progress", "--policies", "static", "--trace", path]
        assert expected in error(capsys, argv), path


def test_simulate_refuses_a_file_trace_that_cannot_fit(capsys, monkeypatch, tmp_path):
    """A recorded trace whose context is too long for memory is refused before allocating."""
    monkeypatch.setattr("jaxkv.sim.simulate.init_state", lambda *a: pytest.fail("allocated"))
    path = _write_npz(
        tmp_path / "long.npz",
        prompt_len=np.int64(2_000_000_000),
        block_size=np.int64(1),
        ids=np.zeros((2, 64, 1), np.int32),
        mass=np.ones((2, 64, 1), np.float32),
    )
    line = error(capsys, ["simulate", "--no-progress", "--policies", "static", "--trace", path])
    assert "the simulation needs at least" in line and "64 layers x 2,000,000,002 blocks" in line


# --------------------------------------------------------------------------- jaxkv generate


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--max-new-tokens", "-3"], "--max-new-tokens=-3: expected an integer >= 1"),
        (["--temperature", "nan"], "--temperature=nan: expected a finite number >= 0"),
        (["--temperature", "1", "--top-k", "0"], "--top-k=0: expected an integer >= 1"),
        (["--temperature", "1", "--top-p", "0"], "--top-p=0.0: expected a finite number in (0, 1]"),
        (["--top-k", "5"], "--top-k truncates sampling, but --temperature=0 decodes greedily"),
        (["--hbm-fraction", "1.5"], "--hbm-fraction=1.5: expected a finite number in (0, 1]"),
        (["--hbm-blocks", "0"], "--hbm-blocks=0: expected an integer >= 1"),
        (["--hbm-bytes", "0.5"], "--hbm-bytes=0.5: expected a finite number >= 1"),
        (["--hbm-bytes", "nan"], "--hbm-bytes=nan: expected a finite number >= 1"),
        (["--seed", "-1"], "--seed=-1: expected an integer in [0, 4294967295]"),
        (
            ["--model", "/nonexistent/ckpt"],
            "--model='/nonexistent/ckpt': not found (nor a named model); expected",
        ),
    ],
)
def test_generate_option_checked_first(capsys, no_work, args, expected):
    assert expected in error(capsys, ["generate", "--prompt", "x", *args])


def test_generate_unlimited_suggests_only_live_policies(capsys, no_work):
    """It suggested 'anneal-oracle', which the decode loop rejects in turn."""
    line = error(capsys, ["generate", "--prompt", "x", "--policy", "unlimited"])
    assert "--policy='unlimited': the Unlimited-HBM bound, not a placement" in line
    assert f"one of {presets.names(online_only=True)}" in line
    assert "oracle" not in line.split("not a placement")[1]


def test_generate_oracle_policy_refused(capsys, no_work):
    line = error(capsys, ["generate", "--prompt", "x", "--policy", "anneal-oracle"])
    assert "--policy='anneal-oracle': plans from perfect knowledge of future reads" in line


def test_generate_plus_now_points_to_follow(capsys, no_work):
    """`lru+now` explained +aw / +ec; +now is not in the decode loop, +follow is."""
    line = error(capsys, ["generate", "--prompt", "x", "--policy", "lru-plan+now"])
    assert "--policy='lru-plan+now': +now plans with the step's own read set" in line
    assert "use e.g. 'lrfu'" in line
    line = error(capsys, ["generate", "--prompt", "x", "--policy", "anneal+now"])
    assert "use e.g. 'anneal+follow'" in line


def test_generate_unknown_policy_lists_live_ones(capsys, no_work):
    line = error(capsys, ["generate", "--prompt", "x", "--policy", "nope"])
    assert "--policy='nope': unknown policy 'nope'; expected an online policy" in line


def test_generate_config_json_list(capsys, tmp_path):
    """A config.json holding a JSON list was an AttributeError."""
    (tmp_path / "config.json").write_text("[1, 2]")
    line = error(capsys, ["generate", "--prompt", "x", "--model", str(tmp_path)])
    assert "config.json: holds a JSON list, expected a JSON object" in line


def test_generate_corrupt_tokenizer(capsys, monkeypatch, tmp_path):
    """A corrupt tokenizer.json raised tokenizers' bare Exception; it is read before weights."""
    monkeypatch.setattr(models.generate, "load_pretrained", lambda *a: pytest.fail("loaded"))
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    line = error(capsys, ["generate", "--prompt", "x", "--model", str(tmp_path)])
    assert "tokenizer.json: not a readable tokenizer (Exception: " in line


# --------------------------------------------------------------------------- model files


def _checkpoint(tmp_path, weights: bytes):
    from models.default import ASSET_DIR

    (tmp_path / "config.json").write_text((ASSET_DIR / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(weights)
    return tmp_path


def test_safetensors_git_lfs_pointer(capsys, tmp_path):
    """A git-lfs pointer reported a header length of about 2e18 bytes."""
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 9437184\n"
    folder = _checkpoint(tmp_path, pointer)
    line = error(capsys, ["generate", "--prompt", "x", "--model", str(folder)])
    assert "model.safetensors: a git-lfs pointer (" in line and "`git lfs pull`" in line


def test_safetensors_garbage(capsys, tmp_path):
    folder = _checkpoint(tmp_path, bytes(range(256)) * 20)
    line = error(capsys, ["generate", "--prompt", "x", "--model", str(folder)])
    assert "model.safetensors: not a safetensors file: expected an 8-byte header length" in line


def test_safetensors_header_not_an_object(tmp_path):
    from models.safetensors_io import SafetensorsFile

    raw = b"[1, 2, 3]"
    (tmp_path / "m.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(ValueError, match="corrupt safetensors header: a JSON list, expected"):
        SafetensorsFile(tmp_path / "m.safetensors")
    raw = json.dumps({"w": {"dtype": "F32", "shape": [2]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(ValueError, match="tensor 'w' has a bad shape or data_offsets"):
        SafetensorsFile(tmp_path / "m.safetensors")


# --------------------------------------------------------------------------- jaxkv trace


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("def main():\n    pass\n")
    return str(path)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--prompt-tokens", "-5"], "--prompt-tokens=-5: expected an integer >= 0"),
        (["--steps", "0"], "--steps=0: expected an integer >= 1"),
        (["--sparsity", "1"], "--sparsity=1.0: expected a finite number in [0, 1)"),
        (["--block-size", "0"], "--block-size=0: expected an integer >= 1"),
    ],
)
def test_trace_option_checked_first(capsys, no_work, prompt_file, tmp_path, args, expected):
    argv = ["trace", "--prompt-file", prompt_file, "--out", str(tmp_path / "t.npz"), *args]
    assert expected in error(capsys, argv)


def test_trace_empty_prompt_file(capsys, no_work, tmp_path):
    (path := tmp_path / "empty.txt").write_text("\n")
    argv = ["trace", "--prompt-file", str(path), "--out", str(tmp_path / "t.npz")]
    assert f"--prompt-file {str(path)!r}: the file is empty: expected the prompt" in error(
        capsys, argv
    )


def test_record_empty_prompt_says_so(tiny):
    """It named an internal variable: `prompt_ids has shape (0,)`."""
    with pytest.raises(ValueError, match=r"^the prompt is empty \(0 tokens\): expected at least"):
        models.record.record_trace(tiny[0], [], 3)


def test_trace_out_not_writable(capsys, no_work, prompt_file, tmp_path, monkeypatch):
    """--out was only written after the whole recording, so a bad path lost it."""
    argv = ["trace", "--prompt-file", prompt_file, "--out"]
    line = error(capsys, [*argv, prompt_file + "/t.npz"])
    assert "prompt.txt' is a file, so no folder can be made there" in line
    line = error(capsys, [*argv, str(tmp_path)])
    assert f"--out={str(tmp_path)!r}: is a directory, expected a file path" in line
    monkeypatch.setattr(os, "access", lambda *a: False)  # a read-only tree (root ignores modes)
    line = error(capsys, [*argv, str(tmp_path / "ro" / "t.npz")])
    assert f"the folder {str(tmp_path)!r} is not writable" in line


# --------------------------------------------------------------------------- jaxkv demo


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--hbm-fraction", "1.5"], "--hbm-fraction=1.5: expected a finite number in (0, 1]"),
        (["--hbm-blocks", "0"], "--hbm-blocks=0: expected an integer >= 1"),
        (["--hbm-bytes", "0.5"], "--hbm-bytes=0.5: expected a finite number >= 1"),
        (["--hbm-bytes", "nan"], "--hbm-bytes=nan: expected a finite number >= 1"),
        (["--new-tokens", "2"], "--new-tokens=2: expected an integer >= 3 (one sampled at"),
        (["--prompt-len", "0"], "--prompt-len=0: expected an integer >= 1"),
        (["--window", "0"], "--window=0: expected an integer >= 1"),
        (["--profile", "tpu"], "--profile='tpu': unknown hardware profile; expected one of"),
        (["--policies", ","], "--policies=',': expected comma-separated policy names"),
        (["--policies", "static,nope"], "--policies='nope': unknown policy 'nope'"),
        (["--policies", "lru-plan+now"], "--policies='lru-plan+now': +now plans with the step's own"),
    ],
)
def test_demo_option_checked_first(capsys, no_work, args, expected):
    """--hbm-fraction 1.5 failed after the all-HBM run, printed inside the progress bar."""
    line = error(capsys, ["demo", *args])
    assert expected in line and "decoding" not in line


@pytest.mark.parametrize("command", [["demo"], ["generate", "--prompt", "x"]])
def test_one_hbm_capacity(capsys, no_work, command):
    """--hbm-fraction, --hbm-blocks and --hbm-bytes say the same thing: one of them."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--hbm-blocks", "4", "--hbm-fraction", "0.5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --hbm-fraction: not allowed with argument --hbm-blocks" in err


def test_demo_plot_path_checked_first(capsys, no_work, tmp_path, monkeypatch):
    """--plot /unwritable/x.png decoded for minutes, then died with a PermissionError."""
    folder = tmp_path / "figs"
    folder.mkdir()
    line = error(capsys, ["demo", "--plot", str(folder)])
    assert f"--plot={str(folder)!r}: is a directory" in line
    monkeypatch.setattr(os, "access", lambda *a: False)  # a read-only folder (root ignores modes)
    line = error(capsys, ["demo", "--plot", str(folder / "demo.png")])
    assert f"the folder {str(folder)!r} is not writable" in line
    assert "decoding" not in line
