"""Hand-computed latencies of page, paper-sa, anneal-oracle and anneal on tiny traces.

Cost model (jaxkv.sim.simulate, jaxkv.cost) with PROF (HBM 10 B/s, link 1 B/s) and GEO (4 bytes per
token-layer, 10 bytes of weights), one layer: per step
  HBM  = weights 10 + write 4 + tail 4 x (tokens in the unsealed block) + HBM-resident reads
         + promotions x block bytes                                          (/ 10 B/s)
  link = host reads + promotions x block bytes, except a block read at this step: its promotion
         rides on the read (HBM write only, the read is a host read); a block read at an earlier
         step crosses the link again (link read + HBM write)                 (/ 1 B/s)
  step = max(HBM / 10, link / 1); demotions are free. Sparsity 0: every id with mass > 0 is read.
Every figure below is derived from these rules and the policies' documented behaviour.
"""

import numpy as np
import pytest

from jaxkv import cost
from jaxkv.config import AnnealConfig, HardwareProfile
from jaxkv.sim import simulate as sim
from jaxkv.sim import trace as tr

PROF = HardwareProfile("t", 10.0, 1.0, 1e9)  # bytes per second: HBM 10, link 1
GEO = cost.Geometry("t", 1, 1, 1, 2, 10.0, 0.0)  # 4 bytes per token-layer, 10 bytes of weights
FAST = AnnealConfig(chains=4, max_iters=200)


def make_trace(prompt_len, block_size, reads):
    """reads: per step a list of (block id, mass); one layer."""
    k = max(len(r) for r in reads)
    ids = np.full((len(reads), 1, k), -1, np.int32)
    mass = np.zeros((len(reads), 1, k), np.float32)
    for t, r in enumerate(reads):
        for j, (i, m) in enumerate(r):
            ids[t, 0, j], mass[t, 0, j] = i, m
    fields = dict(version=1, prompt_len=prompt_len, block_size=block_size, ids=ids, mass=mass)
    return tr.validate(fields)


def run(trace, names, cap, **kw):
    return sim.simulate(
        trace,
        names,
        profile=PROF,
        geometry=GEO,
        sparsity=0.0,
        capacity_blocks=cap,
        chunk=trace.steps,
        progress=False,
        time_plans=False,
        **kw,
    )["policies"]


def check(v, latency, hit, migrated):
    assert v["latency_s"] == pytest.approx(latency, rel=1e-5)
    assert v["hbm_hit_rate"] == pytest.approx(hit, rel=1e-6)
    assert v["migrated_bytes"] == pytest.approx(migrated, rel=1e-6)


def test_page():
    # block 8 (32 bytes), prompt 48: blocks 0..5 sealed, pages of 16 // 8 = 2 blocks:
    # P0 = {0, 1}, P1 = {2, 3}, P2 = {4, 5}. Pool 2 blocks = 1 page, P0 resident. Tail 4 (t + 1).
    trace = make_trace(
        48, 8, [[(0, 0.5), (2, 1), (3, 1)], [(2, 1), (3, 1)], [(3, 1), (4, 3)], [(0, 1), (5, 2)]]
    )
    out = run(trace, ["page"], cap=2)
    # score = 4 [read now] + 2 x resident share + mass / (1 + max mass); read or resident only.
    # t0: P0 4 + 2 + 0.5/3 beats P1 4 + 2/3: no move. HBM 32 (0) + 4 + 14 = 50 -> 5; link 64
    #     (2, 3) -> 64 s.
    # t1: P1 4 + 2/3 beats P0 2 (resident, unread): promote 2, 3, demote 0, 1. 2, 3 are read
    #     now: the promotions ride on the reads (HBM write, host reads). HBM 8 + 14 + 64 = 86
    #     -> 8.6; link 64 (2, 3) -> 64 s.
    # t2: P1 4 + 2 + 1/4 beats P2 4 + 3/4: no move. HBM 32 (3) + 12 + 14 = 58 -> 5.8; link 32
    #     (4) -> 32 s.
    # t3: P2 4 + 2/3 beats P0 4 + 1/3 and P1 2: promote 4 (read at t2, not now: it crosses the
    #     link again, link read + HBM write) and 5 (read now: HBM write, host read); demote 2, 3.
    #     HBM 16 + 14 + 64 = 94 -> 9.4; link 64 (0, 5) + 32 (4) = 96 -> 96 s.
    # sum 64 + 64 + 32 + 96 = 256 s; HBM reads 1 + 0 + 1 + 0 of 3 + 2 + 2 + 2; moved 8 x 32.
    check(out["page"], 256.0, 2 / 9, 256.0)


