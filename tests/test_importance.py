"""Statistics and forecasters: EMA update, oracle, EMA forecast, Quest bound, learned model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.placement import statistics as imp
from jaxkv.sim import learned as lrn
from jaxkv.sim import oracles
from jaxkv.sim import trace as tr


def test_update_stats():
    s = imp.init_stats(1, 3, decay=0.5)
    reads = jnp.asarray([[True, False, True]])
    mass = jnp.asarray([[3.0, 0.0, 1.0]])
    s = imp.update_stats(s, reads, mass, jnp.int32(7))
    np.testing.assert_array_equal(s.last_read, [[7, -1, 7]])
    np.testing.assert_allclose(s.read_ema, [[0.5, 0.0, 0.5]])
    np.testing.assert_allclose(s.mass_ema, [[0.375, 0.0, 0.125]])
    np.testing.assert_allclose(s.window_reads, [[1, 0, 1]])
    s = imp.update_stats(s, ~reads, mass * 0, jnp.int32(8))
    np.testing.assert_array_equal(s.last_read, [[7, 8, 7]])
    np.testing.assert_allclose(s.read_ema, [[0.25, 0.5, 0.25]])


def test_reuse_counts_by_steps_since_the_last_read():
    s = imp.init_stats(1, 4)
    d = imp.REUSE_DECAY
    valid = jnp.asarray([[True, True, True, False]])
    s = imp.update_stats(s, jnp.asarray([[True, True, False, False]]), jnp.ones((1, 4)), 0, valid)
    # step 0: the three valid blocks were never read: class K - 1, two of them read
    k = imp.REUSE_BUCKETS - 1
    assert float(s.since_seen[0, k]) == 3 and float(s.since_read[0, k]) == 2
    s = imp.update_stats(s, jnp.asarray([[True, False, False, True]]), jnp.ones((1, 4)), 1, valid)
    # step 1: blocks 0, 1 were read 1 step ago (block 0 again), block 2 never; block 3 invalid
    np.testing.assert_allclose(s.since_seen[0, [1, k]], [2, 3 * d + 1])
    np.testing.assert_allclose(s.since_read[0, [1, k]], [1, 2 * d])
    assert float(s.since_seen.sum()) == pytest.approx(2 + 3 * d + 1)


def test_reuse_forecast_rolls_the_reread_law_forward():
    """Row j = P(read at step j) of a Markov chain on steps-since-last-read."""
    k = imp.REUSE_BUCKETS
    h = np.full(k, 0.1)
    h[1], h[2], h[3] = 0.8, 0.05, 0.5
    seen = np.full((1, k), 1e6, np.float32)
    read = (h * 1e6 - 0.5).astype(np.float32)[None]  # with the prior (0.5, 1.0): h exactly
    last = jnp.asarray([[9, 7, -1]], jnp.int32)  # at step 10: classes 1, 3, K - 1
    f = np.asarray(imp.reuse_forecast(seen, read, last, 10, jnp.ones((1, 3), bool), 3))

    def chain(c, steps):
        p, out = {c: 1.0}, []
        for _ in range(steps):
            out.append(sum(q * h[s] for s, q in p.items()))
            nxt = {}
            for s, q in p.items():
                nxt[1] = nxt.get(1, 0.0) + q * h[s]
                t = min(s + 1, k - 1)
                nxt[t] = nxt.get(t, 0.0) + q * (1 - h[s])
            p = nxt
        return out

    for i, c in enumerate([1, 3, k - 1]):
        np.testing.assert_allclose(f[:, 0, i], chain(c, 3), rtol=1e-4)


def test_reuse_forecast_learns_a_trace_law_online():
    """Reads drawn from a known law of the steps since the last read are learned back."""
    r = np.random.default_rng(0)
    n, steps = 400, 300
    law = {1: 0.9, 2: 0.02}  # stay read with 0.9; once dropped, rarely back; else 0.1
    s = imp.init_stats(1, n)
    last = np.full(n, -1)
    for t in range(steps):
        since = np.where(last >= 0, t - last, 99)
        p = np.array([law.get(int(x), 0.1) for x in since])
        reads = r.random(n) < p
        s = imp.update_stats(s, jnp.asarray(reads[None]), jnp.ones((1, n)), t)
        last = np.where(reads, t, last)
    f = np.asarray(
        imp.reuse_forecast(
            s.since_seen,
            s.since_read,
            s.last_read,
            steps,
            jnp.ones((1, n), bool),
            2,
            read_ema=s.read_ema,
            streak=s.streak,
        )
    )
    since = np.where(last >= 0, steps - last, 99)
    assert abs(f[0, 0, since == 1].mean() - 0.9) < 0.03
    assert abs(f[0, 0, since == 2].mean() - 0.02) < 0.03
    # two steps ahead from class 1: read (0.9 * 0.9) or dropped then back (0.1 * 0.02)
    assert abs(f[1, 0, since == 1].mean() - (0.81 + 0.002)) < 0.04


def _forecast_after(stats, prob, steps, seed=1):
    """Folds `steps` steps of reads drawn with per-block probability `prob` [N] into `stats`;
    returns (the next step's reuse forecast [N], steps since each block's last read [N])."""
    r = np.random.default_rng(seed)
    n = prob.shape[0]
    for t in range(steps):
        reads = r.random(n) < prob
        stats = imp.update_stats(stats, jnp.asarray(reads[None]), jnp.ones((1, n)), t)
    f = imp.reuse_forecast(
        stats.since_seen,
        stats.since_read,
        stats.last_read,
        steps,
        jnp.ones((1, n), bool),
        1,
        read_ema=stats.read_ema,
        streak=stats.streak,
    )
    return np.asarray(f)[0, 0], steps - np.asarray(stats.last_read[0])


def test_reuse_forecast_separates_a_flickering_hot_set_from_cold_blocks():
    """Hot blocks are read with 0.7 at every step (they flicker), cold ones with 0.05: after a
    miss both sit in the same steps-since class, and only the frequency bins tell them apart."""
    n = 600
    hot = np.arange(n) < n // 3
    prob = np.where(hot, 0.7, 0.05)
    f, since = _forecast_after(imp.init_stats(1, n), prob, 300)
    missed = since == 2  # read two steps ago, not at the last step
    assert abs(f[hot & missed].mean() - 0.7) < 0.08, f[hot & missed].mean()
    assert abs(f[~hot & missed].mean() - 0.05) < 0.05, f[~hot & missed].mean()
    # the law on steps-since alone (one frequency bin) cannot: it mixes the two populations
    g, since = _forecast_after(imp.init_stats(1, n, freq_bins=1), prob, 300)
    missed = since == 2
    assert abs(g[hot & missed].mean() - g[~hot & missed].mean()) < 1e-6


def test_streak_counts_the_run_of_reads_ending_at_the_last_read():
    s = imp.init_stats(1, 3)
    pattern = [[1, 0, 1], [1, 1, 0], [1, 1, 1], [0, 1, 0], [1, 0, 0]]
    want = [[1, 0, 1], [2, 1, 1], [3, 2, 1], [3, 3, 1], [1, 3, 1]]
    for t, (r, w) in enumerate(zip(pattern, want, strict=True)):
        s = imp.update_stats(s, jnp.asarray([r], bool), jnp.ones((1, 3)), t)
        np.testing.assert_array_equal(s.streak, [w], err_msg=f"step {t}")
    assert imp.init_stats(1, 3, streaks=False).streak is None


def test_reuse_state_splits_the_last_step_by_run_length():
    k, r = imp.REUSE_BUCKETS, imp.REUSE_STREAKS
    last = jnp.asarray([[9, 9, 9, 9, 7, -1]], jnp.int32)
    streak = jnp.asarray([[1, 2, 5, 500, 4, 0]], jnp.int32)
    got = imp.reuse_state(last, 10, streak)
    np.testing.assert_array_equal(got, [[1, k, k + 3, k + r - 2, 3, k - 1]])
    np.testing.assert_array_equal(imp.reuse_state(last, 10), [[1, 1, 1, 1, 3, k - 1]])
    assert int(got.max()) == imp.REUSE_STATES - 1


def test_reuse_forecast_rolls_run_lengths_forward():
    """With run lengths the chain's state after a read is the run grown by one, after a miss
    "2 steps since": checked against a brute-force enumeration of read / miss paths."""
    k, n_states = imp.REUSE_BUCKETS, imp.REUSE_STATES
    r = np.random.default_rng(3)
    h = r.uniform(0.05, 0.95, n_states)
    seen = np.full((1, n_states), 1e7, np.float32)
    read = (h * 1e7).astype(np.float32)[None]
    last = jnp.asarray([[9, 9, 9, 6, -1]], jnp.int32)  # at step 10
    streak = jnp.asarray([[1, 3, 40, 2, 0]], jnp.int32)
    w = 4
    f = np.asarray(
        imp.reuse_forecast(seen, read, last, 10, jnp.ones((1, 5), bool), w, streak=streak)
    )
    hh = (read[0] + 2.0 * ((read[0] + 0.5) / (seen[0] + 1.5))) / (seen[0] + 2.0)  # as smoothed

    def state(since, run):
        if since == 1 and run >= 2:
            return k + min(run, imp.REUSE_STREAKS) - 2
        return min(since, k - 1)

    def paths(since, run, steps):  # P(read at each step) by enumerating every path
        out = np.zeros(steps)
        for bits in range(2**steps):
            p, s_, r_ = 1.0, since, run
            for j in range(steps):
                q = hh[state(s_, r_)]
                if (bits >> j) & 1:  # read at step j: the run grows (or starts)
                    p, s_, r_ = p * q, 1, (r_ + 1 if s_ == 1 else 1)
                else:
                    p, s_ = p * (1 - q), s_ + 1
            out += p * np.array([(bits >> j) & 1 for j in range(steps)])
        return out

    for i, (since, run) in enumerate([(1, 1), (1, 3), (1, 40), (4, 2), (99, 0)]):
        np.testing.assert_allclose(f[:, 0, i], paths(since, run, w), rtol=2e-4, err_msg=str(i))


def test_reuse_forecast_learns_when_a_visit_ends():
    """Visits of exactly 4 steps, then a pause: only run lengths tell the forecast that a block
    read 4 steps running is done and one read 2 steps running is not; without them both sit in
    "read at the last step"."""
    n, steps, visit = 300, 240, 4
    r = np.random.default_rng(0)
    start = r.integers(0, 12, n)  # each block: visits of 4 steps every 12, staggered
    with_runs, without = imp.init_stats(1, n), imp.init_stats(1, n, streaks=False)
    for t in range(steps):
        reads = jnp.asarray((((t - start) % 12) < visit)[None])
        with_runs = imp.update_stats(with_runs, reads, jnp.ones((1, n)), t)
        without = imp.update_stats(without, reads, jnp.ones((1, n)), t)
    run = np.asarray(with_runs.streak[0])
    last = np.asarray(with_runs.last_read[0])
    args = (with_runs.last_read, steps, jnp.ones((1, n), bool), 1)
    f = np.asarray(
        imp.reuse_forecast(
            with_runs.since_seen,
            with_runs.since_read,
            *args,
            read_ema=with_runs.read_ema,
            streak=with_runs.streak,
        )
    )[0, 0]
    g = np.asarray(
        imp.reuse_forecast(without.since_seen, without.since_read, *args, read_ema=without.read_ema)
    )[0, 0]
    now = last == steps - 1
    done, going = now & (run == visit), now & (run < visit)
    assert done.any() and going.any()
    assert f[going].min() > 0.9 and f[done].max() < 0.1, (f[going].min(), f[done].max())
    # without run lengths the two are told apart by read frequency alone, and much less well
    assert g[going].min() - g[done].max() < 0.5, (g[going].min(), g[done].max())


def test_visits_forecast_keeps_only_the_visits_in_progress():
    # at step 5: blocks 0, 1, 3 were read at step 4; block 2 at step 3; block 4 never
    last = jnp.asarray([[4, 4, 3, 4, -1]], jnp.int32)
    future = np.array(
        [
            [1, 1, 1, 0, 1],  # step 5
            [1, 0, 1, 1, 1],  # step 6
            [0, 1, 1, 1, 1],  # step 7
        ],
        bool,
    )[:, None, :]
    f = np.asarray(oracles.visits_forecast(jnp.asarray(future), last, 5))
    want = np.array([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], np.float32)
    np.testing.assert_array_equal(f[:, 0], want)
    # at step 0 nothing is in progress (last_read -1 is not step -1)
    assert not np.asarray(oracles.visits_forecast(jnp.asarray(future), last * 0 - 1, 0)).any()


def test_oracle_forecast_masks_rows_past_the_window():
    r = jnp.ones((4, 1, 2), bool)
    np.testing.assert_allclose(oracles.oracle_forecast(r, 2)[:, 0, 0], [1, 1, 0, 0])


def test_ema_forecast_is_a_probability_and_respects_validity():
    ema = jnp.asarray([[0.2, 0.9, 0.5]])
    last = jnp.asarray([[9, 3, 9]], jnp.int32)
    valid = jnp.asarray([[True, True, False]])
    f = np.asarray(imp.ema_forecast(ema, last, jnp.int32(10), valid, 4, window=3))
    assert f.shape == (4, 1, 3)
    assert (f >= 0).all() and (f <= 1).all()
    assert (f[:, 0, 2] == 0).all() and (f[3] == 0).all()
    assert f[0, 0, 0] > 0.2 and f[0, 0, 1] == np.float32(0.9)  # read last step: sharpened
    assert f[0, 0, 0] > f[2, 0, 0]  # the recency boost decays over the window


def test_learned_forecaster_beats_the_base_rate_on_held_out_trace():
    train = tr.SyntheticTrace(
        "patterns", prompt_len=1500, steps=200, num_layers=2, block_size=16, seed=1
    )
    test = tr.SyntheticTrace(
        "patterns", prompt_len=1500, steps=200, num_layers=2, block_size=16, seed=2
    )
    x, y = lrn.collect_examples(train, 0.8, window=25)
    params = lrn.train_learned(x, y, steps=200)
    xt, yt = lrn.collect_examples(test, 0.8, window=25)
    base = float(np.mean(yt > 0))
    prec, rec = lrn.precision_recall(
        params, jnp.asarray(xt), jnp.asarray(yt), window=25, threshold=2.0
    )
    assert float(prec) > base + 0.2 and float(rec) > 0.6, (float(prec), float(rec), base)
    # the loss went down from the all-zero model
    zero = {"w": jnp.zeros(lrn.NUM_FEATURES), "b": jnp.zeros(())}

    def loss(p):
        return float(jnp.mean(jax.nn.softplus(xt @ p["w"] + p["b"]) - yt * (xt @ p["w"] + p["b"])))

    assert loss(params) < loss(zero)
