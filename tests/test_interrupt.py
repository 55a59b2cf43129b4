"""Ctrl-C ends a `jaxkv` command with exit status 130, one line on stderr and no half-written
output file (`jaxkv.cli`): whether the main thread is in Python (KeyboardInterrupt) or stuck
in a device computation that sees no signal until it returns (the watchdog)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# first in every child: Python's own SIGINT handler. A test run started in the background
# (`cmd &`, nohup) passes SIGINT ignored to its children, and Python leaves an ignored SIGINT
# ignored: the child would not see the Ctrl-C these tests send. (Not preexec_fn: a fork of
# the multithreaded test process that runs Python before exec can deadlock.)
SIGINT_HANDLER = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


# `jaxkv demo` with its long stage replaced: it opens the figure's output, writes part of it,
# (with "bar": draws a progress bar it holds, left mid-line as tqdm leaves one), says "ready",
# then waits in Python (sleep) or in a device computation (a jitted loop that runs for
# minutes: native code, where no signal is seen)
SCRIPT = """
import sys, time
import jax, jax.numpy as jnp
import models.demo as demo
from jaxkv import cli

def busy():
    def body(c):
        return c[0] + 1, jnp.sin(c[1]) + 1.0
    loop = jax.jit(lambda n: jax.lax.while_loop(lambda c: c[0] < n, body, (0, jnp.ones(64)))[1])
    loop(2).block_until_ready()  # compiled before "ready"
    return loop

def long_stage(parts, **kw):
    loop = busy() if sys.argv[2] == "device" else None
    if sys.argv[3:] == ["bar"]:
        from tqdm.auto import tqdm

        bar = tqdm(total=10, desc="decoding", file=sys.stderr, mininterval=0)
        bar.update(3)
    with cli.atomic_output(sys.argv[1], ".png") as tmp:
        open(tmp, "wb").write(b"half a figure")
        print("ready", flush=True)
        if loop is None:
            time.sleep(600)
        else:
            loop(2**31 - 1).block_until_ready()
    raise AssertionError("not interrupted")

