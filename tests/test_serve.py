"""The serving engine (`jaxkv.serve.Engine`): its API, its errors, one compilation for any
mix of requests, chunked prefill between decode steps, admission and preemption."""

import math

import numpy as np
import pytest

from jaxkv import CacheConfig, Decoder, PlacementConfig
from jaxkv.serve import Engine, SamplingParams

MAX_LEN, BS = 112, 8


def _cache(model, slots=3, **kw):
    kw.setdefault("hbm_fraction", 0.4)
    return CacheConfig.for_model(model.config, batch=slots, max_len=MAX_LEN, block_size=BS, **kw)


def _prompts(n, seed=1, low=5, high=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(t)).astype(np.int32) for t in rng.integers(low, high, n)]


@pytest.fixture(scope="module")
def solo(tiny):
    """Each prompt decoded alone by `jaxkv.Decoder` over an all-HBM cache, greedy: the
    reference the engine's tokens must equal (the property tests take the engine's own solo
    run, all-HBM, as theirs; this pins that run to the Decoder's). One Decoder, prompts
    right-padded to 64 tokens, 64 new tokens: a smaller budget's tokens are a prefix."""
    model, params = tiny
    c = CacheConfig.for_model(model.config, max_len=192, block_size=BS, hbm_fraction=1.0)
    dec = Decoder(model, c, PlacementConfig(policy="static"), max_new_tokens=64)
    out = {}

    def run(prompt, n):
        key = prompt.tobytes()
        if key not in out:
            padded = np.zeros((1, 64), np.int32)
            padded[0, : len(prompt)] = prompt
            st = dec.generate(params, dec.prefill(params, padded, [len(prompt)]))
            out[key] = [int(t) for t in np.asarray(st.tokens)[0]]
        return out[key][:n]

    return run


def test_engine_equals_the_decoder_alone_and_compiles_each_function_once(tiny, solo):
    """Requests of different lengths, budgets and sampling parameters come and go through 3
    slots (chunks of 16 tokens, a pool of 14 pages): each greedy request's tokens
    equal the Decoder's alone over an all-HBM cache, and no function compiles twice."""
    model, params = tiny
    prompts = _prompts(7)
    budgets = [5, 30, 17, 2, 40, 9, 24]
    place = PlacementConfig(policy="lrfu", window=8)
    c = _cache(model, host_blocks=14, paged_host=True)
    eng = Engine(model, params, c, place, chunk=16, check=True)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=7, top_p=0.8, seed=3)
    extra = eng.submit(prompts[0], sampled)  # a sampled request among them
    outs = eng.generate(prompts, [SamplingParams(max_new_tokens=n) for n in budgets])
    for p, n, o in zip(prompts, budgets, outs, strict=True):
        assert o == solo(p, n)
    assert len(eng.requests[extra].tokens) == 12
    assert eng.core.compilations() == dict(
        step=1, window_step=1, chunk_step=1, insert=1, release=1, init=1
    )
    assert eng.idle and eng.free_pages == eng.pages


@pytest.fixture(scope="module")
def small(tiny):
    """An engine of 3 slots of 112 tokens and a host pool of 12 pages of 8 tokens."""
    model, params = tiny
    return Engine(model, params, _cache(model, host_blocks=12, paged_host=True), chunk=16)


OK_PROMPT = np.arange(10, dtype=np.int32)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], None, r"^the prompt is empty: expected at least one token id$"),
        (np.zeros((2, 3), np.int32), None, r"prompt has shape \(2, 3\)"),
        ([1.5, 2.0], None, "prompt has dtype float64: expected integer token ids"),
        ([3, 256], None, r"prompt\[1\] = 256: expected token ids in \[0, vocab_size=256\)"),
        (np.zeros(100, np.int32), SamplingParams(max_new_tokens=13),
         r"100 tokens plus max_new_tokens=13 exceed a slot's 112 tokens"),
        (np.zeros(100, np.int32), SamplingParams(max_new_tokens=12),
         r"keep 111 tokens in the cache, 13 sealed blocks of 8, more than the whole host pool's "
         r"12 pages"),
        (OK_PROMPT, SamplingParams(stop_ids=(256,)),
         r"stop id 256 is outside the vocabulary: expected ids < vocab_size=256"),
    ],
    ids=["empty", "2d", "float", "token-id", "slot", "pool", "stop-id"],
)  # fmt: skip
def test_submit_refuses_a_bad_request_naming_the_value(small, prompt, params, message):
    queued = len(small.queue)
    with pytest.raises(ValueError, match=message) as e:
        small.submit(prompt, params)
    assert "\n" not in str(e.value)  # one line
    assert len(small.queue) == queued  # nothing was queued


