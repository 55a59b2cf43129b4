import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import Decoder, Greedy, Sampling
from jaxkv import cache as kvc
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.decode.state import PAD_ID, NonFiniteLogitsError, summarize

PROMPT_LENS = (45, 30)
NEW = 24


def _cfg(model, *, block_size=8, max_len=96, batch=2, **capacity):
    mc = model.config
    return CacheConfig.for_model(
        mc,
        batch=batch,
        max_len=max_len,
        block_size=block_size,
        **capacity,
    )


def _prompts(vocab):
    p = jax.random.randint(jax.random.key(7), (2, max(PROMPT_LENS)), 0, vocab)
    return p.astype(jnp.int32)


def _greedy_reference(model, prompt, n):
    """Cache-free: a full causal forward over the whole sequence for every new token (padded to
    one length, which a causal model ignores, so it compiles once)."""
    seq = list(np.asarray(prompt))
    total = len(seq) + n
    forward = nnx.jit(lambda m, t: m(t))
    out = []
    for _ in range(n):
        padded = jnp.asarray([seq + [0] * (total - len(seq))], jnp.int32)
        out.append(int(jnp.argmax(forward(model, padded)[0, len(seq) - 1])))
        seq.append(out[-1])
    return out


@pytest.fixture(scope="module")
def all_hbm_tokens(tiny):
    model, params = tiny
    dec = Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(), max_new_tokens=NEW)
    state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
    assert int(state.step) == NEW - 1
    return np.asarray(state.tokens)


def test_all_hbm_matches_cache_free_forward(tiny, all_hbm_tokens):
    model, _ = tiny
    prompts = _prompts(256)
    for b, n in enumerate(PROMPT_LENS):
        ref = _greedy_reference(model, prompts[b, :n], 12)
        assert all_hbm_tokens[b, :12].tolist() == ref


WT, EX = "write-through", "exclusive"


@pytest.mark.parametrize(
    "policy,hbm,block_size,window,host_tier",
    [
        ("static", dict(hbm_fraction=0.25), 8, 4, WT),
        ("lru-plan", dict(hbm_fraction=0.25), 8, 3, WT),
        ("lru-plan", dict(hbm_fraction=0.25), 8, 3, EX),
        ("static", dict(hbm_blocks=6), 5, 2, EX),
        ("lru-plan", dict(hbm_fraction=0.5), 5, 1, WT),
        ("anneal", dict(hbm_fraction=0.25), 8, 4, WT),
        ("anneal", dict(hbm_fraction=0.25), 8, 4, EX),
        ("anneal+reuse+follow", dict(hbm_fraction=0.25), 8, 4, WT),
        pytest.param(  # about 14 s; the write-through case stays in the default suite
            "anneal+reuse+follow", dict(hbm_fraction=0.25), 8, 4, EX, marks=pytest.mark.slow
        ),
        ("lrfu", dict(hbm_fraction=0.25), 8, 4, WT),
        ("lrfu", dict(hbm_fraction=0.25), 5, 4, EX),
    ],
)
def test_any_placement_gives_all_hbm_tokens(
    tiny, all_hbm_tokens, policy, hbm, block_size, window, host_tier
):
    """Exact attention: the tokens equal the all-HBM cache's under every placement and both
    host tiers (write-through: every HBM copy also bit-identical to its host copy)."""
    model, params = tiny
    cfg = _cfg(model, **hbm, block_size=block_size, host_tier=host_tier)
    dec = Decoder(model, cfg, PlacementConfig(policy=policy, window=window), max_new_tokens=NEW)
    state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
    kvc.check_invariants(state.cache, contents=True)
    np.testing.assert_array_equal(np.asarray(state.tokens), all_hbm_tokens)
    s = summarize(state)
    assert 0.0 < s["hbm_hit_rate"] < 1.0 and s["modeled_seconds"] > 0


