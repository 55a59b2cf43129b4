"""Cost model: the paper's calibration, the step formula, the bounds, the presets."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import cost
from jaxkv.config import HardwareProfile

PAPER_UNLIMITED = {0.4: 31.91, 0.5: 28.25, 0.6: 24.60}


@pytest.mark.parametrize("sparsity", sorted(PAPER_UNLIMITED))
def test_reproduces_paper_unlimited_row(sparsity):
    got = cost.paper_unlimited_seconds(sparsity)
    assert abs(got / PAPER_UNLIMITED[sparsity] - 1) < 0.01, got


def test_layer_step_time_is_the_slower_tier():
    prof = HardwareProfile("t", 10.0, 1.0, 1e9)
    # HBM side (4 + 10 + 4 + 2) / 10 = 2.0; link side (3 + 1) / 1 = 4.0
    t = cost.layer_step_time(
        4.0,
        3.0,
        profile=prof,
        weight_bytes=10.0,
        hbm_write_bytes=4.0,
        hbm_migration_bytes=2.0,
        link_migration_bytes=1.0,
    )
    assert float(t) == pytest.approx(4.0)
    t = cost.layer_step_time(jnp.array([40.0, 0.0]), jnp.array([1.0, 1.0]), profile=prof)
    np.testing.assert_allclose(t, [4.0, 1.0])


def test_step_bytes_adds_the_staged_copy_and_the_summaries():
    """The byte accounting: what the time model charges, plus the host blocks' staged copy
    (written into the staging pool and read there: twice their bytes) and the selection's
    summaries; broadcast over layers."""
    b = cost.step_bytes(
        weight_bytes=100.0, hbm_read_bytes=jnp.array([10.0, 0.0]), host_read_bytes=3.0,
        write_bytes=1.0, summary_bytes=2.0,
    )  # fmt: skip
    assert float(b["staged"]) == 6.0
    np.testing.assert_allclose(b["total"], [100 + 10 + 3 + 1 + 6 + 2, 100 + 3 + 1 + 6 + 2])


def test_no_split_beats_unlimited_and_capacity_bound_sits_between():
    prof = HardwareProfile.preset("gh200-paper")
    rng = np.random.default_rng(0)
    reads = rng.uniform(0, 5e8, size=64).astype(np.float32)
    split = rng.uniform(0, 1, size=(64, 16)).astype(np.float32)
    w = 1.6e8
    any_split = cost.layer_step_time(
        reads[:, None] * split, reads[:, None] * (1 - split), profile=prof, weight_bytes=w
    )
    unl = cost.unlimited_step_time(reads, profile=prof, weight_bytes=w)
    capb = cost.capacity_bound_step_time(reads, 1e8, profile=prof, weight_bytes=w)
    assert np.all(np.asarray(any_split) >= np.asarray(unl)[:, None] * (1 - 1e-6))
    assert np.all(np.asarray(capb) >= np.asarray(unl) * (1 - 1e-6))
    capped = np.minimum(split, 1e8 / np.maximum(reads[:, None], 1))
    fits = cost.layer_step_time(
        reads[:, None] * capped, reads[:, None] * (1 - capped), profile=prof, weight_bytes=w
    )
    assert np.all(np.asarray(fits) >= np.asarray(capb)[:, None] * (1 - 1e-5))


def test_geometry_presets():
    assert cost.get_geometry("llama3-8b").token_bytes == 4096
    assert cost.get_geometry("paper").token_bytes == 16384
    assert cost.get_geometry("paper").weight_bytes == pytest.approx(162.9e6, rel=1e-3)
    # 24 GB in all, 16 GB of parameters: 8 GB of KV over 32 layers of 16 KiB tokens
    assert cost.get_geometry("paper").hbm_capacity_tokens(24e9) == 15258


def test_unknown_geometry_lists_names():
    with pytest.raises(ValueError, match=r"unknown geometry 'gpt'.*llama3-8b.*paper"):
        cost.get_geometry("gpt")


def test_budget_below_params_is_rejected():
    with pytest.raises(ValueError, match=r"HBM budget 10.0 GB leaves no room.*expected > 16.1 GB"):
        cost.get_geometry("llama3-8b").hbm_capacity_tokens(10e9)


def test_sparsity_out_of_range_is_rejected():
    with pytest.raises(ValueError, match=r"sparsity must lie in \[0, 1\), got 1.0"):
        cost.paper_unlimited_seconds(1.0)