def test_submit_refuses_a_prompt_longer_than_the_models_context(tiny):
    model, params = tiny
    eng = Engine(model, params, _cache(model), chunk=16)
    eng.context = 50  # a model whose context is shorter than a slot
    with pytest.raises(ValueError, match="^the prompt has 60 tokens, longer than the model's "
                       "context of 50 tokens$"):  # fmt: skip
        eng.submit(np.zeros(60, np.int32))
    assert not eng.queue


def test_submit_refuses_params_of_another_type(small):
    with pytest.raises(TypeError, match="params: expected a SamplingParams, got a str"):
        small.submit(OK_PROMPT, "greedy")


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(max_new_tokens=0), r"^max_new_tokens=0: expected an int >= 1$"),
        (dict(max_new_tokens=-3), r"^max_new_tokens=-3: expected an int >= 1$"),
        (dict(max_new_tokens=2.0), r"^max_new_tokens=2.0: expected an int >= 1$"),
        (dict(temperature=-1.0), r"^temperature=-1.0: expected a finite number >= 0"),
        (dict(temperature=math.nan), r"^temperature=nan: expected a finite number"),
        (dict(top_k=0), r"^top_k=0: expected None \(all tokens\) or an int >= 1$"),
        (dict(top_k=-2), r"^top_k=-2: expected None \(all tokens\) or an int >= 1$"),
        (dict(top_p=0.0), r"^top_p=0.0: expected a number in \(0, 1\]"),
        (dict(top_p=1.5), r"^top_p=1.5: expected a number in \(0, 1\]"),
        (dict(seed=-1), r"^seed=-1: expected an int in \[0, 2\*\*32\)$"),
        (dict(seed=1.5), r"^seed=1.5: expected an int in \[0, 2\*\*32\)$"),
        (dict(stop_ids=3), r"^stop_ids=3: expected None or a sequence of token ids$"),
        (dict(stop_ids=(-1,)), r"^stop_ids=\(-1,\): expected token ids, ints >= 0$"),
        (dict(stop_ids=tuple(range(9))), "^stop_ids has 9 tokens: expected at most 8$"),
    ],
    ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items())[:30] if isinstance(x, dict) else "",
)
def test_sampling_params_refuse_bad_values_naming_them(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_submit_after_close_is_refused(tiny):
    model, params = tiny
    eng = Engine(model, params, _cache(model, host_blocks=12, paged_host=True), chunk=16)
    eng.close()
    with pytest.raises(RuntimeError, match="^submit: the engine is closed: create a new Engine$"):
        eng.submit(OK_PROMPT)


def test_cancel_frees_a_request_wherever_it_is(tiny, solo):
    model, params = tiny
    eng = Engine(model, params, _cache(model, slots=2), chunk=16, check=True)
    long = np.arange(70, dtype=np.int32) % 256
    two = [np.arange(10, dtype=np.int32), np.arange(40, dtype=np.int32)]
    ids = [eng.submit(p, SamplingParams(max_new_tokens=30)) for p in two]
    waiting = eng.submit(long, SamplingParams(max_new_tokens=5))
    eng.step()
    eng.step()  # the first request runs, the second's 40 tokens are being prefilled
    assert eng.requests[ids[1]].status == "prefilling"
    assert eng.cancel(ids[0]) and eng.cancel(ids[1]) and eng.cancel(waiting)
    events = {e.request_id: e for e in eng.step()}
    for rid in (*ids, waiting):
        assert events[rid].finished and events[rid].reason == "cancelled"
    assert eng.idle and eng.free_pages == eng.pages
    assert not eng.cancel(ids[0])  # finished already
    with pytest.raises(KeyError, match="cancel: no request 99 was submitted"):
        eng.cancel(99)
    # the engine goes on: a request after the cancels decodes as if alone
    p = _prompts(1, seed=5)[0]
    assert eng.generate([p], SamplingParams(max_new_tokens=8))[0] == solo(p, 8)


def test_stream_and_stop_tokens(tiny, solo):
    model, params = tiny
    eng = Engine(model, params, _cache(model), chunk=16)
    p = _prompts(1, seed=2)[0]
    ref = solo(p, 20)
    assert list(eng.stream(p, SamplingParams(max_new_tokens=20))) == ref
    stop = ref[6]
    first = ref.index(stop)
    out = list(eng.stream(p, SamplingParams(max_new_tokens=20, stop_ids=(stop,))))
    assert out == ref[: first + 1]  # the stop token is emitted, then the request ends
    rid = max(eng.requests)
    assert eng.requests[rid].reason == "stop"
    dflt = Engine(model, params, _cache(model), chunk=16, eos_id=stop)  # the model's EOS
    assert dflt.generate([p], SamplingParams(max_new_tokens=20))[0] == ref[: first + 1]


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(tiny):
    """While a 100-token prompt is prefilled 16 tokens a step, the running request produces a
    token at every step; the chunks are bounded and interleave with its decode steps."""
    model, params = tiny
    eng = Engine(model, params, _cache(model, slots=2), chunk=16)
    short = eng.submit(_prompts(1)[0], SamplingParams(max_new_tokens=40))
    while eng.requests[short].status != "running":
        eng.step()
    long = eng.submit(np.arange(100, dtype=np.int32), SamplingParams(max_new_tokens=4))
    produced = []
    while eng.requests[long].status != "running":
        events = {e.request_id: e for e in eng.step()}
        produced.append(len(events[short].tokens) if short in events else 0)
    chunks = [it.chunk for it in eng.log if it.chunk]
    assert max(chunks) <= 16 and sum(chunks) >= 100
    assert len(produced) >= 7 and all(n == 1 for n in produced)  # never stalled


@pytest.mark.slow  # about 30 s (two engines); test_serve_schedules.py preempts by default
def test_admission_waits_for_pages_and_the_newest_is_preempted(tiny, solo):
    """A pool of 12 pages: the second request waits until the first's pages can hold its
    prompt and budget; when the running requests' growth runs the pool out, the newest is
    preempted, requeued and recomputed, and its tokens still equal decoding it alone."""
    model, params = tiny
    c = _cache(model, slots=3, host_blocks=12, paged_host=True)
    eng = Engine(model, params, c, chunk=16, check=True)
    a, b = np.arange(40, dtype=np.int32), np.arange(40, 80, dtype=np.int32)  # 9 pages each
    ra = eng.submit(a, SamplingParams(max_new_tokens=40))
    rb = eng.submit(b, SamplingParams(max_new_tokens=40))
    for _ in range(4):
        eng.step()
    assert eng.requests[ra].status == "running" and eng.requests[rb].status == "waiting"
    while not eng.idle:
        eng.step()
    assert eng.requests[ra].tokens == solo(a, 40) and eng.requests[rb].tokens == solo(b, 40)
    small = Engine(model, params, c, chunk=16, check=True)
    outs = small.generate(_prompts(3, seed=4, low=10, high=20), SamplingParams(max_new_tokens=60))
    assert small.preemptions >= 1
    assert sum(r.preemptions for r in small.requests.values()) == small.preemptions
    for p, o in zip(_prompts(3, seed=4, low=10, high=20), outs, strict=True):
        assert o == solo(p, 60)


def test_blocks_past_every_sliding_window_are_freed_in_both_tiers(tiny):
    """A model whose every layer slides (window 24 tokens, blocks of 8): once a block has
    passed every layer's window its host page and HBM slots go back to the free pools while
    its request decodes: 4 requests whose prompts and outputs would hold 10-12 pages each share
    a pool of 12 through 3 slots without a preemption (admission still asks for a request's
    whole length: the freed pages let the next one in sooner). The device's free pages equal
    the engine's count after every step (`check`), and each request's tokens equal the
    Decoder's alone over an all-HBM cache of the same model."""
    from flax import nnx

    from jaxkv.cache import rows
    from models import tiny_model

    model = tiny_model(0, sliding_window=24)
    params = nnx.split(model)[1]
    prompts = _prompts(4, seed=5, low=40, high=70)
    budgets = [40, 30, 44, 25]
    c = _cache(model, host_blocks=12, paged_host=True)
    eng = Engine(model, params, c, PlacementConfig(policy="lrfu", window=8), chunk=32, check=True)
    assert eng.core.windows == (24, 24)
    ids = [
        eng.submit(p, SamplingParams(max_new_tokens=n))
        for p, n in zip(prompts, budgets, strict=True)
    ]
    freed = 0
    while not eng.idle:
        eng.step()
        sealed = sum(int(n) // BS for b, n in enumerate(eng.lengths) if eng.slots[b] is not None)
        freed = max(freed, sealed - (eng.pages - eng.free_pages))
    assert freed > 0, "no block was freed while its request decoded"
    assert eng.free_pages == eng.pages and eng.preemptions == 0
    ref = CacheConfig.for_model(model.config, max_len=192, block_size=BS, hbm_fraction=1.0)
    dec = Decoder(model, ref, PlacementConfig(policy="static"), max_new_tokens=64)
    for rid, p, n in zip(ids, prompts, budgets, strict=True):
        padded = np.zeros((1, 80), np.int32)
        padded[0, : len(p)] = p
        st = dec.generate(params, dec.prefill(params, padded, [len(p)]))
        assert eng.requests[rid].tokens == [int(t) for t in np.asarray(st.tokens)[0][:n]]
    # the cache function alone: no window on every layer, nothing to drop; an unpaged cache
    cache = eng.state.decode.cache
    assert rows.drop_passed(cache, (24, 0)) is cache and rows.drop_passed(cache, None) is cache
    with pytest.raises(ValueError, match="expected a cache with paged_host=True"):
        from jaxkv.cache import TieredKVCache

        rows.drop_passed(TieredKVCache.create(_cache(model)), (24, 24))
