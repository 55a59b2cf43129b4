import dataclasses

import numpy as np
import pytest

from jaxkv.config import (
    AnnealConfig,
    CacheConfig,
    HardwareProfile,
    PlacementConfig,
    check_number,
)

GEOM = dict(num_layers=2, kv_heads=2, head_dim=8)


def test_capacities_from_fraction_blocks_and_bytes():
    c = CacheConfig(**GEOM, batch=2, max_len=64, block_size=16, hbm_fraction=0.25)
    assert c.max_blocks == 4 and c.total_blocks == 8
    assert c.hbm_slots == 2 and c.hbm_pool_slots == 0
    assert c.host_slots == 8  # write-through: a host copy of every block
    c = CacheConfig(**GEOM, batch=1, max_len=100, block_size=7, hbm_blocks=5)
    assert c.max_blocks == 15 and c.hbm_slots == 5 and c.host_slots == 15
    c = dataclasses.replace(c, host_tier="exclusive")
    assert c.host_slots == 10  # exclusive: what does not fit in HBM
    assert c.block_bytes == 2 * 7 * 2 * 8 * 4
    # bytes count every layer: 2 layers x 896 bytes a block; 5.5 blocks' worth -> 5 a layer
    c = CacheConfig(**GEOM, batch=1, max_len=100, block_size=7, hbm_bytes=int(5.5 * 2 * 896))
    assert c.hbm_slots == 5 and c.host_slots == 15
    c = CacheConfig(
        **GEOM,
        max_len=100,
        block_size=7,
        hbm_fraction=1,
        host_bytes=3 * 2 * 896,
        host_tier="exclusive",
    )
    assert c.hbm_slots == 15 and c.host_slots == 3
    assert CacheConfig(**GEOM, hbm_bytes=10**12).hbm_slots == 128  # a budget over the KV: all


def test_configs_are_hashable_static_args():
    assert hash(CacheConfig(**GEOM, hbm_fraction=0.5)) == hash(
        CacheConfig(**GEOM, hbm_fraction=0.5)
    )
    assert hash(PlacementConfig()) == hash(PlacementConfig())
    assert hash(AnnealConfig()) == hash(AnnealConfig())


def test_error_hbm_cannot_hold_tails():
    with pytest.raises(ValueError, match=r"hbm_blocks=1 gives 1 HBM blocks .* expected >= 2"):
        CacheConfig(**GEOM, batch=2, hbm_blocks=1)


def test_error_hbm_bytes_below_one_block_names_the_figures():
    msg = (
        r"hbm_bytes=1000 gives 0 HBM blocks per layer, .* expected >= 1 blocks per layer \(2 "
        r"layers x 2,048 bytes per block = 4,096 bytes a block across layers: hbm_bytes >= 4,096\)"
    )
    with pytest.raises(ValueError, match=msg):
        CacheConfig(**GEOM, hbm_bytes=1000)


def test_error_too_little_host_capacity():
    with pytest.raises(ValueError, match=r"host_blocks=2 gives 2 host blocks .* at least"):
        CacheConfig(
            **GEOM,
            max_len=160,
            block_size=16,
            hbm_blocks=4,
            host_blocks=2,
            host_tier="exclusive",
        )


def test_error_write_through_host_smaller_than_the_kv():
    with pytest.raises(
        ValueError,
        match=r"host_blocks=6 gives 6 host blocks per layer, but host_tier='write-through' "
        r"keeps a host copy of every block: expected 10 .* use host_tier='exclusive'",
    ):
        CacheConfig(**GEOM, max_len=160, block_size=16, hbm_blocks=4, host_blocks=6)
    CacheConfig(**GEOM, max_len=160, block_size=16, hbm_blocks=4, host_fraction=1.0)


def test_error_unknown_host_tier():
    with pytest.raises(ValueError, match=r"host_tier must be one of .*, got 'inclusive'"):
        CacheConfig(**GEOM, hbm_fraction=1.0, host_tier="inclusive")


def test_error_bytes_looking_block_count():
    msg = (
        r"hbm_blocks=8,000,000: more than the KV footprint of 128 blocks per layer \(batch=1 x "
        r"128 blocks of 16 tokens\): expected <= 128; a byte budget is hbm_bytes=8000000, all "
        r"of the footprint hbm_fraction=1.0"
    )
    with pytest.raises(ValueError, match=msg):
        CacheConfig(**GEOM, hbm_blocks=8_000_000)


def test_error_percent_looking_fraction():
    msg = r"hbm_fraction=25: expected a fraction in \(0, 1\] .* \(25% is hbm_fraction=0.25\)"
    with pytest.raises(ValueError, match=msg):
        CacheConfig(**GEOM, hbm_fraction=25)


def test_error_fraction_out_of_range():
    with pytest.raises(
        ValueError, match=r"^hbm_fraction=0.0: expected a finite number in \(0, 1\]"
    ):
        CacheConfig(**GEOM, hbm_fraction=0.0)


def test_error_fraction_given_as_blocks():
    msg = r"hbm_blocks=0.25: expected a whole number .* say hbm_fraction=0.25"
    with pytest.raises(ValueError, match=msg):
        CacheConfig(**GEOM, hbm_blocks=0.25)


def test_error_blocks_not_an_integer():
    with pytest.raises(ValueError, match=r"^host_blocks=2.5: expected an integer >= 0$"):
        CacheConfig(**GEOM, hbm_fraction=1.0, host_blocks=2.5)


