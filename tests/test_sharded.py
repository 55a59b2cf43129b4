"""The sharded cache and decode loop (`jaxkv.decode.sharded`) on 8 simulated CPU devices and across
two processes under jax.distributed. A mesh needs the devices jax starts with, so the multi-device
runs happen in fresh interpreters (tests/sharded_worker.py, one JSON line each)."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxkv.config import CacheConfig, PlacementConfig
from jaxkv.decode import sharded

WORKER = os.path.join(os.path.dirname(__file__), "sharded_worker.py")


def _worker(*args, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, WORKER, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def exact_lru():
    return _worker("mesh", "--policy", "lru-plan", "--attention", "exact")


@pytest.fixture(scope="module")
def sparse_fp8():
    return _worker("mesh", "--policy", "lru-plan", "--attention", "sparse", "--fp8", "host")


@pytest.fixture(scope="module")
def exact_age():
    return _worker("mesh", "--policy", "lru-plan", "--fp8", "age", "--fp8-age", "16")


def test_sharded_exact_decoding_gives_one_devices_tokens(exact_lru, exact_age):
    """4 data x 2 model shards (sequences and KV heads), tensor-parallel model: the greedy
    tokens equal the one-device decoder's, with FP8 off and with FP8 by age (a block's
    quantization is its own, wherever it lives)."""
    for r in (exact_lru, exact_age):
        assert r["devices"] == 8 and r["shards"] == 8
        assert r["tokens"] == r["reference"]


@pytest.mark.slow  # a worker of its own (about 1 min here)
def test_sharded_lrfu_with_its_lookahead_decodes_one_devices_tokens():
    """lrfu with the steady estimator and the lookahead (each KV-head shard's `first_query`
    gives its own heads' queries, so its own selection) on 4 x 2 shards, sparse: the one-device
    decoder's tokens, and blocks do move. Slack is off: on this tiny model the h200-pcie link
    time hides no promotion, so lrfu at its defaults admits none and nothing would move."""
    r = _worker("mesh", "--policy", "lrfu", "--attention", "sparse", "--policy-kwargs",
                '{"slack": false}')
    assert r["devices"] == 8 and r["tokens"] == r["reference"]
    assert r["summary"]["migrated_blocks"] > 0


@pytest.mark.slow  # the sparse FP8 worker (about 20 s)
def test_every_shard_keeps_its_pools_memory_kind(exact_lru, sparse_fp8, exact_age):
    for r in (exact_lru, sparse_fp8, exact_age):
        assert r["kinds_after_prefill"] == ["pinned_host"]
        assert r["pool_kinds"] == {
            "host_k": ["pinned_host"],
            "host_v": ["pinned_host"],
            "hbm_k": ["device"],
            "hbm_v": ["device"],
            "ring_k": ["device"],
            "ring_v": ["device"],
        }
    assert sparse_fp8["host_dtype"] == "float8_e4m3fn" == exact_age["host_dtype"]
    assert sparse_fp8["hbm_dtype"] == "float32" and exact_age["hbm_dtype"] == "float8_e4m3fn"


@pytest.mark.slow  # the sparse FP8 worker (about 20 s)
def test_migrations_happen_at_each_devices_phase(sparse_fp8):
    """stagger=1, W=4: device d plans (and migrates) only at steps s with
    s = W - 1 + phase_d (mod W), phase_d = d mod 4; every phase migrates at least once, so no
    step has all devices migrating. (Sparse selection ranks blocks by the Quest bound summed over
    a device's own query heads, so its tokens may differ from one device's: not compared.)"""
    r = sparse_fp8
    W, phases, moved = r["window"], r["phases"], np.asarray(r["moved"])
    assert phases == [d % 4 for d in range(8)]
    for d, phase in enumerate(phases):
        steps = np.flatnonzero(moved[d])
        assert steps.size > 0, f"device {d} never migrated"
        assert ((steps - (W - 1) - phase) % W == 0).all(), (d, steps.tolist())
    movers = (moved > 0).sum(axis=0)
    assert movers.max() < 8
    assert not any(r["rows_share_statistics"])  # each device plans from its own heads


@pytest.mark.slow  # default suite: 25-60 s each (CI runs make test-slow)
def test_one_plan_per_model_group():
    """plan_over="model": the two model devices of each data row pool their statistics, so
    they place their shards alike (sparse attention: their own selections differ; with one
    plan per device, `sparse_fp8`, their statistics differ), and stagger=1 offsets the rows'
    phases, not the devices'."""
    r = _worker("mesh", "--policy", "anneal+reuse", "--attention", "sparse", "--plan-over", "model")
    assert r["phases"] == [d // 2 % 4 for d in range(8)]
    assert all(r["rows_share_statistics"]) and all(r["rows_place_alike"])
    W, moved = r["window"], np.asarray(r["moved"])
    assert moved.any()
    np.testing.assert_array_equal(moved[0::2], moved[1::2])  # a row's devices move together
    for d, phase in enumerate(r["phases"]):
        steps = np.flatnonzero(moved[d])
        assert ((steps - (W - 1) - phase) % W == 0).all(), (d, steps)


@pytest.mark.slow  # default suite: 25-60 s each (CI runs make test-slow)
def test_each_device_prices_its_own_link():
    """link_bandwidths: the model shard 1 of every data row reads its host pool over a link a
    tenth as fast (a far NUMA node). Exact LRU places identically on both model shards, so
    both read the same host bytes; the slow devices' modeled steps are never faster and are
    slower wherever a step reads host blocks."""
    gbps = ",".join("55" if d % 2 == 0 else "5.5" for d in range(8))
    r = _worker("mesh", "--policy", "lru-plan", "--attention", "exact", "--link-gbps", gbps)
    lat, host = np.asarray(r["latency"]), np.asarray(r["host_bytes"])
    assert r["tokens"] == r["reference"]
    for row in range(4):
        fast, slow = 2 * row, 2 * row + 1
        np.testing.assert_array_equal(host[fast], host[slow])
        assert (lat[slow] >= lat[fast]).all()
        reads = host[fast] > 0
        assert reads.any() and (lat[slow][reads] > lat[fast][reads]).all()


@pytest.mark.slow  # default suite: 25-60 s each (CI runs make test-slow)
def test_a_shared_link_carries_the_groups_bytes(exact_lru):
    """shared_link="model": the two model shards of a data row read over one link, so each
    one's modeled step is never faster than with a link of its own, and slower wherever the
    step reads host blocks (exact LRU: the same reads, so the same host bytes either way)."""
    r = _worker("mesh", "--policy", "lru-plan", "--attention", "exact", "--shared-link", "model")
    own, shared = np.asarray(exact_lru["latency"]), np.asarray(r["latency"])
    np.testing.assert_array_equal(np.asarray(r["host_bytes"]), np.asarray(exact_lru["host_bytes"]))
    assert r["tokens"] == r["reference"]
    assert (shared >= own).all() and (shared > own).any()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # default suite: 20-35 s each (CI runs make test-slow)
def test_two_processes_decode_one_sharded_cache():
    """Two processes on localhost (4 CPU devices each) under jax.distributed.initialize form one
    4 x 2 mesh; each decodes the same prompts with the cache sharded across both and gets the
    one-device tokens."""
    port = str(_free_port())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                "distributed",
                "--devices",
                "4",
                "--processes",
                "2",
                "--process-id",
                str(i),
                "--port",
                port,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["process"] for o in outs) == [0, 1]
    for o in outs:
        assert o["processes"] == 2 and o["devices"] == 8 and o["local_devices"] == 4
        assert o["shards"] == 4  # this process's half of the 8 shards
        assert o["tokens"] == o["reference"]
        assert o["pool_kinds"]["host_k"] == ["pinned_host"]
    assert outs[0]["tokens"] == outs[1]["tokens"]


@pytest.mark.slow  # default suite: 20-35 s each (CI runs make test-slow)
def test_one_device_mesh_in_process(tiny):
    """A 1 x 1 mesh is the single-device decoder under shard_map: the same tokens."""
    from jaxkv.decode.decoder import Decoder

    model, params = tiny
    cfg = CacheConfig.for_model(model.config, batch=2, max_len=64, block_size=8, hbm_fraction=0.5)
    pl = PlacementConfig(policy="lru-plan", window=3)
    prompts = np.asarray(jax.random.randint(jax.random.key(1), (2, 20), 0, 256), np.int32)
    one = Decoder(model, cfg, pl, max_new_tokens=8)
    ref = np.asarray(one.generate(params, one.prefill(params, prompts)).tokens)
    dec = sharded.ShardedDecoder(model, cfg, pl, mesh=sharded.make_mesh(1, 1), max_new_tokens=8)
    state = dec.generate(params, dec.prefill(dec.shard_params(params), prompts))
    np.testing.assert_array_equal(dec.tokens(state), ref)
    s = sharded.summarize(dec, state)
    assert s["devices"] == 1 and s["steps"] == 7 and s["modeled_seconds"] > 0
    with pytest.raises(ValueError, match="max_new_tokens=8"):
        dec.step(params, state)


def test_bad_arguments_are_refused_up_front(tiny):
    model, _ = tiny
    cfg = CacheConfig.for_model(model.config, batch=2, max_len=64, block_size=8, hbm_fraction=1.0)
    pl = PlacementConfig()
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"but {n} are available"):
        sharded.make_mesh(n + 1, 1)
    with pytest.raises(ValueError, match="data=0"):
        sharded.make_mesh(0, 1)
    mesh = sharded.make_mesh(1, 1)
    with pytest.raises(ValueError, match="stagger=-1"):
        sharded.ShardedDecoder(model, cfg, pl, mesh=mesh, stagger=-1, max_new_tokens=4)
    unpinned = CacheConfig.for_model(
        model.config, batch=2, max_len=64, hbm_fraction=1.0, host_memory_kind="unpinned_host"
    )
    with pytest.raises(ValueError, match="unpinned_host"):
        sharded.ShardedDecoder(model, unpinned, pl, mesh=mesh, max_new_tokens=4)
    with pytest.raises(ValueError, match="mesh must be a Mesh"):
        sharded.ShardedDecoder(model, cfg, pl, mesh=None, max_new_tokens=4)
    with pytest.raises(ValueError, match="shared_link='x'"):
        sharded.ShardedDecoder(model, cfg, pl, mesh=mesh, shared_link="x")
    with pytest.raises(ValueError, match="expected 1 positive bandwidths"):
        sharded.ShardedDecoder(model, cfg, pl, mesh=mesh, link_bandwidths=[1e9, 2e9])
    dec = sharded.ShardedDecoder(model, cfg, pl, mesh=mesh, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"expected \(2, T\)"):
        dec.prefill(None, np.zeros((3, 5), np.int32))


