"""`AnnealQuota` (jaxkv.placement.policies.anneal_quota): quotas per request and layer set by
each window's annealing plan, LRU inside each request's share between plans. The rule against
a plain Python reference over random read streams with plans in between, the split a plan
sets kept by the rule, the planner the registered anneal+reuse, and the engine's tokens under
it equal to all-HBM decoding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cost import CostModel
from jaxkv.placement import registry
from jaxkv.placement import statistics as imp
from jaxkv.placement.admission import StepView, admit
from jaxkv.placement.policies import Follow, Observation
from jaxkv.placement.policies.anneal_quota import AnnealQuota, AnnealQuotaRule, anneal_quota
from tests import test_serve_schedules as schedules

solo = schedules.solo  # the fixture: a request decoded alone over an all-HBM cache


class Reference:
    """One row of the rule in plain Python: `res` the resident blocks, `stamp` their recency
    (larger: more recent), one clock for both."""

    def __init__(self, m: int):
        self.m, self.res, self.stamp, self.clock = m, set(), {}, 0

    def _touch(self, b):
        self.stamp[b], self.clock = self.clock, self.clock + 1

    def sync(self, resident):
        """Blocks that entered HBM outside the rule (a plan) become the most recent, in block
        order; blocks that left it are forgotten."""
        for b in sorted(set(resident) - self.res):
            self._touch(b)
        self.res = set(resident)

    def step(self, reads, valid, cap):
        """Hits restamped in block order, then each miss in block order: a free slot if one is
        left, else the reader's own least recent block, else (the reader holds none) bypass.
        Returns (hits, admitted, evicted)."""
        hits = [b for b in np.flatnonzero(reads & valid) if b in self.res]
        misses = [b for b in np.flatnonzero(reads & valid) if b not in self.res]
        for b in hits:
            self._touch(b)
        admitted, evicted = [], []
        for b in misses:
            if len(self.res) >= cap:
                mine = [x for x in self.res if x // self.m == b // self.m]
                if not mine:
                    continue
                victim = min(mine, key=lambda x: (self.stamp[x], x))
                self.res.discard(victim)
                evicted.append(victim)
            self.res.add(b)
            self._touch(b)
            admitted.append(b)
        return hits, admitted, evicted


def _view(in_hbm, valid, reads, room, t):
    return StepView(in_hbm=jnp.asarray(in_hbm[None]), valid=jnp.asarray(valid[None]),
                    reads=jnp.asarray(reads[None]), room=jnp.asarray([room], jnp.int32),
                    step=jnp.int32(t), stats=None)  # fmt: skip


def _counts(in_hbm, m):
    return in_hbm.reshape(-1, m).sum(-1)


@pytest.mark.parametrize("seed", range(4))
def test_rule_equals_the_reference_and_keeps_each_split(seed):
    """Random reads over 4 sequences of 7 blocks (some not yet sealed), a pool of 9 slots, a
    random "plan" (the residency replaced outside the rule, sometimes leaving slots free) every
    6 steps: the hits, admissions, evictions and placement equal the reference's at every
    step; an evicted block is always the reader's own; with the pool full no sequence's count
    changes."""
    rng = np.random.default_rng(seed)
    seqs, m, cap = 4, 7, 9
    n = seqs * m
    rule = AnnealQuotaRule(seq_blocks=m)
    state = rule.init(1, n)
    step = jax.jit(lambda st, v: admit(rule, st, v, n))
    valid = (np.arange(n) % m) < rng.integers(2, m + 1, seqs).repeat(m)
    ref, in_hbm = Reference(m), np.zeros(n, bool)
    totals = np.zeros(3, int)
    for t in range(40):
        if t % 6 == 0:  # a plan: any valid target within the pool
            k = int(rng.integers(cap - 3, cap + 1))
            in_hbm = np.zeros(n, bool)
            in_hbm[rng.choice(np.flatnonzero(valid), k, replace=False)] = True
            ref.sync(np.flatnonzero(in_hbm))
        reads = (rng.random(n) < 0.4) & (rng.random(seqs) < 0.8).repeat(m)
        room = cap - int(in_hbm.sum())
        adm, state = step(state, _view(in_hbm, valid, reads, room, t))
        new = np.asarray(adm.apply(jnp.asarray(in_hbm[None])))[0]
        hits, admitted, evicted = ref.step(reads, valid, cap)
        assert set(np.flatnonzero(new)) == ref.res, (seed, t)
        assert set(np.flatnonzero(new & ~in_hbm)) == set(admitted) - set(evicted), (seed, t)
        assert set(np.flatnonzero(in_hbm & ~new)) == set(evicted) - set(admitted), (seed, t)
        assert len(hits) == int((reads & valid & in_hbm).sum())
        readers = {b // m for b in admitted}
        assert all(b // m in readers for b in np.flatnonzero(in_hbm & ~new)), (seed, t)
        if room == 0:  # full: every admission evicted the reader's own block, or none came
            assert (_counts(new, m) == _counts(in_hbm, m)).all(), (seed, t)
        totals += (len(hits), len(admitted), len(evicted))
        in_hbm = new
    assert (totals > 0).all(), totals  # the stream exercised hits, admissions and evictions


def test_a_reader_without_blocks_bypasses_a_full_pool_and_takes_a_free_slot():
    """Sequence 1 holds nothing: its misses bypass a full pool (sequence 0's blocks stay); with
    one free slot its first miss takes it and its second replaces that block (now its own
    least recent), never sequence 0's."""
    m = 4
    rule = AnnealQuotaRule(seq_blocks=m)
    valid = np.ones(2 * m, bool)
    in_hbm = np.array([1, 1, 0, 0, 0, 0, 0, 0], bool)
    reads = np.array([0, 0, 0, 0, 1, 1, 0, 0], bool)
    adm, _ = admit(rule, rule.init(1, 2 * m), _view(in_hbm, valid, reads, 0, 0), 8)
    assert int(adm.num_promote[0]) == 0 and int(adm.num_demote[0]) == 0
    adm, _ = admit(rule, rule.init(1, 2 * m), _view(in_hbm, valid, reads, 1, 0), 8)
    new = np.asarray(adm.apply(jnp.asarray(in_hbm[None])))[0]
    assert list(np.flatnonzero(new)) == [0, 1, 5]


L, SEQS, M, CAP = 2, 3, 8, 9


def _observation(seed):
    """A full pool (CAP blocks a layer, sequence 0 holding them all) and random read
    statistics over 3 sequences of 8 sealed blocks: what a window boundary shows the plan."""
    r = np.random.default_rng(seed)
    n = SEQS * M
    in_hbm = np.zeros((L, n), bool)
    in_hbm[:, :CAP] = True
    last = np.where(r.random((L, n)) < 0.7, r.integers(20, 40, (L, n)), -1)
    return Observation(
        in_hbm=jnp.asarray(in_hbm),
        valid=jnp.ones((L, n), bool),
        last_read=jnp.asarray(last, jnp.int32),
        read_ema=jnp.asarray(r.random((L, n)), jnp.float32),
        mass_ema=jnp.asarray(r.random((L, n)) / n, jnp.float32),
        step=jnp.int32(40),
        window_reads=jnp.asarray(r.integers(0, 3, (L, n)), jnp.float32),
        since_seen=jnp.asarray(r.uniform(1, 10, (L, imp.REUSE_BUCKETS)), jnp.float32),
        since_read=jnp.asarray(r.uniform(0, 5, (L, imp.REUSE_BUCKETS)), jnp.float32),
        capacity=CAP,
    )


@pytest.mark.parametrize("seed", range(2))
def test_the_split_after_a_plan_is_the_plans_and_the_rule_keeps_it(seed):
    """The plan's target sets each sequence's blocks per layer; its migrations applied, the
    rule runs 12 steps of random reads with the pool full: every sequence's count in every
    layer stays the plan's (per layer, all rows at once as the simulators run them)."""
    pol = anneal_quota(M, window=4)
    env = CostModel(fixed_bytes=0.0)  # no weights: HBM is worth filling
    _, target = pol.plan(pol.init(L, SEQS * M), _observation(seed), env)
    target = np.asarray(target)
    plan_counts = target.reshape(L, SEQS, M).sum(-1)
    assert (target.sum(-1) == CAP).all(), target.sum(-1)  # the plan fills the pool
    # neither the even split nor the residency the plan started from (sequence 0 holding all)
    assert (plan_counts != CAP // SEQS).any() and (plan_counts[:, 0] < CAP).all(), plan_counts
    rule = pol.rule
    state = rule.init(L, SEQS * M)
    rng = np.random.default_rng(seed)
    in_hbm = target
    moved = 0
    for t in range(12):
        reads = rng.random(in_hbm.shape) < 0.4
        view = StepView(in_hbm=jnp.asarray(in_hbm), valid=jnp.ones_like(in_hbm),
                        reads=jnp.asarray(reads), room=jnp.zeros((L,), jnp.int32),
                        step=jnp.int32(t), stats=None)  # fmt: skip
        adm, state = admit(rule, state, view, SEQS * M)
        new = np.asarray(adm.apply(jnp.asarray(in_hbm)))
        moved += int((new & ~in_hbm).sum())
        assert (new.reshape(L, SEQS, M).sum(-1) == plan_counts).all(), (seed, t)
        in_hbm = new
    assert moved > 0  # the rule admitted blocks (inside each share)


def test_the_planner_is_the_registered_anneal_reuse():
    """Every planning field equals the registered "anneal+reuse" at the same W and budget; only
    the name, the rule and seq_blocks differ."""
    pol = anneal_quota(5, window=16, budget=64)
    planner = registry.resolve("anneal+reuse", None, registry.Settings(window=16, budget=64))
    for f in dataclasses.fields(planner):
        if f.name != "name":
            assert getattr(pol, f.name) == getattr(planner, f.name), f.name
    assert pol.name == "anneal-quota" and pol.seq_blocks == 5
    assert pol.rule == AnnealQuotaRule(seq_blocks=5)


def test_anneal_quota_refuses_bad_values():
    with pytest.raises(ValueError, match=r"AnnealQuota.seq_blocks=0: expected"):
        anneal_quota(0)
    with pytest.raises(ValueError, match=r"AnnealQuota.seq_blocks=2.0: expected"):
        AnnealQuota(seq_blocks=2.0)
    with pytest.raises(ValueError, match=r"AnnealQuota.follow=Follow\(.*\): expected None"):
        AnnealQuota(seq_blocks=2, follow=Follow())
    with pytest.raises(ValueError, match=r"Anneal window=0"):
        anneal_quota(4, window=0)


@pytest.mark.slow  # 75 s on 2 shared cores: the engine compiles its step, window step and prefill
def test_engine_tokens_equal_all_hbm_decoding(tiny, solo):
    """A random schedule of 8 requests (arrivals, cancels, sampled and greedy, preemptions)
    under anneal-quota, exact attention: every request's tokens equal its all-HBM solo
    decoding, the accounts hold after every step, and the decode step and the window step
    (the plan) compiled once."""
    eng = schedules._engine(tiny, "anneal-quota")
    plan = schedules._schedule(11, 8)
    schedules.run_schedule(eng, plan)
    schedules.check_tokens(eng, plan, solo)
    assert eng.preemptions > 0
    comp = eng.core.compilations()
    assert comp["step"] == 1 and comp["window_step"] == 1, comp
