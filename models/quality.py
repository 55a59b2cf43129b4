"""Next-token quality of one cache setting against another, teacher-forced on real text.

Each window of a token stream is prefilled up to `prompt_len` and its next `steps` tokens are
fed one a step (`Decoder.score`), so every run predicts the same positions whatever it would
have sampled: the runs differ only in the cache setting under test (sparse attention against
exact here; bench/fp8_quality.py compares FP8 policies with the same helpers). Per decode step
and sequence: KL(reference || run) of the next-token distributions in nats, top-1 agreement,
and the log-likelihood of the text's true next token, whence each run's perplexity.

`sparse_vs_exact` is what `jaxkv bench-serve` prints beside its headline (the sparse quality at
the headline's read fraction) and what bench/sparse_quality.py tabulates per top-k share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import Decoder
from jaxkv.config import CacheConfig, PlacementConfig


def kl_top1(ref_logits, logits) -> tuple[np.ndarray, np.ndarray]:
    """(KL(ref || q) [steps, batch] in nats, top-1 agreement [steps, batch] bool) of two
    [steps, batch, vocab] logit arrays."""
    lr = jax.nn.log_softmax(jnp.asarray(ref_logits), -1)
    lq = jax.nn.log_softmax(jnp.asarray(logits), -1)
    kl = np.asarray(jnp.sum(jnp.exp(lr) * (lr - lq), -1))
    return kl, np.asarray(jnp.argmax(lr, -1) == jnp.argmax(lq, -1))


def perplexity(logits, truth) -> float:
    """exp(mean negative log-likelihood) of the true next tokens `truth` [steps, batch] under
    `logits` [steps, batch, vocab]."""
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    return float(np.exp(-np.take_along_axis(lp, np.asarray(truth)[..., None], -1)[..., 0].mean()))


def score(model, params, windows, prompt_len: int, steps: int, cache_config: CacheConfig,
          placement: PlacementConfig, profile: str = "h200-pcie"):  # fmt: skip
    """Prefills `windows` [batch, >= prompt_len + steps] up to `prompt_len` and teacher-forces
    the next `steps` tokens. Returns (the final DecodeState, logits [steps, batch, vocab]
    float32 numpy): logits[i] predicts windows[:, prompt_len + i + 1]."""
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < prompt_len + steps + 1:
        raise ValueError(
            f"windows of shape {windows.shape}: expected [batch, >= prompt_len + steps + 1 = "
            f"{prompt_len + steps + 1}]"
        )
    dec = Decoder(model, cache_config, placement, max_new_tokens=steps + 1, profile=profile)
    state = dec.prefill(params, jnp.asarray(windows[:, :prompt_len]))
    fed = jnp.asarray(windows[:, prompt_len : prompt_len + steps])
    state, logits = dec.score(params, state, fed)
    return state, np.asarray(jax.device_get(logits), np.float32)


def compare(ref_logits, logits, truth) -> dict:
    """KL (mean, median, p99, max), top-1 agreement and both perplexities of `logits` against
    `ref_logits` ([steps, batch, vocab] each); truth [steps, batch] the true next tokens."""
    kl, top1 = kl_top1(ref_logits, logits)
    ppl_ref, ppl_q = perplexity(ref_logits, truth), perplexity(logits, truth)
    return dict(
        kl_mean=float(kl.mean()),
        kl_median=float(np.median(kl)),
        kl_p99=float(np.quantile(kl, 0.99)),
        kl_max=float(kl.max()),
        top1_agreement=float(top1.mean()),
        ppl_exact=ppl_ref,
        ppl_sparse=ppl_q,
        ppl_delta_pct=100.0 * (ppl_q / ppl_ref - 1.0),
    )


def sparse_vs_exact(model, params, windows, prompt_len: int, steps: int, topk: float, *,
                    block_size: int = 16, window: int = 16) -> dict:  # fmt: skip
    """Sparse attention (each layer reads its top `topk` share of sealed blocks, plus sink and
    recent ones) against exact, both all-HBM (the blocks a sparse step selects do not depend on
    placement, so neither does its quality), teacher-forced on `windows` [batch, prompt_len +
    steps + 1] (`score`). Returns `compare`'s figures plus read_share (the sparse run's block
    reads over the exact run's), positions (steps x batch) and the run's shape."""
    windows = np.asarray(windows, np.int32)
    batch = windows.shape[0]
    cfg = CacheConfig.for_model(model.config, batch=batch, max_len=prompt_len + steps + 1,
                                block_size=block_size, hbm_fraction=1.0)  # fmt: skip
    out = {}
    for mode in ("exact", "sparse"):
        place = PlacementConfig(policy="static", window=window, attention=mode, topk=topk)
        state, logits = score(model, params, windows, prompt_len, steps, cfg, place)
        out[mode] = (logits, float(jax.device_get(state.metrics.total_reads)))
    truth = windows[:, prompt_len + 1 : prompt_len + steps + 1].T  # [steps, batch]
    return dict(
        **compare(out["exact"][0], out["sparse"][0], truth),
        read_share=out["sparse"][1] / max(out["exact"][1], 1.0),
        topk=topk,
        positions=steps * batch,
        batch=batch,
        prompt_len=prompt_len,
        steps=steps,
    )
