"""Per-block access statistics and the math of the online forecasts of the next window's reads.

A forecast is A [W, layers, N] float32: A[t, l, i] = probability (or expected count) that block i
of layer l is read at step t of the coming window. The online forecasts here (the parts that
use them: `jaxkv.placement.forecasts`):
  ema     - decayed read frequency (`Stats.read_ema`), the same for every step of the window,
            sharpened by recency (a block read in the last step is likely read again soon):
            `ema_forecast`.
  reuse   - the trace's own re-read law, learned online: how often a block of read frequency
            bin e, last read k steps ago (and, when k = 1, read r steps running) is read
            (`Stats.since_seen` / `since_read`, decayed counts per class), rolled forward over
            the window as a Markov chain on the class (`reuse_forecast`).
The oracles' forecasts (the true future, the visits in progress) are `jaxkv.sim.oracles`; the
learned (logistic, optax-trained) forecaster `jaxkv.sim.learned`; the Quest bound the sparse
decode loop ranks blocks by `jaxkv.attention.quest_scores`.
The statistics are updated once per step by `update_stats`, the same function in the simulator and
the decode loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, replace, static_field

READ_DECAY = 0.9  # per-step decay of read_ema and mass_ema
REUSE_BUCKETS = 64  # steps-since-last-read classes of the reuse law: 1 .. 62, then ">= 63 / never"
REUSE_DECAY = 0.98  # per-step decay of the reuse counts (forgets over about 50 steps)
POOL_WEIGHT = 2.0  # pseudo-counts pulling a frequency bin's re-read law to the pooled law
REUSE_FREQ_BINS = 8  # read-frequency classes of the reuse law: read_ema in [e / 8, (e + 1) / 8)
# run-length classes of the reuse law for blocks read at the last step: read r = 1 .. 31 steps
# running, then ">= 32"; with them a block's states per frequency bin are REUSE_STATES
REUSE_STREAKS = 32
REUSE_STATES = REUSE_BUCKETS + REUSE_STREAKS - 1


@pytree_dataclass
class Stats:
    """Decayed per-block access statistics."""

    last_read: jax.Array  # [layers, N] int32: step of the last read, -1 if never
    read_ema: jax.Array  # [layers, N] float32: decayed read indicator (~ P(read) per step)
    mass_ema: jax.Array  # [layers, N] float32: decayed share of the step's attention mass
    window_reads: jax.Array  # [layers, N] float32: reads since the last plan
    # [layers, F x REUSE_STATES] float32 (F = REUSE_FREQ_BINS): decayed counts of valid blocks of
    # each reuse class at a step (read frequency bin, steps since the last read, run length:
    # `reuse_class`), and of those among them read at that step
    since_seen: jax.Array | None = None
    since_read: jax.Array | None = None
    # [layers, N] int32: length of the run of consecutive steps read that ends at `last_read`
    # (0 = never read); None: the reuse classes ignore run lengths (F x REUSE_BUCKETS counts)
    streak: jax.Array | None = None
    # the adaptive estimator (`jaxkv.placement.policies.Lrfu.steady_queries`; None without it):
    # [layers, N] float32, the steady read frequency (the prompt's prior, held constant), and
    # [layers] float32, the decayed counts of the reads that the `room` most valuable valid
    # blocks held before each step, by read_ema and by `steady` (`estimator_hits`)
    steady: jax.Array | None = None
    ema_hits: jax.Array | None = None
    steady_hits: jax.Array | None = None
    decay: float = static_field(default=READ_DECAY)
    room: int = static_field(default=0)  # the HBM slots of a layer the hit counts assume


def init_stats(
    num_layers: int,
    num_blocks: int,
    decay: float = READ_DECAY,
    freq_bins: int = REUSE_FREQ_BINS,
    streaks: bool = True,
) -> Stats:
    """Empty statistics for [num_layers, num_blocks] blocks.

    freq_bins: read-frequency classes of the reuse law (1: the law ignores read frequency).
    streaks: the reuse law tells blocks read at the last step apart by run length (`streak`).
    """
    shape = (num_layers, num_blocks)
    classes = freq_bins * (REUSE_STATES if streaks else REUSE_BUCKETS)
    return Stats(
        last_read=jnp.full(shape, -1, jnp.int32),
        read_ema=jnp.zeros(shape, jnp.float32),
        mass_ema=jnp.zeros(shape, jnp.float32),
        window_reads=jnp.zeros(shape, jnp.float32),
        since_seen=jnp.zeros((num_layers, classes), jnp.float32),
        since_read=jnp.zeros((num_layers, classes), jnp.float32),
        streak=jnp.zeros(shape, jnp.int32) if streaks else None,
        decay=decay,
    )


def since_bucket(last_read, step):
    """[layers, N] int32: steps since the last read as a reuse class, 1 .. REUSE_BUCKETS - 2, and
    REUSE_BUCKETS - 1 for longer ago or never."""
    k = REUSE_BUCKETS - 1
    since = jnp.where(last_read >= 0, step - last_read, k)
    return jnp.clip(since, 1, k).astype(jnp.int32)


def update_stats(stats: Stats, reads, mass, step, valid=None) -> Stats:
    """Folds one step in.

    Args:
      stats: current statistics.
      reads: [layers, N] bool, blocks read at this step.
      mass: [layers, N] float32, attention mass at this step (any scale; normalized per layer).
      step: [] int32, the step.
      valid: [layers, N] bool, the blocks that could be read (sealed); None = all. Only the
        reuse counts use it.
    Returns:
      Stats.
    """
    d = stats.decay
    share = mass / jnp.maximum(jnp.sum(mass, axis=-1, keepdims=True), 1e-30)
    seen, got = stats.since_seen, stats.since_read
    if seen is not None:  # O(N) scatter-adds per (layer, class): this runs every decode step
        f = seen.shape[-1] // _states(stats.streak)
        cls = reuse_class(stats.last_read, stats.read_ema, step, f, stats.streak)
        rows = jnp.arange(cls.shape[0])[:, None]
        v = jnp.ones(reads.shape, jnp.float32) if valid is None else valid.astype(jnp.float32)
        seen = (REUSE_DECAY * seen).at[rows, cls].add(v)
        got = (REUSE_DECAY * got).at[rows, cls].add(v * reads)
    ema_hits, steady_hits = stats.ema_hits, stats.steady_hits
    if stats.steady is not None:
        v = jnp.ones(reads.shape, bool) if valid is None else valid
        ema_hits, steady_hits = estimator_hits(stats, reads, v)
    last_read, read_ema, streak = fold_reads(
        stats.last_read, stats.read_ema, stats.streak, reads, step, d
    )
    return Stats(
        last_read=last_read,
        read_ema=read_ema,
        mass_ema=d * stats.mass_ema + (1.0 - d) * share,
        window_reads=stats.window_reads + reads,
        since_seen=seen,
        since_read=got,
        streak=streak,
        steady=stats.steady,
        ema_hits=ema_hits,
        steady_hits=steady_hits,
        decay=d,
        room=stats.room,
    )


def with_steady(stats: Stats, steady, room: int) -> Stats:
    """`stats` with the adaptive estimator: `steady` [layers, N] held constant beside read_ema,
    no hits counted yet, the `room` most valuable blocks of a layer compared (>= 1)."""
    if isinstance(room, bool) or not isinstance(room, int) or room < 1:
        raise ValueError(f"with_steady room={room!r}: expected an int >= 1 (HBM slots a layer)")
    zeros = jnp.zeros(stats.read_ema.shape[:1], jnp.float32)
    steady = jnp.asarray(steady, jnp.float32).reshape(stats.read_ema.shape)
    return replace(stats, steady=steady, ema_hits=zeros, steady_hits=zeros, room=int(room))


def estimator_hits(stats: Stats, reads, valid, layer=None):
    """([rows] ema_hits, [rows] steady_hits) after a step: each count decayed, plus the step's
    reads [rows, N] that the estimator's `stats.room` most valuable `valid` [rows, N] blocks
    held before it (ties to the lower index). Rows are all layers, or `layer` alone (an int or
    a traced int: [1, N] reads). ARC's idea, per layer: the estimator that caught more of the
    recent reads is the one to trust (`steady_choice`)."""

    def row(x):
        return x if layer is None else x[layer][None]

    def caught(x):
        k = min(stats.room, x.shape[-1])
        _, idx = jax.lax.top_k(jnp.where(valid, x, -jnp.inf), k)
        return jnp.sum(jnp.take_along_axis(reads & valid, idx, axis=-1), -1).astype(jnp.float32)

    d = stats.decay
    ema = d * row(stats.ema_hits) + caught(row(stats.read_ema))
    return ema, d * row(stats.steady_hits) + caught(row(stats.steady))


def steady_choice(stats: Stats, reads, valid, layer=None):
    """None without the adaptive estimator; else (steady [rows, N], [rows] bool): the steady
    read frequency and whether it, rather than read_ema, caught more of the reads with this
    step's (`estimator_hits`; a tie keeps read_ema)."""
    if stats.steady is None:
        return None
    ema, steady = estimator_hits(stats, reads, valid, layer)
    rows = stats.steady if layer is None else stats.steady[layer][None]
    return rows, steady > ema


