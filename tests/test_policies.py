"""Policies: the interface contract under jit for every policy, and each policy's rule."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.config import AnnealConfig, HardwareProfile
from jaxkv.cost import CostModel
from jaxkv.placement import policies as P
from jaxkv.placement import presets
from jaxkv.placement import pricing as pr
from jaxkv.placement import statistics as imp
from jaxkv.placement.forecasts import EMA, Now, Reuse
from jaxkv.sim import oracles as O

L, N, CAP, H = 2, 24, 6, 5
ENV = CostModel()  # the environment the old flat Anneal fields defaulted to
NO_WEIGHTS = CostModel(fixed_bytes=0.0)
FAST = AnnealConfig(chains=4, max_iters=200)


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


def anneal(**knobs):
    return presets.anneal_policy(**{"config": FAST, **knobs})


def plan(pol, obs, env=ENV):
    return pol.plan(pol.init(L, N), obs, env)


def problem(pol, obs, env=ENV):
    """The annealing problem of the policy's first plan (what `plan` hands the annealer)."""
    return pol.problem(pol.init(L, N), obs, env)[0]


def terminal_value(pol, obs, env=ENV):
    """The chain of terminal values over the policy's window, as `Anneal.problem` runs it."""
    h = pol.energy_steps
    _, fc = pol.forecast.update((), obs, env, h)
    value = None
    for v in pol.values:
        value = v(value, obs, env, fc, h)
    return value


ALL = {
    "static": P.Static(),
    "lru-plan": P.LruPlan(),
    **{f().name: f() for f in P.FIELD_RULES},
    "page": O.Page(page_blocks=2),
    "paper-sa": O.PaperSA(lookahead=H),
    "anneal": anneal(window=H),
    # (min_window: AdaptiveWindow refuses high < low; the old default 20 > 5 clipped W to 5)
    "anneal+aw+ec": anneal(window=H, min_window=1, max_window=H, adaptive=True, compensate=True),
    "anneal-oracle": anneal(name="anneal-oracle", forecast="oracle", window=H),
    "anneal-oracle+tail": anneal(forecast="oracle", window=2, tail=H - 2),
    "anneal-oracle+dual": anneal(forecast="oracle", window=2, dual=True),
    "anneal+reuse": anneal(forecast="reuse", unforeseen=True, window=H),
    "anneal+reuse+runs": anneal(forecast="reuse", unforeseen=True, window=H),
    "anneal-oracle+visits": anneal(forecast="visits", window=2, tail=H - 2),
    "anneal+now": anneal(now=True, window=H),
    "anneal+reuse+now+runs": anneal(forecast="reuse", unforeseen=True, now=True, window=H),
    "anneal+reuse+now+spread+runs": anneal(
        forecast="reuse", unforeseen=True, now=True, ride=1.0, spread=1.5, window=H
    ),
    "anneal+spread": anneal(spread=1.0, window=H),
    "anneal-learned": anneal(forecast="learned", learned=(1.0, 0, 0, 0, 0, 0, -1.0), window=H),
}


# the default suite plans with every heuristic, the annealer and its most combined variant; the
# other annealer variants (5-8 s each) run in make test-slow, which CI runs
DEFAULT_PLANS = ("anneal", "anneal+reuse+now+spread+runs")


@pytest.mark.parametrize(
    "name",
    [
        n
        if not n.startswith("anneal") or n in DEFAULT_PLANS
        else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(ALL)
    ],
)
def test_plan_is_jittable_within_capacity_and_valid(name):
    pol = ALL[name]
    obs = observation(runs=name.endswith("+runs"))
    if getattr(pol, "needs_values", False):
        vals = np.random.default_rng(1).random((H, L, N)) * 1e-4
        obs = dataclasses.replace(obs, value_to_go=jnp.asarray(vals, jnp.float32))
    state = pol.init(L, N)
    step = jax.jit(lambda s, o: pol.plan(s, o, ENV))
    for _ in range(2):  # state threads through
        state, target = step(state, obs)
    t = np.asarray(target)
    assert t.shape == (L, N) and t.dtype == bool
    assert (t.sum(-1) <= CAP).all()
    assert not (t & ~np.asarray(obs.valid)).any()


RESOLVED = (
    "static lru-plan anneal anneal+reuse anneal+reuse+follow anneal+aw+ec anneal-oracle "
    "anneal-oracle+dual anneal-oracle+visits page paper-sa paper-sa[10,0.5] anneal+reuse+now"
).split()


