"""A serving run priced after the fact (`jaxkv.serve.timing`): on the engine's own profile and
sizes the decode steps cost what the step itself modeled; other sizes and profiles reprice the
same reads."""

import numpy as np
import pytest

from jaxkv import CacheConfig, PlacementConfig
from jaxkv.cost import GEOMETRIES
from jaxkv.serve import Engine, SamplingParams, timing


@pytest.fixture(scope="module")
def run(tiny):
    model, params = tiny
    c = CacheConfig.for_model(model.config, batch=3, max_len=112, block_size=8,
                              hbm_fraction=0.3, paged_host=True)  # fmt: skip
    place = PlacementConfig(policy="lrfu", attention="sparse", topk=0.5)
    eng = Engine(model, params, c, place, chunk=16, profile="h200-pcie")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).astype(np.int32) for n in (40, 70, 20, 55)]
    eng.generate(prompts, SamplingParams(max_new_tokens=30))
    return eng


def test_own_pricing_equals_the_steps_modeled_latency(run):
    t = timing.iteration_seconds(run.log, run.cache_config, run.core.decoder.profile,
                                 timing.Sizes.of_engine(run))  # fmt: skip
    own = np.array([it.out["latency"] for it in run.log if it.out is not None])
    steps = t["step"][[i for i, it in enumerate(run.log) if it.out is not None]]
    np.testing.assert_allclose(steps, own, rtol=1e-5)
    assert (t["prefill"] > 0).sum() >= 4  # every prompt prefilled in chunks, priced


def test_price_reports_the_run(run):
    p = timing.price(run, "h200-pcie")
    assert p["tokens"] == 4 * 30 == sum(len(r.tokens) for r in run.requests.values())
    assert p["tokens_per_s"] == pytest.approx(p["tokens"] / p["modeled_seconds"])
    assert 0 < p["ttft_p50_s"] <= p["ttft_p99_s"] and 0 < p["tpot_p50_s"] <= p["tpot_p99_s"]
    assert 0 < p["hbm_hit_rate"] < 1 and p["link_bytes_per_token"] > 0
    # Llama-3.1-8B's sizes (its weights and KV blocks far larger than the tiny model's): slower
    big = timing.price(run, "h200-pcie", timing.Sizes.of_geometry(GEOMETRIES["llama3-8b"]))
    assert big["modeled_seconds"] > 100 * p["modeled_seconds"]
    assert big["hbm_hit_rate"] == p["hbm_hit_rate"]  # the same reads
    charged = timing.price(run, "h200-pcie", plan_share=0.5)
    assert charged["modeled_seconds"] > p["modeled_seconds"]
    assert timing.plan_share(run) == 0.0  # lrfu does not plan
