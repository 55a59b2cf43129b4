"""Policies: the interface contract under jit for every policy, and each policy's rule."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import importance as imp
from jaxkv import policies as P
from jaxkv.config import AnnealConfig, HardwareProfile

L, N, CAP, H = 2, 24, 6, 5


def observation(seed=0, forecast=True, window_reads=True, runs=False):
    r = np.random.default_rng(seed)
    k = imp.REUSE_STATES if runs else imp.REUSE_BUCKETS
    valid = np.zeros((L, N), bool)
    valid[:, :20] = True
    in_hbm = np.zeros((L, N), bool)
    in_hbm[:, :CAP] = True
    last = np.where(r.random((L, N)) < 0.5, r.integers(0, 30, (L, N)), -1) * valid
    return P.Observation(
        in_hbm=jnp.asarray(in_hbm),
        valid=jnp.asarray(valid),
        last_read=jnp.asarray(last, jnp.int32),
        read_ema=jnp.asarray(r.random((L, N)) * valid, jnp.float32),
        mass_ema=jnp.asarray(r.random((L, N)) * valid / N, jnp.float32),
        step=jnp.int32(31),
        forecast=jnp.asarray((r.random((H, L, N)) < 0.3) & valid, jnp.float32)
        if forecast
        else None,
        window_reads=jnp.asarray(r.integers(0, 3, (L, N)) * valid, jnp.float32)
        if window_reads
        else None,
        since_seen=jnp.asarray(r.uniform(5, 50, (L, k)), jnp.float32),
        since_read=jnp.asarray(r.uniform(0, 5, (L, k)), jnp.float32),
        streak=jnp.asarray(r.integers(1, 40, (L, N)) * (last >= 0), jnp.int32) if runs else None,
        capacity=CAP,
    )


FAST = AnnealConfig(chains=4, max_iters=200)
ALL = {
    "static": P.Static(),
    "lru": P.Reactive(),
    "page": P.Page(page_blocks=2),
    "paper-sa": P.PaperSA(lookahead=H),
    "anneal": P.Anneal(window=H, config=FAST),
    "anneal+aw+ec": P.Anneal(window=H, max_window=H, adaptive=True, compensate=True, config=FAST),
    "anneal-oracle": P.Anneal(name="anneal-oracle", forecast="oracle", window=H, config=FAST),
    "anneal-oracle+tail": P.Anneal(forecast="oracle", window=2, tail=H - 2, config=FAST),
    "anneal-oracle+dual": P.Anneal(forecast="oracle", window=2, dual=True, config=FAST),
    "anneal+reuse": P.Anneal(forecast="reuse", unforeseen=True, window=H, config=FAST),
    "anneal+reuse+runs": P.Anneal(forecast="reuse", unforeseen=True, window=H, config=FAST),
    "anneal-oracle+visits": P.Anneal(forecast="visits", window=2, tail=H - 2, config=FAST),
    "anneal+now": P.Anneal(now=True, window=H, config=FAST),
    "anneal+reuse+now+runs": P.Anneal(
        forecast="reuse", unforeseen=True, now=True, window=H, config=FAST
    ),
    "anneal+reuse+now+spread+runs": P.Anneal(
        forecast="reuse", unforeseen=True, now=True, ride=1.0, spread=1.5, window=H, config=FAST
    ),
    "anneal+spread": P.Anneal(spread=1.0, window=H, config=FAST),
    "anneal-learned": P.Anneal(
        forecast="learned", learned=(1.0, 0, 0, 0, 0, 0, -1.0), window=H, config=FAST
    ),
}


@pytest.mark.parametrize("name", sorted(ALL))
def test_plan_is_jittable_within_capacity_and_valid(name):
    pol = ALL[name]
    obs = observation(runs=name.endswith("+runs"))
    if getattr(pol, "needs_values", False):
        vals = np.random.default_rng(1).random((H, L, N)) * 1e-4
        obs = dataclasses.replace(obs, value_to_go=jnp.asarray(vals, jnp.float32))
    state = pol.init(L, N)
    plan = jax.jit(pol.plan)
    for _ in range(2):  # state threads through
        state, target = plan(state, obs)
    t = np.asarray(target)
    assert t.shape == (L, N) and t.dtype == bool
    assert (t.sum(-1) <= CAP).all()
    assert not (t & ~np.asarray(obs.valid)).any()


def test_static_never_moves():
    obs = observation()
    _, t = P.Static().plan((), obs)
    np.testing.assert_array_equal(t, obs.in_hbm & obs.valid)


def test_page_holds_the_pages_read_next():
    obs = observation()
    f = np.zeros((H, L, N), np.float32)
    f[0, :, [8, 9, 12]] = 1.0  # pages (2 blocks) 4 and 6
    obs = P.Observation(**{**obs.__dict__, "forecast": jnp.asarray(f)})
    _, t = P.Page(page_blocks=2).plan((), obs)
    t = np.asarray(t)
    assert t[:, [8, 9, 12, 13]].all()
    assert (t.sum(-1) <= CAP).all()


def test_paper_sa_evicts_unread_and_promotes_top_fraction():
    obs = observation()
    f = np.zeros((H, L, N), np.float32)
    f[0, :, 1] = 1.0  # resident block read soon: kept
    f[0, :, 10] = 1.0  # host block read next step: score 1
    f[3, :, 11] = 1.0  # host block read in 4 steps: score 1/4
    obs = P.Observation(**{**obs.__dict__, "forecast": jnp.asarray(f)})
    _, t = P.PaperSA(lookahead=H, fraction=0.5).plan((), obs)
    t = np.asarray(t)
    assert t[:, 1].all() and t[:, 10].all()
    assert not t[:, 11].any()  # R = 0.5 of the two candidates
    assert not t[:, [0, 2, 3, 4, 5]].any()  # resident, not read within the lookahead
    _, t = P.PaperSA(lookahead=H, fraction=1.0).plan((), obs)
    assert np.asarray(t)[:, 11].all()


def test_anneal_oracle_promotes_what_is_read():
    obs = observation()
    f = np.zeros((H, L, N), np.float32)
    f[:, :, 10:16] = 1.0  # six host blocks read at every step
    obs = P.Observation(**{**obs.__dict__, "forecast": jnp.asarray(f)})
    pol = P.Anneal(name="anneal-oracle", forecast="oracle", window=H, config=FAST, fixed_bytes=0.0)
    _, t = pol.plan(pol.init(L, N), obs)
    # link-bound: the reads go to HBM up to the balance point, never to an unread block
    t = np.asarray(t)
    assert t[:, 10:16].sum() >= 8 and not t[:, :10].any() and not t[:, 16:].any()


def test_visits_oracle_sees_a_visit_in_progress_but_not_one_to_come():
    obs = observation()
    f = np.zeros((H, L, N), np.float32)
    f[:, :, 10:13] = 1.0  # host blocks 10-12 read at every step of the window
    last = np.asarray(obs.last_read).copy()
    last[:, 10:12] = 30  # 10, 11: read at step 30, their visit goes on at step 31
    last[:, 12] = 20  # 12: a visit starting now
    obs = dataclasses.replace(obs, forecast=jnp.asarray(f), last_read=jnp.asarray(last))
    kw = dict(window=H, config=FAST, fixed_bytes=0.0)
    _, t = P.Anneal(forecast="visits", **kw).plan(P.Anneal().init(L, N), obs)
    t = np.asarray(t)
    assert t[:, 10:12].all() and not t[:, 12].any()
    _, t = P.Anneal(forecast="oracle", **kw).plan(P.Anneal().init(L, N), obs)
    assert np.asarray(t)[:, 10:13].all()  # the full oracle promotes all three


@pytest.mark.parametrize("forecast", ["ema", "reuse"])
def test_now_forecast_is_the_step_read_then_the_online_forecast_from_after_it(forecast):
    obs = observation(runs=True)
    pol = P.Anneal(forecast=forecast, now=True, window=H, config=FAST)
    a = np.asarray(pol._now_forecast(obs, H))
    r0 = (np.asarray(obs.forecast[0]) > 0) & np.asarray(obs.valid)
    np.testing.assert_array_equal(a[0], r0)
    # rows 1.. : the online forecast for the window from step + 1, with the step's reads folded
    # in as update_stats folds them (the reuse law's counts are those of the observation)
    stats = imp.Stats(
        obs.last_read, obs.read_ema, obs.mass_ema, obs.window_reads, streak=obs.streak
    )
    after = imp.update_stats(stats, jnp.asarray(r0), jnp.ones((L, N)), obs.step, obs.valid)
    plain = P.Anneal(forecast=forecast, window=H, config=FAST)
    moved = dataclasses.replace(
        obs, last_read=after.last_read, read_ema=after.read_ema, streak=after.streak
    )
    want = np.asarray(plain._online_forecast(moved, obs.step + 1, H - 1))
    np.testing.assert_allclose(a[1:], want, rtol=1e-6, atol=1e-7)
    if forecast == "reuse":  # the random law of `observation` need not favour a fresh read
        return
    # a block that starts a visit now is forecast as one read at the last step
    start = r0 & ~np.asarray(imp.read_last_step(obs.last_read, obs.step))
    ahead = np.asarray(plain._online_forecast(obs, obs.step + 1, H - 1))
    assert (a[1][start] >= ahead[0][start] - 1e-6).all() and (a[1][start] > ahead[0][start]).any()


def test_now_needs_the_step_reads_and_an_online_forecast():
    obs = dataclasses.replace(observation(), forecast=None)
    pol = P.Anneal(now=True, window=H, config=FAST)
    assert pol.needs_forecast and pol.horizon == 1
    with pytest.raises(ValueError, match="needs obs.forecast"):
        pol.plan(pol.init(L, N), obs)
    with pytest.raises(ValueError, match=r"now=True refines an online forecast .* 'oracle'"):
        P.Anneal(forecast="oracle", now=True)


def test_now_promotes_a_visit_that_starts_at_this_step():
    obs = observation()
    f = np.zeros((H, L, N), np.float32)
    f[0, :, 10:13] = 1.0  # host blocks 10-12 read now, never before
    last = np.asarray(obs.last_read).copy()
    last[:, 10:13] = -1
    ema = np.asarray(obs.read_ema).copy()
    ema[:, 10:13] = 0.0
    obs = dataclasses.replace(
        obs, forecast=jnp.asarray(f), last_read=jnp.asarray(last), read_ema=jnp.asarray(ema)
    )
    kw = dict(window=H, config=FAST, fixed_bytes=0.0, link_reserve=0.0)
    _, t = P.Anneal(now=True, **kw).plan(P.Anneal().init(L, N), obs)
    assert np.asarray(t)[:, 10:13].all()  # the promotion rides on this step's read
    _, t = P.Anneal(**kw).plan(P.Anneal().init(L, N), obs)
    assert not np.asarray(t)[:, 10:13].any()  # unseen blocks: nothing to go on


def test_spread_variance_by_hand():
    """The link reads' variance per step: Bernoulli over the blocks left on host (their
    host-side link loads: with ride 1, first-read probabilities after step 0) plus the
    unforeseen reads as a Poisson count; blocks in HBM add nothing."""
    pol = P.Anneal(window=3, ride=1.0, block_bytes=4.0)
    a = jnp.asarray([[[0.5, 0.2, 1.0, 0.5]], [[0.5, 0.5, 0.0, 0.5]], [[1.0, 0.5, 0.0, 0.5]]])
    off = jnp.asarray([[True, True, True, False]])  # block 3 in HBM
    fixed = jnp.asarray([[0.0, 8.0, 2.0]])  # bytes: 2 and 0.5 unforeseen reads at steps 1, 2
    var = np.asarray(pol._link_variance(a, pol._host_loads(a), fixed, off))[:, 0]
    # link loads on host: step 0 the reads (0.5, 0.2, 1.0); step 1 first reads (0.5, 0.5, 0);
    # step 2 first reads 1.0 x (1 - 0.5) = 0.5, 0.5 x (1 - 0.5) = 0.25, 0
    want = [0.25 + 0.16 + 0.0, 0.25 + 0.25 + 2.0, 0.25 + 0.1875 + 0.5]
    np.testing.assert_allclose(var, want, rtol=1e-6)
    plain = np.asarray(P.Anneal(window=3)._link_variance(a, {}, None, off))[:, 0]
    np.testing.assert_allclose(plain, [0.41, 0.5, 0.25], rtol=1e-6)  # the plan held: a(1 - a)


def test_spread_validation_and_wiring(monkeypatch):
    with pytest.raises(ValueError, match="spread must be finite and >= 0, got -1.0"):
        P.Anneal(spread=-1.0)
    seen = []
    real_run = P.anneal.run

    def run(problem, key, config):
        seen.append(problem)
        return real_run(problem, key, config)

    monkeypatch.setattr(P.anneal, "run", run)
    obs = observation()
    kw = dict(window=H, config=FAST, forecast="reuse", unforeseen=True, ride=1.0)
    P.Anneal(**kw).plan(P.Anneal().init(L, N), obs)
    pol = P.Anneal(spread=1.5, **kw)
    pol.plan(pol.init(L, N), obs)
    assert seen[0].spread is None
    pr = seen[1]
    a = jnp.swapaxes(pr.forecast, 0, 1)  # [W, L, N]
    var = pol._link_variance(a, pol._host_loads(a), pr.fixed_link, ~obs.in_hbm & obs.valid)
    unit = pol.block_bytes / pol.profile.link_bandwidth
    np.testing.assert_allclose(pr.spread, 1.5 * unit * np.sqrt(np.asarray(var)).T, rtol=1e-5)
    assert (np.asarray(pr.spread) > 0).all()


def test_compensation_triggers_on_a_bad_forecast():
    pol = P.Anneal(window=H, compensate=True, config=FAST, error_threshold=0.15)
    obs = observation()
    st = pol.init(L, N)
    st, _ = pol.plan(st, obs)
    bad = P.Observation(**{**obs.__dict__, "window_reads": obs.window_reads * 0 + 5.0 * obs.valid})
    st2, _ = pol.plan(st, bad)
    assert int(st2.compensations) == 1


def test_compensation_compares_reads_with_the_steps_they_cover():
    # planning every step over a W = 5 lookahead: the reads of the one step between plans are
    # compared with that step's forecast (not the whole window's), so an exact forecast passes
    pol = P.Anneal(
        forecast="oracle", window=H, interval=1, compensate=True, config=FAST, error_threshold=0.15
    )
    obs = observation()
    st, _ = pol.plan(pol.init(L, N), obs)
    exact = P.Observation(**{**obs.__dict__, "window_reads": obs.forecast[0]})
    st, _ = pol.plan(st, exact)
    assert int(st.compensations) == 0


def test_adaptive_window_moves_by_step_within_bounds():
    pol = P.Anneal(window=50, adaptive=True, config=FAST, min_window=20, max_window=60)
    obs = observation(forecast=False)
    st = pol.init(L, N)
    st, _ = pol.plan(st, obs)  # hit rate >= 0 (previous): grow
    assert int(pol.next_window(st)) == 60
    st, _ = pol.plan(st, obs)
    assert int(pol.next_window(st)) == 60  # clipped at max_window
    worse = P.Observation(**{**obs.__dict__, "in_hbm": obs.in_hbm & False})
    st, _ = pol.plan(st, worse)
    assert int(pol.next_window(st)) == 50


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("window", 0, "Anneal window=0: expected an integer >= 1"),
        ("interval", -1, "Anneal interval=-1: expected an integer >= 0"),
        ("discount", float("nan"), "Anneal discount=nan: expected a finite number in (0, 1]"),
        ("demote_cost", -1.0, "Anneal demote_cost=-1.0: expected a finite number >= 0"),
    ],
)
def test_anneal_rejects_bad_fields(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        P.Anneal(**{field: value})


def test_unlimited_refuses_to_plan():
    with pytest.raises(ValueError, match=r"'unlimited' is a bound computed by jaxkv.cost"):
        P.Unlimited().plan((), observation())


def test_oracle_without_forecast_is_rejected():
    with pytest.raises(ValueError, match=r"policy 'page' needs obs.forecast"):
        P.Page().plan((), observation(forecast=False))


def test_unknown_policy_lists_names():
    with pytest.raises(ValueError, match=r"unknown policy 'belady'.*anneal-oracle.*paper-sa"):
        P.get_policy("belady")


def test_bad_forecast_kind():
    with pytest.raises(ValueError, match=r"forecast must be one of \('ema', 'reuse', .*got 'x'"):
        P.Anneal(forecast="x")


def test_reuse_needs_the_reuse_counts():
    obs = dataclasses.replace(observation(), since_seen=None)
    pol = P.Anneal(forecast="reuse", window=H, config=FAST)
    with pytest.raises(ValueError, match=r"forecast='reuse' needs obs.since_seen"):
        pol.plan(pol.init(L, N), obs)


def test_bad_tail():
    with pytest.raises(ValueError, match=r"tail needs forecast='oracle' or 'visits', got 'ema'"):
        P.Anneal(tail=4)
    with pytest.raises(ValueError, match=r"tail must be >= 0, tail_decay in \(0, 1\]"):
        P.Anneal(forecast="oracle", tail=4, tail_decay=0.0)
    with pytest.raises(ValueError, match=r"overflow_link_ratio > 0; got .* 0.0"):
        P.Anneal(forecast="oracle", tail=4, overflow_link_ratio=0.0)


def test_tail_value_prices_a_resident_block_by_its_next_read_after_the_window():
    obs = observation()
    pol = P.Anneal(
        forecast="oracle", window=2, tail=3, tail_value=0.5, tail_decay=0.5, overflow_value=0.0
    )
    v = np.asarray(pol._tail_value(obs, 2))
    f = np.asarray(obs.forecast)[2:5] > 0  # the tail steps, [3, L, N]
    unit = pol.block_bytes / pol.profile.link_bandwidth
    for li, i in [(0, 0), (0, 5), (1, 7), (1, 19), (0, 22)]:
        hits = np.flatnonzero(f[:, li, i])
        resident = obs.valid[li, i] and obs.in_hbm[li, i]
        want = 0.5 * unit * 0.5 ** hits[0] if hits.size and resident else 0.0
        assert v[li, i] == pytest.approx(want)
    # only resident blocks carry the value (what demoting them costs later); host blocks none
    assert np.all(v[~np.asarray(obs.in_hbm)] == 0.0)
    assert np.any(v[np.asarray(obs.in_hbm)] > 0.0)
    # a pool with room for every valid block (20 here) never evicts: no value at all
    roomy = dataclasses.replace(obs, capacity=20)
    assert not np.asarray(pol._tail_value(roomy, 2)).any()


def test_dual_takes_the_value_to_go_at_the_window_end_and_keeps_the_dearest_block():
    obs = observation()
    r = np.random.default_rng(3)
    vg = jnp.asarray(r.random((H, L, N)) * 1e-3, jnp.float32)
    pol = P.Anneal(name="anneal-oracle+dual", forecast="oracle", window=2, dual=True, config=FAST)
    assert pol.needs_values and pol.horizon == 2
    v = np.asarray(pol._tail_value(dataclasses.replace(obs, value_to_go=vg), 2))
    np.testing.assert_allclose(v, np.where(obs.valid, vg[1], 0.0))  # row W - 1, valid only
    # nothing read in the window, a pool of one slot: the block the dual values most stays
    quiet = dataclasses.replace(obs, forecast=jnp.zeros_like(obs.forecast), capacity=1)
    for li, i in ((0, 3), (1, 17)):
        vals = jnp.zeros((H, L, N), jnp.float32).at[:, li, i].set(1.0)
        _, t = pol.plan(pol.init(L, N), dataclasses.replace(quiet, value_to_go=vals))
        assert np.asarray(t)[li, i] and np.asarray(t)[li].sum() == 1


def test_dual_validation():
    msg = r"dual=True .* needs forecast='oracle' and adaptive=False"
    with pytest.raises(ValueError, match=msg):
        P.Anneal(forecast="ema", dual=True)
    with pytest.raises(ValueError, match=msg):
        P.Anneal(forecast="oracle", adaptive=True, dual=True)
    pol = P.Anneal(forecast="oracle", window=2, dual=True, config=FAST)
    with pytest.raises(ValueError, match=r"needs obs.value_to_go of shape \[>= 2, layers, N\]"):
        pol.plan(pol.init(L, N), observation())


def test_overflow_value_counts_every_read_after_the_window_where_the_pool_overflows():
    obs = observation()
    f = np.zeros((H, L, N), np.float32)
    # layer 0: the first step reads 8 blocks > CAP = 6 (overflow); layer 1 reads 3 (no overflow)
    f[0, 0, [0, 1, 2, 3, 10, 11, 12, 13]] = 1.0
    f[0, 1, [0, 10, 11]] = 1.0
    f[2:, :, [0, 10]] = 1.0  # blocks 0 (resident) and 10 (host) read at all 3 tail steps
    f[4, :, [1, 14]] = 1.0  # block 1 (resident) and 14 (host, unread at step 0): the last one
    obs = dataclasses.replace(obs, forecast=jnp.asarray(f))
    pol = P.Anneal(forecast="oracle", window=2, tail=3, tail_value=0.5, tail_decay=0.5)
    pol = dataclasses.replace(pol, overflow_value=0.2)
    v = np.asarray(pol._tail_value(obs, 2))
    unit = pol.block_bytes / pol.profile.link_bandwidth
    # layer 0: every read after the window, for resident blocks and the first step's reads
    assert v[0, 0] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    assert v[0, 10] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    assert v[0, 1] == pytest.approx(0.2 * unit * 0.25)
    assert v[0, 14] == 0.0  # on host and not read at the first step: no prefetch value
    assert v[0, 2] == 0.0  # read at the first step only
    # layer 1: Belady's value (the next read), resident blocks only
    assert v[1, 0] == pytest.approx(0.5 * unit)
    assert v[1, 1] == pytest.approx(0.5 * unit * 0.25)
    assert v[1, 10] == 0.0 and v[1, 14] == 0.0
    # without weights, layer 1's first step (1 resident read, 2 host reads) is link-bound under
    # the current placement: the whole-visit value applies there too
    v = np.asarray(dataclasses.replace(pol, fixed_bytes=0.0)._tail_value(obs, 2))
    assert v[1, 0] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    assert v[1, 10] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    assert v[1, 14] == 0.0
    # link-bound by 1.1 x only: below the default ratio (1.2) Belady's value stays
    b, prof = pol.block_bytes, pol.profile
    fixed = prof.hbm_bandwidth * 2 * b / (prof.link_bandwidth * 1.1) - b
    near = dataclasses.replace(pol, fixed_bytes=fixed)
    assert np.asarray(near._tail_value(obs, 2))[1, 0] == pytest.approx(0.5 * unit)
    v = np.asarray(dataclasses.replace(near, overflow_link_ratio=1.0)._tail_value(obs, 2))
    assert v[1, 0] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    # with `dual`, the dual's value replaces Belady's (layer 1) and the overflow layer keeps its
    # whole-visit value (layer 0)
    vg = np.random.default_rng(5).random((H, L, N)).astype(np.float32)
    dual = dataclasses.replace(pol, dual=True)
    v = np.asarray(dual._tail_value(dataclasses.replace(obs, value_to_go=jnp.asarray(vg)), 2))
    np.testing.assert_allclose(v[1], np.where(obs.valid[1], vg[1, 1], 0.0))
    assert v[0, 0] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    assert v[0, 2] == 0.0


def test_unforeseen_charges_the_reads_the_forecast_cannot_place():
    """Reads per step since the last plan minus the forecast's sum, times the host share of the
    (1 - a0)-weighted cold blocks, in bytes, on every step of the window."""
    obs = observation()
    pol = P.Anneal(forecast="ema", window=H, interval=1, unforeseen=True)
    state = pol.init(L, N)
    a = jnp.full((H, L, N), 0.1, jnp.float32) * obs.valid[None]
    a0 = a[0]
    got = np.asarray(pol._unforeseen_link(a, a0, obs, state))  # [L, H]
    wr, valid, hbm = (np.asarray(x) for x in (obs.window_reads, obs.valid, obs.in_hbm))
    for li in range(L):
        missing = max(wr[li].sum() / 1.0 - 0.1 * valid[li].sum(), 0.0)
        cold = 0.9 * valid[li]
        share = (cold * ~hbm[li]).sum() / cold.sum()
        np.testing.assert_allclose(got[li], pol.block_bytes * missing * share, rtol=1e-5)


def test_bad_ride():
    with pytest.raises(ValueError, match=r"ride must lie in \[0, 1\], got 1.5"):
        P.Anneal(ride=1.5)


def test_ride_prices_a_host_block_by_its_first_read():
    # forecast [W=5, layers=1, N=3]: block 0 read at steps 0, 2, 3; block 1 at 1, 2, 4; block 2
    # with probability 0.5 at every step
    a = jnp.asarray([[1.0, 0, 1, 1, 0], [0, 1, 1, 0, 1], [0.5] * 5]).T[:, None, :]
    h = P.Anneal(ride=1.0)._host_loads(a)
    hh, hl = np.asarray(h["host_hbm"][0]).T, np.asarray(h["host_link"][0]).T  # [N, W]
    # step 0 as held (a host read); later reads hit HBM, the first of them crosses the link
    np.testing.assert_allclose(hl[0], [1, 0, 1, 0, 0])
    np.testing.assert_allclose(hl[1], [0, 1, 0, 0, 0])
    np.testing.assert_allclose(hl[2], [0.5, 0.5, 0.25, 0.125, 0.0625])
    np.testing.assert_allclose(hh, np.asarray(a[:, 0]).T * (np.arange(5) >= 1))
    half = P.Anneal(ride=0.5)._host_loads(a)
    np.testing.assert_allclose(np.asarray(half["host_link"][0]).T[0], [1, 0, 1, 0.5, 0])


def test_ride_charges_the_displaced_block_where_the_pool_is_full():
    """With an exclusive cache (demote_cost 1) a first-read promotion in a full pool also
    demotes a block: one more crossing of the link and one more HBM access."""
    a = jnp.asarray([[1.0, 0, 1, 1, 0], [0, 1, 1, 0, 1]]).T[:, None, :]  # [W=5, layers=1, N=2]
    a2 = jnp.concatenate([a, a], axis=1)  # two layers: pool full in layer 0 only
    pol = P.Anneal(ride=1.0, demote_cost=1.0)
    h = pol._host_loads(a2, jnp.asarray([True, False]))
    plain = pol._host_loads(a2)
    first = np.asarray([[0, 0, 1, 0, 0], [0, 1, 0, 0, 0]], np.float32)  # [N, W]
    for key in ("host_link", "host_hbm"):
        got, ref = np.asarray(h[key]), np.asarray(plain[key])
        np.testing.assert_allclose(got[1], ref[1])  # room in the pool: nothing displaced
        np.testing.assert_allclose(got[0], ref[0] + first.T)
    free = P.Anneal(ride=1.0, demote_cost=0.0)._host_loads(a2, jnp.asarray([True, True]))
    np.testing.assert_allclose(np.asarray(free["host_link"]), np.asarray(plain["host_link"]))


def test_now_with_an_exclusive_cache_promotes_what_it_reads_again():
    """The decode loop's exclusive cache (demote_cost 1): a block read now and at the next
    steps replaces a resident block nobody reads. Before the displaced block was priced into
    ride's re-plans, every plan left it on host for the next plan to promote."""
    n, cap = 6, 2
    valid = jnp.ones((1, n), bool)
    in_hbm = jnp.asarray([[True, True, False, False, False, False]])
    step = jnp.int32(40)
    # block 0 is read every step (resident), block 1 not since step 5, block 4 every step (on
    # host): the EMA forecast reads them at 0.9, 0.01 and 0.9
    last = jnp.asarray([[39, 5, -1, -1, 39, -1]], jnp.int32)
    obs = P.Observation(
        in_hbm=in_hbm,
        valid=valid,
        last_read=last,
        read_ema=jnp.asarray([[0.9, 0.01, 0, 0, 0.9, 0]], jnp.float32),
        mass_ema=jnp.zeros((1, n), jnp.float32),
        step=step,
        forecast=jnp.asarray([[[1.0, 0, 0, 0, 1, 0]]]),
        window_reads=jnp.asarray([[1.0, 0, 0, 0, 1, 0]]),
        capacity=cap,
    )
    slow = HardwareProfile("slow-link", hbm_bandwidth=1e13, link_bandwidth=1e9, hbm_bytes=1e9)
    pol = P.get_policy(
        "anneal",
        **P.modifier_kwargs(("now",)),
        window=3,
        demote_cost=1.0,
        profile=slow,
        block_bytes=2048.0,
        fixed_bytes=1e5,
        config=FAST,
    )
    _, target = pol.plan(pol.init(1, n), obs)
    assert np.asarray(target[0]).tolist() == [True, False, False, False, True, False]


