"""The `jaxkv` command.

Subcommands are plugins: a module exposing `add_cli(subparsers)`, which adds its parser and sets
`func(args) -> int`. The library's own (`simulate`) are listed here; commands that need a model
(`demo`, `generate`, `trace`) live in the `models` package and register through the
`jaxkv.commands` entry-point group in pyproject.toml, so the library never imports `models`.

Ctrl-C (SIGINT) ends any command with exit status 130 and one line on stderr, no traceback:
`main` turns the KeyboardInterrupt into that line, and a watchdog thread, woken by the signal
itself (`signal.set_wakeup_fd`), ends the process `INTERRUPT_GRACE_S` seconds later if the
main thread has not got there (it may sit in a compilation or a device computation, which see
the signal only when they return). Output files are written through `atomic_output`, so an
interrupt or a failure leaves no half-written file (the watchdog removes the temporary ones).
The line starts a line of its own: open progress bars are closed first (`_close_bars`), and
whatever was left mid-line on stderr (a bar the watchdog cannot touch from its thread, or one
whose constructor the interrupt cut short after its first draw, which tqdm cannot close) is
cleared on a terminal or, in a log or pipe, has its line ended: `main` routes `sys.stderr`
through `_LineTracker`, which knows whether the last thing written ended its line. A
KeyboardInterrupt that lands in a garbage-collection callback (jax registers one), which
Python would print as "Exception ignored" and drop, is handed back to the main thread
(`_unraisable`).
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import importlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
from importlib.metadata import entry_points
from pathlib import Path

INTERRUPT_GRACE_S = 2.0  # the watchdog's wait for the main thread after Ctrl-C
_REDELIVER_S = 0.05  # a KeyboardInterrupt lost in a gc callback is raised again this much later
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
_TEMPS: set[str] = set()  # temporary output files being written (`atomic_output`)
_HELD: dict[int, object] = {}  # output held back from stdout (`held_output`), by id


@contextlib.contextmanager
def held_output(pending):
    """While inside, `pending()` (the text a command has decided to print but holds back, e.g.
    a partial line bound for a pipe) is written to stdout if the watchdog ends the process
    after Ctrl-C (its main thread stuck in a computation), so no output is lost there. Python's
    own path (KeyboardInterrupt) is the command's to handle."""
    _HELD[id(pending)] = pending
    try:
        yield
    finally:
        _HELD.pop(id(pending), None)


@contextlib.contextmanager
def atomic_output(path, suffix: str = ""):
    """Yields a temporary path beside `path` to write the output to; on success renames it to
    `path` (with a normal file's mode), on any exception or interrupt removes it, so `path` is
    never half-written. `suffix`: the temporary file's (e.g. ".png" for matplotlib)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        suffix=suffix or path.suffix, prefix=f".{path.name}.", dir=path.parent
    )
    os.close(fd)
    _TEMPS.add(tmp)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600
        os.replace(tmp, path)
    finally:
        _TEMPS.discard(tmp)
        if os.path.exists(tmp):
            os.unlink(tmp)


def _interrupted_line(command: str) -> str:
    return f"jaxkv {command}: interrupted (Ctrl-C); no output file was left half-written"


class _LineTracker:
    """A text stream that passes everything to `stream` and remembers whether the last text
    written ended its line (`at_line_start`); every other attribute is the stream's."""

    def __init__(self, stream):
        self._stream = stream
        self.at_line_start = True

    def write(self, s: str) -> int:
        if s:
            self.at_line_start = s.endswith("\n")
        return self._stream.write(s)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _end_line(err) -> str:
    """What starts a fresh line on stderr (`err`, a `_LineTracker` or a plain stream): nothing
    if the last write ended its line, else a clear of a terminal's line or a newline."""
    if getattr(err, "at_line_start", True):
        return ""
    return "\r\x1b[K" if os.isatty(2) else "\n"


def _unraisable(default):
    """A `sys.unraisablehook` that re-delivers a KeyboardInterrupt raised where Python cannot
    propagate it (a gc callback) to the main thread, without printing it; others go to
    `default`. Delivered from a timer thread a moment later, as raised inside the hook it
    would be swallowed again. An interrupt that lands while the hook runs (an earlier timer's,
    in a long collection) is caught and the timer scheduled again; one that lands in a later
    gc callback comes back here."""

    def hook(u):
        if not isinstance(u.exc_value, KeyboardInterrupt):
            return default(u)
        while True:
            try:
                timer = threading.Timer(_REDELIVER_S, _thread.interrupt_main)
                timer.daemon = True
                timer.start()
                return None
            except KeyboardInterrupt:
                continue

    return hook


