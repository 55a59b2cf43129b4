"""Policies as values wherever a name is accepted: `simulate(...)` (in a list, or under labels),
`PlacementConfig(policy=...)` for the decode loop, and `jaxkv simulate --policies
module:attribute`; every refusal names the value and what was expected (one test per message)."""

import dataclasses
import json
import re

import jax.numpy as jnp
import pytest

from jaxkv import Decoder, cli
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.placement import forecasts, policies, pricing
from jaxkv.sim import simulate as sim
from jaxkv.sim import trace as tr

MINE = policies.Anneal(
    name="mine",
    forecast=forecasts.Reuse(),
    terms=(pricing.Unforeseen(), pricing.Ride(1.0), pricing.Spread(1.5)),
    follow=policies.Follow("ranked"),
    window=4,
)
MY_LRU = policies.LruPlan(name="my-lru")  # cheap to compile: the tests below run several
TRACE = tr.SyntheticTrace("recency-low", 40, 16, 2, 4, seed=3)
PROF = HardwareProfile.preset("h200-pcie")


def run(policies_, **kw):
    kw = dict(profile=PROF, sparsity=0.6, hbm_fraction=0.25, chunk=8, progress=False) | kw
    return sim.simulate(TRACE, policies_, time_plans=False, **kw)["policies"]


# ---- the simulator -----------------------------------------------------------------------------


def test_simulate_runs_a_policy_object_beside_names():
    out = run(["static", MY_LRU, "lru-plan", "unlimited"])
    assert list(out) == ["static", "my-lru", "lru-plan", "unlimited"]
    assert out["my-lru"]["latency_s"] == out["lru-plan"]["latency_s"]


@pytest.mark.slow  # three anneal policies compiled (the README's composed example runs one)
def test_a_policy_object_is_the_preset_it_composes():
    """The same object as the preset's parts (under a label) replays to the same figures."""
    same = dataclasses.replace(MINE, name="anneal+reuse+follow")
    out = run({"mine": MINE, "preset": "anneal+reuse+follow", "same": same}, follow_window=4)
    assert out["mine"]["latency_s"] == out["same"]["latency_s"]
    assert out["preset"]["latency_s"] == pytest.approx(out["mine"]["latency_s"])


@pytest.mark.slow  # two anneal policies compiled
def test_two_variants_of_one_preset_in_one_run():
    kw = {"every-2": {"interval": 2}, "every-8": {"interval": 8}}
    out = run({"every-2": "anneal", "every-8": "anneal"}, policy_kwargs=kw)
    assert list(out) == ["every-2", "every-8"]
    assert (out["every-2"]["plans"], out["every-8"]["plans"]) == (8, 2)


def test_an_object_that_is_not_a_policy_is_named():
    msg = "policies: a dict is neither a policy name nor a policy: it lacks name, horizon"
    with pytest.raises(TypeError, match=re.escape(msg)):
        run(["static", {"window": 4}])


def test_an_unhashable_policy_is_named():
    class Mutable(policies.Static):
        __hash__ = None  # as a dataclass that is not frozen

    msg = "policies: a Mutable (policy 'static') is not hashable"
    with pytest.raises(TypeError, match=re.escape(msg)):
        run([Mutable()])


def test_two_policies_under_one_label_are_named():
    with pytest.raises(ValueError, match="two policies are labelled 'mine': expected distinct"):
        run([MINE, dataclasses.replace(MINE, window=8)])


def test_a_label_that_is_not_a_string_is_named():
    with pytest.raises(ValueError, match=r"policies: key 3: expected a non-empty str label"):
        run({3: "static"})


def test_a_bad_name_under_a_label_is_named():
    with pytest.raises(ValueError, match=r"policies\['mine'\]: unknown policy 'anneal2'"):
        run({"mine": "anneal2"})


def test_the_bound_under_another_label_is_named():
    msg = "policies['best']: 'unlimited' is reported under its own name only"
    with pytest.raises(ValueError, match=re.escape(msg)):
        run({"best": "unlimited"})


def test_a_presets_own_label_on_another_policy_is_named():
    msg = "policies['unlimited']: the label 'unlimited' is the preset's own"
    with pytest.raises(ValueError, match=re.escape(msg)):
        run({"unlimited": MINE})


def test_policy_kwargs_on_an_object_are_named():
    msg = "policy_kwargs['mine']: 'mine' is a policy object; set its knobs on the object"
    with pytest.raises(ValueError, match=re.escape(msg)):
        run([MINE], policy_kwargs={"mine": {"window": 8}})


# ---- the decode loop -------------------------------------------------------------------------


