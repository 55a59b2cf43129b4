"""The field's cache rules in the step (`jaxkv.placement.policies`: LRU, ARC, SLRU, LFU with
aging, W-TinyLFU) against textbook implementations (tests/field_reference.py), step by step:
hits, admissions and the final placement; Belady's MIN with bypass (`jaxkv.sim.belady`) is the
limit of every one of them and of the live policy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from field_reference import REFERENCES, BeladyRef

from jaxkv.placement import policies as P
from jaxkv.placement import registry
from jaxkv.placement import statistics as imp
from jaxkv.placement.admission import NEVER_READ, StepView, admit
from jaxkv.sim.belady import Belady
from jaxkv.sim.bounds import min_link_crossings

# small periods and a large window, so aging and the window's filter act within a short stream
POLICIES = {
    "lru": P.Lru(),
    "arc": P.Arc(),
    "slru": P.Slru(protected=0.6),
    "lfu": P.Lfu(period=4),
    "tinylfu": P.TinyLfu(window=0.25, protected=0.6, period=4),
}


def _reference(name, policy):
    """The textbook implementation with the policy's knobs (the same names)."""
    knobs = {k: v for k, v in dataclasses.asdict(policy).items() if k != "name"}
    return REFERENCES[name](**knobs)


def _stream(seed, rows, n, steps):
    """A workload per row: a drifting hot set read every step plus noise, blocks sealing over
    time (entering HBM outside the rule where a slot is free), a pool whose size moves by a
    block now and then (tails), and now and then a freed run of blocks (a finished sequence)."""
    rng = np.random.default_rng(seed)
    hot = [list(rng.choice(n // 2, 4, replace=False)) for _ in range(rows)]
    valid = np.zeros((rows, n), bool)
    valid[:, : n // 2] = True
    pool = rng.integers(3, 8, rows)
    for t in range(steps):
        for r in range(rows):
            if rng.random() < 0.3:  # the hot set drifts
                hot[r][rng.integers(4)] = int(rng.integers(n))
        reads = np.zeros((rows, n), bool)
        for r in range(rows):
            reads[r, hot[r]] = True
            reads[r, rng.choice(n, 3, replace=False)] = True
        sealing = np.zeros((rows, n), bool)
        for r in range(rows):
            free = np.flatnonzero(~valid[r])
            if free.size and rng.random() < 0.4:
                sealing[r, free[0]] = True
        freed = np.zeros((rows, n), bool)
        if rng.random() < 0.1:
            r = int(rng.integers(rows))
            freed[r, rng.integers(n // 2) : n // 2 + 3] = True
        pool = np.clip(pool + rng.integers(-1, 2, rows) * (rng.random(rows) < 0.2), 1, 9)
        yield t, reads & valid, valid.copy(), pool.copy(), sealing, freed
        valid = (valid | sealing) & ~freed


def _run(policy, seed, rows=3, n=20, steps=30, budget=64):
    """Drives the JAX rule and `rows` references over one stream; asserts each step's
    admissions and placement equal; returns the hits per step."""
    rule = policy.rule
    refs = [_reference(policy.name, policy) for _ in range(rows)]
    state = rule.init(rows, n)
    in_hbm = np.zeros((rows, n), bool)
    step = jax.jit(lambda st, v: admit(rule, st, v, budget))
    hits = []
    for t, reads, valid, pool, sealing, _freed in _stream(seed, rows, n, steps):
        in_hbm &= valid
        room = pool - in_hbm.sum(1)
        view = StepView(
            in_hbm=jnp.asarray(in_hbm),
            valid=jnp.asarray(valid),
            reads=jnp.asarray(reads),
            room=jnp.asarray(room, jnp.int32),
            step=jnp.int32(t),
            stats=None,
        )
        adm, state = step(state, view)
        new = np.array(adm.apply(jnp.asarray(in_hbm)))
        pro, dem = (np.asarray(m) for m in adm.masks(n))
        hits.append(int((reads & in_hbm).sum()))
        for r in range(rows):
            want = refs[r].step(
                set(np.flatnonzero(in_hbm[r])),
                set(np.flatnonzero(valid[r])),
                set(np.flatnonzero(reads[r])),
                int(room[r]),
                budget,
                t,
            )
            got = set(np.flatnonzero(new[r]))
            assert got == want, (policy.name, seed, t, r, sorted(got ^ want))
        # every promotion rides a read from host, every demotion leaves HBM, within the budget
        assert not (pro & ~(reads & ~in_hbm)).any() and not (dem & ~in_hbm).any()
        assert (pro.sum(1) <= budget).all()
        assert (new.sum(1) <= np.maximum(pool, in_hbm.sum(1))).all()
        # the sealed blocks then enter HBM where a slot is free (outside the rule)
        in_hbm = new
        for r in range(rows):
            for b in np.flatnonzero(sealing[r]):
                if in_hbm[r].sum() < pool[r]:
                    in_hbm[r, b] = True
    return np.asarray(hits)


@pytest.mark.parametrize("name", list(POLICIES))
def test_each_field_rule_equals_its_textbook_implementation(name):
    for seed in range(2):
        _run(POLICIES[name], seed)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(POLICIES))
def test_field_rules_equal_their_references_on_more_streams(name):
    for seed in range(2, 8):
        _run(POLICIES[name], seed, n=32, steps=60)


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_a_budget_bypasses_the_misses_past_it(name):
    """At most `budget` misses a row are offered, the first in block order; the rest bypass."""
    _run(POLICIES[name], 5, budget=2)


def test_default_knobs_are_the_classes_and_the_rules_registered():
    """Each field rule is registered as a field rule, its knobs read from its class."""
    assert registry.names("field") and set(registry.names("field")) == set(POLICIES)
    for n in POLICIES:
        e = registry.entry(n)
        assert e.kind == "field" and e.online
        assert registry.resolve(n, None) == type(POLICIES[n])()
    assert registry.entry("tinylfu").knob_defaults() == dict(window=0.01, protected=0.8, period=16)
    with pytest.raises(ValueError, match=r"\['x'\] are not knobs of 'lfu'; expected some of"):
        registry.resolve("lfu", None, x=1)
    with pytest.raises(ValueError, match="Lfu period=0: expected an integer >= 1"):
        P.Lfu(period=0)
    with pytest.raises(ValueError, match=r"TinyLfu window=2: expected a finite number in \[0, 1\]"):
        P.TinyLfu(window=2)


# ---- Belady -----------------------------------------------------------------------------------


def _next_use(reads):
    """[T, rows, N] int32: the next step after t at which each block is read."""
    T = reads.shape[0]
    out = np.full(reads.shape, NEVER_READ, np.int64)
    nxt = np.full(reads.shape[1:], NEVER_READ, np.int64)
    for t in range(T - 1, -1, -1):
        out[t] = nxt
        nxt = np.where(reads[t], t, nxt)
    return out.astype(np.int32)


def _fixed_stream(seed, rows, n, steps):
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(n, 0.3), size=rows)
    reads = np.zeros((steps, rows, n), bool)
    for t in range(steps):
        for r in range(rows):
            k = int(rng.integers(2, 7))
            reads[t, r, rng.choice(n, k, replace=False, p=weights[r])] = True
    return reads


def _hits(policy, reads, pool, stats=None):
    """Hits per row of a rule on a stream with a fixed pool, from an empty HBM."""
    T, rows, n = reads.shape
    rule = policy.rule
    state = rule.init(rows, n)
    nu = _next_use(reads)
    in_hbm = np.zeros((rows, n), bool)
    valid = np.ones((rows, n), bool)
    st = stats or imp.init_stats(rows, n)
    step = jax.jit(lambda s, v: admit(rule, s, v, n))
    hits = np.zeros(rows, int)
    for t in range(T):
        hits += (reads[t] & in_hbm).sum(1)
        view = StepView(
            in_hbm=jnp.asarray(in_hbm),
            valid=jnp.asarray(valid),
            reads=jnp.asarray(reads[t]),
            room=jnp.asarray(pool - in_hbm.sum(1), jnp.int32),
            step=jnp.int32(t),
            stats=st,
            next_use=jnp.asarray(nu[t]),
        )
        adm, state = step(state, view)
        st = imp.update_stats(st, jnp.asarray(reads[t]), jnp.zeros((rows, n)), jnp.int32(t))
        in_hbm = np.array(adm.apply(jnp.asarray(in_hbm)))
    return hits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_hits_at_least_every_rule_and_equal_the_fewest_crossings(seed):
    """On random read streams Belady's hits are >= every field rule's and the live policy's,
    its misses are the fewest any placement makes (`min_link_crossings`), and it equals its
    reference."""
    rows, n, steps, pool = 2, 16, 40, 4
    reads = _fixed_stream(seed, rows, n, steps)
    best = _hits(Belady(), reads, pool)
    f = min_link_crossings(reads, np.zeros(n, bool), -np.ones(steps, int), pool)
    np.testing.assert_array_equal(reads.sum((0, 2)) - best, f)
    ref, nu = BeladyRef(), _next_use(reads)
    for r in range(rows):  # the reference, from the same start
        res, h = set(), 0
        for t in range(steps):
            got = set(np.flatnonzero(reads[t, r]))
            h += len(got & res)
            res = ref.step(res, set(range(n)), got, pool - len(res), dict(enumerate(nu[t, r])), t)
        assert h == best[r]
    lrfu = P.Lrfu(prompt_prior=False, slack=False)  # no cost model in this stream: every admission
    for name, policy in {**POLICIES, "lrfu": lrfu}.items():
        got = _hits(policy, reads, pool)
        assert (got <= best).all(), (name, got, best)


def test_belady_refuses_to_run_without_the_future_or_a_full_budget():
    rule = Belady().rule
    view = StepView(
        in_hbm=jnp.zeros((1, 4), bool),
        valid=jnp.ones((1, 4), bool),
        reads=jnp.ones((1, 4), bool),
        room=jnp.ones((1,), jnp.int32),
        step=jnp.int32(0),
        stats=None,
    )
    with pytest.raises(ValueError, match=r"StepView.next_use\): it runs in jaxkv.sim.loop"):
        rule.step((), view, 4)
    view = StepView(**{**view.__dict__, "next_use": jnp.zeros((1, 4), jnp.int32)})
    with pytest.raises(ValueError, match="expected a budget of at least N=4 blocks a row, got 2"):
        rule.step((), view, 2)
    assert registry.entry("belady").kind == "oracle" and not registry.is_online("belady")
