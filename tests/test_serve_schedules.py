"""The engine under random schedules (issue 47's first must-hold): requests arrive at random
iterations with random lengths, budgets and sampling parameters, some are cancelled, a small
host pool forces preemptions; every request's tokens equal decoding it alone over an all-HBM
cache, and after every step the free pools and the allocated blocks account for every slot of
both tiers. Exact attention; the policies static, lrfu (the live policy) and anneal (a
planning policy that migrates at every window's end); the slow sweep adds the field's lru and
the ways of sharing HBM among requests (lru-quota, anneal-quota).

The reference is the engine itself with one slot, an all-HBM cache, the static policy and a
host pool that holds anything (`solo`): tests/test_serve.py pins that engine's greedy tokens to
the `jaxkv.Decoder`'s; here it also covers sampled requests (a request's draws depend on its
own logits and seed only, `jaxkv.serve.sampling`)."""

import dataclasses

import numpy as np
import pytest

from jaxkv import CacheConfig, PlacementConfig
from jaxkv import cache as kvc
from jaxkv.config import TIER_HBM
from jaxkv.placement.policies.anneal_quota import anneal_quota
from jaxkv.placement.policies.lru_quota import LruQuota
from jaxkv.serve import Engine, SamplingParams

MAX_LEN, BS, SLOTS, PAGES = 112, 8, 3, 16  # a request takes up to 13 pages: preemptions


def _config(model, **kw):
    return CacheConfig.for_model(
        model.config, batch=SLOTS, max_len=MAX_LEN, block_size=BS, paged_host=True, **kw
    )


@pytest.fixture(scope="module")
def solo(tiny):
    """(prompt, params) -> the tokens of that request decoded alone: one slot, all-HBM."""
    model, params = tiny
    c = CacheConfig.for_model(model.config, batch=1, max_len=MAX_LEN, block_size=BS,
                              hbm_fraction=1.0)  # fmt: skip
    eng = Engine(model, params, c, PlacementConfig(policy="static"), chunk=16)
    memo = {}

    def run(prompt, p: SamplingParams):
        key = (prompt.tobytes(), p)
        if key not in memo:
            memo[key] = eng.generate([prompt], p)[0]
        return memo[key]

    return run


_engines = {}


def _engine(tiny, policy):
    """One engine per policy for the module (its compilations are what a test waits for; a
    schedule leaves it idle, and the next schedule runs on it as on a fresh one)."""
    name = policy
    if name not in _engines:
        model, params = tiny
        c = _config(model, hbm_fraction=0.3, host_blocks=PAGES)
        quota = None
        if policy == "lru-quota":  # HiSparse's fixed hot buffer per request, the pool split
            quota = c.hbm_pool_slots // SLOTS
            policy = LruQuota(quota=quota, seq_blocks=c.max_blocks)
        if policy == "anneal-quota":  # the split re-chosen by each window's plan
            policy = anneal_quota(c.max_blocks, window=4, budget=8)
        place = PlacementConfig(policy=policy, window=4, max_moves=8)
        _engines[name] = Engine(model, params, c, place, chunk=16, hbm_quota=quota)
    return _engines[name]


@dataclasses.dataclass
class Planned:
    prompt: np.ndarray
    params: SamplingParams
    arrive: int  # the iteration it is submitted at
    cancel_at: int | None  # the iteration it is cancelled at (None: never)
    id: int | None = None


def _schedule(seed: int, n: int) -> list[Planned]:
    """`n` requests: prompts of 3 to 60 tokens, budgets of 1 to 40 (prompt + budget within a
    slot), a third sampled (temperature, top-k, top-p, seed), a fifth with a stop token, a
    fifth cancelled a few iterations after they arrive; arrivals over the first 30 iterations."""
    rng = np.random.default_rng(seed)
    out = []
    for arrive in np.sort(rng.integers(0, 30, n)):
        T = int(rng.integers(3, 61))
        kw = dict(max_new_tokens=int(rng.integers(1, min(41, MAX_LEN - T + 1))))
        if rng.random() < 1 / 3:
            kw.update(temperature=float(rng.uniform(0.5, 1.5)), seed=int(rng.integers(2**31)))
            kw.update(top_k=int(rng.integers(1, 50)) if rng.random() < 0.5 else None)
            kw.update(top_p=float(rng.uniform(0.5, 1.0)) if rng.random() < 0.5 else 1.0)
        if rng.random() < 0.2:
            kw.update(stop_ids=(int(rng.integers(256)),))
        cancel = int(arrive + rng.integers(0, 25)) if rng.random() < 0.2 else None
        prompt = rng.integers(0, 256, T).astype(np.int32)
        out.append(Planned(prompt, SamplingParams(**kw), int(arrive), cancel))
    return out


