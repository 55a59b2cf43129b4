"""The cache bound: Belady with bypass against exhaustive search, and no policy beats it."""

import itertools

import numpy as np
import pytest
from conftest import random_block_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv import cost
from jaxkv.config import AnnealConfig, HardwareProfile
from jaxkv.sim import bounds as bnd
from jaxkv.sim import simulate as sim
from jaxkv.sim import trace as tr
from jaxkv.sim.cli import format_table

PROF = HardwareProfile("t", 10.0, 1.0, 1e9)  # bytes per second: HBM 10, link 1
GEO = cost.Geometry("t", 1, 1, 1, 2, 10.0, 0.0)  # 4 bytes per token-layer, 10 bytes of weights


def brute_force(reads, init, new, capacity):
    """Fewest crossings of one layer by dynamic programming over every HBM set S_t (|S_t| <= C),
    prefetches allowed: S_t may be any set, each block outside K_t costs one crossing."""
    T, N = reads.shape
    mask = lambda bits: sum(1 << int(i) for i in np.flatnonzero(bits))  # noqa: E731
    r = [mask(reads[t]) for t in range(T)]
    nb = [0 if b < 0 else 1 << int(b) for b in new]
    sets = [
        sum(1 << i for i in c)
        for k in range(capacity + 1)
        for c in itertools.combinations(range(N), k)
    ]
    pc = int.bit_count
    dp = {}  # dp[S] = fewest crossings through step t with S_t = S
    for t in range(T):
        if t == 0:
            k0 = mask(init) | nb[0]
            dp = {s: pc(s & ~k0) + pc(r[0] & ~s) for s in sets}
        else:
            dp = {
                s: min(v + pc(s & ~(p | r[t - 1] | nb[t])) for p, v in dp.items()) + pc(r[t] & ~s)
                for s in sets
            }
    return min(dp.values())


def random_instance(rng, T, N, L, C, fresh):
    """Reads, initial content and sealed blocks; with `fresh`, blocks are sealed once, in order,
    never read or held before (as in the simulator), else there are no sealed blocks."""
    if fresh:
        p0 = int(rng.integers(1, N + 1))  # blocks sealed at prefill
        seal = np.full(N, -1)
        steps = np.sort(rng.choice(np.arange(1, T), size=min(N - p0, T - 1), replace=False))
        seal[p0 : p0 + len(steps)] = steps
        new = np.full(T, -1)
        new[steps] = np.arange(p0, p0 + len(steps))
        valid = np.stack([((seal >= 0) & (seal <= t)) | (np.arange(N) < p0) for t in range(T)])
    else:
        p0, new, valid = N, np.full(T, -1), np.ones((T, N), bool)
    reads = (rng.random((T, L, N)) < rng.uniform(0.2, 0.8)) & valid[:, None, :]
    init = np.zeros((L, N), bool)
    for layer in range(L):
        k = int(rng.integers(0, min(C, p0) + 1))
        init[layer, rng.choice(p0, size=k, replace=False)] = True
    return reads, init, new


@pytest.mark.parametrize("fresh", [False, True])
def test_belady_matches_exhaustive_search(fresh):
    rng = np.random.default_rng(1 + fresh)
    for _ in range(60):
        T, N, L, C = int(rng.integers(6, 9)), 6, 2, int(rng.integers(1, 4))
        reads, init, new = random_instance(rng, T, N, L, C, fresh)
        got = bnd.min_link_crossings(reads, init, new, C)
        want = [brute_force(reads[:, layer], init[layer], new, C) for layer in range(L)]
        np.testing.assert_array_equal(got, want)


def test_hand_computed_crossings():
    # C = 1; reads {0, 1}, {0}, {1}, {0}: 2 misses at step 0, keep 0 (read at 1, 1 at 2), hit;
    # keep 0 (read at 3, 1 at 2: one miss either way), miss 1 at step 2, hit 0 at step 3.
    reads = np.zeros((4, 1, 4), bool)
    for t, blocks in enumerate([(0, 1), (0,), (1,), (0,)]):
        reads[t, 0, list(blocks)] = True
    assert bnd.min_link_crossings(reads, np.zeros(4, bool), np.full(4, -1), 1).tolist() == [3]
    assert bnd.min_link_crossings(reads, np.zeros(4, bool), np.full(4, -1), 0).tolist() == [5]
    assert bnd.min_link_crossings(reads, np.zeros(4, bool), np.full(4, -1), 2).tolist() == [2]
    # block 0 in HBM before step 0 saves its crossing; a block sealed at step 1 is free there
    assert bnd.min_link_crossings(reads, [1, 0, 0, 0], np.full(4, -1), 2).tolist() == [1]
    # reads {0}, {2}, {2}: block 2, sealed at step 1, is in HBM for free there
    reads = np.zeros((3, 1, 3), bool)
    reads[0, 0, 0] = reads[1, 0, 2] = reads[2, 0, 2] = True
    assert bnd.min_link_crossings(reads, [1, 0, 0], [-1, 2, -1], 1).tolist() == [0]
    assert bnd.min_link_crossings(reads, [1, 0, 0], [-1, -1, -1], 1).tolist() == [1]


