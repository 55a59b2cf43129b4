"""The learned forecaster: a logistic model over per-block features (EMA values, age, steps
since the last read, position), trained with optax on traces and judged by precision / recall of
the next window's reads on held-out traces. Research code: the runtime never imports it; the
annealing policy takes it as a forecaster part (`LearnedForecast`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv.placement import presets
from jaxkv.placement.forecasts import Forecast
from jaxkv.placement.statistics import Stats, init_stats, update_stats
from jaxkv.sim.trace import read_mask

NUM_FEATURES = 6


def features(stats: Stats, step, valid, prompt_len: int, block_size: int):
    """Per-block features: [layers, N, NUM_FEATURES] float32.

    read_ema, mass_ema (scaled by N), log1p(steps since last read) (or a never-read flag), age of
    the block in tokens (log1p), relative position in the context, a bias.
    """
    n = stats.read_ema.shape[-1]
    since = jnp.where(stats.last_read >= 0, step - stats.last_read, 10_000)
    pos = jnp.arange(n, dtype=jnp.float32)[None, :] * block_size
    now = (prompt_len + step).astype(jnp.float32)
    f = jnp.stack(
        [
            stats.read_ema,
            stats.mass_ema * n,
            jnp.log1p(since.astype(jnp.float32)) / 10.0,
            jnp.broadcast_to(jnp.log1p(jnp.maximum(now - pos, 0.0)) / 12.0, stats.read_ema.shape),
            jnp.broadcast_to(pos / jnp.maximum(now, 1.0), stats.read_ema.shape),
            jnp.ones_like(stats.read_ema),
        ],
        axis=-1,
    )
    return jnp.where(valid[..., None], f, 0.0)


def learned_forecast(params, feats, valid, wmax: int, window=None):
    """P(read per step) from a logistic model, flat over the window: [wmax, layers, N] float32.

    Args:
      params: {"w": [NUM_FEATURES], "b": []} float32.
      feats: [layers, N, NUM_FEATURES] from `features`.
      valid: [layers, N] bool.
      wmax: rows (static); window: active rows.
    """
    p = jax.nn.sigmoid(feats @ params["w"] + params["b"]) * valid
    out = jnp.broadcast_to(p[None], (wmax,) + p.shape)
    if window is not None:
        out = out * (jnp.arange(wmax) < window)[:, None, None]
    return out


def collect_examples(trace, sparsity: float, window: int = 50, max_steps: int | None = None):
    """Runs the statistics over a trace and pairs each window boundary's features with the
    fraction of the next window's steps that read each block.

    Returns:
      (x [examples, NUM_FEATURES] float32, y [examples] float32), valid blocks only.
    """
    steps = min(max_steps or trace.steps, trace.steps)
    stats = init_stats(trace.num_layers, trace.num_blocks)
    xs, ys = [], []
    for t0 in range(0, steps - window + 1, window):
        mass = trace.mass(t0, window)
        reads = read_mask(mass, trace.prompt_len, trace.block_size, sparsity, t0)
        valid = sealed_mask(trace, t0)
        if t0 > 0:
            f = features(stats, jnp.int32(t0), valid, trace.prompt_len, trace.block_size)
            freq = jnp.mean(reads.astype(jnp.float32), axis=0)
            v = np.asarray(valid)
            xs.append(np.asarray(f)[v])
            ys.append(np.asarray(freq)[v])
        stats = _fold(stats, reads, mass, jnp.int32(t0))
    if not xs:
        raise ValueError(f"trace has {steps} steps, expected at least {2 * window} to train on")
    return np.concatenate(xs), np.concatenate(ys)


@jax.jit
def _fold(stats, reads, mass, t0):
    def body(s, inp):
        r, m, t = inp
        return update_stats(s, r, m, t), None

    ts = t0 + jnp.arange(reads.shape[0], dtype=jnp.int32)
    return jax.lax.scan(body, stats, (reads, mass, ts))[0]


def sealed_mask(trace, step: int):
    """[layers, N] bool: blocks sealed (placeable) at `step`."""
    sealed = (trace.prompt_len + step) // trace.block_size
    return jnp.broadcast_to(
        jnp.arange(trace.num_blocks) < sealed, (trace.num_layers, trace.num_blocks)
    )


def train_learned(x, y, *, steps: int = 300, learning_rate: float = 0.05, seed: int = 0):
    """Fits the logistic forecaster with optax (Adam, cross-entropy on read frequencies).

    Args:
      x: [examples, NUM_FEATURES] float32; y: [examples] float32 in [0, 1].
    Returns:
      params {"w": [NUM_FEATURES], "b": []}.
    """
    params = {"w": jnp.zeros((NUM_FEATURES,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    opt = optax.adam(learning_rate)
    x, y = jnp.asarray(x), jnp.asarray(y)

    def loss(p):
        logits = x @ p["w"] + p["b"]
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, y))

    @jax.jit
    def fit(params):
        def body(carry, _):
            p, s = carry
            g = jax.grad(loss)(p)
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (params, opt.init(params)), None, length=steps)[0][0]

    del seed  # deterministic: zero init, full-batch Adam
    return fit(params)


@functools.partial(jax.jit, static_argnames=("window", "threshold"))
def precision_recall(params, x, y, window: int = 50, threshold: float = 1.0):
    """Precision and recall of "read in the next window" predictions.

    Args:
      params: the logistic model; x: [examples, NUM_FEATURES]; y: [examples] read frequencies.
      window: steps per window; a block is predicted read when its expected reads over the
        window (per-step probability x window) reach `threshold`.
    Returns:
      (precision, recall) float32 scalars.
    """
    p = jax.nn.sigmoid(x @ params["w"] + params["b"])
    pred = p * window >= threshold
    truth = y > 0
    tp = jnp.sum(pred & truth)
    return tp / jnp.maximum(jnp.sum(pred), 1), tp / jnp.maximum(jnp.sum(truth), 1)


@dataclasses.dataclass(frozen=True)
class LearnedForecast:
    """A forecaster part for `jaxkv.placement.policies.Anneal`: the logistic model with weights
    `params` = (w_0, ..., w_5, b) (`train_learned`'s "w" then "b"), flat over the window. Its
    features need the prompt length and block size: the plan's `CostModel` gives them."""

    params: tuple
    name = "learned"
    oracle = False
    knows_now = False
    needs_forecast = False

    def __post_init__(self):
        if len(self.params) != NUM_FEATURES + 1:
            raise ValueError(
                f"LearnedForecast params must be (w_0, ..., w_{NUM_FEATURES - 1}, b): "
                f"{NUM_FEATURES + 1} numbers, got {len(self.params)}"
            )

    @classmethod
    def from_params(cls, params) -> LearnedForecast:
        """From `train_learned`'s {"w", "b"}."""
        w = [float(x) for x in np.asarray(params["w"])]
        return cls(tuple(w + [float(params["b"])]))

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def update(self, state, obs, env, steps: int):
        stats = Stats(obs.last_read, obs.read_ema, obs.mass_ema, obs.read_ema)
        feats = features(stats, obs.step, obs.valid, env.prompt_len, env.block_size)
        p = {
            "w": jnp.asarray(self.params[:-1], jnp.float32),
            "b": jnp.float32(self.params[-1]),
        }
        return state, Forecast(learned_forecast(p, feats, obs.valid, steps))


def _learned(k: dict) -> LearnedForecast:
    if k["learned"] is None:
        raise ValueError("Anneal forecast='learned' needs learned=(w_0, ..., w_5, b), got None")
    return LearnedForecast(tuple(k["learned"]))


presets.register_forecast("learned", _learned)
presets.extend_knobs("learned", dict(learned=None), lambda k: None, lambda k: [], online=True)