@pytest.mark.parametrize(
    "policy,window",
    [("lru-plan", 3), pytest.param("anneal+reuse+follow", 4, marks=pytest.mark.slow)],
)
def test_pallas_transfers_match_xla_and_all_hbm(tiny, policy, window):
    """fetch="pallas": host reads, spills and migrations through the Pallas gather / scatter
    kernels (the interpreter on CPU, on the pinned_host pools). Under sparse attention (the
    selection depends on the logical blocks only, so placement still changes nothing) the
    tokens equal the all-HBM run's, and the blocks moved equal fetch="xla"'s."""
    model, params = tiny
    placement = PlacementConfig(policy=policy, window=window, attention="sparse", topk=0.3)
    runs = {}
    for name, hbm, fetch in (
        ("all-hbm", 1.0, "xla"),
        ("xla", 0.25, "xla"),
        ("pallas", 0.25, "pallas"),
    ):
        cfg = dataclasses.replace(_cfg(model, hbm_fraction=hbm), fetch=fetch)
        dec = Decoder(model, cfg, placement, max_new_tokens=NEW)
        state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
        kvc.check_invariants(state.cache)
        assert state.cache.host_k.sharding.memory_kind == "pinned_host"
        runs[name] = (np.asarray(state.tokens), summarize(state))
    for name in ("xla", "pallas"):
        np.testing.assert_array_equal(runs[name][0], runs["all-hbm"][0])
    moved = runs["xla"][1]["migrated_blocks"]
    assert runs["pallas"][1]["migrated_blocks"] == moved
    assert moved > 0 or policy != "lru-plan"  # LRU migrates here; the follow rule may not need to


@pytest.mark.slow  # about 13 s
def test_reuse_forecast_in_live_decode_is_lossless_and_learns(tiny, all_hbm_tokens):
    """anneal with the online re-read law (as `anneal+reuse` in the simulator): the decode loop
    feeds it the reuse counts, placement never changes the tokens."""
    model, params = tiny
    kw = dict(forecast="reuse", unforeseen=True, link_reserve=0.0)
    dec = Decoder(
        model,
        _cfg(model, hbm_fraction=0.25),
        PlacementConfig(policy="anneal", window=3),
        max_new_tokens=NEW,
        policy_kwargs=kw,
    )
    state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
    kvc.check_invariants(state.cache)
    np.testing.assert_array_equal(np.asarray(state.tokens), all_hbm_tokens)
    assert float(state.stats.since_seen.sum()) > 0 and float(state.stats.since_read.sum()) > 0


@pytest.mark.parametrize(
    "policy,window,host_tier",
    [("lru-plan", 2, WT), pytest.param("anneal", 4, EX, marks=pytest.mark.slow)],  # 12 s
)
def test_policy_migrates_under_sparse_attention(tiny, policy, window, host_tier):
    """Blocks are copied between the tiers (under write-through, anneal on this model's
    HBM-bound steps only demotes, which copies nothing: its exclusive run is the check)."""
    model, params = tiny
    p = PlacementConfig(policy=policy, window=window, attention="sparse", topk=3, max_moves=4)
    cfg = _cfg(model, hbm_fraction=0.25, host_tier=host_tier)
    dec = Decoder(model, cfg, p, max_new_tokens=NEW)
    state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
    kvc.check_invariants(state.cache)
    assert summarize(state)["migrated_blocks"] > 0


# a link 10^4 times slower than HBM: the tiny model's steps are link-bound, so placement matters
SLOW_LINK = HardwareProfile("slow-link", hbm_bandwidth=1e13, link_bandwidth=1e9, hbm_bytes=1e9)


def _sparse_run(tiny, policy, window, **kw):
    model, params = tiny
    p = PlacementConfig(policy=policy, window=window, attention="sparse", topk=3, max_moves=4)
    dec = Decoder(
        model, _cfg(model, hbm_fraction=0.25), p, max_new_tokens=NEW, profile=SLOW_LINK, **kw
    )
    return dec, dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))


@pytest.fixture(scope="module")
def sparse_static(tiny):
    return _sparse_run(tiny, "static", 1)[1]


@pytest.mark.slow  # about 20 s
def test_follow_plans_between_steps_and_follows_in_them(tiny, sparse_static):
    """anneal+reuse+follow: the annealer plans a target every W steps, between steps and for
    all layers at once; each step's layers promote the host blocks they read that the target
    marks, from the fetched copies. The tokens are those of any other placement; it beats Static
    and LRU on modeled time here."""
    # the tiny model's sparse read set is its sink and two most recent blocks (topk 3): pure
    # recency, where promoting every block as it is read ("read") wins; the default "ranked"
    # wins where the read set churns (bench/RESULTS.md)
    dec, state = _sparse_run(tiny, "anneal+reuse+follow", 2, policy_kwargs={"follow_admit": "read"})
    assert dec.follows and dec.policy.follow.admit == "read" and dec.policy.window == 2
    kvc.check_invariants(state.cache)
    np.testing.assert_array_equal(np.asarray(state.tokens), np.asarray(sparse_static.tokens))
    steps = int(state.step)
    assert int(state.policy_state.plans) == steps // 2 == int(state.metrics.windows)
    got, static = summarize(state), summarize(sparse_static)
    _, lru = _sparse_run(tiny, "lru-plan", 1)
    assert got["migrated_blocks"] > 0
    assert got["hbm_hit_rate"] > static["hbm_hit_rate"]
    best_other = min(static["modeled_seconds"], summarize(lru)["modeled_seconds"])
    assert got["modeled_seconds"] < best_other