def test_slabs_and_packed_reads_agree():
    rng = np.random.default_rng(7)
    T, N, L, C = 50, 37, 5, 7
    reads, init, new = random_instance(rng, T, N, L, C, True)
    want = bnd.min_link_crossings(reads, init, new, C)
    packed = bnd.PackedReads(T, L, N)
    packed.put(0, np.packbits(reads[:20], axis=-1))
    packed.put(20, np.packbits(reads[20:], axis=-1))
    assert packed.bits.nbytes == bnd.PackedReads.nbytes(T, L, N)
    for m in (1, 40, 200, 2000, 1 << 23):
        np.testing.assert_array_equal(
            bnd.min_link_crossings(packed, init, new, C, max_elements=m), want
        )
        np.testing.assert_array_equal(
            bnd.min_link_crossings(reads, init, new, C, max_elements=m), want
        )
    # C >= N: only first reads of blocks not in HBM at first, never the sealed ones
    first = reads.any(0) & ~init
    first[:, new[new >= 0]] = False
    np.testing.assert_array_equal(bnd.min_link_crossings(reads, init, new, N), first.sum(-1))


def test_simulator_geometry_helpers():
    np.testing.assert_array_equal(bnd.initial_hbm(7, 2, 6, 2), [1, 1, 0, 0, 0, 0])
    # prompt 7, block 2: step 1 (8 tokens) seals block 3, step 3 seals block 4
    np.testing.assert_array_equal(bnd.new_blocks(7, 2, 5, 6), [-1, 3, -1, 4, -1])
    np.testing.assert_array_equal(bnd.new_blocks(7, 2, 5, 4), [-1, 3, -1, -1, -1])


def test_hand_computed_cache_bound():
    # test_simulate's tiny trace: prompt 3, block 1, C = 1, reads {1, 2} at both steps, HBM {0}.
    # Step 0 misses 1 and 2; step 1 keeps one of them (block 3, sealed at step 1, is never
    # read): F = 3 crossings x 4 bytes / 1 B/s = 12 s > Unlimited 52 / 11 s and the capacity
    # bound 8 s. LRU keeping fetched blocks attains it (12 s), plain LRU re-reads (16 s).
    ids = np.array([[[1, 2]], [[1, 2]]], np.int32)
    mass = np.ones((2, 1, 2), np.float32)
    trace = tr.validate(dict(version=1, prompt_len=3, block_size=1, ids=ids, mass=mass))
    kw = dict(profile=PROF, geometry=GEO, sparsity=0.0, capacity_blocks=1, progress=False)
    res = sim.simulate(trace, ["lru-plan", "unlimited"], keep_fetched=True, **kw)
    b = res["bounds"]
    assert b["cache_crossings"] == [3]
    assert b["unlimited_s"] == pytest.approx(52 / 11, rel=1e-6)
    assert b["capacity_s"] == pytest.approx(8.0)
    assert b["cache_s"] == pytest.approx(12.0)
    assert b["best_s"] == pytest.approx(12.0)
    assert res["policies"]["lru-plan"]["latency_s"] == pytest.approx(12.0)
    # the per-layer formula: max(sum_t u_t, F b / B_link) = Unlimited + excess over sum_t L*_t
    assert bnd.cache_bound_seconds([3], [52 / 11], 4.0, 1.0).tolist() == [12.0]
    assert bnd.cache_bound_seconds([1], [52 / 11], 4.0, 1.0) == pytest.approx(52 / 11)
    table = format_table(res)
    assert "bound@cache (fewest link crossings, Belady): 12.0000 s (2.538 x unlimited)" in table
    # over the memory limit the cache bound is skipped, not guessed
    res = sim.simulate(trace, ["static"], cache_bound_max_bytes=1, **kw)
    b = res["bounds"]
    assert b["cache_s"] is None and b["best_s"] is None and "skipped" in b["cache_note"]
    assert "bound@cache (fewest link crossings): not computed, skipped" in format_table(res)


