"""Statistics and forecasters: EMA update, oracle, EMA forecast, Quest bound, learned model."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import importance as imp
from jaxkv import trace as tr


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


def test_oracle_forecast_masks_rows_past_the_window():
    r = jnp.ones((4, 1, 2), bool)
    np.testing.assert_allclose(imp.oracle_forecast(r, 2)[:, 0, 0], [1, 1, 0, 0])


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


def test_quest_bound_upper_bounds_every_key():
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(5, 4, 2, 8)).astype(np.float32)  # [N, block, heads, dim]
    q = rng.normal(size=(2, 8)).astype(np.float32)
    bound = np.asarray(imp.quest_bound(jnp.asarray(q), keys.min(1), keys.max(1)))
    exact = np.einsum("nbhd,hd->nbh", keys, q).max(1).sum(-1)
    assert (bound >= exact - 1e-5).all()
    f = np.asarray(imp.quest_forecast(jnp.asarray(bound)[None], jnp.ones((1, 5), bool), 2, 3))
    assert f.shape == (3, 1, 5) and (f.sum(-1) == 2).all()
    assert f[0, 0, np.argmax(bound)] == 1


def test_learned_forecaster_beats_the_base_rate_on_held_out_trace():
    train = tr.SyntheticTrace(
        "patterns", prompt_len=1500, steps=200, num_layers=2, block_size=16, seed=1
    )
    test = tr.SyntheticTrace(
        "patterns", prompt_len=1500, steps=200, num_layers=2, block_size=16, seed=2
    )
    x, y = imp.collect_examples(train, 0.8, window=25)
    params = imp.train_learned(x, y, steps=200)
    xt, yt = imp.collect_examples(test, 0.8, window=25)
    base = float(np.mean(yt > 0))
    prec, rec = imp.precision_recall(
        params, jnp.asarray(xt), jnp.asarray(yt), window=25, threshold=2.0
    )
    assert float(prec) > base + 0.2 and float(rec) > 0.6, (float(prec), float(rec), base)
    # the loss went down from the all-zero model
    zero = {"w": jnp.zeros(imp.NUM_FEATURES), "b": jnp.zeros(())}

    def loss(p):
        return float(jnp.mean(jax.nn.softplus(xt @ p["w"] + p["b"]) - yt * (xt @ p["w"] + p["b"])))

    assert loss(params) < loss(zero)
