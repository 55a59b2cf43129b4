"""`jaxkv generate` (models/generate_cli.py, models/generate.py, models/stream.py): the answer
streams as it is decoded (a terminal sees each piece, a pipe whole lines), never a broken
character; the text comes from an option, a file, standard input or a conversation; it says why
it stopped; --json; a policy object; Ctrl-C keeps what was generated and exits 130."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import models.generate as gen
from jaxkv import cli
from models.generate_cli import Output
from models.stream import IncrementalText

ROOT = Path(__file__).resolve().parents[1]
SIGINT_HANDLER = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer and a ChatML template, as GGUF."""
    from flax import nnx

    import models
    from tests.models.gguf_writer import tiny_tokenizer, write_gguf
    from tests.models.test_gguf import _config

    tok = tiny_tokenizer()
    model = models.Llama(_config(tok.get_vocab_size(), init_std=0.5), rngs=nnx.Rngs(3))
    path = tmp_path_factory.mktemp("chat") / "tiny.gguf"
    write_gguf(path, model, tokenizer=tok)
    return str(path)


@pytest.fixture
def tiny_loaded(monkeypatch, tiny):
    """`jaxkv generate --model default` decodes the tiny random model (bytes, no stop token),
    its context cut to 64 tokens."""
    from models import tiny_model

    model = tiny_model(0, max_seq_len=64)
    monkeypatch.setattr(gen, "load_model", lambda spec: (model, None))
    return model


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# --------------------------------------------------------------------------- text in pieces


def _bytes_decoder(ids):
    return bytes(ids).decode("utf-8", errors="replace")


@given(st.lists(st.integers(0, 255), max_size=40))
def test_pieces_add_up_to_the_text_and_never_end_mid_character(ids):
    """Any byte stream: the pieces join to the whole decode, and no piece but the last (the
    flush) ends with U+FFFD, the mark of a character still unfinished."""
    text = IncrementalText(_bytes_decoder)
    pieces = [text.push(i) for i in ids]
    tail = text.flush()
    assert "".join(pieces) + tail == _bytes_decoder(ids)
    assert not any(p.endswith("\ufffd") for p in pieces)


def test_a_multibyte_character_is_held_until_whole():
    text = IncrementalText(_bytes_decoder)
    got = [text.push(b) for b in "é🦊!".encode()]
    assert got == ["", "é", "", "", "", "🦊", "!"]


def test_the_byte_level_tokenizer_streams_whole_characters():
    from tests.models.gguf_writer import TEXT, tiny_tokenizer

    tok = tiny_tokenizer()
    ids = tok.encode(TEXT[:300]).ids
    text = IncrementalText(lambda t: tok.decode(t))
    pieces = [text.push(i) for i in ids] + [text.flush()]
    assert "".join(pieces) == TEXT[:300] and "\ufffd" not in "".join(pieces)