@pytest.mark.parametrize(
    "admit", [pytest.param(a, marks=pytest.mark.slow) for a in ("read", "ranked", "target")]
)  # about 14 s each
def test_follow_moves_only_blocks_the_step_read(tiny, admit):
    """Step by step: a follow step promotes only blocks it read from host (under
    admit="target" only those the target in force marks), at most max_moves per layer, and
    demotes only to make room for them, blocks the step did not read (under "target" only
    blocks outside the target)."""
    model, params = tiny
    p = PlacementConfig(
        policy="anneal+reuse+follow", window=3, attention="sparse", topk=3, max_moves=2
    )
    dec = Decoder(
        model,
        _cfg(model, hbm_fraction=0.25),
        p,
        max_new_tokens=NEW,
        profile=SLOW_LINK,
        policy_kwargs={"follow_admit": admit},
    )
    state = dec.prefill(params, _prompts(256), PROMPT_LENS)
    L, N = dec.cache_config.num_layers, dec.cache_config.batch * dec.cache_config.max_blocks
    promotions = 0
    for _ in range(NEW - 1):
        before = np.asarray(state.cache.in_hbm).reshape(L, N)
        free = np.asarray(state.cache.hbm_free).sum(1)
        target = np.asarray(state.policy_state.target)
        t = int(state.step)
        state = dec.step(params, state)
        after = np.asarray(state.cache.in_hbm).reshape(L, N)
        sealed_now = np.asarray(state.cache.sealed).reshape(L, N)
        read = np.asarray(state.stats.last_read == t)
        promoted = after & ~before
        demoted = before & ~after & sealed_now  # (a tail spill is not a demotion)
        assert not (promoted & ~read).any() and not (demoted & read).any()
        if admit == "target":
            assert not (promoted & ~target).any() and not (demoted & target).any()
        assert (demoted.sum(1) <= np.maximum(promoted.sum(1) - free, 0)).all()
        assert (promoted.sum(1) <= 2).all()
        promotions += int(promoted.sum())
        kvc.check_invariants(state.cache)
    assert promotions > 0


@pytest.mark.parametrize("host_tier", [WT, pytest.param(EX, marks=pytest.mark.slow)])
def test_migrations_load_both_sides_of_their_step(tiny, host_tier):
    """The modeled time of a step with follow migrations, recomputed by hand: per layer,
    max((weights + HBM reads + token write + copied) / B_hbm, (host reads + written back) /
    B_link): a promotion rides on the step's host read (its HBM write is the extra cost); a
    demotion crosses the link under an exclusive host tier and costs nothing under a
    write-through one."""
    model, params = tiny
    p = PlacementConfig(policy="anneal+reuse+follow", window=1, attention="sparse", topk=3)
    cfg = _cfg(model, hbm_fraction=0.25, host_tier=host_tier)
    dec = Decoder(model, cfg, p, max_new_tokens=NEW, profile=SLOW_LINK)
    state = dec.prefill(params, _prompts(256), PROMPT_LENS)
    for _ in range(NEW - 1):  # the first step that migrates, demotes and seals no block
        sealed = np.asarray(state.cache.sealed)
        before = np.asarray(state.cache.in_hbm) & sealed
        n0, t = int(state.metrics.migrated_blocks), int(state.step)
        state = dec.step(params, state)
        after = np.asarray(state.cache.in_hbm)
        if (before & ~after).any() and (state.cache.sealed == sealed).all():
            break
    else:
        pytest.fail("no step demoted")
    c = dec.cache_config
    read = np.asarray(state.stats.last_read == t).reshape(after.shape)
    promoted = (after & ~before).sum(axis=(1, 2))
    demoted = (before & ~after).sum(axis=(1, 2))
    if host_tier == WT:  # a demotion only frees its HBM slot
        demoted = 0 * demoted
    assert (promoted + demoted).sum() == int(state.metrics.migrated_blocks) - n0
    host = (read & ~before & sealed).sum(axis=(1, 2))  # read before the moves; tails in HBM
    bb, prof = c.block_bytes, SLOW_LINK
    t_hbm = (
        dec.weight_bytes_per_layer
        + bb * (read.sum(axis=(1, 2)) - host)
        + c.batch * bb // c.block_size
        + bb * (promoted + demoted)
    ) / prof.hbm_bandwidth
    t_link = bb * (host + demoted) / prof.link_bandwidth
    want = np.maximum(t_hbm, t_link).sum()
    np.testing.assert_allclose(float(state.metrics.latency[t]), want, rtol=1e-5)