def fold_reads(last_read, read_ema, streak, reads, step, decay: float = READ_DECAY):
    """The per-block statistics after a step's reads (`update_stats` without the reuse counts).

    Args:
      last_read: [layers, N] int32; read_ema: [layers, N] float32; streak: [layers, N] int32
        run lengths, or None.
      reads: [layers, N] bool, blocks read at `step`.
    Returns:
      (last_read, read_ema, streak).
    """
    if streak is not None:
        ran = read_last_step(last_read, step)
        streak = jnp.where(reads, jnp.where(ran, streak + 1, 1), streak)
    return jnp.where(reads, step, last_read), ema_after(read_ema, reads, decay), streak


def ema_after(read_ema, reads, decay: float = READ_DECAY):
    """[layers, N] float32: `read_ema` with one step's reads [layers, N] bool folded in."""
    return decay * read_ema + (1.0 - decay) * reads


def _states(streak) -> int:
    """Reuse states per frequency bin: with run lengths (`streak` given) or without."""
    return REUSE_BUCKETS if streak is None else REUSE_STATES


def reuse_state(last_read, step, streak=None):
    """[layers, N] int32: a block's reuse state within its frequency bin.

    k = `since_bucket` (1 .. REUSE_BUCKETS - 1) for a block last read k steps ago; with `streak`
    ([layers, N] int32 run lengths), a block read at the last step r >= 2 steps running is in
    state REUSE_BUCKETS + min(r, REUSE_STREAKS) - 2 instead of 1 (r = 1 stays in state 1).
    State 0 is unused.
    """
    k = since_bucket(last_read, step)
    if streak is None:
        return k
    r = jnp.clip(streak, 1, REUSE_STREAKS)
    return jnp.where((k == 1) & (r >= 2), REUSE_BUCKETS + r - 2, k).astype(jnp.int32)