def check_accounts(eng: Engine) -> None:
    """Every slot of both tiers is free or held by exactly one block, per layer: HBM free slots
    + blocks in HBM = the pool; free host pages + sealed blocks = the host pool, and the
    engine's own count of free pages agrees; the table's invariants (`check_invariants`: no
    slot or page shared, free masks equal to the unused slots, HBM copies equal to host)."""
    cache = eng.state.decode.cache
    c = cache.config
    kvc.check_invariants(cache, contents=True)
    tier = np.asarray(cache.tier)  # [layers, slots, max_blocks]
    hbm_free, host_free = np.asarray(cache.hbm_free), np.asarray(cache.host_free)
    lengths = np.asarray(cache.lengths)
    sealed = int((lengths // c.block_size).sum())
    for layer in range(c.num_layers):
        in_hbm = int((tier[layer] == TIER_HBM).sum())
        assert int(hbm_free[layer].sum()) + in_hbm == c.hbm_slots, layer
        assert int(host_free[layer].sum()) + sealed == c.host_slots, layer
    assert eng.free_pages == int(host_free[0].sum())
    for b, rid in enumerate(eng.slots):
        if rid is None:
            assert lengths[b] == 0  # an empty slot holds nothing but its tail slot


def run_schedule(eng: Engine, plan: list[Planned], max_iterations: int = 2000) -> int:
    """Submits and cancels as planned, steps the engine until every request finished (checking
    the accounts after every step); returns the iterations it took. AssertionError past
    `max_iterations` (a deadlock)."""
    it, pending = 0, list(plan)
    while pending or not eng.idle:
        while pending and pending[0].arrive <= it:
            p = pending.pop(0)
            p.id = eng.submit(p.prompt, p.params)
        for p in plan:
            if p.cancel_at == it and p.id is not None:
                eng.cancel(p.id)
        eng.step()
        check_accounts(eng)
        it += 1
        assert it < max_iterations, "the engine did not finish its requests (a deadlock?)"
    return it


def check_tokens(eng: Engine, plan: list[Planned], solo) -> None:
    """Each request's tokens equal its solo decoding (a prefix of them if cancelled), and it
    finished for the reason its tokens give."""
    for p in plan:
        r = eng.requests[p.id]
        ref = solo(p.prompt, p.params)
        assert r.status == "finished"
        if r.reason == "cancelled":
            assert r.tokens == ref[: len(r.tokens)], p
        else:
            assert r.tokens == ref, p
            want = "stop" if r.tokens[-1] in (p.params.stop_ids or ()) else "length"
            assert r.reason == want, (r.reason, p)
    assert eng.free_pages == eng.pages
    hbm_free = np.asarray(eng.state.decode.cache.hbm_free)
    assert (hbm_free.sum(axis=1) == eng.cache_config.hbm_slots - SLOTS).all()  # the tails


@pytest.mark.parametrize(  # static and anneal (about 20 s each) run with the slow tests
    "policy",
    [
        pytest.param("static", marks=pytest.mark.slow),
        "lrfu",
        pytest.param("anneal", marks=pytest.mark.slow),
    ],
)
def test_random_schedule_equals_solo_decoding(tiny, solo, policy):
    """One schedule of 8 requests (arrivals, cancels, sampled and greedy, stop tokens) with
    preemptions: tokens equal solo decoding, the accounts hold after every step, and the
    decode step compiled once."""
    eng = _engine(tiny, policy)
    before = eng.preemptions
    plan = _schedule(11, 8)
    run_schedule(eng, plan)
    check_tokens(eng, plan, solo)
    assert eng.preemptions > before  # the schedule exercised preemption
    assert any(eng.requests[p.id].reason == "cancelled" for p in plan)
    comp = eng.core.compilations()
    assert comp["step"] == 1 and comp["window_step"] == 1, comp


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    ["static", "lrfu", "anneal", "lru", "anneal+reuse+follow", "lru-quota", "anneal-quota"],
)
def test_random_schedules_sweep(tiny, solo, policy):
    """Twelve schedules of 4 to 14 requests a policy, on one engine: every one equals solo
    decoding with the accounts holding after every step, and nothing recompiles."""
    eng = _engine(tiny, policy)
    for seed in range(100, 112):
        plan = _schedule(seed, 4 + seed % 11)
        run_schedule(eng, plan)
        check_tokens(eng, plan, solo)
    comp = eng.core.compilations()
    assert all(n == 1 for n in comp.values()), comp