@pytest.mark.slow  # default suite: about 20 s (CI runs make test-slow)
def test_adaptive_anneal_window_is_the_policys(tiny):
    """+aw in the decode loop: the anneal policy's own controller (as in the simulator) sets
    W, within PlacementConfig's bounds; the decode loop's W is the policy's."""
    model, params = tiny
    p = PlacementConfig(
        policy="anneal+aw",
        window=3,
        min_window=2,
        max_window=5,
        window_step=1,
        attention="sparse",
        topk=3,
    )
    dec = Decoder(model, _cfg(model, hbm_fraction=0.25), p, max_new_tokens=NEW)
    assert (dec.policy.adaptive.low, dec.policy.adaptive.high, dec.policy.adaptive.step) == (
        2,
        5,
        1,
    )
    state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
    w = np.asarray(state.metrics.window_trace[: int(state.step)])
    assert w.min() >= 2 and w.max() <= 5 and len(set(w.tolist())) > 1
    assert int(state.window) == int(state.policy_state.window)


def test_layers_are_scanned_once(tiny):
    """The decode step traces one layer body under a scan: its jaxpr has (within a few lines
    of constants) the same size for a 2-layer and a 6-layer model, and a scan of length
    num_layers; unrolled layers would triple it."""
    from models import tiny_model

    sizes = []
    for layers in (2, 6):
        model = tiny_model(0, num_layers=layers)
        params = nnx.split(model)[1]
        p = PlacementConfig(policy="anneal+reuse+follow", window=2, attention="sparse", topk=3)
        dec = Decoder(model, _cfg(model, hbm_fraction=0.25), p, max_new_tokens=4)
        state = jax.eval_shape(
            dec.prefill_fn, params, _prompts(256), jnp.array(PROMPT_LENS), jax.random.key(0)
        )
        jaxpr = jax.make_jaxpr(dec.window_step)(params, state)
        text = str(jaxpr)
        assert f"length={layers}" in text
        sizes.append(len(text.splitlines()))
    assert sizes[1] < 1.02 * sizes[0]


def test_window_reads_restart_at_each_plan(tiny):
    """A plan sees the reads since the previous plan (`unforeseen`, `+ec` use them)."""
    model, params = tiny
    p = PlacementConfig(policy="lru-plan", window=2, attention="sparse", topk=3)
    dec = Decoder(model, _cfg(model, hbm_fraction=0.25), p, max_new_tokens=NEW)
    state = dec.prefill(params, _prompts(256), PROMPT_LENS)
    state = dec.step(params, dec.step(params, state))  # plans after step 2
    assert float(state.stats.window_reads.sum()) == 0.0
    state = dec.step(params, state)
    reads = state.stats.last_read == int(state.step) - 1
    np.testing.assert_array_equal(np.asarray(state.stats.window_reads), np.asarray(reads))


@pytest.mark.parametrize(
    "policy", ["lru-plan", pytest.param("anneal+reuse+follow", marks=pytest.mark.slow)]
)
def test_decode_step_compiles_once_across_windows(tiny, policy):
    """One compilation of each jitted function across windows and a change of W (counted)."""
    model, params = tiny
    p = PlacementConfig(policy=policy, window=2, attention="sparse", topk=3)
    dec = Decoder(model, _cfg(model, hbm_fraction=0.25), p, max_new_tokens=NEW)
    state = dec.prefill(params, _prompts(256), PROMPT_LENS)
    for _ in range(5):
        state = dec.step(params, state)
    state = dec.with_window(state, 3)
    for _ in range(6):
        state = dec.step(params, state)
    assert int(state.metrics.windows) == 2 + 2  # steps 2, 4 at W=2; then 8, 11 at W=3
    assert dec._step._cache_size() == 1
    state = dec.generate(params, state, until=15)
    state = dec.with_window(state, 2)
    state = dec.generate(params, state, until=20)
    assert dec._generate._cache_size() == 1
    assert dec.compilations() == 3  # prefill, step, generate


def test_adaptive_window_stays_in_bounds(tiny):
    model, params = tiny
    p = PlacementConfig(
        policy="lru-plan",
        window=3,
        adaptive_window=True,
        min_window=2,
        max_window=5,
        window_step=1,
        attention="sparse",
        topk=3,
    )
    dec = Decoder(model, _cfg(model, hbm_fraction=0.25), p, max_new_tokens=NEW)
    state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
    w = np.asarray(state.metrics.window_trace[: int(state.step)])
    assert w.min() >= 2 and w.max() <= 5 and len(set(w.tolist())) > 1


