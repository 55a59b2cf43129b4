"""Train the small default model: a Llama-architecture decoder on the Python standard library.

The corpus is every UTF-8 ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (no
site-packages), so every machine has it offline; about 2% of the files (chosen by a hash of their
relative path) are held out. A byte-level BPE tokenizer is trained with ``tokenizers`` on the
training files. Training runs mostly at a short sequence length and finishes at ``--long-seq``
(2048) so the model is usable at that context. Everything is seeded: the batch of step ``s`` is
drawn from ``numpy.random.default_rng([seed, s])``, so a resumed run sees the same data.

Resumable: ``--out DIR`` holds ``tokenizer.json``, ``run.json`` (the arguments), ``ckpt.npz``
(parameters, optimizer state, step; written atomically every ``--ckpt-every`` steps) and, at the
end, ``model/`` (a Hugging Face-format checkpoint that ``models.load_pretrained`` reads) and
``summary.json``. ``--resume`` continues from ``ckpt.npz`` with the arguments in ``run.json``.

Printed: training loss, held-out loss and bits per byte (bpb) against a unigram baseline (token
unigram with add-one smoothing fitted on the training split; and the byte unigram).

    python -m models.train_tiny --out runs/tiny            # start
    python -m models.train_tiny --out runs/tiny --resume   # continue after an interruption
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.hf import save_pretrained
from models.llama import Llama, LlamaConfig

EOS = "<|endoftext|>"


# ------------------------------------------------------------------------------------ corpus
def corpus_files(heldout_percent: float) -> tuple[list[Path], list[Path], Path]:
    """UTF-8 stdlib sources split into (train, held-out) by a hash of the relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or not p.is_file():
            continue
        try:
            p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        (held if zlib.crc32(rel.encode()) % 10000 < heldout_percent * 100 else train).append(p)
    return train, held, root


def train_tokenizer(files: list[Path], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenization) with one special token, EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((p.read_text("utf-8") for p in files), trainer)
    return tok


def encode(tok, files: list[Path]) -> tuple[np.ndarray, int]:
    """Token stream [n] uint16 (files joined by EOS) and the byte count it covers (each EOS
    counted as one byte)."""
    eos = tok.token_to_id(EOS)
    texts = [p.read_text("utf-8") for p in files]
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    nbytes = sum(len(t.encode("utf-8")) for t in texts) + len(texts)
    return np.asarray(ids, np.uint16), nbytes


def token_bytes(tok) -> np.ndarray:
    """[vocab] UTF-8 bytes each token stands for (byte-level BPE: one character per byte; the
    EOS separator counts as one byte)."""
    n = tok.get_vocab_size()
    out = np.array([len(tok.id_to_token(i)) for i in range(n)], np.int64)
    out[tok.token_to_id(EOS)] = 1
    return out


def unigram_log2p(train_ids: np.ndarray, vocab: int) -> np.ndarray:
    """[vocab] log2 probabilities of an add-one-smoothed token unigram fitted on train."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    return np.log2(counts / counts.sum())


def byte_unigram_bits(train: list[Path], held: list[Path]) -> tuple[float, int]:
    counts = np.ones(256)
    for p in train:
        counts += np.bincount(np.frombuffer(p.read_bytes(), np.uint8), minlength=256)
    logp = np.log2(counts / counts.sum())
    data = np.concatenate([np.frombuffer(p.read_bytes(), np.uint8) for p in held])
    return float(-logp[data].sum()), len(data)


# ---------------------------------------------------------------------------------- training
def model_config(args, vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        dim=args.dim,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.dim // args.heads,
        ffn_dim=args.ffn,
        rope_theta=10000.0,
        tie_embeddings=True,
        max_seq_len=args.long_seq,
        init_std=0.02,
    )


def schedule(args) -> optax.Schedule:
    """Learning rate per step: warmup + cosine over the short phase, then the long phase
    re-warms to ``long_lr`` (its new positions need a real learning rate) and decays again.

    Runs started before ``--long-lr`` existed (no ``long_lr`` in run.json) keep their schedule:
    one cosine over both phases.
    """
    long_lr = getattr(args, "long_lr", None)
    total = args.steps + args.long_steps
    if long_lr is None:
        return optax.warmup_cosine_decay_schedule(
            0.0, args.lr, args.warmup, total, end_value=args.lr * 0.05
        )
    short = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, args.steps, end_value=args.lr * 0.05
    )
    warm = min(10, max(1, args.long_steps // 4))
    long = optax.warmup_cosine_decay_schedule(
        0.0, long_lr, warm, max(args.long_steps, warm + 1), end_value=long_lr * 0.05
    )
    return optax.join_schedules([short, long], [args.steps])


def sample_batch(ids: np.ndarray, seed: int, step: int, batch: int, seq: int) -> np.ndarray:
    """[batch, seq + 1] int32 windows of the stream at offsets drawn from rng([seed, step])."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq - 1, batch)
    return np.stack([ids[s : s + seq + 1] for s in starts]).astype(np.int32)