class _Sink(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty, self.writes = tty, []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def test_a_terminal_gets_each_piece_and_a_pipe_whole_lines():
    for tty, expected in ((True, ["a", "b\nc", "d", "\n"]), (False, ["ab\n", "cd\n"])):
        sink = _Sink(tty)
        out = Output(sink)
        for piece in ("a", "b\nc", "d"):
            out.write(piece)
        assert out.pending() == ("" if tty else "cd")
        out.close()
        assert sink.writes == expected and sink.getvalue() == "ab\ncd\n"


# --------------------------------------------------------------------------- why it stopped


def test_it_says_the_context_is_full(capsys, tiny_loaded):
    """More new tokens than the context holds: it generates what fits and says so (it was an
    error before any work, and a request that fit stopped without a word)."""
    prompt = "x" * 60  # 60 byte tokens of a 64-token context
    rc, _, err = run(capsys, "--prompt", prompt, "--max-new-tokens", "100")
    assert rc == 0
    assert "[4 tokens in " in err and "stopped: the model's context is full (64 tokens)" in err


def test_a_prompt_the_context_cannot_hold_is_refused(capsys, tiny_loaded):
    rc, _, err = run(capsys, "--prompt", "x" * 64)
    assert rc == 2 and "the prompt is 64 tokens and the model's context 64: no room" in err


def test_it_says_why_it_stopped_and_json_holds_it_all(capsys, tiny_loaded, monkeypatch):
    """Max new tokens, then the model's stop token: the closing line says which (an answer that
    ended at once printed "[1 tokens; ...]" and nothing more); --json holds the text, the ids,
    the reason and the cache's statistics."""
    rc, out, err = run(capsys, "--prompt", "def f():", "--max-new-tokens", "6", "--json")
    reply = json.loads(out)
    assert rc == 0 and err == ""
    assert set(reply) == {
        "text",
        "token_ids",
        "finish_reason",
        "stop_token",
        "prompt_tokens",
        "model",
        "seconds",
        "statistics",
    }
    ids = reply["token_ids"]
    assert len(ids) == 6 and reply["finish_reason"] == "max_tokens"
    assert reply["text"] == gen.decode_text(None, ids) and reply["prompt_tokens"] == 8
    assert {"hbm_hit_rate", "migrated_blocks", "modeled_tokens_per_s"} <= set(reply["statistics"])
    stop = ids[3]
    monkeypatch.setattr(gen, "stop_ids", lambda spec: (stop,))
    rc, out, err = run(capsys, "--prompt", "def f():", "--max-new-tokens", "6")
    n = ids.index(stop)
    assert rc == 0 and out == "def f():" + gen.decode_text(None, ids[:n]) + "\n"
    assert f"[{n} token{'s' if n != 1 else ''} in " in err
    assert f"stopped: the model ended its turn (token {stop}); HBM hit rate" in err


# ------------------------------------------------------------------ where the text comes from


def _request(*argv):
    from models.generate_cli import request

    return request(cli.build_parser().parse_args(["generate", *argv]))


def test_prompt_from_a_file_and_from_standard_input(monkeypatch, tmp_path):
    (path := tmp_path / "p.txt").write_text("def g(x): # é")
    assert _request("--prompt-file", str(path)).prompt == "def g(x): # é"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("def g(x): # é".encode())))
    r = _request("--prompt", "-")
    assert r.prompt == "def g(x): # é" and not r.chat
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hi")))
    r = _request("--chat", "-", "--system", "Be brief.")
    assert (r.prompt, r.chat, r.system) == ("Hi", True, "Be brief.")


def test_chat_system_and_messages_render_under_the_template(chat_gguf, tmp_path, monkeypatch):
    """--chat with --system, and the same conversation as --messages, give the same prompt."""
    seen = []
    monkeypatch.setattr(gen, "encode", lambda tok, text, *a, **k: seen.append(text) or [1, 2])
    monkeypatch.setattr(gen, "Decoder", lambda *a, **k: pytest.fail("prompt built"))
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (path := tmp_path / "m.json").write_text(json.dumps(convo))
    for argv in (["--chat", "Hi", "--system", "Be brief."], ["--messages", str(path)]):
        with pytest.raises(pytest.fail.Exception):
            cli.main(["generate", "--model", chat_gguf, *argv])
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert seen == [expected, expected]


def test_sparse_attention_and_a_policy_object(capsys, tiny_loaded, tmp_path):
    (tmp_path / "mine.py").write_text(
        "from jaxkv.placement.policies import LruPlan\nmine = LruPlan(name='mine')\n"
    )
    rc, out, err = run(
        capsys,
        *("--prompt", "x" * 40, "--max-new-tokens", "3", "--attention", "sparse"),
        *("--policy", f"{tmp_path / 'mine.py'}:mine", "--hbm-blocks", "1", "--json"),
    )
    assert rc == 0 and json.loads(out)["finish_reason"] == "max_tokens", err


# --------------------------------------------------------------------------- streaming, Ctrl-C