def test_eos_stops_sequences(tiny, all_hbm_tokens):
    model, params = tiny
    eos = int(all_hbm_tokens[0, 3])
    dec = Decoder(
        model, _cfg(model, hbm_fraction=1.0), PlacementConfig(), max_new_tokens=NEW, eos_id=eos
    )
    state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
    toks = np.asarray(state.tokens)
    first = toks[0].tolist().index(eos)
    assert (toks[0, first + 1 :] == PAD_ID).all() and bool(state.done[0])
    want = [r.tolist().index(eos) + 1 if eos in r else NEW for r in toks]  # the pad uncounted
    assert np.asarray(state.lengths).tolist() == want and want[0] == first + 1


def test_any_of_several_eos_ids_stops_a_sequence(tiny, all_hbm_tokens):
    model, params = tiny
    first, second = int(all_hbm_tokens[0, 5]), int(all_hbm_tokens[1, 2])
    dec = Decoder(
        model,
        _cfg(model, hbm_fraction=1.0),
        PlacementConfig(),
        max_new_tokens=NEW,
        eos_id=[first, second],
    )
    assert dec.eos_id == (first, second)
    toks = np.asarray(dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS)).tokens)
    for row, eos in ((0, first), (1, second)):
        stop = min(toks[row].tolist().index(t) for t in (first, second) if t in toks[row])
        assert stop <= toks[row].tolist().index(eos) and (toks[row, stop + 1 :] == PAD_ID).all()


def test_nan_weights_stop_the_run_naming_the_step(tiny):
    """NaN weights used to decode all-zero tokens without a word."""
    model, params = tiny
    nan_params = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
    dec = Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(), max_new_tokens=4)
    state = dec.prefill(nan_params, _prompts(256), PROMPT_LENS)
    msg = r"^the logits of sequences \[0, 1\] held NaN or inf at the prefill \(step 0\), the tok"
    with pytest.raises(NonFiniteLogitsError, match=msg) as err:
        dec.generate(nan_params, state)
    assert int(err.value.state.step) == 0  # stopped there: no step decoded on NaN
    assert (np.asarray(err.value.state.tokens)[:, 1:] == PAD_ID).all()


def test_non_finite_logits_later_name_the_decode_step():
    from jaxkv.decode.state import SamplingState, check_finite

    z = jnp.zeros((2,), jnp.int32)
    sm = SamplingState(tokens=None, last=z, done=z, step=z, key=None, bad_step=jnp.array([7, 5]))
    state = dataclasses.make_dataclass("S", ["sampling"])(sm)
    msg = r"^the logits of sequence \[1\] held NaN or inf at decode step 5, .* \(sequences \[0\] l"
    with pytest.raises(NonFiniteLogitsError, match=msg):
        check_finite(state)


@pytest.mark.parametrize("bad", [-1, 10**9, 2.0, True, [], [1, "2"]])
def test_eos_id_is_checked(tiny, bad):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"eos_id=.*expected|eos_id=.* is empty"):
        Decoder(
            model, _cfg(model, hbm_fraction=1.0), PlacementConfig(), max_new_tokens=NEW, eos_id=bad
        )


def test_stops_when_cache_full(tiny):
    model, params = tiny
    dec = Decoder(
        model, _cfg(model, hbm_fraction=1.0, max_len=50), PlacementConfig(), max_new_tokens=NEW
    )
    state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
    assert int(state.cache.lengths.max()) == 50 and int(state.step) == 50 - 45


def test_sampling_is_seeded_and_truncates():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 256))
    keys = jax.random.split(jax.random.key(0), 64)
    s = Sampling(temperature=1.0, top_k=2)
    draws = np.stack([np.asarray(s(logits, k)) for k in keys])
    assert set(np.unique(draws)) <= {0, 1}
    p = Sampling(temperature=1.0, top_p=0.6)
    draws = np.stack([np.asarray(p(logits, k)) for k in keys])
    assert set(np.unique(draws)) <= {0, 1}
    np.testing.assert_array_equal(s(logits, keys[0]), s(logits, keys[0]))
    assert Greedy()(logits, None).tolist() == [0] * 256


def test_error_geometry_mismatch(tiny):
    model, _ = tiny
    cfg = CacheConfig(num_layers=3, kv_heads=2, head_dim=16, hbm_fraction=1.0)
    with pytest.raises(ValueError, match=r"\(num_layers, kv_heads, head_dim\)=\(3, 2, 16\) does"):
        Decoder(model, cfg)


def test_error_unknown_policy(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"unknown policy 'fifo'; expected one of"):
        Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(policy="fifo"))