def test_tensor_shard_divides_the_heads_and_names_what_does_not_divide(tiny):
    """The seam ShardedDecoder uses (jaxkv.model_api.TensorParallel): the model builds its own
    shard, and refuses a split that does not divide its heads."""
    model, _ = tiny
    c = model.config
    local = model.tensor_shard(2, "model")
    assert (local.config.num_heads, local.config.num_kv_heads, local.config.ffn_dim) == (
        c.num_heads // 2,
        c.num_kv_heads // 2,
        c.ffn_dim // 2,
    )
    assert local.config.tp_axis == "model"
    with pytest.raises(ValueError, match=f"KV heads={c.num_kv_heads} does not divide"):
        model.tensor_shard(c.num_kv_heads + 1, "model")


def test_param_specs_split_the_tensor_parallel_weights(tiny):
    from jax.sharding import PartitionSpec as P

    model, params = tiny
    specs = {
        jax.tree_util.keystr(p): s
        for p, s in jax.tree_util.tree_leaves_with_path(
            sharded.param_specs(model, params), is_leaf=lambda x: isinstance(x, P)
        )
    }
    assert specs["['layers']['attn']['q']['w'].value"] == P(None, None, "model")
    assert specs["['layers']['attn']['o']['w'].value"] == P(None, "model")
    assert specs["['layers']['mlp']['down']['w'].value"] == P(None, "model")
    assert specs["['layers']['mlp']['up']['w'].value"] == P(None, None, "model")
    assert specs["['embed'].value"] == P() and specs["['lm_head'].value"] == P()


def test_non_finite_logits_raise_naming_the_global_sequence():
    """On a 2 x 2 mesh, the last sequence (data shard 1, its row 1) holds a token whose
    embedding is NaN: generate raises NonFiniteLogitsError naming sequence 3 (not its row
    within a shard, nor once per model shard) at the prefill, and that sequence stopped."""
    from jaxkv.decode.state import PAD_ID

    r = _worker("nan", "--devices", "4", "--mesh", "2,2")
    assert r["message"] is not None, "no NonFiniteLogitsError raised"
    assert r["message"].startswith(
        "the logits of sequence [3] held NaN or inf at the prefill (step 0)"
    ), r["message"]
    tokens = np.asarray(r["tokens"])
    assert (tokens[3, 1:] == PAD_ID).all() and (tokens[:3, 1] != PAD_ID).all(), tokens
