"""`Decoder` as a frozen dataclass and its per-device seam (`jaxkv.decode.per_device.PerDevice`).
What the seam does under shard_map (per-device links, a shared link, pooled statistics) is
tested in tests/test_sharded.py on a simulated mesh; here, what can be checked on one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import CacheConfig, Decoder, HardwareProfile, PlacementConfig
from jaxkv.decode.decoder import PLAN_MODES
from jaxkv.decode.per_device import PerDevice

GH200 = HardwareProfile.preset("gh200")
SLOW = dataclasses.replace(GH200, name="slow-link", link_bandwidth=GH200.link_bandwidth / 3)


def _decoder(tiny, **kw):
    model, _ = tiny
    cfg = CacheConfig.for_model(model.config, batch=2, max_len=64, block_size=8, hbm_fraction=0.25)
    p = PlacementConfig(policy="lru-plan", window=2, attention="sparse", topk=3)
    return Decoder(model, cfg, p, max_new_tokens=4, **kw)


def test_decoder_is_a_frozen_dataclass_equal_by_its_fields(tiny):
    a, b = _decoder(tiny), _decoder(tiny)
    assert dataclasses.is_dataclass(a)
    assert "per_device" in {f.name for f in dataclasses.fields(a)}
    assert a == b and hash(a) == hash(b)  # equal decoders compile the same programs
    assert a != _decoder(tiny, profile="h200-pcie")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_new_tokens = 8


def test_per_device_is_a_field_of_the_decoder(tiny):
    pd = PerDevice(profiles=(GH200, SLOW), index=(0, 1))
    dec = _decoder(tiny, per_device=pd)
    assert dec.per_device == pd
    assert dec != _decoder(tiny)
    assert [s.profile for s in dec._siblings] == [GH200, SLOW]
    assert all(s.per_device is None for s in dec._siblings)  # each sibling a plain decoder


def test_per_device_first_profile_must_be_the_decoders(tiny):
    with pytest.raises(ValueError, match="per_device.profiles\\[0\\]='slow-link': expected"):
        _decoder(tiny, per_device=PerDevice(profiles=(SLOW,), index=(0,)))


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(profiles=(), index=(0,)), "profiles=\\(\\): expected HardwareProfiles"),
        (dict(profiles=("gh200",), index=(0,)), "expected HardwareProfiles"),
        (dict(profiles=(GH200,), index=()), "index=\\(\\): expected one profile index"),
        (dict(profiles=(GH200,), index=(0, 1)), "each in \\[0, 1\\)"),
        (dict(profiles=(GH200,), index=(0,), shared_link="x"), "shared_link='x': expected"),
        (dict(profiles=(GH200,), index=(0,), plan_axis="rows"), "plan_axis='rows': expected"),
    ],
)
def test_per_device_names_a_bad_value(kw, message):
    with pytest.raises(ValueError, match=message):
        PerDevice(**kw)


def test_pooling_without_a_plan_axis_leaves_the_state(tiny):
    dec = _decoder(tiny)
    model, params = tiny
    state = dec.prefill(params, jnp.ones((2, 20), jnp.int32))
    pd = PerDevice(profiles=(GH200,), index=(0,))
    assert pd.pool_statistics(state) is state


def test_device_step_is_the_step_that_plans_when_due(tiny):
    """`device_step` (the unjitted body a shard_map runs) decodes the step `step` does: the
    same tokens and placement, at a window boundary and between two."""
    dec = _decoder(tiny)
    _, params = tiny
    prompts = jax.random.randint(jax.random.key(3), (2, 20), 0, 256).astype(jnp.int32)
    ref = dec.prefill(params, prompts)
    got = dec.prefill(params, prompts)
    body = jax.jit(dec.device_step)
    for _ in range(3):  # window 2: the second step plans
        ref, got = dec.step(params, ref), body(params, got)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
        np.testing.assert_array_equal(np.asarray(got.cache.tier), np.asarray(ref.cache.tier))
        assert int(got.metrics.windows) == int(ref.metrics.windows)
    assert int(ref.metrics.windows) >= 1


def test_a_step_names_a_bad_plan_mode(tiny):
    dec = _decoder(tiny)
    _, params = tiny
    state = dec.prefill(params, jnp.ones((2, 20), jnp.int32))
    assert PLAN_MODES == ("never", "always", "when_due")
    with pytest.raises(ValueError, match="plan='cond': expected one of"):
        dec._step_impl(params, state, plan="cond")
