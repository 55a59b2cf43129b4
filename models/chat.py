"""Prompts and conversations as `jaxkv generate` reads them: text from the command line, a file
or standard input, checked to be UTF-8; a conversation (`--messages FILE.json`) checked to be
a list of {"role", "content"} turns; and a conversation rendered under a model's chat template.

Every problem is a ValueError naming the option, the file and, for text that is not UTF-8, the
first byte that is not and where it sits, before the model loads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROLES = ("system", "user", "assistant")


def _not_utf8(label: str, data: bytes, e: UnicodeDecodeError) -> ValueError:
    byte = data[e.start]
    return ValueError(
        f"{label}: byte 0x{byte:02x} at offset {e.start} is not UTF-8 ({e.reason}): expected "
        "UTF-8 text (convert it first, e.g. `iconv -f latin1 -t utf-8`)"
    )


def argument_text(text: str, label: str) -> str:
    """`text` as given on the command line, checked: Python decodes the bytes of an argument
    that are not UTF-8 to lone surrogates (U+DC80..U+DCFF), which a tokenizer refuses; they
    are named here instead (ValueError with the byte and its offset in the argument)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        data = text.encode("utf-8", "surrogateescape")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _not_utf8(label, data, e) from None
        raise ValueError(f"{label}: holds a lone surrogate code point: expected text") from None
    return text


def read_text(source: str, label: str) -> str:
    """The text of file `source`, or of standard input for "-", decoded as UTF-8 (ValueError
    naming `label`, the file and the first byte that is not UTF-8; an unreadable file, a
    folder, or a terminal on standard input are ValueErrors too)."""
    if source == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise ValueError(
                f"{label} -: standard input is a terminal: expected text piped in "
                f"(e.g. `cat prompt.txt | jaxkv generate {label} -`)"
            )
        data = sys.stdin.buffer.read()
        where = f"{label} - (standard input)"
    else:
        path = Path(source)
        where = f"{label} {source!r}"
        if path.is_dir():
            raise ValueError(f"{where}: is a directory, expected a text file")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ValueError(f"{where}: file not found") from None
        except OSError as e:
            raise ValueError(f"{where}: unreadable ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(where, data, e) from None


def load_messages(source: str, label: str = "--messages") -> list[dict]:
    """A conversation from JSON file `source` ("-": standard input): a list of {"role": one of
    `ROLES`, "content": text} turns, ending with a user turn (the model answers it).
    ValueError naming the file, the turn and what was expected."""
    text = read_text(source, label)
    where = f"{label} {source!r}"
    try:
        turns = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    example = '[{"role": "user", "content": "Hello"}]'
    if not isinstance(turns, list) or not turns:
        got = "an empty list" if turns == [] else f"a JSON {type(turns).__name__}"
        raise ValueError(f"{where}: holds {got}: expected a list of turns, e.g. {example}")
    for i, turn in enumerate(turns):
        at = f"{where}: turn {i}"
        if not isinstance(turn, dict) or set(turn) != {"role", "content"}:
            keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise ValueError(f"{at} is {keys!r}: expected an object with role and content only")
        if turn["role"] not in ROLES:
            raise ValueError(f"{at}: role {turn['role']!r}: expected one of {ROLES}")
        if not isinstance(turn["content"], str):
            raise ValueError(f"{at}: content is a {type(turn['content']).__name__}: expected text")
        argument_text(turn["content"], at)
    if turns[-1]["role"] != "user":
        raise ValueError(
            f"{where}: the last turn is {turns[-1]['role']!r}: expected a user turn, which the "
            "model answers"
        )
    return [dict(t) for t in turns]


def render(template: str, messages: list[dict], *, bos: str, eos: str, who: str) -> str:
    """`messages` under chat `template` (Jinja, sandboxed, as transformers renders it), ready
    for the assistant's answer; ValueError when the template refuses them or does not render
    (`who` names the model)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ValueError(f"the chat template of {who} refused the messages: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template of {who} does not render ({e})") from None