def test_split_name_and_modifier_kwargs():
    assert P.split_name("anneal+reuse+now") == ("anneal", ("reuse", "now"))
    assert P.split_name("lru") == ("lru", ())
    kw = P.modifier_kwargs(("reuse", "now"))
    assert kw["forecast"] == "reuse" and kw["now"] and kw["ride"] == 1.0
    assert kw["spread"] == P.NOW_SPREAD and not kw["adaptive"] and not kw["compensate"]
    assert P.modifier_kwargs(("dual",))["dual"] and P.modifier_kwargs(("aw", "ec"))["adaptive"]
    with pytest.raises(ValueError, match=r"unknown policy 'fifo\+now'; expected one of"):
        P.split_name("fifo+now")
    with pytest.raises(ValueError, match=r"\+visits cuts the oracle, for anneal-oracle only"):
        P.split_name("anneal+visits")


def test_bad_link_reserve():
    with pytest.raises(ValueError, match=r"link_reserve must lie in \[0, 1\), got 1.0"):
        P.Anneal(link_reserve=1.0)


def test_link_reserve_derates_online_planning_only():
    online, oracle = P.Anneal(link_reserve=0.25), P.Anneal(forecast="oracle", link_reserve=0.25)
    bw = online.profile.link_bandwidth
    assert online._planning_profile().link_bandwidth == pytest.approx(0.75 * bw)
    assert oracle._planning_profile().link_bandwidth == bw


def test_learned_needs_params():
    with pytest.raises(ValueError, match=r"forecast='learned' needs learned="):
        P.Anneal(forecast="learned")


def test_top_capacity_breaks_ties_by_index():
    t = P.top_capacity(jnp.zeros((1, 5)), jnp.ones((1, 5), bool), 2)
    np.testing.assert_array_equal(t, [[True, True, False, False, False]])