def test_weight_dominated_steps_lend_their_link_time():
    """Why L*_t = u_t x B_link, not the ideal split D_t x B_link / (B_hbm + B_link).

    B_hbm 10, B_link 1, 1-byte blocks, 100 bytes of weights per step. Step 0 reads nothing
    (weights dominate: u_0 = 10 s), step 1 reads 200 blocks none of which is in HBM (F = 200,
    u_1 = 300 / 11 s). Prefetching p = 100 / 9 blocks at step 0 costs max((100 + p) / 10, p) =
    p s there, and step 1 then reads 200 - p blocks over the link: 200 s in all. The ideal-split
    formula, sum u + (F - sum_t D_t / 11) / 1 = 200.9 s, would exceed it; ours is exactly 200 s.
    """
    prof = HardwareProfile("t", 10.0, 1.0, 1e9)
    p = 100 / 9
    step0 = cost.layer_step_time(
        0.0, 0.0, profile=prof, weight_bytes=100.0, hbm_migration_bytes=p, link_migration_bytes=p
    )
    step1 = cost.layer_step_time(p, 200 - p, profile=prof, weight_bytes=100.0)
    schedule = float(step0 + step1)
    u = cost.unlimited_step_time(np.array([0.0, 200.0]), profile=prof, weight_bytes=100.0)
    ideal_split = float(u.sum()) + (200 - (100 + 300) / 11)
    bound = float(bnd.cache_bound_seconds([200], [float(u.sum())], 1.0, 1.0)[0])
    assert schedule == pytest.approx(200.0, rel=1e-6)
    assert bound == pytest.approx(200.0, rel=1e-6) and bound <= schedule * (1 + 1e-6)
    assert ideal_split > schedule + 0.5


FAST = AnnealConfig(chains=4, max_iters=100)
NAMES = [
    "static",
    "lru-plan",
    "page",
    "paper-sa",
    "anneal",
    "anneal-oracle",
    "anneal-oracle+dual",
    "anneal+reuse",
    "anneal+now",
]
# KV-dominated (the cache bound binds) and weight-dominated (Unlimited is weights / B_hbm)
SMALL = cost.Geometry("small", 2, 1, 8, 2, 64.0, 0.0)  # 32 bytes per token-layer
MID = cost.Geometry("mid", 2, 1, 8, 2, 4096.0, 0.0)  # weights dominate the steps that read few
GEOMETRIES = {"small": SMALL, "mid": MID, "paper": cost.get_geometry("paper")}


@pytest.mark.slow  # about 210 s; one fixed case runs in the default suite (below)
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**16),
    sparsity=st.sampled_from([0.0, 0.5]),
    cap=st.sampled_from([0, 3, 6]),
    geometry=st.sampled_from(sorted(GEOMETRIES)),
    keep_fetched=st.booleans(),
)
def test_no_policy_beats_the_cache_bound(seed, sparsity, cap, geometry, keep_fetched):
    check_no_policy_beats_the_cache_bound(seed, sparsity, cap, geometry, keep_fetched)


@pytest.mark.slow  # about 33 s; test_simulate keeps its Unlimited case in the default suite
def test_no_policy_beats_the_cache_bound_on_one_case():
    check_no_policy_beats_the_cache_bound(7, 0.5, 3, "mid", True)


def check_no_policy_beats_the_cache_bound(seed, sparsity, cap, geometry, keep_fetched):
    trace = random_block_trace(seed)
    res = sim.simulate(
        trace,
        NAMES + ["unlimited"],
        profile=HardwareProfile.preset("gh200-paper"),
        geometry=GEOMETRIES[geometry],
        sparsity=sparsity,
        capacity_blocks=cap,
        keep_fetched=keep_fetched,
        chunk=6,
        window=4,
        anneal_config=FAST,
        paper_sa_grid=((2,), (1.0,)),
        progress=False,
        time_plans=False,
    )
    b = res["bounds"]
    assert b["cache_s"] >= b["unlimited_s"] * (1 - 1e-6)
    assert b["best_s"] >= max(b["cache_s"], b["capacity_s"]) * (1 - 1e-6)
    for name in NAMES:
        lat = res["policies"][name]["latency_s"]
        assert lat >= b["cache_s"] * (1 - 1e-6), (name, lat, b)
        assert lat >= b["best_s"] * (1 - 1e-6), (name, lat, b)
