"""README.md and docs/ as printed: every code block runs, every link resolves.

Python blocks are executed. Shell blocks (```sh) are checked line by line: a `jaxkv` command
goes through the command's own checks (stopped where it would start its work: a model load, a
trace read, a simulation), or through the parser alone when it reads a pipe; `make` targets,
scripts and modules must exist; other programs must be known. ```text blocks are output or
diagrams and are not run; a block without a language is refused."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
BLOCKS = [(page, lang, code) for page in PAGES for lang, code in FENCE.findall(page.read_text())]
PYTHON = [(p, c) for p, lang, c in BLOCKS if lang == "python"]
SHELL = [(p, c) for p, lang, c in BLOCKS if lang == "sh"]
KNOWN_PROGRAMS = {"pip", "git", "iconv", "cat", "numactl"}  # described, never run here


def _id(page) -> str:
    return str(page.relative_to(ROOT))


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) < 220
    for page in sorted((ROOT / "docs").glob("*.md")):  # every page is on the map
        assert f"(docs/{page.name})" in text, page.name
    assert any("Decoder(" in c for p, c in PYTHON if p == README)


def test_every_block_says_what_it_is():
    assert {lang for _, lang, _ in BLOCKS} <= {"python", "sh", "text"}


def test_every_relative_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{_id(page)}: {target}"


def test_the_examples_cover_the_api():
    code = "\n".join(c for _, c in PYTHON)
    assert "presets.resolve" in code and "FunctionalModel(" in code and "fp8=" in code
    assert "ShardedDecoder(" in code and "simulate(" in code
    # bring your own model: in plain JAX, no flax, decoded against the all-HBM tokens
    assert any("FunctionalModel(" in c and "flax" not in c and "assert" in c for _, c in PYTHON)
    # a composed policy object in the simulator and in the decode loop
    assert any("simulate(" in c and "PlacementConfig(policy=mine" in c for _, c in PYTHON)


@pytest.mark.parametrize("i", range(len(PYTHON)), ids=[f"{_id(p)}-{i}" for i, (p, _) in
                                                       enumerate(PYTHON)])  # fmt: skip
def test_python_block_runs(i, capsys):
    page, code = PYTHON[i]
    if "generate(" in code:  # the library example: a shorter decode keeps the suite quick
        code = code.replace("max_new_tokens=128", "max_new_tokens=8").replace(
            "(1, 1000)", "(1, 100)"
        )
    exec(compile(code, f"{_id(page)} example {i}", "exec"), {})


class _Started(BaseException):
    """A documented command got past its checks to its work."""


@pytest.fixture
def stopped_at_work(monkeypatch):
    import models.bench_serve
    import models.demo
    import models.generate
    import models.record
    from jaxkv.sim import cli as simulate_cli
    from jaxkv.sim import trace as tr

    def started(*args, **kwargs):
        raise _Started

    for module, name in (
        (simulate_cli, "simulate"),
        (tr, "load"),
        (models.generate, "load_model"),
        (models.record, "load_model"),
        (models.demo, "load_model"),
        (models.bench_serve, "load_model"),
    ):
        monkeypatch.setattr(module, name, started)
    monkeypatch.chdir(ROOT)


def _commands(code: str):
    """Each command line of a shell block (continuations joined, comments dropped), split into
    the commands of its pipeline: (words, piped)."""
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        parts, cur = [], []
        for w in words:
            (parts.append(cur), cur := []) if w == "|" else cur.append(w)
        parts.append(cur)
        for part in parts:
            while part and re.fullmatch(r"[A-Z_]+=\S*", part[0]):  # VAR=value prefixes
                part = part[1:]
            yield part, len(parts) > 1


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("i", range(len(SHELL)), ids=[f"{_id(p)}-{i}" for i, (p, _) in
                                                      enumerate(SHELL)])  # fmt: skip
def test_shell_block_commands_are_valid(i, stopped_at_work, capsys):
    from jaxkv import cli

    page, code = SHELL[i]
    for words, piped in _commands(code):
        where = f"{_id(page)}: {' '.join(words)}"
        program, args = words[0], words[1:]
        if program == "jaxkv":
            if piped:  # it reads the pipe: its options are checked by the parser alone
                cli.build_parser().parse_args(args)
                continue
            try:
                rc = cli.main(args)
            except _Started:
                rc = 0
            except SystemExit as e:  # --help, --version
                rc = e.code
            assert rc == 0, f"{where}: {capsys.readouterr().err}"
        elif program == "make":
            targets = [a for a in args if "=" not in a]
            assert set(targets) <= _make_targets(), where
        elif program in ("python", "python3"):
            if args[0] == "-m":
                assert (ROOT / (args[1].replace(".", "/") + ".py")).exists(), where
            else:
                assert (ROOT / args[0]).exists(), where
        else:
            assert program in KNOWN_PROGRAMS, where


def test_every_policy_name_on_the_results_page_resolves():
    """Every policy name bench/RESULTS.md reports a figure for is still a preset."""
    import jaxkv.sim  # noqa: F401  the oracles (anneal-oracle, ...) register from the simulator
    from jaxkv.cost import CostModel
    from jaxkv.placement import presets

    text = (ROOT / "bench" / "RESULTS.md").read_text()
    found = set(re.findall(r"\b(anneal(?:-oracle)?(?:\+[a-z]+)*|paper-sa\[\d+,[\d.]+\])", text))
    assert {"anneal+reuse+follow", "anneal-oracle+dual"} <= found
    for name in sorted(found):
        policy = presets.resolve(name, CostModel())
        assert policy.name.startswith(name.split("+")[0].split("[")[0]), name
    rows = set(re.findall(r"^\| \**([a-z][a-z-]*)\** \|", text, re.M))  # a table's first column
    rules = {"lru-plan", "lru", "arc", "slru", "lfu", "tinylfu", "lrfu"}
    assert rules <= rows, rules - rows
    for name in sorted(rules):
        assert presets.resolve(name, CostModel()).name.startswith(name.split("-")[0]), name