@pytest.mark.parametrize("name", RESOLVED)
def test_resolve_builds_every_preset_with_the_protocol_attributes(name):
    pol = presets.resolve(name, ENV)
    base, mods = presets.split_name(name)
    oracle = base in ("page", "paper-sa", "anneal-oracle")
    assert pol.name == name
    assert isinstance(pol.horizon, int) and pol.horizon >= 1
    assert (pol.horizon > 1) == (base in ("paper-sa", "anneal-oracle"))
    assert pol.needs_forecast == (oracle or "now" in mods)
    assert pol.needs_forecast == (not presets.is_online(name))
    assert pol.needs_values == ("dual" in mods)
    assert isinstance(pol.rule, P.Follow) == ("follow" in mods)
    assert pol.rule is None or pol.rule.admit == P.FOLLOW_ADMITS_DEFAULT
    assert pol.budget is None
    assert pol.adapts_window == ("aw" in mods)
    w = int(pol.next_window(pol.init(L, N)))
    want = {"static": P.NEVER, "anneal+reuse+now": presets.NOW_WINDOW}
    want.update({"anneal-oracle": 3, "anneal-oracle+visits": 3, "anneal-oracle+dual": 2})
    want.update({n: 50 for n in ("anneal", "anneal+reuse", "anneal+reuse+follow", "anneal+aw+ec")})
    assert w == want.get(name, 1)
    if name == "paper-sa[10,0.5]":
        assert (pol.lookahead, pol.fraction, pol.horizon) == (10, 0.5, 10)


def test_static_never_moves():
    obs = observation()
    _, t = P.Static().plan((), obs)  # env may be omitted
    np.testing.assert_array_equal(t, obs.in_hbm & obs.valid)


def test_page_holds_the_pages_read_next():
    obs = observation()
    f = np.zeros((H, L, N), np.float32)
    f[0, :, [8, 9, 12]] = 1.0  # pages (2 blocks) 4 and 6
    obs = P.Observation(**{**obs.__dict__, "forecast": jnp.asarray(f)})
    _, t = O.Page(page_blocks=2).plan((), obs, ENV)
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
    _, t = O.PaperSA(lookahead=H, fraction=0.5).plan((), obs)
    t = np.asarray(t)
    assert t[:, 1].all() and t[:, 10].all()
    assert not t[:, 11].any()  # R = 0.5 of the two candidates
    assert not t[:, [0, 2, 3, 4, 5]].any()  # resident, not read within the lookahead
    _, t = O.PaperSA(lookahead=H, fraction=1.0).plan((), obs)
    assert np.asarray(t)[:, 11].all()


def test_anneal_oracle_promotes_what_is_read():
    obs = observation()
    f = np.zeros((H, L, N), np.float32)
    f[:, :, 10:16] = 1.0  # six host blocks read at every step
    obs = P.Observation(**{**obs.__dict__, "forecast": jnp.asarray(f)})
    pol = anneal(name="anneal-oracle", forecast="oracle", window=H)
    _, t = plan(pol, obs, NO_WEIGHTS)
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
    _, t = plan(anneal(forecast="visits", window=H), obs, NO_WEIGHTS)
    t = np.asarray(t)
    assert t[:, 10:12].all() and not t[:, 12].any()
    _, t = plan(anneal(forecast="oracle", window=H), obs, NO_WEIGHTS)
    assert np.asarray(t)[:, 10:13].all()  # the full oracle promotes all three


@pytest.mark.parametrize("base", [EMA(), Reuse()], ids=["ema", "reuse"])
def test_now_forecast_is_the_step_read_then_the_online_forecast_from_after_it(base):
    obs = observation(runs=True)
    assert anneal(forecast=base.name, now=True, window=H).forecast == Now(base)
    _, fc = Now(base).update((), obs, ENV, H)
    a = np.asarray(fc.reads)
    r0 = (np.asarray(obs.forecast[0]) > 0) & np.asarray(obs.valid)
    np.testing.assert_array_equal(a[0], r0)
    # rows 1.. : the online forecast for the window from step + 1, with the step's reads folded
    # in as update_stats folds them (the reuse law's counts are those of the observation)
    stats = imp.Stats(
        obs.last_read, obs.read_ema, obs.mass_ema, obs.window_reads, streak=obs.streak
    )
    after = imp.update_stats(stats, jnp.asarray(r0), jnp.ones((L, N)), obs.step, obs.valid)
    moved = dataclasses.replace(
        obs, last_read=after.last_read, read_ema=after.read_ema, streak=after.streak
    )
    want = np.asarray(base.predict(moved, obs.step + 1, H - 1))
    np.testing.assert_allclose(a[1:], want, rtol=1e-6, atol=1e-7)
    if isinstance(base, Reuse):  # the random law of `observation` need not favour a fresh read
        return
    # a block that starts a visit now is forecast as one read at the last step
    start = r0 & ~np.asarray(imp.read_last_step(obs.last_read, obs.step))
    ahead = np.asarray(base.predict(obs, obs.step + 1, H - 1))
    assert (a[1][start] >= ahead[0][start] - 1e-6).all() and (a[1][start] > ahead[0][start]).any()