def _ignore_sigint() -> None:
    """Ignores SIGINT from here on (from the main thread; a no-op elsewhere)."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _open_bars() -> list:
    """The tqdm progress bars drawn and not closed (none if tqdm was never imported). Never
    raises: the watchdog thread calls it while the main thread may be changing the set."""
    std = sys.modules.get("tqdm.std")
    with contextlib.suppress(Exception):
        return [b for b in list(std.tqdm._instances) if not getattr(b, "disable", True)]
    return []


def _close_bars() -> None:
    """Closes every open progress bar (each ends its line, or clears it with leave=False), so
    what is printed next starts a line; a bar the interrupted code still holds would
    otherwise be redrawn after it when collected."""
    for bar in _open_bars():
        with contextlib.suppress(Exception):
            bar.close()


def _start_watchdog(command: str, handled: threading.Event):
    """After a SIGINT, ends the process with EXIT_INTERRUPTED once INTERRUPT_GRACE_S pass
    without `handled` set (the main thread stuck in native code), removing temporary outputs.
    Returns a function that stops the watchdog (and restores the previous wakeup fd). Only
    from the main thread (signal.set_wakeup_fd); a no-op elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    r, w = socket.socketpair()
    w.setblocking(False)
    try:
        old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    except ValueError:
        r.close(), w.close()
        return lambda: None

    def watch():
        while True:
            data = r.recv(64)
            if not data:  # stopped
                return
            if signal.SIGINT in data:
                break
        if handled.wait(INTERRUPT_GRACE_S):
            return
        for tmp in list(_TEMPS):
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        for pending in list(_HELD.values()):
            with contextlib.suppress(Exception):
                os.write(1, (pending() or "").encode())
        # a progress bar left mid-line: cleared on a terminal, its line ended in a log or pipe
        os.write(2, (_end_line(sys.stderr) + _interrupted_line(command) + "\n").encode())
        os._exit(EXIT_INTERRUPTED)

    threading.Thread(target=watch, name="jaxkv-interrupt", daemon=True).start()

    def stop():
        signal.set_wakeup_fd(old)
        w.close()  # the watcher's recv returns b"": it ends

    return stop


_BUILTIN = {"simulate": "jaxkv.sim.cli", "policies": "jaxkv.cli"}