def reuse_class(last_read, read_ema, step, freq_bins: int = REUSE_FREQ_BINS, streak=None):
    """[layers, N] int32: a block's reuse class e x S + `reuse_state`, with e = its
    read-frequency bin, floor(read_ema x freq_bins) (0 when freq_bins = 1), and S the states
    per bin (REUSE_STATES with `streak`, else REUSE_BUCKETS)."""
    e = jnp.clip(jnp.floor(read_ema * freq_bins), 0, freq_bins - 1).astype(jnp.int32)
    return e * _states(streak) + reuse_state(last_read, step, streak)


def _reuse_successors(streaks: bool):
    """(after a read, after a miss) [S] int32: each reuse state's next state."""
    k = REUSE_BUCKETS
    s = jnp.arange(REUSE_STATES if streaks else k)
    miss = jnp.where(s < k, jnp.minimum(s + 1, k - 1), 2)  # a run that ends: 1 step since
    if not streaks:
        return jnp.ones_like(s), miss
    nxt = jnp.where(s == 1, k, jnp.minimum(s + 1, REUSE_STATES - 1))  # run r -> r + 1 (capped)
    return jnp.where((s < k) & (s != 1), 1, nxt), miss


def reuse_forecast(
    since_seen,
    since_read,
    last_read,
    step,
    valid,
    wmax: int,
    prior=(0.5, 1.0),
    read_ema=None,
    streak=None,
):
    """Online forecast from the trace's own re-read law: [wmax, layers, N] float32.

    h[e, s] = P(a block of read-frequency bin e in reuse state s is read now); the state s is the
    steps k since its last read and, for k = 1, how many steps running it was read
    (`reuse_state`). From the decayed counts: h[e, s] = (read[e, s] + POOL_WEIGHT x g[s]) /
    (seen[e, s] + POOL_WEIGHT), with g[s] the law on s pooled over the bins, Beta(prior)-smoothed,
    so that a bin with thin counts falls back on the pooled law. A block's state then evolves as
    a Markov chain (e held fixed over the window): read with probability h[e, s] (k -> 1, the run
    grows by one), else k -> k + 1 (capped; a run ends); row j of the forecast is P(read at step
    j of the window) from the block's state now. Exact when reads depend on the bin and the
    state only; learned per layer, online, from past reads alone. The frequency bin separates a
    block that flickers in and out of a hot set (read often, missed the last step) from one that
    left it; the run length tells a visit that has just begun from one that is due to end (on
    recency-low, whose blocks redraw their weight every 6 steps, the two differ most).

    Args:
      since_seen, since_read: [layers, F x S] float32 (`Stats`; S = REUSE_STATES with
        `streak`, REUSE_BUCKETS without; F frequency bins, 1 for no bins).
      last_read: [layers, N] int32; step: [] int32, the window's first step; valid: [layers, N].
      wmax: rows (static).
      prior: (a, b): g = (read + a) / (seen + a + b) over all bins.
      read_ema: [layers, N] float32 (`Stats.read_ema`), needed when F > 1.
      streak: [layers, N] int32 run lengths (`Stats.streak`), or None (counts without them).
    """
    k = _states(streak)
    f = since_seen.shape[-1] // k
    if f * k != since_seen.shape[-1]:
        raise ValueError(
            f"reuse counts must have F x {k} classes per layer "
            f"({'with' if streak is not None else 'without'} run lengths), "
            f"got {since_seen.shape[-1]}"
        )
    if f > 1 and read_ema is None:
        raise ValueError(f"reuse_forecast with {f} frequency bins needs read_ema, got None")
    a, b = prior
    seen = since_seen.reshape(since_seen.shape[0], f, k)
    got = since_read.reshape(since_read.shape[0], f, k)
    got_s, seen_s = jnp.sum(got, 1), jnp.sum(seen, 1)  # [L, S]: pooled over the bins
    pooled = (got_s + a) / (seen_s + a + b)  # the law on s alone
    if streak is not None:
        # a run length first met (at step r of decoding, every block read since step 0 is in
        # run state r for the first time) falls back on the law of all runs, not on the prior
        run = (jnp.arange(k) == 1) | (jnp.arange(k) >= REUSE_BUCKETS)
        g1 = (jnp.sum(got_s * run, -1, keepdims=True) + a) / (
            jnp.sum(seen_s * run, -1, keepdims=True) + a + b
        )
        pooled = jnp.where(run, (got_s + POOL_WEIGHT * g1) / (seen_s + POOL_WEIGHT), pooled)
    # each bin's law shrinks to the pooled one where its own counts are thin
    h = (got + POOL_WEIGHT * pooled[:, None]) / (seen + POOL_WEIGHT)  # [L, F, S]
    on_read, on_miss = _reuse_successors(streak is not None)

    def body(v, _):  # v[l, e, s]: P(read j steps ahead | state s now) -> j + 1 steps ahead
        return h * v[..., on_read] + (1.0 - h) * v[..., on_miss], v

    _, table = jax.lax.scan(body, h, None, length=wmax)  # [wmax, L, F, S]
    table = table.reshape(wmax, h.shape[0], f * k)
    ema = jnp.zeros(last_read.shape, jnp.float32) if read_ema is None else read_ema
    cls = reuse_class(last_read, ema, step, f, streak)  # [L, N]
    p = jnp.take_along_axis(table, jnp.broadcast_to(cls[None], (wmax,) + cls.shape), axis=-1)
    return jnp.where(valid[None], p, 0.0)


def read_last_step(last_read, step):
    """[layers, N] bool: read at step - 1 (`last_read` is -1 for never, which is not step - 1 at
    step 0)."""
    return (last_read == step - 1) & (last_read >= 0)


def ema_forecast(read_ema, last_read, step, valid, wmax: int, window=None, recency: float = 1.0):
    """Online forecast from decayed statistics: P(read) per step, flat over the window.

    Args:
      read_ema: [layers, N] float32.
      last_read: [layers, N] int32.
      step: [] int32, the current step (the first step of the window).
      valid: [layers, N] bool.
      wmax: rows of the output (static).
      window: active rows (rows >= window are zeroed); None = all.
      recency: weight of the "read at the last step" indicator, decaying over the window.
    Returns:
      [wmax, layers, N] float32.
    """
    t = jnp.arange(wmax, dtype=jnp.float32)[:, None, None]
    just = read_last_step(last_read, step).astype(jnp.float32)[None]
    p = read_ema[None] + recency * just * (READ_DECAY ** (t + 1)) * (1.0 - read_ema[None])
    p = jnp.where(valid[None], jnp.clip(p, 0.0, 1.0), 0.0)
    if window is not None:
        p = p * (jnp.arange(wmax) < window)[:, None, None]
    return p
