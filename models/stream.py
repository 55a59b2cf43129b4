"""Tokens as they are decoded, and their text as it becomes whole: what `jaxkv generate` streams.

`Stream` decodes one sequence one `Decoder.step` at a time (the state donated each step, as
`Decoder.generate` would take it, without the while loop) and yields each new piece of text
as soon as it is whole: `IncrementalText` holds back the bytes of a character a token has only
started (byte-level BPE splits multi-byte characters over tokens), so what is printed never
holds a broken character. When the stream ends, `finish_reason` says why: the model's stop
token (`end_of_turn`), `max_tokens`, `context_full` (the model's context holds no more), or
`interrupted` (Ctrl-C, set by the caller).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from jaxkv.decode.state import check_finite

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole character

FINISH_WORDS = {
    "end_of_turn": "the model ended its turn",
    "max_tokens": "max new tokens reached",
    "context_full": "the model's context is full",
    "interrupted": "interrupted",
}


class IncrementalText:
    """Text of a growing list of token ids, handed out in pieces that never split a character.

    `decode(ids) -> str` decodes a list of ids (replacing bytes that are not a whole character
    by U+FFFD). `push(id)` returns the text the new token completes ("" while a character is
    unfinished); `flush()` whatever is left, unfinished bytes as U+FFFD. Each push decodes only
    the ids since the last whole piece (the offsets of text-generation-inference's streamer), so
    a stream costs O(tokens), and a piece's text is the same as decoding everything at once."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._start = 0  # ids before it are out, and end on a whole character
        self._done = 0  # ids up to here are out

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self._decode(self.ids[self._start : self._done])
        now = self._decode(self.ids[self._start :])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""  # a character still unfinished (or nothing printable yet)
        self._start, self._done = self._done, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        before = self._decode(self.ids[self._start : self._done])
        now = self._decode(self.ids[self._start :])
        self._start = self._done = len(self.ids)
        return now[len(before) :]

    @property
    def text(self) -> str:
        return self._decode(self.ids)


@dataclasses.dataclass
class Stream:
    """One sequence decoded step by step from a prefilled `state` (batch 1): iterate to get
    each piece of text as it is whole (`IncrementalText`); afterwards `finish_reason`, `ids`
    (the generated tokens, without the stop token), `text` and `state` (the last one a step
    returned: a Ctrl-C inside a step leaves the one before, whose buffers that step took).

    decoder, params: the `jaxkv.Decoder` and its params; stop: the stop token ids (the first
    ends the stream and is not part of the text); context_full: True when max_new_tokens was
    cut to what the model's context holds (reaching it is then `context_full`)."""

    decoder: object
    params: object
    state: object
    decode: Callable[[list[int]], str]
    stop: tuple[int, ...] = ()
    context_full: bool = False
    finish_reason: str | None = None
    stop_token: int | None = None

    def __post_init__(self):
        self._text = IncrementalText(self.decode)

    @property
    def ids(self) -> list[int]:
        return self._text.ids

    @property
    def text(self) -> str:
        return self._text.text

    def flush(self) -> str:
        """The text held back (an unfinished character at an interrupt or a stop)."""
        return self._text.flush()

    def __iter__(self) -> Iterator[str]:
        dec, last = self.decoder, self.decoder.max_new_tokens - 1
        step = 0
        while True:
            token = int(self.state.tokens[0, step])  # waits for the step that sampled it
            if token in self.stop:
                self.finish_reason, self.stop_token = "end_of_turn", token
                break
            if bool(self.state.done[0]):  # done without a stop token: non-finite logits
                check_finite(self.state)  # NonFiniteLogitsError naming the step
            piece = self._text.push(token)
            if piece:
                yield piece
            if step >= last:
                self.finish_reason = "context_full" if self.context_full else "max_tokens"
                break
            self.state = dec.step(self.params, self.state)
            step += 1
        tail = self.flush()
        if tail:
            yield tail
