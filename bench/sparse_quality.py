"""What sparse (Quest-style top-k) attention costs in accuracy, at each share of blocks read.

Held-out text (the stdlib files models/train_tiny.py holds out) is cut into `--batch` windows of
`--prompt-len` + `--steps` + 1 tokens. Each window's prompt is prefilled and the rest is
teacher-forced (`Decoder.score`), once with exact attention (every block read: the reference)
and once per `--topk` share with sparse attention (each layer reads the top-k sealed blocks by
the Quest bound, plus the tail being written). The cache is all-HBM for every run: the blocks a
sparse step selects do not depend on placement, so neither does its accuracy (placement decides
only where the selected blocks are read from, and `jaxkv demo` checks that the sparse tokens
are the same under every policy).

Per decode step: KL(exact || sparse) of the next-token distributions, top-1 agreement, and the
log-likelihood of the true next token, whence the perplexity delta; and the share of block reads
the sparse run made against the exact one (the tail and the rounding of k put it above --topk).

  python bench/sparse_quality.py                          # SmolLM2-135M, 2,048-token prompts
  python bench/sparse_quality.py --model default --prompt-len 512 --json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _progress import tqdm  # noqa: E402
from fp8_quality import _run, add_text_args, check_text_args, load_windows  # noqa: E402

from jaxkv.config import check_number  # noqa: E402
from models import quality  # noqa: E402


def parse_topk(text: str) -> list[float]:
    """'0.1,0.25,0.5' -> [0.1, 0.25, 0.5]; each a fraction in (0, 1)."""
    out = []
    for part in text.split(","):
        try:
            f = float(part)
        except ValueError:
            msg = f"--topk={text!r}: expected comma-separated fractions in (0, 1)"
            raise ValueError(msg) from None
        check_number("--topk", f, low=0.0, high=1.0, low_open=True, high_open=True)
        out.append(f)
    return out


def compare(full: dict, sparse: dict, truth: np.ndarray) -> dict:
    """Accuracy of one sparse run against the exact run (`models.quality.compare`), its share of
    the exact run's block reads and both modeled tokens/s; truth [steps, batch]."""
    return dict(
        **quality.compare(full["logits"], sparse["logits"], truth),
        read_share=sparse["reads"] / full["reads"],
        tokens_per_s_exact=full["tokens_per_s"],
        tokens_per_s_sparse=sparse["tokens_per_s"],
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_text_args(ap, model="smollm2", dtype="float32", batch=2, prompt_len=2048)
    ap.add_argument("--topk", default="0.1,0.25,0.5", help="shares of the sealed blocks read")
    ap.add_argument("--profile", default="h200-pcie", help="hardware modeled for tokens/s")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    check_text_args(args)
    shares = parse_topk(args.topk)
    model, tok, params, windows, truth = load_windows(args)
    mc = model.config
    t0 = time.perf_counter()
    run = lambda attention, k: _run(  # noqa: E731
        model, params, windows, args.prompt_len, args.steps, 1.0, "static", attention, "off",
        args.profile, args.block_size, topk=k,
    )  # fmt: skip
    full = run("exact", 0.25)
    rows = []
    for k in tqdm(shares, desc="sparse quality", file=sys.stderr):
        rows.append(dict(topk=k, **compare(full, run("sparse", k), truth)))
    out = dict(
        model=args.model,
        geometry=f"{mc.num_layers} layers, {mc.num_kv_heads} kv heads x {mc.head_dim}",
        dtype=args.dtype,
        batch=args.batch,
        prompt_len=args.prompt_len,
        steps=args.steps,
        block_size=args.block_size,
        text="held-out stdlib" if tok is not None else "random tokens",
        device=str(jax.devices()[0].device_kind),
        jax=jax.__version__,
        wall_s=time.perf_counter() - t0,
        rows=rows,
    )
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"Sparse top-k attention vs exact, {out['model']} ({out['geometry']}, {args.dtype}), "
        f"{out['text']}, batch {args.batch} x ({args.prompt_len} prompt + {args.steps} "
        f"teacher-forced steps), blocks of {args.block_size}; {out['device']}, jax {out['jax']}; "
        f"{out['wall_s']:.0f} s"
    )
    print(
        f"{'top-k':>6} {'reads':>7} {'KL mean':>9} {'KL median':>9} {'KL p99':>9} {'top-1':>7} "
        f"{'ppl exact':>9} {'ppl sparse':>10} {'dppl%':>7}"
    )
    for r in rows:
        print(
            f"{r['topk']:>6.0%} {r['read_share']:>7.1%} {r['kl_mean']:>9.4f} "
            f"{r['kl_median']:>9.4f} {r['kl_p99']:>9.4f} {r['top1_agreement']:>7.2%} "
            f"{r['ppl_exact']:>9.3f} {r['ppl_sparse']:>10.3f} {r['ppl_delta_pct']:>+7.2f}"
        )
    print(
        "KL in nats per decode step against exact attention; 'reads' the block reads made "
        "against exact's (the tail block and the rounding of k come on top of top-k)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