def _plugins() -> dict[str, str]:
    """name -> module path of every subcommand (entry points override nothing built in)."""
    found = {ep.name: ep.value.split(":")[0] for ep in entry_points(group="jaxkv.commands")}
    return {**found, **_BUILTIN}


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help ("(default: 16)") unless the help says it
    already or there is none to show (None, a flag's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        shown = "default" in text or "%(default)" in text
        if shown or d is None or d is False or d is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (exit status 2), pointing to --help,
    and whose help shows the defaults (`HelpFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# help for options a plugin left without any (jaxkv.sim.cli's), so that every option of every
# command says what it does; a plugin's own help wins
_FALLBACK_HELP = {
    "simulate": {
        "--sparsity": "share of each step's blocks not read (0.6: the top 40%% are read)",
        "--block-size": "tokens per block of a synthetic trace (default: 16)",
        "--prompt-len": "prompt tokens of a synthetic trace",
        "--steps": "decode steps of a synthetic trace",
        "--layers": "layers of a synthetic trace",
        "--profile": "hardware profile the cost model prices (jaxkv.config.PROFILES)",
        "--chunk": "steps replayed per compiled chunk (progress and memory, not results)",
        "--demote-cost": "cost of a demotion, in link transfers of one block",
        "--seed": "seed of the synthetic trace and the annealer",
        "--json": "print one JSON object instead of the table",
        "--no-progress": "draw no progress bar",
    },
}


def _fill_help(command: str, parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if action.help is None:
            for opt in action.option_strings:
                if opt in _FALLBACK_HELP.get(command, {}):
                    action.help = _FALLBACK_HELP[command][opt]


def version() -> str:
    """'jaxkv X (jax Y)': the installed distribution's version and jax's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        own = dist_version("jaxkv")
    except PackageNotFoundError:  # run from a source tree that was never installed
        own = importlib.import_module("jaxkv").__version__
    try:
        jax = dist_version("jax")
    except PackageNotFoundError:
        jax = "not installed"
    return f"jaxkv {own} (jax {jax}, Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="jaxkv",
        description="A paged KV cache split over HBM and host memory for JAX decoding: decode "
        "a model over it, replay traces through placement policies, list what is there.",
        epilog="`jaxkv COMMAND --help` shows a command's options and their defaults.",
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in sorted(_plugins().items()):
        importlib.import_module(module).add_cli(sub)
        if name in sub.choices:
            _fill_help(name, sub.choices[name])
    return parser


# ---- jaxkv policies -------------------------------------------------------------------------

KIND_WORDS = {
    "live": "the policy to use in a decode",
    "field": "the field's rules in the step, the baselines (a decode can run them)",
    "online": "a decode can run it",
    "oracle": "reads the future: the simulators only (jaxkv simulate, bench/loop_traces.py)",
    "bound": "not a placement: jaxkv simulate's bound",
}


def _knob(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def format_policies(rows: list[dict]) -> str:
    """`jaxkv policies`'s text: one line per policy (name, kind, what it does), its modifiers
    and knobs (defaults) below it, then what the kinds mean."""
    import shutil
    import textwrap

    cols = max(60, min(120, shutil.get_terminal_size((100, 24)).columns))
    width = max(len(r["name"]) for r in rows)
    pad = " " * (width + 10)
    lines = []
    for r in rows:
        lines.append(f"{r['name']:<{width}}  {r['kind']:<6}  {r['doc']}")
        if r["modifiers"]:
            mods = "; ".join(f"{m} {d}" for m, d in r["modifiers"].items())
            lines += textwrap.wrap(
                f"modifiers: {mods}", cols, initial_indent=pad, subsequent_indent=pad + "  "
            )
        if r["knobs"]:
            knobs = ", ".join(f"{k}={_knob(v)}" for k, v in r["knobs"].items())
            lines += textwrap.wrap(
                f"knobs: {knobs}", cols, initial_indent=pad, subsequent_indent=pad + "  "
            )
    kinds = "; ".join(f"{k}: {w}" for k, w in KIND_WORDS.items())
    note = (
        "A name with modifiers reads e.g. anneal+reuse+follow. Knobs are set by "
        "Decoder(policy_kwargs={...}) or simulate(policy_kwargs={label: {...}}); a policy "
        "object (module:attribute) runs wherever a name does. docs/policies.md says more."
    )
    return "\n".join([*lines, "", *textwrap.wrap(kinds, cols), *textwrap.wrap(note, cols)])


def _policies_cmd(args) -> int:
    import jaxkv.sim  # noqa: F401  (the simulator's oracles register their names)
    from jaxkv.placement import presets

    rows = presets.describe()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(format_policies(rows))
    return 0


def add_cli(sub) -> None:
    """Adds `jaxkv policies`."""
    p = sub.add_parser(
        "policies",
        help="list the placement policies: the live one, the others a decode can run, the "
        "oracles and the bound, each with its knobs",
        description="The placement policies by name (jaxkv.placement.presets.describe).",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    p.set_defaults(func=_policies_cmd)


# ---- running a command ----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Runs a subcommand: its status; 2 with one error line for a ValueError or a usage error;
    130 with one line for Ctrl-C (the module docstring); 1 with one line for anything else
    (a bug: $JAXKV_TRACEBACK=1 shows its traceback)."""
    args = build_parser().parse_args(argv)
    handled = threading.Event()
    stop = _start_watchdog(args.command, handled)
    err, hook, on_int = sys.stderr, sys.unraisablehook, signal.getsignal(signal.SIGINT)
    sys.stderr = _LineTracker(err)
    sys.unraisablehook = _unraisable(hook)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"jaxkv {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`jaxkv ... | head`): nothing more to say
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:
        if interrupted_by(e):
            return _interrupted(args.command, handled)
        if os.environ.get("JAXKV_TRACEBACK"):
            raise
        print(
            f"jaxkv {args.command}: internal error: {type(e).__name__}: {_one_line(e)} (a bug in "
            "jaxkv: please report it with the command; JAXKV_TRACEBACK=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return _interrupted(args.command, handled)
    finally:
        handled.set()
        stop()
        sys.stderr, sys.unraisablehook = err, hook
        if on_int is not None and signal.getsignal(signal.SIGINT) is not on_int:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, on_int)


def _interrupted(command: str, handled: threading.Event) -> int:
    """Ctrl-C's one line (the module docstring) and its exit status."""
    handled.set()
    _ignore_sigint()  # a second Ctrl-C (or a re-delivered one) cannot cut the line short
    _close_bars()
    print(_end_line(sys.stderr) + _interrupted_line(command), file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def interrupted_by(e: BaseException) -> bool:
    """Whether `e` is, or was caused by, a KeyboardInterrupt. A Ctrl-C that lands inside a C
    function which then returns normally (numpy's dtype hooks, seen under jax) surfaces as
    "SystemError: ... returned a result with an exception set", the KeyboardInterrupt its
    cause: that is the user's Ctrl-C, not a bug."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _one_line(e: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