# `jaxkv generate` with each decode step slowed down, so that reading the stream can tell
# whether the text came piece by piece
SLOW = """
import sys, time
from jaxkv import cli
from jaxkv.decode.decoder import Decoder

step = Decoder.step
def slow(self, params, state):
    time.sleep(float(sys.argv[1]))
    return step(self, params, state)
Decoder.step = slow
sys.exit(cli.main(["generate", *sys.argv[2:]]))
"""


def _child(argv, delay, **kw):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    code = SIGINT_HANDLER + textwrap.dedent(SLOW)
    return subprocess.Popen(
        [sys.executable, "-c", code, str(delay), *argv], cwd=ROOT, env=env, **kw
    )


def _read(fd, timeout) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return b""
    try:
        return os.read(fd, 4096)
    except OSError:  # the pty's other end closed
        return b""


def test_a_terminal_sees_the_answer_as_it_is_decoded(chat_gguf):
    """`jaxkv generate --chat` on a terminal: the first piece of the answer is shown while the
    rest is still being decoded (it used to print everything at the end)."""
    master, slave = pty.openpty()
    argv = ["--model", chat_gguf, "--chat", "Hi", "--max-new-tokens", "12"]
    p = _child(argv, 0.25, stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            got = _read(master, 1.0)
            if got:
                chunks.append((time.monotonic(), got))
            elif p.poll() is not None:
                break
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
        os.close(master)
    done = time.monotonic()
    assert p.returncode == 0, err.decode()
    assert len(chunks) >= 3, chunks
    assert done - chunks[0][0] > 1.0, chunks  # the first piece came well before the end
    assert b"stopped: max new tokens reached" in err and b"Traceback" not in err


def test_ctrl_c_keeps_what_was_generated_and_exits_130(tmp_path):
    """Ctrl-C in the middle of an answer piped to a file: what was generated is printed (the
    partial line included), the closing line says interrupted, then the one Ctrl-C line."""
    out = (tmp_path / "out.txt").open("wb")
    argv = ["--prompt", "def main():", "--max-new-tokens", "400"]
    p = _child(argv, 0.05, stdout=out, stderr=subprocess.PIPE)
    try:
        start = time.monotonic()
        while (tmp_path / "out.txt").stat().st_size <= len("def main():"):
            assert time.monotonic() - start < 120 and p.poll() is None, p.stderr.read()
            time.sleep(0.2)
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
        out.close()
    err = err.decode()
    text = (tmp_path / "out.txt").read_text()
    assert p.returncode == 130, err
    assert text.startswith("def main():") and text.endswith("\n") and len(text) > 13
    lines = err.strip().splitlines()
    assert "stopped: interrupted" in lines[-2] and "Traceback" not in err, err
    assert lines[-1] == "jaxkv generate: interrupted (Ctrl-C); no output file was left half-written"
    n = int(lines[-2].split()[0].lstrip("["))
    assert 0 < n < 399


@pytest.mark.slow
def test_smollm2_streams_its_chat_answer():
    """The real model, if it is in the cache (never downloaded here): on a terminal its answer's
    first words come before the answer is done."""
    from models import named

    if not named.is_cached("smollm2"):
        pytest.skip("SmolLM2 is not in the cache (jaxkv generate --model smollm2 fetches it)")
    master, slave = pty.openpty()
    argv = ["--model", "smollm2", "--chat", "Tell me about Paris in three sentences."]
    p = _child([*argv, "--max-new-tokens", "48"], 0.0, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    chunks = []
    try:
        while True:
            got = _read(master, 1.0)
            if got:
                chunks.append((time.monotonic(), got))
            elif p.poll() is not None:
                break
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
        os.close(master)
    assert p.returncode == 0, err.decode()
    assert len(chunks) >= 3 and chunks[-1][0] - chunks[0][0] > 0.5, chunks
    assert np.all(np.diff([t for t, _ in chunks]) >= 0)