def make_fns(graphdef, tx, micro: int):
    def loss_fn(params, rest, tokens):  # tokens [b, T + 1]
        model = nnx.merge(graphdef, params, rest)
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def train_step(params, rest, opt_state, tokens):  # tokens [micro, b, T + 1]
        def acc(carry, tk):
            loss, grads = jax.value_and_grad(loss_fn)(params, rest, tk)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(acc, zero, tokens)
        loss, grads = jax.tree.map(lambda x: x / micro, (loss, grads))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def eval_nats(params, rest, tokens):  # tokens [b, T + 1] -> summed nats
        model = nnx.merge(graphdef, params, rest)
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).sum()

    return (
        jax.jit(train_step, donate_argnums=(0, 2), static_argnums=()),
        jax.jit(eval_nats),
    )


@dataclasses.dataclass
class Eval:
    """Held-out figures over the predicted tokens of non-overlapping windows."""

    nats: float
    tokens: int
    bytes: int
    unigram_bits: float

    @property
    def loss(self) -> float:
        return self.nats / self.tokens

    @property
    def bpb(self) -> float:
        return self.nats / math.log(2) / self.bytes

    @property
    def unigram_bpb(self) -> float:
        return self.unigram_bits / self.bytes

    def line(self) -> str:
        gain = 100 * (1 - self.bpb / self.unigram_bpb)
        return (
            f"held-out loss {self.loss:.4f} nats/token, {self.bpb:.3f} bpb vs token-unigram "
            f"{self.unigram_bpb:.3f} bpb ({gain:.1f}% better) over {self.tokens} tokens"
        )


def evaluate(eval_fn, params, rest, ids, seq, max_tokens, tbytes, uni_log2p) -> Eval:
    """Evaluate windows of ``seq`` tokens (each predicting its next ``seq``) of ``ids``."""
    n = max(1, min(len(ids) - 1, max_tokens) // seq)
    e = Eval(0.0, 0, 0, 0.0)
    for i in range(n):
        w = ids[i * seq : (i + 1) * seq + 1].astype(np.int32)
        e.nats += float(eval_fn(params, rest, jnp.asarray(w[None])))
        e.tokens += len(w) - 1
        e.bytes += int(tbytes[w[1:]].sum())
        e.unigram_bits += float(-uni_log2p[w[1:]].sum())
    return e


def save_ckpt(path: Path, step: int, params, opt_state) -> None:
    leaves = jax.tree.leaves((params, opt_state))
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, step=np.int64(step), **{f"a{i}": np.asarray(x) for i, x in enumerate(leaves)})
    os.replace(tmp, path)