# block 4 (16 bytes), prompt 16: blocks 0..3 sealed for 4 steps; tail 4 (t + 1); pool 2 = {0, 1}
SA_TRACE = [[(0, 1), (1, 1)], [(2, 1), (3, 1)], [(3, 1)], [(2, 1), (3, 1)]]


def test_paper_sa_full_fraction():
    out = run(make_trace(16, 4, SA_TRACE), ["paper-sa"], cap=2, paper_sa_grid=((2,), (0.5, 1.0)))
    # W = 2: score = read(t) + read(t + 1) / 2; keep resident blocks read soon, promote the top R
    # of the host blocks read soon, within capacity. R = 1:
    # t0: 0, 1 kept (read now) fill the pool: 2, 3 (read at t1) wait. HBM 32 + 4 + 14 = 50 -> 5 s.
    # t1: 0, 1 unread soon, evicted; promote 2 (1) and 3 (1.5), both read now: HBM write, host
    #     read. HBM 8 + 14 + 32 = 54 -> 5.4; link 32 -> 32 s.
    # t2: keep 2, 3: HBM 16 (3) + 12 + 14 = 42 -> 4.2 s.
    # t3: keep 2, 3: HBM 32 + 16 + 14 = 62 -> 6.2 s.
    # sum 5 + 32 + 4.2 + 6.2 = 47.4 s (beats R = 0.5's 59.2 s below); HBM reads 2 + 0 + 1 + 2
    # of 7; moved 2 promotions + 2 demotions x 16 bytes.
    assert out["paper-sa"]["tuned"] == "paper-sa[2,1.0]"
    check(out["paper-sa"], 47.4, 5 / 7, 64.0)


def test_paper_sa_half_fraction():
    out = run(make_trace(16, 4, SA_TRACE), ["paper-sa"], cap=2, paper_sa_grid=((2,), (0.5,)))
    # R = 0.5: t0 as above, 5 s.
    # t1: candidates 2 (1), 3 (1.5): ceil(0.5 x 2) = 1 -> promote 3 only (read now); 0, 1
    #     evicted. HBM 8 + 14 + 16 = 38 -> 3.8; link 16 (2) + 16 (3) = 32 -> 32 s.
    # t2: candidate 2 (score 1/2): ceil(0.5) = 1 -> promote 2, keep 3. 2 was read at t1, not
    #     now: it crosses the link again (link read + HBM write). HBM 16 (3) + 12 + 14 + 16 = 58
    #     -> 5.8; link 16 -> 16 s.
    # t3: keep 2, 3: 62 -> 6.2 s.
    # sum 5 + 32 + 16 + 6.2 = 59.2 s; HBM reads 2 + 0 + 1 + 2 of 7; moved (1 + 2) + 1 blocks x
    # 16 bytes.
    check(out["paper-sa"], 59.2, 5 / 7, 64.0)


def test_anneal_oracle():
    # block 4 (16 bytes), prompt 15: blocks 0..2 sealed at t0, block 3 seals at t1 (pool full:
    # host). Pool 1 = {0}. Tails 4 x (4, 1, 2, 3). W = 3, discount 1, a plan every step.
    trace = make_trace(15, 4, [[(0, 1)], [(0, 1), (3, 1)], [(3, 1)], [(3, 1)]])
    out = run(
        trace,
        ["anneal-oracle"],
        cap=1,
        oracle_window=3,
        oracle_discount=1.0,
        interval=1,
        anneal_config=FAST,
    )
    # Energy per step with fixed 10 + 4 x (1 + 4/2) = 22 bytes:
    # t0: only 0 is read in t0..t2 among the valid blocks: keep {0}.
    # t1, rows t1..t3: keep {0}: max(38/10, 16) + 16 + 16 = 48; {3} (read now: HBM write 16,
    #     link read 16, 0 read from host): 32 + 3.8 + 3.8 = 39.6; {} 64 -> promote 3, demote 0.
    # t2, t3: {3} holds every read: keep.
    # Simulated: t0 HBM 16 + 16 + 14 = 46 -> 4.6 s. t1 HBM 4 + 14 + 16 = 34 -> 3.4; link 16 (0)
    # + 16 (3) = 32 -> 32 s. t2 HBM 16 + 8 + 14 = 38 -> 3.8 s. t3 16 + 12 + 14 = 42 -> 4.2 s.
    # sum 4.6 + 32 + 3.8 + 4.2 = 44.6 s (static: 52.6); HBM reads 1 + 0 + 1 + 1 of 5; moved 2.
    check(out["anneal-oracle"], 44.6, 3 / 5, 32.0)