def test_error_oracle_policy_in_live_decode(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"policy 'anneal-oracle' plans from perfect knowledge"):
        Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(policy="anneal-oracle"))
    with pytest.raises(ValueError, match=r"policy 'anneal-oracle\+dual' plans from perfect"):
        Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(policy="anneal-oracle+dual"))
    with pytest.raises(
        ValueError,
        match=r"\+now anneals each layer on its critical path.*use "
        r"'anneal\+reuse\+follow'",
    ):
        Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(policy="anneal+reuse+now"))
    with pytest.raises(ValueError, match=r"unknown modifier 'fast'; expected 'aw'"):
        Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(policy="anneal+fast"))
    with pytest.raises(ValueError, match=r"\+now \(.*\) applies to anneal only"):
        Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(policy="anneal-oracle+now"))


def test_error_prompt_longer_than_cache(tiny):
    model, params = tiny
    dec = Decoder(model, _cfg(model, hbm_fraction=1.0, max_len=40), PlacementConfig())
    with pytest.raises(ValueError, match=r"prompt length 45 exceeds the cache's max_len=40"):
        dec.prefill(params, _prompts(256))


def test_error_prompt_shape(tiny):
    model, params = tiny
    dec = Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig())
    with pytest.raises(ValueError, match=r"prompts has shape \(45,\), expected \(batch=2, T\)"):
        dec.prefill(params, jnp.zeros((45,), jnp.int32))


def test_error_prompt_dtype(tiny):
    model, params = tiny
    dec = Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig())
    with pytest.raises(ValueError, match=r"prompts has dtype float32, expected an integer"):
        dec.prefill(params, jnp.zeros((2, 4), jnp.float32))


@pytest.mark.parametrize(
    "width, lengths, msg",
    [
        (0, None, r"the prompts are empty \(shape \(2, 0\): 0 tokens\): expected at least one"),
        (4, [0, 3], r"lengths=\[0, 3\]: sequence 0's prompt is empty \(0 tokens\): expected at"),
        (4, [4, 9.5], r"lengths=\[4.0, 9.5\]: sequence 1's length 9.5 is not a whole number"),
        (4, [4, 5], r"lengths=\[4, 5\]: sequence 1's length 5 exceeds the prompts' width T=4"),
        (4, [4], r"lengths=\[4\]: expected 2 prompt lengths, one per sequence \(batch=2\)"),
    ],
)
def test_error_prompt_lengths(tiny, width, lengths, msg):
    """Each refused before any work: an empty prompt, a fractional length (was truncated),
    a length past the prompts' width, a length per sequence missing."""
    model, params = tiny
    dec = Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig())
    with pytest.raises(ValueError, match="^" + msg):
        dec.prefill(params, jnp.zeros((2, width), jnp.int32), lengths)


def test_error_max_new_tokens(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 1, got 0"):
        Decoder(model, _cfg(model, hbm_fraction=1.0), max_new_tokens=0)


def test_error_prompt_token_ids_outside_the_vocabulary(tiny):
    """Ids past the vocabulary (or negative) are refused; padding past a length is not read."""
    model, params = tiny
    dec = Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(), max_new_tokens=2)
    prompts = np.zeros((2, 4), np.int32)
    prompts[1, 2] = 300
    with pytest.raises(ValueError, match=r"prompts\[1, 2\] = 300: expected token ids in \[0, "):
        dec.prefill(params, prompts)
    prompts[1, 2] = -7
    with pytest.raises(ValueError, match=r"prompts\[1, 2\] = -7: expected .*vocab_size=256"):
        dec.prefill(params, prompts)
    dec.prefill(params, prompts, [4, 2])  # -7 is padding there
    with pytest.raises(ValueError, match=r"token id 256 at \(0, 1\): expected ids in \[0, vocab"):
        model(jnp.asarray([[1, 256]], jnp.int32))


def test_step_past_max_new_tokens(tiny):
    """`step` refuses a state that holds max_new_tokens tokens (it overwrote the last token and
    dropped the metrics); the unchecked `decode_step` leaves every sequence as it is."""
    model, params = tiny
    dec = Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(), max_new_tokens=3)
    state = dec.generate(params, dec.prefill(params, _prompts(256), PROMPT_LENS))
    assert int(state.step) == 2
    tokens, lengths = np.asarray(state.tokens), np.asarray(state.cache.lengths)
    with pytest.raises(ValueError, match=r"decoded max_new_tokens=3 tokens \(step 2\): no room"):
        dec.step(params, state)
    after = dec.decode_step(params, state)
    np.testing.assert_array_equal(np.asarray(after.tokens), tokens)
    np.testing.assert_array_equal(np.asarray(after.cache.lengths), lengths)