def test_now_needs_the_step_reads_and_an_online_forecast():
    obs = dataclasses.replace(observation(), forecast=None)
    pol = anneal(now=True, window=H)
    assert pol.needs_forecast and pol.horizon == 1
    with pytest.raises(ValueError, match="policy 'anneal' needs obs.forecast"):
        plan(pol, obs)
    with pytest.raises(ValueError, match=r"now=True refines an online forecast .* 'oracle'"):
        presets.anneal_policy(forecast="oracle", now=True)
    with pytest.raises(ValueError, match=r"Now refines an online forecast \(EMA or Reuse\), got"):
        Now(O.Oracle())


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
    _, t = plan(anneal(now=True, window=H, link_reserve=0.0), obs, NO_WEIGHTS)
    assert np.asarray(t)[:, 10:13].all()  # the promotion rides on this step's read
    _, t = plan(anneal(window=H, link_reserve=0.0), obs, NO_WEIGHTS)
    assert not np.asarray(t)[:, 10:13].any()  # unseen blocks: nothing to go on


def test_spread_variance_by_hand():
    """The link reads' variance per step: Bernoulli over the blocks left on host (their
    host-side link loads: with ride 1, first-read probabilities after step 0) plus the
    unforeseen reads as a Poisson count; blocks in HBM add nothing."""
    a = jnp.asarray([[[0.5, 0.2, 1.0, 0.5]], [[0.5, 0.5, 0.0, 0.5]], [[1.0, 0.5, 0.0, 0.5]]])
    off = jnp.asarray([[True, True, True, False]])  # block 3 in HBM
    fixed = jnp.asarray([[0.0, 8.0, 2.0]])  # bytes: 2 and 0.5 unforeseen reads at steps 1, 2
    var = np.asarray(pr.link_variance(a, pr.host_loads(a, 1.0, 0.0), fixed, off, 4.0))[:, 0]
    # link loads on host: step 0 the reads (0.5, 0.2, 1.0); step 1 first reads (0.5, 0.5, 0);
    # step 2 first reads 1.0 x (1 - 0.5) = 0.5, 0.5 x (1 - 0.5) = 0.25, 0
    want = [0.25 + 0.16 + 0.0, 0.25 + 0.25 + 2.0, 0.25 + 0.1875 + 0.5]
    np.testing.assert_allclose(var, want, rtol=1e-6)
    plain = np.asarray(pr.link_variance(a, {}, None, off, 4.0))[:, 0]
    np.testing.assert_allclose(plain, [0.41, 0.5, 0.25], rtol=1e-6)  # the plan held: a(1 - a)


def test_spread_validation_and_wiring():
    with pytest.raises(ValueError, match=re.escape("Spread k=-1.0: expected a finite number >= 0")):
        presets.anneal_policy(spread=-1.0)
    obs = observation()
    kw = dict(window=H, forecast="reuse", unforeseen=True, ride=1.0)
    assert problem(anneal(**kw), obs).spread is None
    pol = anneal(spread=1.5, **kw)
    assert pr.Spread(1.5) in pol.terms
    prob = problem(pol, obs)
    a = jnp.swapaxes(prob.forecast, 0, 1)  # [W, L, N]
    host = pr.host_loads(a, 1.0, ENV.demote_cost)
    var = pr.link_variance(a, host, prob.fixed_link, ~obs.in_hbm & obs.valid, ENV.block_bytes)
    unit = ENV.block_bytes / ENV.profile.link_bandwidth
    np.testing.assert_allclose(prob.spread, 1.5 * unit * np.sqrt(np.asarray(var)).T, rtol=1e-5)
    assert (np.asarray(prob.spread) > 0).all()