demo.run_demo_parts = long_stage
sys.exit(cli.main(["demo", "--model", "default", "--plot", sys.argv[1], "--json"]))
"""
LINE = "jaxkv demo: interrupted (Ctrl-C); no output file was left half-written"


@pytest.mark.parametrize(
    "where", [pytest.param("python", marks=pytest.mark.slow), "device"]
)  # a few seconds each (a fresh process importing jax and the models)
def test_ctrl_c_exits_130_with_one_line_and_no_file(tmp_path, where):
    err, took = _interrupt_demo(tmp_path, where)
    lines = err.strip().splitlines()
    assert lines == [LINE], err
    assert took < 5.0, took
    assert list(tmp_path.iterdir()) == []  # neither the figure nor its temporary file


@pytest.mark.parametrize("where", ["python", "device"])
def test_ctrl_c_line_starts_its_own_line_after_a_progress_bar(tmp_path, where):
    """A bar still open when Ctrl-C comes (tqdm ends its line only when closed): the line
    used to follow the bar on its line, and in Python the bar, collected later, was redrawn
    after it. Now the bar is closed first (Python) or its line ended (the watchdog)."""
    err, _ = _interrupt_demo(tmp_path, where, "bar")
    assert "decoding" in err and err.count(LINE) == 1 and "Traceback" not in err, err
    assert err.endswith("\n" + LINE + "\n"), repr(err)
    assert list(tmp_path.iterdir()) == []


def _interrupt_demo(tmp_path, where, *extra):
    """SCRIPT run with `where` (and `extra` arguments), interrupted once it is ready: asserts
    exit status 130; returns (stderr, seconds from the signal to the exit)."""
    out = tmp_path / "fig.png"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(
        [sys.executable, "-c", SIGINT_HANDLER + textwrap.dedent(SCRIPT), str(out), where, *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        time.sleep(0.3)  # inside the long stage
        t0 = time.perf_counter()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=20)
        took = time.perf_counter() - t0
    finally:
        p.kill()
    assert p.returncode == 130, err
    return err, took


# `python -m jaxkv.cli`
CLI = "import runpy; runpy.run_module('jaxkv.cli', run_name='__main__', alter_sys=True)"


def test_ctrl_c_ends_jaxkv_simulate_the_same_way():
    """`jaxkv simulate` goes through the same entry point: interrupted once its progress bar
    is drawn, it exits 130 with the line on its own line, no traceback."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    argv = ["simulate", "--trace", "synthetic:patterns", "--policies", "static,lru-plan"]
    p = subprocess.Popen(
        [sys.executable, "-c", SIGINT_HANDLER + CLI, *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        seen = b""
        while b"chunk" not in seen:  # the bar is drawn: the replay has started
            got = os.read(p.stderr.fileno(), 4096)
            assert got, (seen + p.stderr.read()).decode()
            seen += got
        p.send_signal(signal.SIGINT)
        _, rest = p.communicate(timeout=20)
    finally:
        p.kill()
    err = (seen + rest).decode()
    line = "jaxkv simulate: interrupted (Ctrl-C); no output file was left half-written"
    assert p.returncode == 130, err
    assert err.endswith("\n" + line + "\n") and err.count(line) == 1, repr(err)
    assert "Traceback" not in err


def _main_with(monkeypatch, func):
    """`jaxkv.cli.main` running a command whose body is `func`: (status, what it wrote)."""
    import argparse
    import io

    from jaxkv import cli

    def parser():
        p = argparse.ArgumentParser(prog="jaxkv")
        sub = p.add_subparsers(dest="command", required=True)
        sub.add_parser("probe").set_defaults(func=func)
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    # Python's own handler, as in a foreground run (a background run inherits SIGINT ignored,
    # and `_thread.interrupt_main`, which the CLI uses to hand an interrupt back, does nothing
    # then)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    try:
        status = cli.main(["probe"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sys.stderr is err  # put back
    return status, err.getvalue()


def test_interrupt_after_a_bar_cut_short_in_its_constructor_starts_a_line(monkeypatch):
    """The CI failure of 2026-12-05: the interrupt came after tqdm's first draw but before its
    constructor set the bar's clock, so `close()` wrote nothing and the line followed the bar.
    Any text left mid-line on stderr now gets its line ended, whatever wrote it."""

    def command(args):
        sys.stderr.write("\rsimulate:   0%|          | 0/3 [00:00<?, ?chunk/s]")
        raise KeyboardInterrupt

    status, err = _main_with(monkeypatch, command)
    line = "jaxkv probe: interrupted (Ctrl-C); no output file was left half-written"
    assert status == 130
    assert err.endswith("chunk/s]\n" + line + "\n"), repr(err)


def test_interrupt_lost_in_a_gc_callback_reaches_the_main_thread(monkeypatch):
    """A KeyboardInterrupt raised inside a garbage-collection callback (jax has one) cannot
    propagate: Python printed it as "Exception ignored" and went on, and only the watchdog
    ended the run. It is now handed back to the main thread, silently."""
    import gc

    def callback(phase, info):
        raise KeyboardInterrupt

    def command(args):
        gc.callbacks.append(callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(callback)
        for _ in range(10_000_000):  # the re-delivered interrupt lands here
            pass
        raise AssertionError("the interrupt was lost")

    status, err = _main_with(monkeypatch, command)
    assert status == 130
    assert err == "jaxkv probe: interrupted (Ctrl-C); no output file was left half-written\n"


def test_interrupt_wrapped_in_a_system_error_is_still_ctrl_c(monkeypatch):
    """The local failure of 2026-12-07: a Ctrl-C landed inside numpy's dtype hook, which then
    returned normally, so Python raised "SystemError: ... returned a result with an exception
    set" with the KeyboardInterrupt as its cause, and `jaxkv generate` reported an internal
    error (exit 1). An exception caused by a KeyboardInterrupt is the user's Ctrl-C."""

    def command(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise SystemError("<function f> returned a result with an exception set") from e

    status, err = _main_with(monkeypatch, command)
    assert status == 130
    assert err == "jaxkv probe: interrupted (Ctrl-C); no output file was left half-written\n"


def test_interrupted_by_walks_the_chain_and_stops_at_a_cycle():
    from jaxkv.cli import interrupted_by

    a, b = ValueError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a  # a cycle, as a re-raised exception can make
    assert not interrupted_by(a)
    b.__cause__ = KeyboardInterrupt()
    assert interrupted_by(a)
    assert not interrupted_by(ValueError("plain"))