@pytest.mark.parametrize(
    "kind",
    [
        "pinned_host",
        *(pytest.param(k, marks=pytest.mark.slow) for k in ("unpinned_host", "device")),
    ],
)
def test_decoder_keeps_the_host_memory_kind(tiny, all_hbm_tokens, kind):
    """The host pools keep the configured memory kind through prefill, step and generate (an
    unpinned_host pool came back as device), and the tokens stay the all-HBM ones."""
    model, params = tiny
    cfg = dataclasses.replace(_cfg(model, hbm_fraction=0.25), host_memory_kind=kind)
    dec = Decoder(model, cfg, PlacementConfig(policy="lru-plan", window=3), max_new_tokens=NEW)
    state = dec.prefill(params, _prompts(256), PROMPT_LENS)
    kinds = lambda s: {s.cache.host_k.sharding.memory_kind, s.cache.host_v.sharding.memory_kind}
    assert kinds(state) == {kind} and state.cache.hbm_k.sharding.memory_kind == "device"
    state = dec.step(params, state)
    assert kinds(state) == {kind}
    state = dec.generate(params, state)
    assert kinds(state) == {kind}
    np.testing.assert_array_equal(np.asarray(state.tokens), all_hbm_tokens)


def test_error_sampling_temperature():
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0, got 0"):
        Sampling(temperature=0)
    with pytest.raises(ValueError, match=r"temperature must be finite and > 0, got inf"):
        Sampling(temperature=float("inf"))
    with pytest.raises(ValueError, match=r"top_k must be an int >= 1 or None, got 2.5"):
        Sampling(top_k=2.5)


def test_error_unlimited_in_live_decode(tiny):
    """unlimited is a bound: refused when the Decoder is built (it failed at the first plan)."""
    model, _ = tiny
    with pytest.raises(ValueError, match=r"'unlimited' is the Unlimited-HBM bound .* use "):
        Decoder(model, _cfg(model, hbm_fraction=0.5), PlacementConfig(policy="unlimited"))


def _pallas_run(impl, host_memory_kind):
    from models import tiny_model

    model = tiny_model(0, dtype="bfloat16")
    params = nnx.split(model)[1]
    mc = model.config
    cfg = CacheConfig.for_model(
        mc,
        batch=2,
        max_len=64,
        block_size=16,
        hbm_fraction=0.5,
        dtype="bfloat16",
        host_memory_kind=host_memory_kind,
    )
    p = PlacementConfig(policy="lru-plan", window=2, compact_every=1)
    dec = Decoder(model, cfg, p, max_new_tokens=5, impl=impl)
    prompt = jax.random.randint(jax.random.key(7), (2, 40), 0, 256).astype(jnp.int32)
    state = dec.generate(params, dec.prefill(params, prompt, [40, 29]))
    kvc.check_invariants(state.cache)
    return np.asarray(state.tokens)


@pytest.mark.slow  # about 21 s; tests/pallas_kernels keeps the kernels against their references
def test_pallas_decode_matches_xla_in_interpreter():
    # The host tier is emulated in device memory here: in jax 0.12.0.1 a Pallas kernel in
    # interpret mode cannot be lowered inside a jit that also has pinned_host operands (the
    # interpreter's ordered-effect token upsets the memory-kind bookkeeping: "safe_zip() argument
    # 1 has length 3 but argument 0 has length 2"). The GPU test below runs the real tiers.
    np.testing.assert_array_equal(_pallas_run("pallas", "device"), _pallas_run("xla", "device"))


@pytest.mark.gpu
def test_pallas_decode_matches_xla_on_gpu_with_pinned_host():
    from pallas_kernels.common import hopper_available

    if not hopper_available():
        pytest.skip("needs a Hopper GPU")
    np.testing.assert_array_equal(
        _pallas_run("pallas", "pinned_host"), _pallas_run("xla", "pinned_host")
    )


FIXTURES = __import__("pathlib").Path(__file__).parent / "models" / "fixtures"
# the anneal policies compile their planner (~25 s each on 2 CPU cores): `make test-slow`
LIVE_POLICIES = (
    "static",
    "lru-plan",
    "anneal+reuse+follow",
    *(pytest.param(p, marks=pytest.mark.slow) for p in ("anneal", "anneal+reuse", "anneal+aw")),
)