def test_anneal_ema():
    # block 2 (8 bytes), prompt 2: block 0 sealed (in the pool of 1), block 1 seals at t2 and
    # block 2 at t4 (pool full: host). Tails 4 x (1, 2, 1, 2, 1). W = 2, discount 1, every step.
    trace = make_trace(2, 2, [[(0, 1)], [(0, 1)], [(1, 1)], [(1, 1)], [(1, 1)]])
    out = run(trace, ["anneal"], cap=1, window=2, interval=1, discount=1.0, anneal_config=FAST)
    # ema forecast p_k = ema + [last read = t - 1] 0.9^(k + 1) (1 - ema), ema decay 0.9; energy
    # fixed 10 + 4 x (1 + 1) = 18 bytes.
    # t0: only block 0 is valid; nothing read yet, so every forecast is 0 and {0} ties with {}
    #     (1.8 + 1.8 = 3.6 s: a free demotion): the annealer stays put on ties (greedy_init keeps
    #     x0 unless a prefix is strictly better, a chain's best changes on strict improvement
    #     only). HBM 8 + 4 + 14 = 26 -> 2.6 s.
    # t1: 0 (ema 0.1, read at t0): p = 0.91, 0.829, it stays. HBM 8 + 8 + 14 = 30 -> 3 s.
    # t2: 1 never read (forecast 0), 0 forecast 0.919: keep. HBM 4 + 14 = 18 -> 1.8; link 8 (1)
    #     -> 8 s.
    # t3: 1 (ema 0.1, read at t2): p = 0.91, 0.829; 0 (ema 0.171): p = 0.171, 0.171.
    #     keep {0}: max(1.94, 7.28) + max(1.94, 6.63) = 13.91; {1}: a promotion costs HBM
    #     (1 - p_0) x 8 = 0.72 (the HBM write unless the read rides on it) and link 8:
    #     max((7.28 + 0.72 + 18) / 10, 1.37 + 8) + max(2.46, 1.37) = 9.37 + 2.46 = 11.83;
    #     (at the full link rate; the planner keeps half the link in reserve (link_reserve),
    #     which scales link terms by 2: {1} 18.74 + 2.74 = 21.48 vs keep {0} 27.82, the same
    #     choice)
    #     {} 8.65 + 8 = 16.65 -> promote 1, demote 0 (best by 2.08 s).
    #     1 is read now: the promotion rides on the read (HBM write, host read).
    #     HBM 8 + 14 + 8 = 30 -> 3; link 8 (1) -> 8 s.
    # t4: 1 (ema 0.19, read at t3) p = 0.919, 0.846, 0 cold (0.154: a promotion would be a link
    #     read + HBM write), 2 never read: keep {1}. HBM 8 + 4 + 14 = 26 -> 2.6 s (8 s unpromoted).
    # sum 2.6 + 3 + 8 + 8 + 2.6 = 24.2 s (static 29.6); HBM reads 1 + 1 + 0 + 0 + 1 of 5;
    # moved 2 x 8 bytes.
    check(out["anneal"], 24.2, 3 / 5, 16.0)


def test_promotion_at_step_zero_crosses_the_link():
    # block 4, prompt 16, pool 2 = {0, 1}; t0 reads 2, 3; t1 reads 3; t2 reads 2, 3.
    trace = make_trace(16, 4, [[(2, 1), (3, 1)], [(3, 1)], [(2, 1), (3, 1)]])
    out = run(trace, ["paper-sa"], cap=2, paper_sa_grid=((2,), (1.0,)))
    # t0: promote 2, 3, both read now and never read before: HBM 4 + 14 + 32 = 50 -> 5; link 32
    #     (host reads) -> 32 s. t1: HBM 16 + 8 + 14 = 38 -> 3.8 s. t2: 32 + 12 + 14 -> 5.8 s.
    # sum 41.6 s; HBM reads 0 + 1 + 2 of 5; moved 4 x 16. (Were 2, 3 read from HBM at t0, as
    # the old "read at the previous step" exception once had it with last_read = -1 matching
    # t - 1 = -1: 17.8 s, hit 1.)
    check(out["paper-sa"], 41.6, 3 / 5, 64.0)