def test_compensation_triggers_on_a_bad_forecast():
    pol = anneal(window=H, compensate=True, error_threshold=0.15)
    assert pol.compensate == pr.Compensate(0.15, 5)
    obs = observation()
    st, _ = plan(pol, obs)
    bad = P.Observation(**{**obs.__dict__, "window_reads": obs.window_reads * 0 + 5.0 * obs.valid})
    st2, _ = pol.plan(st, bad, ENV)
    assert int(st2.compensations) == 1


def test_compensation_compares_reads_with_the_steps_they_cover():
    # planning every step over a W = 5 lookahead: the reads of the one step between plans are
    # compared with that step's forecast (not the whole window's), so an exact forecast passes
    pol = anneal(forecast="oracle", window=H, interval=1, compensate=True, error_threshold=0.15)
    obs = observation()
    st, _ = plan(pol, obs)
    exact = P.Observation(**{**obs.__dict__, "window_reads": obs.forecast[0]})
    st, _ = pol.plan(st, exact, ENV)
    assert int(st.compensations) == 0


def test_adaptive_window_moves_by_step_within_bounds():
    pol = anneal(window=50, adaptive=True, min_window=20, max_window=60)
    assert pol.adaptive == pr.AdaptiveWindow(20, 60, 10) and pol.adapts_window
    obs = observation(forecast=False)
    st, _ = plan(pol, obs)  # hit rate >= 0 (previous): grow
    assert int(pol.next_window(st)) == 60
    st, _ = pol.plan(st, obs, ENV)
    assert int(pol.next_window(st)) == 60  # clipped at max_window
    worse = P.Observation(**{**obs.__dict__, "in_hbm": obs.in_hbm & False})
    st, _ = pol.plan(st, worse, ENV)
    assert int(pol.next_window(st)) == 50


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("window", 0, "Anneal window=0: expected an integer >= 1"),
        ("interval", -1, "Anneal interval=-1: expected an integer >= 0"),
        ("discount", float("nan"), "Anneal discount=nan: expected a finite number in (0, 1]"),
        ("demote_cost", -1.0, "CostModel demote_cost=-1.0: expected a finite number >= 0"),
        ("forecast", "x", f"Anneal forecast must be one of {tuple(presets.FORECASTS)}, got 'x'"),
        ("forecast", "learned", "Anneal forecast='learned' needs learned=(w_0, ..., w_5, b)"),
        ("ride", 1.5, "Ride share=1.5: expected a finite number in [0, 1]"),
        ("link_reserve", 1.0, "LinkReserve share=1.0: expected a finite number in [0, 1)"),
    ],
)
def test_anneal_rejects_bad_fields(field, value, message):
    make = CostModel if field == "demote_cost" else presets.anneal_policy
    with pytest.raises(ValueError, match=re.escape(message)):
        make(**{field: value})


def test_unlimited_refuses_to_plan():
    with pytest.raises(ValueError, match=r"'unlimited' is a bound computed by jaxkv.cost"):
        O.Unlimited().plan((), observation(), ENV)


def test_oracle_without_forecast_is_rejected():
    with pytest.raises(ValueError, match=r"policy 'page' needs obs.forecast"):
        O.Page().plan((), observation(forecast=False))


def test_unknown_policy_lists_names():
    with pytest.raises(ValueError, match=r"unknown policy 'fifo'.*anneal-oracle.*paper-sa"):
        presets.resolve("fifo", ENV)


def test_reuse_needs_the_reuse_counts():
    obs = dataclasses.replace(observation(), since_seen=None)
    pol = anneal(forecast="reuse", window=H)
    with pytest.raises(ValueError, match=r"the reuse forecast needs obs.since_seen"):
        plan(pol, obs)


def test_bad_tail():
    with pytest.raises(ValueError, match=r"BeladyTail values blocks from the true future: it "):
        presets.anneal_policy(tail=4)
    with pytest.raises(ValueError, match=re.escape("tail_decay=0.0: expected a finite")):
        presets.anneal_policy(forecast="oracle", tail=4, tail_decay=0.0)
    with pytest.raises(ValueError, match=re.escape("overflow_link_ratio=0.0: expected a fin")):
        presets.anneal_policy(tail_decay=0.5, overflow_link_ratio=0.0)  # checked without a tail
    with pytest.raises(ValueError, match=re.escape("BeladyTail decay=0.0: expected a finite")):
        O.BeladyTail(4, 0.1, 0.0)


