"""bench/fp8_quality.py --equal-hbm-bytes: the HBM pool each FP8 policy gets from FP8 off's
HBM bytes (pure config arithmetic; the decode runs are the bench's, not the tests')."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import load_bench

BENCH = Path(__file__).parents[1] / "bench"


@pytest.fixture(scope="module")
def fq():
    return load_bench("fp8_quality")


MC = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16")


def _cfg(fq, hbm, fp8, batch=4, max_len=641, bs=16):
    return fq._config(MC, batch, max_len, bs, hbm, fp8)


def test_fp8_off_and_host_get_their_own_pool_back(fq):
    for fp8 in ("off", "host"):
        ref = _cfg(fq, "0.5", "off")
        n, fits = fq.equal_bytes_blocks(_cfg(fq, 1.0, fp8), fq.hbm_footprint(ref))
        assert (n, fits) == (ref.hbm_slots, True)  # host: the HBM pool stays bf16


def test_age_spends_the_budget_on_the_ring_then_fp8_blocks(fq):
    ref = _cfg(fq, "0.5", "off")
    budget = fq.hbm_footprint(ref)
    for fp8 in ("age:0", "age:256"):
        probe = _cfg(fq, 1.0, fp8)
        n, fits = fq.equal_bytes_blocks(probe, budget)
        got = _cfg(fq, n, fp8)
        assert fits and fq.hbm_footprint(got) <= budget  # never more HBM than FP8 off
        # ... and not a block's bytes less than it could: one more FP8 block would not fit
        assert fq.hbm_footprint(got) + probe.hbm_block_bytes > budget or n == probe.total_blocks
    # age:0's ring is the tails alone, so FP8 buys about twice FP8 off's pool
    n0, _ = fq.equal_bytes_blocks(_cfg(fq, 1.0, "age:0"), budget)
    assert 1.8 * ref.hbm_slots < n0 <= ref.total_blocks


def test_a_ring_larger_than_the_budget_does_not_fit(fq):
    ref = _cfg(fq, "tails", "off")  # HBM holds the 4 tails: less than age:256's ring
    probe = _cfg(fq, 1.0, "age:256")
    n, fits = fq.equal_bytes_blocks(probe, fq.hbm_footprint(ref))
    assert not fits and n == probe.batch  # the smallest pool, reported as over the budget
    big, _ = fq.equal_bytes_blocks(probe, 10**12)
    assert big == probe.total_blocks  # capped by the cache
