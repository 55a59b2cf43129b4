"""Annealer: brute-force optimum, capacity, determinism, O(W) deltas, compile once."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.config import AnnealConfig, HardwareProfile
from jaxkv.placement import anneal
from jaxkv.placement.anneal import greedy
from jaxkv.placement.anneal import problem as anneal_problem

PROF = HardwareProfile.preset("gh200-paper")
B = 16384.0


def problem(seed, n=12, w=8, cap=4, layers=1, invalid=0):
    """Random instance: 0/1 forecasts, random x0, budget, demotion cost and piggybacks; even
    seeds add a terminal value on about half the blocks (odd seeds: none); seeds = 3 mod 4 price
    host blocks with their own HBM and link loads (host_hbm, host_link); seeds = 2 mod 3 give
    each step a spread (expected step times under uncertain loads)."""
    r = np.random.default_rng(seed)
    a = (r.random((layers, w, n)) < r.random((layers, 1, n))).astype(np.float32)
    valid = np.ones((layers, n), bool)
    valid[:, n - invalid :] = False
    x0 = np.zeros((layers, n), bool)
    for li in range(layers):
        x0[li, r.choice(n - invalid, cap, replace=False)] = True
    host = {}
    if seed % 4 == 3:  # e.g. promoted at the first read: that read on the link, the rest in HBM
        host = dict(
            host_hbm=jnp.asarray(a * r.random(a.shape), jnp.float32),
            host_link=jnp.asarray(a * r.random(a.shape), jnp.float32),
        )
    return anneal.AnnealProblem(
        **host,
        forecast=jnp.asarray(a),
        x0=jnp.asarray(x0),
        valid=jnp.asarray(valid),
        fixed=jnp.full((w,), B * r.uniform(0, 20), jnp.float32),
        weight=jnp.asarray(r.uniform(0.5, 1.0) ** np.arange(w), jnp.float32),
        promote_hbm=jnp.asarray(r.random((layers, n)), jnp.float32),
        promote_link=jnp.asarray(r.random((layers, n)) < 0.5, jnp.float32),
        profile=PROF,
        block_bytes=B,
        capacity=cap,
        budget=(3, 8)[seed % 2],
        demote_cost=float(seed % 2),
        fixed_link=None if seed % 2 else jnp.asarray(r.uniform(0, 3, (layers, w)) * B, jnp.float32),
        value=None
        if seed % 2
        else jnp.asarray(
            (r.random((layers, n)) < 0.5) * r.uniform(0, 2, (layers, n)) * B / PROF.link_bandwidth,
            jnp.float32,
        ),
        spread=jnp.asarray(r.uniform(0, 3, (layers, w)) * B / PROF.link_bandwidth, jnp.float32)
        if seed % 3 == 2
        else None,
    )


def brute_force(pr, n=12, cap=4):
    xs = []
    x0 = np.asarray(pr.x0[0])
    for k in range(cap + 1):
        for c in itertools.combinations(range(n), k):
            x = np.zeros(n, bool)
            x[list(c)] = True
            if (x != x0).sum() <= pr.budget and not (x & ~np.asarray(pr.valid[0])).any():
                xs.append(x)
    return float(jnp.min(anneal.energy(pr, jnp.asarray(np.stack(xs))[None])))


@pytest.mark.slow  # default suite: about 40 s (CI runs make test-slow)
def test_finds_brute_force_optimum_in_95_percent_of_seeded_runs():
    hits, runs = 0, 40
    for seed in range(runs):
        pr = problem(seed)
        e = anneal.run(pr, jax.random.key(seed)).energy
        opt = brute_force(pr)
        hits += float(e[0]) <= opt * (1 + 1e-6)
        assert float(e[0]) >= opt * (1 - 1e-6)  # never below the true optimum
    assert hits >= 0.95 * runs, f"{hits}/{runs}"


@pytest.mark.slow  # about 25 s a half
@pytest.mark.parametrize("seeds", [range(10), range(10, 20)])
def test_annealing_improves_on_its_greedy_init(seeds):
    """Never above the greedy start; below it on some instances (seeds 2 and 9 of the first ten;
    the second ten, in `make test-slow`, are all solved by the start)."""
    gaps = 0
    for seed in seeds:
        pr = problem(seed)
        g = float(anneal.energy(pr, anneal.greedy_init(pr))[0])
        e = anneal.run(pr, jax.random.key(seed)).energy
        assert float(e[0]) <= g * (1 + 1e-6)
        gaps += float(e[0]) < g * (1 - 1e-6)
    assert gaps > 0 or seeds.start > 0  # the first ten are not all solved by the init


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2))])
def test_never_exceeds_capacity_budget_or_validity(seed):
    pr = problem(seed, n=40, w=6, cap=10, layers=3, invalid=7)
    res = anneal.run(pr, jax.random.key(seed), AnnealConfig(chains=4, max_iters=300, patience=300))
    x, e, st = np.asarray(res.x), res.energy, res.state
    assert (x.sum(-1) <= 10).all()
    assert not (x & ~np.asarray(pr.valid)).any()
    assert ((x != np.asarray(pr.x0)).sum(-1) <= pr.budget).all()
    assert (np.asarray(st.best_x).sum(-1) <= 10).all()
    np.testing.assert_allclose(anneal.energy(pr, jnp.asarray(x)), e, rtol=1e-5)


def test_same_seed_same_answer():
    pr = problem(7, n=30, w=5, cap=8, layers=2)
    r1 = anneal.run(pr, jax.random.key(3))
    r2 = anneal.run(pr, jax.random.key(3))
    np.testing.assert_array_equal(r1.x, r2.x)
    np.testing.assert_array_equal(r1.energy, r2.energy)


@pytest.mark.parametrize("seed", [7, pytest.param(2, marks=pytest.mark.slow)])  # 25 s each
def test_fixed_trip_loop_equals_the_converging_loop(seed):
    """A GPU runs `max_iters` iterations that keep the state once every chain has stopped (no
    host sync per iteration); a CPU exits the loop then. Same answer, metrics included: the
    chains stop well before max_iters here, so the frozen iterations are exercised."""
    pr = problem(seed, n=30, w=5, cap=8, layers=2)
    cfg = AnnealConfig(max_iters=120)
    a = anneal.run(pr, jax.random.key(3), cfg, loop="converge")
    b = anneal.run(pr, jax.random.key(3), cfg, loop="fixed")
    auto = anneal.run(pr, jax.random.key(3), cfg)  # this CPU: the converging loop
    assert int(a.metrics.iterations) < cfg.max_iters, "no chain stopped early: nothing frozen"
    for r in (b, auto):
        np.testing.assert_array_equal(r.x, a.x)
        for f in dataclasses.fields(a.metrics):
            np.testing.assert_array_equal(getattr(r.metrics, f.name), getattr(a.metrics, f.name))
    with pytest.raises(ValueError, match="loop='fast'"):
        anneal.run(pr, jax.random.key(3), cfg, loop="fast")


@pytest.mark.parametrize("seed", [10, *(pytest.param(s, marks=pytest.mark.slow) for s in (11, 12))])
def test_delta_energy_equals_full_recompute(seed):
    pr = problem(seed, n=30, w=7, cap=9, layers=2)
    cfg = AnnealConfig(chains=5, patience=100)
    st = anneal.init(pr, jax.random.key(0), cfg)
    # every chain runs, hot enough to wander (a certified start would not move)
    st = dataclasses.replace(
        st, certified=jnp.zeros_like(st.certified), t0=st.start_energy, stall=0 * st.stall
    )
    for _ in range(60):
        st = anneal.step(pr, st, cfg)
    hbm, link = anneal.loads(pr, st.x)
    np.testing.assert_allclose(st.hbm, hbm, rtol=1e-5, atol=1.0)
    np.testing.assert_allclose(st.link, link, rtol=1e-5, atol=1.0)
    np.testing.assert_allclose(st.energy, anneal.energy(pr, st.x), rtol=1e-5)
    # the counts stay consistent with x and x0
    x = np.asarray(st.x)
    np.testing.assert_array_equal(st.count, x.sum(-1))
    np.testing.assert_array_equal(st.moved, (x != np.asarray(pr.x0)[:, None]).sum(-1))
    assert int(st.it) == 60
    assert (np.asarray(st.accepted) > 10).all()


def test_host_loads_by_hand():
    # two blocks, two steps, capacity 1; block 0 read at both steps, block 1 at step 1 only.
    a = jnp.asarray([[[1.0, 0.0], [1.0, 1.0]]])
    pr = anneal.AnnealProblem(
        forecast=a,
        x0=jnp.asarray([[True, False]]),
        valid=jnp.ones((1, 2), bool),
        fixed=jnp.zeros(2, jnp.float32),
        weight=jnp.ones(2, jnp.float32),
        promote_hbm=jnp.ones((1, 2), jnp.float32),
        promote_link=jnp.ones((1, 2), jnp.float32),
        profile=PROF,
        block_bytes=B,
        capacity=1,
        # on host, block 1's step-1 read is carried by the link and written to HBM
        host_hbm=jnp.asarray([[[0.0, 0.0], [0.0, 1.0]]]),
        host_link=jnp.asarray([[[1.0, 0.0], [1.0, 1.0]]]),
    )
    hbm, link = anneal.loads(pr, jnp.asarray([[[True, False], [False, True]]]))
    # x = (1, 0): step 0 HBM reads block 0; step 1 HBM reads block 0 and writes block 1, whose
    # read crosses the link
    np.testing.assert_allclose(hbm[0, 0], [B, 2 * B])
    np.testing.assert_allclose(link[0, 0], [0.0, B])
    # x = (0, 1): block 1 promoted (link + HBM at step 0); block 0 on host at both steps
    np.testing.assert_allclose(hbm[0, 1], [B, B])
    np.testing.assert_allclose(link[0, 1], [2 * B, B])


def test_compiled_once_per_shape():
    anneal.run(problem(0), jax.random.key(0))
    size = anneal.run._cache_size()
    # seeds of seed 0's structure (even, not 2 mod 3, not 3 mod 4: `problem`): same shapes,
    # statics and optional fields (seed 2's spread is a new pytree; the test passed only while
    # an earlier test in the same worker had compiled that variant)
    for seed in (4, 6, 12):
        anneal.run(problem(seed), jax.random.key(seed))  # same shapes and statics
    assert anneal.run._cache_size() == size
    anneal.run(problem(0, n=13), jax.random.key(0))  # a new shape compiles once more
    assert anneal.run._cache_size() == size + 1


def test_terminal_value_keeps_the_blocks_needed_soonest():
    """With nothing read in the window, the terminal value alone decides what stays (Belady)."""
    n, cap = 10, 3
    v = np.zeros((1, n), np.float32)
    v[0, [2, 5, 7, 8]] = np.array([4.0, 1.0, 3.0, 2.0]) * B / PROF.link_bandwidth
    pr = anneal.AnnealProblem(
        forecast=jnp.zeros((1, 4, n), jnp.float32),
        x0=jnp.asarray(np.arange(n)[None] < cap),
        valid=jnp.ones((1, n), bool),
        fixed=jnp.full((4,), B, jnp.float32),
        weight=jnp.ones((4,), jnp.float32),
        promote_hbm=jnp.ones((1, n), jnp.float32),
        promote_link=jnp.zeros((1, n), jnp.float32),  # promotions ride on reads: link-free
        profile=PROF,
        block_bytes=B,
        capacity=cap,
        value=jnp.asarray(v),
    )
    res = anneal.run(pr, jax.random.key(0))
    x, e = res.x, res.energy
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(x[0])), [2, 7, 8])
    assert float(e[0]) == pytest.approx(float(anneal.energy(pr, x)[0]), rel=1e-6)
    assert float(e[0]) == pytest.approx(
        float(anneal.energy(pr, jnp.asarray(np.isin(np.arange(n), [2, 7, 8]))[None])[0]), rel=1e-6
    )


def test_settle_keeps_idle_residents_and_drops_idle_promotions():
    """Blocks the window never touches go back where they were: the idle promotion is undone,
    the idle residents refill the free slots by terminal value (then index); busy moves stay."""
    n, cap, w = 10, 5, 3
    a = np.zeros((1, w, n), np.float32)
    a[0, :, [1, 6]] = 1.0  # busy: resident block 1, host block 6
    v = np.zeros((1, n), np.float32)
    v[0, 4] = B / PROF.link_bandwidth  # idle resident with a terminal value
    pr = anneal.AnnealProblem(
        forecast=jnp.asarray(a),
        x0=jnp.asarray(np.arange(n)[None] < cap),  # blocks 0..4 resident
        valid=jnp.ones((1, n), bool),
        fixed=jnp.full((w,), B, jnp.float32),
        weight=jnp.ones((w,), jnp.float32),
        promote_hbm=jnp.ones((1, n), jnp.float32),
        promote_link=jnp.ones((1, n), jnp.float32),
        profile=PROF,
        block_bytes=B,
        capacity=cap,
        value=jnp.asarray(v),
    )
    # the plan: demote busy 1 and idle 0, 2, 3, 4; promote busy 6 and idle 8, 9
    x = jnp.asarray(np.isin(np.arange(n), [6, 8, 9])[None])
    s = np.asarray(anneal.settle(pr, x))
    # 8, 9 undone; 4 free slots beside 6: the valued 4, then 0, 2, 3
    np.testing.assert_array_equal(np.flatnonzero(s[0]), [0, 2, 3, 4, 6])
    assert float(anneal.energy(pr, jnp.asarray(s))[0]) <= float(anneal.energy(pr, x)[0])
    # room for one idle resident: the valued 4 wins over 3 (lower index, no value)
    x2 = jnp.asarray(np.isin(np.arange(n), [0, 1, 2, 6])[None])
    np.testing.assert_array_equal(
        np.flatnonzero(np.asarray(anneal.settle(pr, x2))[0]), [0, 1, 2, 4, 6]
    )


@pytest.mark.parametrize("seed", range(8))
def test_settle_never_raises_energy_capacity_or_moves(seed):
    pr = problem(seed, n=12, cap=4)
    r = np.random.default_rng(seed)
    for _ in range(20):
        x = np.zeros((1, 12), bool)
        x[0, r.choice(12, r.integers(0, 5), replace=False)] = True
        s = np.asarray(anneal.settle(pr, jnp.asarray(x)))
        assert s.sum() <= pr.capacity
        x0 = np.asarray(pr.x0)
        assert (s != x0).sum() <= (x != x0).sum()
        assert not (s & ~np.asarray(pr.valid)).any()
        e_x = float(anneal.energy(pr, jnp.asarray(x))[0])
        assert float(anneal.energy(pr, jnp.asarray(s))[0]) <= e_x * (1 + 1e-6)


def _valued_idle_residents(
    first_only=(), budget=1 << 30, n=40, hosts=(30, 31), value=(0.05, 0.01), fixed=1.0
):
    """A full pool of 30 residents unread in the 2-step window with terminal values value[0],
    value[0] + value[1], ... link transfers; `hosts` read at both steps, `first_only` at the
    first step only; `fixed` HBM bytes per step (x block bytes); a promotion rides on a
    first-step read. Defaults: 40 blocks, host blocks 30 and 31."""
    cap, w = 30, 2
    a = np.zeros((1, w, n), np.float32)
    a[0, :, list(hosts)] = 1.0
    a[0, 0, list(first_only)] = 1.0
    v = np.zeros((1, n), np.float32)
    v[0, :cap] = (value[0] + value[1] * np.arange(cap)) * B / PROF.link_bandwidth
    x0 = np.arange(n)[None] < cap
    return x0, anneal.AnnealProblem(
        forecast=jnp.asarray(a),
        x0=jnp.asarray(x0),
        valid=jnp.ones((1, n), bool),
        fixed=jnp.full((w,), fixed * B, jnp.float32),
        weight=jnp.ones((w,), jnp.float32),
        promote_hbm=jnp.asarray(1.0 - a[:, 0]),  # as the policies price a ride
        promote_link=jnp.ones((1, n), jnp.float32),
        profile=PROF,
        block_bytes=B,
        capacity=cap,
        budget=budget,
        value=jnp.asarray(v),
    )


def test_greedy_init_trades_idle_residents_for_promotions_that_save_reads():
    """Promoting the two host blocks read at both steps (their first read rides, the second
    hits) beats keeping the two least valuable residents. Every prefix of mass, next-read or
    resident-first order either keeps x0 or drops all the residents' value at once; the
    saved-link order finds the swap. Host block 32, read at the first step only, saves
    nothing and stays on host."""
    x0, pr = _valued_idle_residents(first_only=(32,))
    g = np.asarray(anneal.greedy_init(pr))[0]
    np.testing.assert_array_equal(np.flatnonzero(g & ~x0[0]), [30, 31])
    np.testing.assert_array_equal(np.flatnonzero(x0[0] & ~g), [0, 1])
    e_g = float(anneal.energy(pr, jnp.asarray(g[None]))[0])
    assert e_g < float(anneal.energy(pr, jnp.asarray(x0))[0])
    e = anneal.run(pr, jax.random.key(0)).energy
    assert float(e[0]) <= e_g * (1 + 1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_best_swaps_energy_is_exact_and_fits_capacity_and_budget(seed):
    pr = problem(seed, n=12, cap=4, invalid=seed % 3)
    score = jnp.asarray(np.random.default_rng(seed).random((1, 12)), jnp.float32)
    x, e = greedy.best_swaps(pr, score)
    x = np.asarray(x)
    assert x.sum() <= pr.capacity and not (x & ~np.asarray(pr.valid)).any()
    assert (x != np.asarray(pr.x0 & pr.valid)).sum() <= pr.budget
    assert float(e[0]) == pytest.approx(float(anneal.energy(pr, jnp.asarray(x))[0]), rel=1e-5)
    assert float(e[0]) <= float(anneal.energy(pr, pr.x0 & pr.valid)[0]) * (1 + 1e-6)


def test_budgeted_init_takes_the_best_swaps_that_fit():
    """The case above under a budget of 2 moves: one of the two good swaps fits (host block 30,
    for the least valuable resident 0). No prefix of any order fits: each that takes a
    promotion takes both, and with them two demotions."""
    x0, pr = _valued_idle_residents(budget=2)
    g = np.asarray(anneal.greedy_init(pr))[0]
    np.testing.assert_array_equal(np.flatnonzero(g != x0[0]), [0, 30])


def test_greedy_init_takes_a_partial_trade_no_prefix_can():
    """A full pool of 30 idle residents with small terminal values, 20 host blocks read at both
    steps of the window, and an HBM side near the balance point: each promotion saves a link
    read but adds an HBM write, so the best plan promotes only a few (m = 2 here, found by
    scanning every m). A prefix of any order promotes all the host blocks it ranks above a
    resident or none of them: without the swap scan the init took a 32-move prefix, 1.8%
    worse."""
    cap, hosts = 30, 20
    x0, pr = _valued_idle_residents(
        n=60, hosts=range(cap, cap + hosts), value=(0.01, 0.001), fixed=200.0
    )
    trades = []  # promote hosts cap .. cap + m - 1 for the m least valuable residents
    for m in range(hosts + 1):
        x = x0.copy()
        x[0, cap : cap + m] = True
        x[0, :m] = False
        trades.append(float(anneal.energy(pr, jnp.asarray(x))[0]))
    best_m = int(np.argmin(trades))
    assert 0 < best_m < hosts
    g = np.asarray(anneal.greedy_init(pr))[0]
    assert (g & ~x0[0]).sum() == best_m and (x0[0] & ~g).sum() == best_m
    e_g = float(anneal.energy(pr, jnp.asarray(g[None]))[0])
    assert e_g == pytest.approx(min(trades), rel=1e-6)
    a = np.asarray(pr.forecast)
    scores = (jnp.asarray(a.sum(1)), jnp.asarray(x0, jnp.float32), jnp.asarray(a[:, 0]))
    prefixes = [float(greedy.best_prefix(pr, s)[1][0]) for s in scores]
    assert e_g < min(prefixes) * (1 - 1e-3)


def test_spread_prices_the_expected_step_time():
    """With a spread s, a step costs E[max(T_hbm, T_link + s Z)], Z standard normal: checked
    against Monte Carlo; s = 0 is the max of the loads; the expectation never falls below it."""
    r = np.random.default_rng(0)
    th_bytes = r.uniform(0, 3e6, 64).astype(np.float32)
    tl_bytes = r.uniform(0, 3e5, 64).astype(np.float32)
    s = r.uniform(0, 3e-4, 64).astype(np.float32)
    s[:8] = 0.0
    one = jnp.ones((1,), jnp.float32)
    e = jax.vmap(
        lambda h, link, sp: anneal_problem.energy_of_loads(
            h[None], link[None], 0.0 * one, one, PROF, sp[None]
        )
    )(th_bytes, tl_bytes, s)
    th, tl = th_bytes / PROF.hbm_bandwidth, tl_bytes / PROF.link_bandwidth
    z = r.standard_normal((200_000, 1))
    mc = np.mean(np.maximum(th, tl + s * z), axis=0)
    np.testing.assert_allclose(e, mc, rtol=3e-3)
    np.testing.assert_allclose(e[:8], np.maximum(th, tl)[:8], rtol=1e-6)
    assert (np.asarray(e) >= np.maximum(th, tl) * (1 - 1e-6)).all()


@pytest.mark.parametrize(
    "sd_blocks", [4.0, *(pytest.param(s, marks=pytest.mark.slow) for s in (0.0, 12.0))]
)
def test_spread_keeps_the_link_below_the_balance_point(sd_blocks):
    """300 identical host blocks, each read with probability 0.5, free promotions, room for
    all: the expected step time is lowest where moving one more block to HBM stops paying,
    Phi(d / s) = u_hbm / (u_hbm + u_link) with d = T_link - T_hbm: at the balance point (d = 0)
    without a spread, about 1.38 s below it with one. The annealer finds that plan."""
    n, b = 300, B
    a = jnp.full((1, 1, n), 0.5, jnp.float32)
    u_l = b / PROF.link_bandwidth
    sp = None if not sd_blocks else jnp.full((1, 1), sd_blocks * u_l, jnp.float32)
    pr = anneal.AnnealProblem(
        forecast=a,
        x0=jnp.zeros((1, n), bool),
        valid=jnp.ones((1, n), bool),
        fixed=jnp.full((1,), 50 * b, jnp.float32),
        weight=jnp.ones((1,), jnp.float32),
        promote_hbm=jnp.zeros((1, n), jnp.float32),
        promote_link=jnp.zeros((1, n), jnp.float32),
        profile=PROF,
        block_bytes=b,
        capacity=n,
        spread=sp,
    )
    ks = np.arange(n + 1)
    xs = jnp.asarray(np.arange(n)[None, :] < ks[:, None])[None]  # [1, n + 1, n]: k in HBM
    e_k = np.asarray(anneal.energy(pr, xs))[0]
    k_best = int(np.argmin(e_k))
    res = anneal.run(pr, jax.random.key(0))
    x, e = res.x, res.energy
    assert float(e[0]) <= e_k[k_best] * (1 + 1e-6)
    k = int(np.asarray(x).sum())
    th = (50 * b + 0.5 * b * k) / PROF.hbm_bandwidth
    tl = 0.5 * b * (n - k) / PROF.link_bandwidth
    u_h = b / PROF.hbm_bandwidth
    step = 0.5 * (u_l + u_h)  # d moves by this much per block
    if not sd_blocks:
        assert abs(tl - th) <= step
    else:
        z = jax.scipy.special.ndtri(u_h / (u_h + u_l))
        assert abs((tl - th) - float(z) * sd_blocks * u_l) <= step
        assert tl < th  # the link kept below the HBM time, by more than one block


def _exact_moves(pr, x):
    """Energy changes of every single promotion, demotion and swap of x [N] (layer 0) that keeps
    capacity and budget, by full recomputation: [M] float."""
    x0 = np.asarray(pr.x0[0] & pr.valid[0])
    valid = np.asarray(pr.valid[0])
    ins, outs = np.flatnonzero(valid & ~x), np.flatnonzero(x)
    cands = [(j, None) for j in ins] + [(None, i) for i in outs]
    cands += [(j, i) for j in ins for i in outs]
    ys = []
    for j, i in cands:
        y = x.copy()
        if j is not None:
            y[j] = True
        if i is not None:
            y[i] = False
        if y.sum() <= pr.capacity and (y != x0).sum() <= pr.budget:
            ys.append(y)
    e = np.asarray(anneal.energy(pr, jnp.asarray(np.stack([x, *ys]))[None]))[0]
    return e[1:] - e[0], e[0]


@pytest.mark.parametrize("budget", [3, 1 << 30])
def test_certificate_is_sound(budget):
    """`certify` holds only where no single promotion, demotion or swap (capacity and budget
    kept) lowers the energy by more than tol, on random assignments and on greedy starts; and
    it is not vacuous: it holds on some and fails on others."""
    held = failed = 0
    for seed in range(12):
        pr = dataclasses.replace(problem(seed), budget=budget)
        deltas = anneal.block_deltas(pr)
        r = np.random.default_rng(seed)
        xs = [np.asarray(anneal.greedy_init(pr))[0]]
        for _ in range(6):
            x = np.zeros(12, bool)
            x[r.choice(12, r.integers(0, pr.capacity + 1), replace=False)] = True
            if (x != np.asarray(pr.x0[0])).sum() <= budget:
                xs.append(x)
        for x in xs:
            de, e = _exact_moves(pr, x)
            tol = 1e-3 * float(np.median(np.abs(de))) if de.size else 0.0
            hbm, link = anneal.loads(pr, jnp.asarray(x[None]))
            moved = jnp.asarray([(x != np.asarray(pr.x0[0])).sum()], jnp.int32)
            ok = bool(
                anneal.certify(
                    pr, deltas, jnp.asarray(x[None]), hbm, link, moved, jnp.float32([tol])
                )[0]
            )
            if ok:
                assert de.size == 0 or de.min() >= -tol - 1e-6 * e, (seed, x, de.min(), tol)
            held += ok
            failed += not ok
    assert held and failed