def test_tail_value_prices_a_resident_block_by_its_next_read_after_the_window():
    obs = observation()
    pol = anneal(
        forecast="oracle", window=2, tail=3, tail_value=0.5, tail_decay=0.5, overflow_value=0.0
    )
    assert pol.values == (O.BeladyTail(3, 0.5, 0.5),) and pol.horizon == 5
    v = np.asarray(terminal_value(pol, obs))
    # the plan's annealing problem carries the same value
    np.testing.assert_array_equal(v, problem(pol, obs).value)
    f = np.asarray(obs.forecast)[2:5] > 0  # the tail steps, [3, L, N]
    unit = ENV.block_bytes / ENV.profile.link_bandwidth
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
    assert not np.asarray(terminal_value(pol, roomy)).any()


def test_dual_takes_the_value_to_go_at_the_window_end_and_keeps_the_dearest_block():
    obs = observation()
    r = np.random.default_rng(3)
    vg = jnp.asarray(r.random((H, L, N)) * 1e-3, jnp.float32)
    pol = anneal(name="anneal-oracle+dual", forecast="oracle", window=2, dual=True)
    assert pol.needs_values and pol.horizon == 2 and pol.values == (O.Dual(),)
    v = np.asarray(terminal_value(pol, dataclasses.replace(obs, value_to_go=vg)))
    np.testing.assert_allclose(v, np.where(obs.valid, vg[1], 0.0))  # row W - 1, valid only
    # nothing read in the window, a pool of one slot: the block the dual values most stays
    quiet = dataclasses.replace(obs, forecast=jnp.zeros_like(obs.forecast), capacity=1)
    for li, i in ((0, 3), (1, 17)):
        vals = jnp.zeros((H, L, N), jnp.float32).at[:, li, i].set(1.0)
        _, t = plan(pol, dataclasses.replace(quiet, value_to_go=vals))
        assert np.asarray(t)[li, i] and np.asarray(t)[li].sum() == 1


def test_dual_validation():
    with pytest.raises(ValueError, match=r"Dual values blocks .* needs the Oracle forecast"):
        presets.anneal_policy(forecast="ema", dual=True)
    with pytest.raises(ValueError, match=r"Dual needs a fixed window: got an adaptive one"):
        presets.anneal_policy(forecast="oracle", adaptive=True, dual=True)
    pol = anneal(forecast="oracle", window=2, dual=True)
    with pytest.raises(ValueError, match=r"needs obs.value_to_go of shape \[>= 2, layers, N\]"):
        plan(pol, observation())


def test_overflow_value_counts_every_read_after_the_window_where_the_pool_overflows():
    obs = observation()
    f = np.zeros((H, L, N), np.float32)
    # layer 0: the first step reads 8 blocks > CAP = 6 (overflow); layer 1 reads 3 (no overflow)
    f[0, 0, [0, 1, 2, 3, 10, 11, 12, 13]] = 1.0
    f[0, 1, [0, 10, 11]] = 1.0
    f[2:, :, [0, 10]] = 1.0  # blocks 0 (resident) and 10 (host) read at all 3 tail steps
    f[4, :, [1, 14]] = 1.0  # block 1 (resident) and 14 (host, unread at step 0): the last one
    obs = dataclasses.replace(obs, forecast=jnp.asarray(f))
    kw = dict(forecast="oracle", window=2, tail=3, tail_value=0.5, tail_decay=0.5)
    pol = anneal(overflow_value=0.2, **kw)
    assert pol.values == (O.BeladyTail(3, 0.5, 0.5), O.Overflow(3, 0.2, 0.5, 1.2))
    v = np.asarray(terminal_value(pol, obs))
    unit = ENV.block_bytes / ENV.profile.link_bandwidth
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
    v = np.asarray(terminal_value(pol, obs, NO_WEIGHTS))
    assert v[1, 0] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    assert v[1, 10] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    assert v[1, 14] == 0.0
    # link-bound by 1.1 x only: below the default ratio (1.2) Belady's value stays
    b, prof = ENV.block_bytes, ENV.profile
    near = CostModel(fixed_bytes=prof.hbm_bandwidth * 2 * b / (prof.link_bandwidth * 1.1) - b)
    assert np.asarray(terminal_value(pol, obs, near))[1, 0] == pytest.approx(0.5 * unit)
    ratio = anneal(overflow_value=0.2, overflow_link_ratio=1.0, **kw)
    v = np.asarray(terminal_value(ratio, obs, near))
    assert v[1, 0] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    # with `dual`, the dual's value replaces Belady's (layer 1) and the overflow layer keeps its
    # whole-visit value (layer 0)
    vg = np.random.default_rng(5).random((H, L, N)).astype(np.float32)
    dual = anneal(overflow_value=0.2, dual=True, **kw)
    v = np.asarray(terminal_value(dual, dataclasses.replace(obs, value_to_go=jnp.asarray(vg))))
    np.testing.assert_allclose(v[1], np.where(obs.valid[1], vg[1, 1], 0.0))
    assert v[0, 0] == pytest.approx(0.2 * unit * (1 + 0.5 + 0.25))
    assert v[0, 2] == 0.0