def load_ckpt(path: Path, params, opt_state):
    treedef = jax.tree.structure((params, opt_state))
    with np.load(path) as z:
        leaves = [jnp.asarray(z[f"a{i}"]) for i in range(treedef.num_leaves)]
        step = int(z["step"])
    params, opt_state = jax.tree.unflatten(treedef, leaves)
    return step, params, opt_state


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="run folder (checkpoints, log, model)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.npz")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--steps", type=int, default=1800, help="short-sequence steps")
    p.add_argument("--long-steps", type=int, default=100, help="final steps at --long-seq")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--long-seq", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per optimizer step")
    p.add_argument("--micro-tokens", type=int, default=2048, help="tokens per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--long-lr", type=float, default=1e-3, help="peak learning rate at --long-seq")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--heldout-percent", type=float, default=2.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--final-eval-tokens", type=int, default=131072)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--max-files", type=int, default=0, help="use only the first N train files")
    p.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="checkpoint and exit at this step (not saved in run.json)",
    )
    return p.parse_args(argv)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out: Path = args.out
    run_file = out / "run.json"
    if args.resume:
        if not run_file.exists():
            raise ValueError(f"--resume: {run_file} not found: expected a started run in {out}")
        saved = json.loads(run_file.read_text())
        args = argparse.Namespace(
            **{**saved, "out": out, "resume": True, "stop_after": args.stop_after}
        )
    else:
        if (out / "ckpt.npz").exists():
            raise ValueError(f"{out / 'ckpt.npz'} exists: pass --resume or choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        saved = {k: v for k, v in vars(args).items() if k not in ("out", "resume", "stop_after")}
        run_file.write_text(json.dumps(saved, indent=1))
    log("python", sys.version.split()[0], "jax", jax.__version__, "devices", jax.devices())

    train_files, held_files, root = corpus_files(args.heldout_percent)
    if args.max_files:
        train_files = train_files[: args.max_files]
    from tokenizers import Tokenizer

    tok_file = out / "tokenizer.json"
    if tok_file.exists():
        tok = Tokenizer.from_file(str(tok_file))
    else:
        t0 = time.time()
        tok = train_tokenizer(train_files, args.vocab)
        tok.save(str(tok_file))
        log(f"tokenizer: BPE {tok.get_vocab_size()} trained in {time.time() - t0:.0f}s")
    vocab = tok.get_vocab_size()
    train_ids, train_bytes = encode(tok, train_files)
    held_ids, held_bytes = encode(tok, held_files)
    log(
        f"corpus {root}: {len(train_files)} train files {train_bytes / 1e6:.1f} MB "
        f"{len(train_ids)} tokens ({train_bytes / len(train_ids):.2f} B/token); "
        f"{len(held_files)} held-out files {held_bytes / 1e6:.2f} MB {len(held_ids)} tokens"
    )
    tbytes = token_bytes(tok)
    if int(tbytes[held_ids].sum()) != held_bytes:
        raise ValueError(
            f"token byte lengths sum to {int(tbytes[held_ids].sum())}: expected "
            f"{held_bytes} (the held-out bytes); is the tokenizer byte-level?"
        )
    uni_log2p = unigram_log2p(train_ids, vocab)
    uni_bpb = float(-uni_log2p[held_ids].sum()) / held_bytes
    byte_bits, nb = byte_unigram_bits(train_files, held_files)
    byte_bpb = byte_bits / nb
    log(f"held-out baselines: token-unigram {uni_bpb:.3f} bpb, byte-unigram {byte_bpb:.3f} bpb")

    config = model_config(args, vocab)
    model = Llama(config, rngs=nnx.Rngs(args.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    log(f"model {config.num_params() / 1e6:.2f}M params: {dataclasses.asdict(config)}")

    total = args.steps + args.long_steps
    sched = schedule(args)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            sched,
            b1=0.9,
            b2=0.95,
            weight_decay=args.weight_decay,
            mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
        ),
    )
    opt_state = tx.init(params)
    ckpt = out / "ckpt.npz"
    step = 0
    if args.resume and ckpt.exists():
        step, params, opt_state = load_ckpt(ckpt, params, opt_state)
        log(f"resumed at step {step}")

    fns = {}
    eval_fn = None
    t_last, tokens_since = time.time(), 0
    while step < total:
        seq = args.seq if step < args.steps else args.long_seq
        per_step = max(1, args.batch_tokens // seq)
        per_micro = max(1, min(per_step, args.micro_tokens // seq))
        micro = max(1, per_step // per_micro)
        if (seq, micro) not in fns:
            fns[(seq, micro)], eval_fn = make_fns(graphdef, tx, micro)
        batch = sample_batch(train_ids, args.seed, step, micro * per_micro, seq)
        batch = batch.reshape(micro, per_micro, seq + 1)
        params, opt_state, loss = fns[(seq, micro)](params, rest, opt_state, jnp.asarray(batch))
        step += 1
        tokens_since += micro * per_micro * seq
        if step % 10 == 0 or step == total:
            loss = float(loss)  # blocks until the step is done, so dt is honest
            dt = time.time() - t_last
            log(
                f"step {step}/{total} seq {seq} loss {loss:.4f} "
                f"lr {float(sched(step)):.2e} {tokens_since / dt:.0f} tok/s"
            )
            t_last, tokens_since = time.time(), 0
        if step % args.ckpt_every == 0 or step == total or step == args.stop_after:
            save_ckpt(ckpt, step, params, opt_state)
        if step == args.stop_after:
            log(f"stopped after step {step} (--stop-after); continue with --resume")
            return {"stopped_at": step}
        if step % args.eval_every == 0 and step < total:
            e = evaluate(eval_fn, params, rest, held_ids, seq, args.eval_tokens, tbytes, uni_log2p)
            log(f"eval step {step} seq {seq}: {e.line()}")
            t_last = time.time()

    if eval_fn is None:
        _, eval_fn = make_fns(graphdef, tx, 1)
    summary = {
        "params": config.num_params(),
        "steps": total,
        "tokens_per_step": args.batch_tokens,
        "unigram_token_bpb_all_heldout": uni_bpb,
        "unigram_byte_bpb": byte_bpb,
        "python": sys.version.split()[0],
        "heldout_files": len(held_files),
        "heldout_bytes": held_bytes,
    }
    for seq in sorted({args.seq, args.long_seq}):
        e = evaluate(
            eval_fn, params, rest, held_ids, seq, args.final_eval_tokens, tbytes, uni_log2p
        )
        summary[f"seq{seq}"] = {
            "heldout_loss": e.loss,
            "heldout_bpb": e.bpb,
            "unigram_bpb_same_tokens": e.unigram_bpb,
            "tokens": e.tokens,
        }
        log(f"final seq {seq}: {e.line()}; byte-unigram {byte_bpb:.3f} bpb")
    model = nnx.merge(graphdef, params, rest)
    save_pretrained(
        model, out / "model", tokenizer=tok, eos_token_id=tok.token_to_id(EOS), bos_token_id=None
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"wrote {out / 'model'} and {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()