def _fixture_decode(name, policy, *, hbm=0.3, host=None, attention="exact", impl="xla"):
    """Greedy tokens of a transformers fixture through the tiered decoder (block size 4: the
    window starts inside a block), and the decoder's final state."""
    from models import load_pretrained

    with np.load(FIXTURES / name / "reference.npz") as z:
        prompt, want = z["prompt"], z["continuation"]
    model = load_pretrained(FIXTURES / name)
    params = nnx.state(model)
    cfg = CacheConfig.for_model(
        model.config,
        batch=1,
        max_len=len(prompt) + len(want),
        block_size=4,
        hbm_fraction=hbm,
        host_fraction=host,
    )
    placement = PlacementConfig(policy=policy, window=2, attention=attention, topk=3)
    dec = Decoder(model, cfg, placement, max_new_tokens=len(want), impl=impl)
    state = dec.generate(params, dec.prefill(params, jnp.asarray(prompt[None], jnp.int32)))
    kvc.check_invariants(state.cache)
    return np.asarray(state.tokens)[0], want, state, dec


@pytest.mark.parametrize(
    "policy",
    [
        p if p != "anneal+reuse+follow" else pytest.param(p, marks=pytest.mark.slow)
        for p in LIVE_POLICIES
    ],
)
def test_sliding_window_decode_equals_transformers(policy):
    """Mistral (window 14 over a 20-token sequence, every layer): the tiered decoder's greedy
    tokens equal transformers' under every live policy, with 30% of the cache in HBM."""
    got, want, state, _ = _fixture_decode("mistral", policy)
    np.testing.assert_array_equal(got, want)
    assert 0.0 < summarize(state)["hbm_hit_rate"] < 1.0


@pytest.mark.parametrize(
    "policy", ["lru-plan", pytest.param("anneal+reuse+follow", marks=pytest.mark.slow)]
)
def test_sliding_layers_decode_equals_transformers(policy):
    """Qwen2 sliding in layer 1 only, over a window of 5 tokens (layer 0 attends all)."""
    got, want, _, _ = _fixture_decode("qwen2_sliding", policy)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # about 21 s; models/test_llama keeps the windows
def test_sliding_window_reads_only_the_window():
    """With a window of 5 and blocks of 4, the sliding layer reads the 2 or 3 blocks holding
    the last 5 tokens, the full layer every written block. Blocks wholly before the window
    are never read again: no plan targets them, so (the host pool having room) they leave
    HBM. Sparse decoding under the window is placement-free too."""
    got, want, state, dec = _fixture_decode("qwen2_sliding", "lru-plan", hbm=0.6, host=1.0)
    np.testing.assert_array_equal(got, want)
    n = int(state.cache.lengths[0])
    in_hbm = np.asarray(state.cache.in_hbm)[:, 0]
    dead = (np.arange(in_hbm.shape[1]) + 1) * 4 <= n + 1 - 5
    placeable = np.asarray(dec._placeable(state.cache)).reshape(in_hbm.shape)
    assert dead.sum() >= 2 and not (placeable[1] & dead).any() and placeable[0, dead].all()
    assert not (in_hbm[1] & dead).any() and in_hbm[1].any()
    _, target = dec._plan_impl(state)
    assert not (np.asarray(target).reshape(in_hbm.shape)[1] & dead).any()
    sparse_all = _fixture_decode("qwen2_sliding", "lru-plan", hbm=1.0, attention="sparse")[0]
    sparse_tiered = _fixture_decode("qwen2_sliding", "lru-plan", hbm=0.3, attention="sparse")[0]
    np.testing.assert_array_equal(sparse_tiered, sparse_all)


def test_decoders_start_from_one_shared_prefill(tiny, all_hbm_tokens):
    """`model_prefill` once, then each policy's Decoder from it: the tokens of a full prefill."""
    model, params = tiny
    prompts = _prompts(256)
    first = Decoder(model, _cfg(model, hbm_fraction=1.0), PlacementConfig(), max_new_tokens=NEW)
    pre = first.model_prefill(params, prompts, PROMPT_LENS)
    other = Decoder(
        model,
        _cfg(model, hbm_fraction=0.25),
        PlacementConfig(policy="lru-plan"),
        max_new_tokens=NEW,
    )
    state = other.generate(params, other.prefill(params, prompts, PROMPT_LENS, prefilled=pre))
    np.testing.assert_array_equal(np.asarray(state.tokens), all_hbm_tokens)
    with pytest.raises(ValueError, match=r"prefilled.lengths=\[45, 30\] differ from the prompt"):
        other.prefill(params, prompts, (45, 29), prefilled=pre)
    short = first.model_prefill(params, prompts[:, :40], (40, 30))
    with pytest.raises(ValueError, match=r"prefilled.k has shape .*: expected .*model_prefill"):
        other.prefill(params, prompts, PROMPT_LENS, prefilled=short)