def test_unforeseen_charges_the_reads_the_forecast_cannot_place():
    """Reads per step since the last plan minus the forecast's sum, times the host share of the
    (1 - a0)-weighted cold blocks, in bytes, on every step of the window."""
    obs = observation()
    pol = anneal(forecast="ema", window=H, interval=1, unforeseen=True)
    assert pr.Unforeseen() in pol.terms
    state = pol.init(L, N)
    a = jnp.full((H, L, N), 0.1, jnp.float32) * obs.valid[None]
    ctx = pr.PlanContext(obs, ENV, pol.forecast, a, jnp.ones((H,)), pol.next_window(state))
    got = np.asarray(pr.Unforeseen()(pr.Pricing(ENV.profile), ctx).fixed_link)  # [L, H]
    wr, valid, hbm = (np.asarray(x) for x in (obs.window_reads, obs.valid, obs.in_hbm))
    for li in range(L):
        missing = max(wr[li].sum() / 1.0 - 0.1 * valid[li].sum(), 0.0)
        cold = 0.9 * valid[li]
        share = (cold * ~hbm[li]).sum() / cold.sum()
        np.testing.assert_allclose(got[li], ENV.block_bytes * missing * share, rtol=1e-5)


def test_ride_prices_a_host_block_by_its_first_read():
    # forecast [W=5, layers=1, N=3]: block 0 read at steps 0, 2, 3; block 1 at 1, 2, 4; block 2
    # with probability 0.5 at every step
    a = jnp.asarray([[1.0, 0, 1, 1, 0], [0, 1, 1, 0, 1], [0.5] * 5]).T[:, None, :]
    h = pr.host_loads(a, 1.0, 0.0)
    hh, hl = np.asarray(h["host_hbm"][0]).T, np.asarray(h["host_link"][0]).T  # [N, W]
    # step 0 as held (a host read); later reads hit HBM, the first of them crosses the link
    np.testing.assert_allclose(hl[0], [1, 0, 1, 0, 0])
    np.testing.assert_allclose(hl[1], [0, 1, 0, 0, 0])
    np.testing.assert_allclose(hl[2], [0.5, 0.5, 0.25, 0.125, 0.0625])
    np.testing.assert_allclose(hh, np.asarray(a[:, 0]).T * (np.arange(5) >= 1))
    half = pr.host_loads(a, 0.5, 0.0)
    np.testing.assert_allclose(np.asarray(half["host_link"][0]).T[0], [1, 0, 1, 0.5, 0])


def test_ride_charges_the_displaced_block_where_the_pool_is_full():
    """With an exclusive cache (demote_cost 1) a first-read promotion in a full pool also
    demotes a block: one more crossing of the link and one more HBM access."""
    a = jnp.asarray([[1.0, 0, 1, 1, 0], [0, 1, 1, 0, 1]]).T[:, None, :]  # [W=5, layers=1, N=2]
    a2 = jnp.concatenate([a, a], axis=1)  # two layers: pool full in layer 0 only
    h = pr.host_loads(a2, 1.0, 1.0, jnp.asarray([True, False]))
    plain = pr.host_loads(a2, 1.0, 1.0)
    first = np.asarray([[0, 0, 1, 0, 0], [0, 1, 0, 0, 0]], np.float32)  # [N, W]
    for key in ("host_link", "host_hbm"):
        got, ref = np.asarray(h[key]), np.asarray(plain[key])
        np.testing.assert_allclose(got[1], ref[1])  # room in the pool: nothing displaced
        np.testing.assert_allclose(got[0], ref[0] + first.T)
    free = pr.host_loads(a2, 1.0, 0.0, jnp.asarray([True, True]))
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
    env = CostModel(profile=slow, block_bytes=2048.0, fixed_bytes=1e5, demote_cost=1.0)
    pol = presets.resolve("anneal+now", env, presets.Settings(config=FAST), window=3)
    _, target = pol.plan(pol.init(1, n), obs, env)
    assert np.asarray(target[0]).tolist() == [True, False, False, False, True, False]