def _decoder(policy, tiny, **placement):
    model, _ = tiny
    cache = CacheConfig.for_model(
        model.config, batch=1, max_len=128, block_size=8, hbm_fraction=0.25
    )
    return Decoder(model, cache, PlacementConfig(policy=policy, **placement), max_new_tokens=12)


def test_decoder_runs_a_policy_object(tiny):
    _, params = tiny
    dec = _decoder(MY_LRU, tiny, window=2, attention="sparse")
    state = dec.generate(params, dec.prefill(params, jnp.arange(70, dtype=jnp.int32)[None]))
    assert dec.policy is MY_LRU and int(state.metrics.migrated_blocks) > 0


@pytest.mark.slow  # an anneal policy compiled (the README's composed example runs one)
def test_decoder_runs_a_composed_policy_that_follows(tiny):
    _, params = tiny
    dec = _decoder(MINE, tiny, window=4, attention="sparse")
    assert dec.policy is MINE and dec.follows
    state = dec.generate(params, dec.prefill(params, jnp.arange(70, dtype=jnp.int32)[None]))
    assert int(state.metrics.windows) >= 2 and int(state.step) == 11


def test_decoder_refuses_a_non_policy(tiny):
    msg = "PlacementConfig.policy: an int is neither a policy name nor a policy"
    with pytest.raises(TypeError, match=re.escape(msg)):
        _decoder(3, tiny)


def test_decoder_names_a_window_mismatch(tiny):
    msg = "PlacementConfig.policy 'mine' (Anneal) looks window=4 steps ahead but PlacementConfig"
    with pytest.raises(ValueError, match=re.escape(msg)):
        _decoder(MINE, tiny, window=50)


def test_decoder_refuses_a_policy_that_needs_the_future(tiny):
    now = dataclasses.replace(MINE, forecast=forecasts.Now(forecasts.Reuse()), follow=None)
    with pytest.raises(ValueError, match="plans from the true future reads, which a live decode"):
        _decoder(now, tiny, window=4)


def test_decoder_refuses_knob_overrides_of_an_object(tiny):
    model, _ = tiny
    cache = CacheConfig.for_model(model.config, batch=1, max_len=64, hbm_fraction=0.25)
    msg = "policy_kwargs ['spread'] set knobs of a preset name; PlacementConfig.policy 'mine'"
    with pytest.raises(ValueError, match=re.escape(msg)):
        Decoder(model, cache, PlacementConfig(policy=MINE, window=4), policy_kwargs={"spread": 1})


# ---- the command line --------------------------------------------------------------------------

ARGS = ["simulate", "--trace", "synthetic:recency-low", "--prompt-len", "40", "--steps", "16"]
ARGS += ["--layers", "2", "--block-size", "4", "--hbm-fraction", "0.25", "--no-progress"]

POLICY_FILE = """
from jaxkv.placement import policies
mine = policies.LruPlan(name="mine")
not_a_policy = 3
"""


@pytest.fixture
def policy_module(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(POLICY_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(tmp_path)  # undone after the test, as chdir is
    return tmp_path / "my_policies.py"


def _cli_error(capsys, policies_) -> str:
    assert cli.main(ARGS + ["--policies", policies_]) == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_runs_a_policy_object_by_module_and_attribute(policy_module, capsys):
    assert cli.main(ARGS + ["--policies", "static,my_policies:mine", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["policies"]) == ["static", "mine"]


def test_cli_runs_a_policy_object_from_a_file(policy_module, capsys):
    assert cli.main(ARGS + ["--policies", f"{policy_module}:mine", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["policies"]) == ["mine"]


def test_cli_names_a_module_it_cannot_import(policy_module, capsys):
    err = _cli_error(capsys, "static,nowhere:mine")
    assert "--policies: 'nowhere:mine': cannot import 'nowhere'" in err
    assert "expected module:attribute with the module importable from the working" in err


def test_cli_names_a_missing_attribute(policy_module, capsys):
    err = _cli_error(capsys, "my_policies:yours")
    assert "--policies: 'my_policies:yours': 'my_policies' has no attribute 'yours'" in err


def test_cli_names_an_attribute_that_is_not_a_policy(policy_module, capsys):
    err = _cli_error(capsys, "my_policies:not_a_policy")
    assert "'my_policies:not_a_policy': an int is neither a policy name nor a policy" in err


def test_cli_names_an_empty_attribute(capsys):
    err = _cli_error(capsys, "my_policies:")
    assert "--policies: 'my_policies:': expected module:attribute or file.py:attribute" in err