def test_error_two_capacity_keywords():
    msg = r"^hbm_fraction=0.5, hbm_bytes=4096: expected exactly one of hbm_fraction=, hbm_blocks="
    with pytest.raises(ValueError, match=msg):
        CacheConfig(**GEOM, hbm_fraction=0.5, hbm_bytes=4096)


def test_error_no_hbm_capacity():
    msg = r"^no HBM capacity given: expected exactly one of .* \(e.g. hbm_fraction=1.0, all 128"
    with pytest.raises(ValueError, match=msg):
        CacheConfig(**GEOM)


@pytest.mark.parametrize(
    "old,use",
    [
        (dict(hbm_capacity=0.25), "say hbm_fraction=0.25;"),
        (dict(hbm_capacity=25), r"say hbm_blocks=25 \(if blocks per layer\) or hbm_bytes=25"),
        (dict(host_capacity=1.0, hbm_fraction=1.0), "say host_fraction=1.0;"),
    ],
)
def test_error_old_capacity_keyword(old, use):
    (name, value), *_ = old.items()
    with pytest.raises(ValueError, match=rf"^{name}={value} is no longer accepted .*{use}"):
        CacheConfig(**GEOM, **old)


def test_error_bad_dtype():
    with pytest.raises(ValueError, match=r"dtype must be one of .* got 'int8'"):
        CacheConfig(**GEOM, dtype="int8")


def test_error_bad_block_size():
    with pytest.raises(ValueError, match=r"block_size must be an integer >= 1, got 0"):
        CacheConfig(**GEOM, block_size=0)


def test_error_capacity_type():
    with pytest.raises(ValueError, match=r"^hbm_fraction='half': expected a finite number in"):
        CacheConfig(**GEOM, hbm_fraction="half")


def test_error_unknown_profile():
    with pytest.raises(ValueError, match=r"unknown hardware profile 'tpu'; expected one of"):
        HardwareProfile.preset("tpu")


def test_profiles_and_alpha_star():
    p = HardwareProfile.preset("gh200-paper")
    assert p.alpha_star == pytest.approx(4900 / 5350)


def test_error_placement_attention_mode():
    with pytest.raises(ValueError, match=r"attention must be 'exact' or 'sparse', got 'dense'"):
        PlacementConfig(attention="dense")


def test_error_placement_topk_fraction():
    with pytest.raises(ValueError, match=r"topk as a fraction must lie in \(0, 1\], got 0.0"):
        PlacementConfig(topk=0.0)


def test_measure_returns_positive_bandwidths():
    p = HardwareProfile.measure(nbytes=1 << 20, repeats=2)
    assert p.hbm_bandwidth > 0 and p.link_bandwidth > 0


def test_error_host_memory_kind():
    with pytest.raises(ValueError, match=r"host_memory_kind must be one of .* got 'hbm'"):
        CacheConfig(**GEOM, host_memory_kind="hbm")


def test_for_model_takes_geometry_and_dtype():
    from models import tiny_config

    mc = tiny_config(dtype="bfloat16")
    c = CacheConfig.for_model(mc, max_len=128, hbm_fraction=0.5)
    assert (c.num_layers, c.kv_heads, c.head_dim, c.dtype) == (2, 2, 16, "bfloat16")
    assert c.max_len == 128 and c.hbm_slots == 4


def test_check_number_messages():
    with pytest.raises(ValueError, match=r"^--w=0: expected an integer >= 1$"):
        check_number("--w", 0, integer=True, low=1)
    with pytest.raises(ValueError, match=r"^x=nan: expected a finite number in \(0, 1\]$"):
        check_number("x", float("nan"), low=0.0, high=1.0, low_open=True)
    with pytest.raises(ValueError, match=r"^x=True: expected a finite number >= 0$"):
        check_number("x", True, low=0.0)
    with pytest.raises(ValueError, match=r"^x=2.5: expected an integer <= 3$"):
        check_number("x", 2.5, integer=True, high=3)
    check_number("x", np.float32(0.5), low=0.0, high=1.0, high_open=True)
    check_number("x", np.int64(3), integer=True, low=0)


def test_error_anneal_config_non_finite():
    with pytest.raises(ValueError, match=r"t0_quantile=inf: expected a finite number in \[0, 1\]"):
        AnnealConfig(t0_quantile=float("inf"))
    with pytest.raises(ValueError, match=r"tolerance=nan: expected a finite number >= 0"):
        AnnealConfig(tolerance=float("nan"))


def test_error_anneal_config_schedule():
    with pytest.raises(ValueError, match=r"t0_quantile=1.5: expected a finite number in \[0, 1\]"):
        AnnealConfig(t0_quantile=1.5)
    with pytest.raises(ValueError, match=r"t_final=0.0: expected a finite number in \(0, 1\]"):
        AnnealConfig(t_final=0.0)
    with pytest.raises(ValueError, match=r"tolerance=-0.1: expected a finite number >= 0"):
        AnnealConfig(tolerance=-0.1)
    with pytest.raises(ValueError, match=r"candidates must be an integer >= 1, got 0"):
        AnnealConfig(candidates=0)
    with pytest.raises(ValueError, match=r"patience must be an integer >= 1, got 2.5"):
        AnnealConfig(patience=2.5)


def test_error_placement_window_controls():
    with pytest.raises(ValueError, match=r"window_step must be an integer >= 1, got 0"):
        PlacementConfig(window_step=0)
    with pytest.raises(ValueError, match=r"min_window must be an integer >= 1, got 1.5"):
        PlacementConfig(min_window=1.5)
    assert PlacementConfig(attention="sparse", topk=np.float32(0.5)).topk == 0.5