def test_split_name_and_modifier_knobs():
    assert presets.split_name("anneal+reuse+now") == ("anneal", ("reuse", "now"))
    assert presets.split_name("lru-plan") == ("lru-plan", ())
    knobs = {**presets.MODIFIERS["reuse"].knobs, **presets.MODIFIERS["now"].knobs}
    for pol in (presets.anneal_policy(**knobs), presets.resolve("anneal+reuse+now", ENV)):
        assert pol.forecast == Now(Reuse())
        assert pol.terms == (
            pr.Unforeseen(),
            pr.Ride(1.0),
            pr.Spread(presets.NOW_SPREAD),
        )  # no reserve
        assert pol.adaptive is None and pol.compensate is None and pol.follow is None
    assert O.ORACLE_MODIFIERS["dual"].knobs["dual"]
    assert O.Dual() in presets.resolve("anneal-oracle+dual", ENV).values
    assert presets.MODIFIERS["aw"].knobs["adaptive"] and presets.MODIFIERS["ec"].knobs["compensate"]
    aw = presets.resolve("anneal+aw+ec", ENV)
    assert aw.adaptive == pr.AdaptiveWindow(25, 100, 10) and aw.compensate == pr.Compensate()
    with pytest.raises(ValueError, match=r"unknown policy 'fifo\+now'; expected one of"):
        presets.split_name("fifo+now")
    with pytest.raises(ValueError, match=r"policy 'anneal\+visits': \+visits .*anneal-oracle"):
        presets.split_name("anneal+visits")


def test_follow_validation():
    with pytest.raises(ValueError, match=r"Anneal follow plans a target from an online forecast"):
        presets.anneal_policy(follow=True, now=True)
    with pytest.raises(ValueError, match=r"Anneal follow plans a target .* got forecast Oracle"):
        presets.anneal_policy(forecast="oracle", follow=True)
    with pytest.raises(ValueError, match=r"Follow admit must be one of \('read', .*got 'x'"):
        presets.anneal_policy(follow=True, follow_admit="x")


def test_link_reserve_derates_online_planning_only():
    bw = ENV.profile.link_bandwidth
    obs = observation()
    for forecast, want in (("ema", 0.75 * bw), ("oracle", bw)):
        pol = anneal(forecast=forecast, link_reserve=0.25, window=H)
        assert pr.LinkReserve(0.25) in pol.terms
        assert problem(pol, obs).profile.link_bandwidth == pytest.approx(want)


def test_top_capacity_breaks_ties_by_index():
    t = P.top_capacity(jnp.zeros((1, 5)), jnp.ones((1, 5), bool), 2)
    np.testing.assert_array_equal(t, [[True, True, False, False, False]])


def test_oracle_knob_defaults_are_the_parts_defaults():
    """The simulator adds its parts' knobs to anneal's (the runtime never imports it), their
    defaults read from the parts themselves."""
    b, ov = O.BeladyTail(), O.Overflow()
    k = presets.all_knobs()
    assert (k["tail_value"], k["tail_decay"]) == (b.value, b.decay)
    assert (k["overflow_value"], k["overflow_link_ratio"]) == (ov.value, ov.link_ratio)
    assert ov.decay == b.decay  # one tail_decay knob serves both
    assert set(O.ORACLE_KNOBS) <= set(k) and not set(O.ORACLE_KNOBS) & set(presets.KNOBS)


def test_policy_lists_split_at_top_level_commas_only():
    from jaxkv.placement.presets import split_policies

    assert split_policies("static, paper-sa[10,0.5],lru") == ["static", "paper-sa[10,0.5]", "lru"]
    assert split_policies("paper-sa[2,0.5],paper-sa[50,0.25]") == [
        "paper-sa[2,0.5]",
        "paper-sa[50,0.25]",
    ]
    for bad in ("paper-sa[10,0.5", "lru]", "a]b[c"):
        with pytest.raises(ValueError, match="unbalanced brackets"):
            split_policies(bad)
