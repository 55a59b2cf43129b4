"""The model interface (`jaxkv.model_api`): a model in plain JAX decodes exactly like the all-HBM
cache, and every way a model, its config or a state can be wrong is named before work starts
(one test per message)."""

import dataclasses
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import Decoder, FunctionalModel, model_api
from jaxkv.config import CacheConfig, PlacementConfig


class Config(NamedTuple):  # hashable: the Decoder compiles for it
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 1  # multi-query
    head_dim: int = 24
    vocab_size: int = 64
    max_len: int = 96
    dtype: str = "float32"


CFG = Config()


def init(cfg: Config, key) -> dict:
    """A params pytree: token and learned position embeddings, per-layer projections, output."""
    L, H, hd = cfg.num_layers, cfg.num_heads, cfg.head_dim
    D = H * hd
    k = jax.random.split(key, 7)

    def w(key, *shape):
        return jax.random.normal(key, shape) / math.sqrt(shape[-2])

    return dict(
        embed=jax.random.normal(k[0], (cfg.vocab_size, D)),
        pos=jax.random.normal(k[1], (cfg.max_len, D)),
        wq=w(k[2], L, D, H * hd),
        wk=w(k[3], L, D, hd),
        wv=w(k[4], L, D, hd),
        wo=w(k[5], L, H * hd, D),
        out=w(k[6], D, cfg.vocab_size),
    )


def _norm(x):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def prefill(params, tokens):
    B, T = tokens.shape
    H, hd = CFG.num_heads, CFG.head_dim
    h = params["embed"][tokens] + params["pos"][:T]
    causal = jnp.tril(jnp.ones((T, T), bool))
    ks, vs = [], []
    for i in range(CFG.num_layers):
        x = _norm(h)
        q = (x @ params["wq"][i]).reshape(B, T, H, hd)
        k = (x @ params["wk"][i]).reshape(B, T, 1, hd)
        v = (x @ params["wv"][i]).reshape(B, T, 1, hd)
        s = jnp.einsum("bthd,bskd->bhts", q, k) / math.sqrt(hd)
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        h = h + jnp.einsum("bhts,bskd->bthd", p, v).reshape(B, T, H * hd) @ params["wo"][i]
        ks.append(k)
        vs.append(v)
    return _norm(h) @ params["out"], jnp.stack(ks), jnp.stack(vs)


def decode_step(params, tokens, positions, attend, carry):
    B = tokens.shape[0]
    H, hd = CFG.num_heads, CFG.head_dim
    h = params["embed"][tokens] + params["pos"][positions]
    for i in range(CFG.num_layers):
        x = _norm(h)
        q = (x @ params["wq"][i]).reshape(B, H, hd)
        k = (x @ params["wk"][i]).reshape(B, 1, hd)
        v = (x @ params["wv"][i]).reshape(B, 1, hd)
        out, carry = attend(i, q, k, v, carry)
        h = h + out.reshape(B, H * hd) @ params["wo"][i]
    return _norm(h) @ params["out"], carry


PARAMS = init(CFG, jax.random.key(0))
MODEL = FunctionalModel(CFG, prefill=prefill, decode_step=decode_step, params=PARAMS)
LENGTHS = (50, 37)  # a ragged batch
NEW = 16


def _cache(hbm, **kw):
    kw = dict(batch=2, max_len=CFG.max_len, block_size=8, hbm_fraction=hbm) | kw
    return CacheConfig.for_model(CFG, **kw)


def _prompts():
    return jax.random.randint(jax.random.key(1), (2, max(LENGTHS)), 0, CFG.vocab_size)


def _decode(model, placement, hbm, params=PARAMS):
    dec = Decoder(model, _cache(hbm), placement, max_new_tokens=NEW)
    return dec, dec.generate(params, dec.prefill(params, _prompts(), LENGTHS))


@pytest.fixture(scope="module")
def all_hbm_tokens():
    """The all-HBM cache's tokens, which are the cache-free forward's."""
    _, state = _decode(MODEL, PlacementConfig(), 1.0)
    tokens = np.asarray(state.tokens)
    forward = jax.jit(lambda t: prefill(PARAMS, t)[0])  # padded to one length: one compile
    seq = list(np.asarray(_prompts()[1, : LENGTHS[1]]))
    for _ in range(4):
        padded = jnp.asarray([seq + [0] * (LENGTHS[1] + 4 - len(seq))])
        seq.append(int(jnp.argmax(forward(padded)[0, len(seq) - 1])))
    assert tokens[1, :4].tolist() == seq[LENGTHS[1] :]
    return tokens


@pytest.mark.parametrize("policy", ["static", "lru-plan"])
def test_plain_jax_model_decodes_like_the_all_hbm_cache(all_hbm_tokens, policy):
    """Exact attention at 25% HBM, a ragged batch: the greedy tokens of a multi-query model in
    plain JAX are the all-HBM cache's."""
    _, state = _decode(MODEL, PlacementConfig(policy=policy, window=3), 0.25)
    np.testing.assert_array_equal(np.asarray(state.tokens), all_hbm_tokens)
    assert float(state.metrics.hbm_reads) < float(state.metrics.total_reads)


@pytest.mark.slow
def test_plain_jax_model_under_the_follow_policy(all_hbm_tokens):
    _, state = _decode(MODEL, PlacementConfig(policy="anneal+reuse+follow", window=4), 0.25)
    np.testing.assert_array_equal(np.asarray(state.tokens), all_hbm_tokens)


# ---- what the Decoder refuses when it is built ------------------------------------------------


def _refused(model, error, message):
    with pytest.raises(error, match=re.escape(message)):
        Decoder(model, _cache(0.25), PlacementConfig())


class Plain:
    """A model in plain JAX handed over without the adapter."""

    def __init__(self):
        self.config, self.params = CFG, PARAMS

    def prefill(self, tokens):
        return prefill(self.params, tokens)


def test_a_plain_object_is_pointed_to_the_adapter():
    _refused(Plain(), TypeError, "model: a Plain is neither a flax nnx.Module nor a jaxkv.Func")


class NoConfig(nnx.Module):
    def prefill(self, tokens): ...

    def decode_step(self, tokens, positions, attend, carry): ...


def test_missing_config():
    _refused(NoConfig(), TypeError, "model (NoConfig) has no .config")


class NoDecodeStep(nnx.Module):
    def __init__(self):
        self.config = CFG

    def prefill(self, tokens): ...


def test_missing_method():
    msg = "model (NoDecodeStep) has no method decode_step(tokens, positions, attend, carry)"
    _refused(NoDecodeStep(), TypeError, msg)


def test_function_without_params_argument():
    model = FunctionalModel(
        CFG, prefill=lambda tokens: None, decode_step=decode_step, params=PARAMS
    )
    _refused(model, TypeError, "FunctionalModel.prefill(tokens) cannot be called as prefill(params")


@dataclasses.dataclass(frozen=True)
class NoVocab:
    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 24


def test_config_missing_a_field():
    model = FunctionalModel(NoVocab(), prefill=prefill, decode_step=decode_step, params=PARAMS)
    _refused(model, TypeError, "FunctionalModel.config (NoVocab) has no field 'vocab_size'")


def test_config_field_not_a_positive_int():
    model = dataclasses.replace(MODEL, config=CFG._replace(num_kv_heads=0))
    _refused(model, ValueError, "FunctionalModel.config.num_kv_heads=0: expected an int >= 1")


@dataclasses.dataclass  # not frozen: no hash
class Mutable:
    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 24
    vocab_size: int = 64


def test_config_not_hashable():
    model = dataclasses.replace(MODEL, config=Mutable())
    _refused(model, TypeError, "FunctionalModel.config (Mutable) is not hashable")


class Sliding(NamedTuple):
    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 24
    vocab_size: int = 64
    sliding_window: int = 16


def test_sliding_window_without_layer_windows():
    model = dataclasses.replace(MODEL, config=Sliding())
    _refused(model, TypeError, "has a sliding_window but no layer_windows() giving num_layers=2")


def test_functional_model_needs_its_weight_bytes():
    with pytest.raises(ValueError, match=re.escape("FunctionalModel needs params= (an example")):
        FunctionalModel(CFG, prefill=prefill, decode_step=decode_step)


def test_functional_model_weight_bytes_must_be_a_number():
    with pytest.raises(ValueError, match=re.escape("weight_bytes=-1.0: expected a number >= 0")):
        FunctionalModel(CFG, prefill=prefill, decode_step=decode_step, weight_bytes=-1.0)


def test_functional_model_weight_bytes_must_match_the_params():
    with pytest.raises(ValueError, match=re.escape("weight_bytes=1.0 differs from the params'")):
        FunctionalModel(CFG, prefill, decode_step, weight_bytes=1.0, params=PARAMS)


def test_functional_model_counts_abstract_params():
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
    model = FunctionalModel(CFG, prefill, decode_step, params=abstract)
    assert (
        model.weight_bytes == MODEL.weight_bytes == sum(x.nbytes for x in jax.tree.leaves(PARAMS))
    )


def test_cache_config_for_model_names_a_missing_dtype():
    with pytest.raises(TypeError, match=re.escape("model config (Mutable) has no field 'dtype'")):
        CacheConfig.for_model(Mutable(), batch=1, max_len=32)


# ---- what the model passes and returns, checked while it is traced ----------------------------


def _bound(**fns):
    return model_api.bind(dataclasses.replace(MODEL, **fns), PARAMS)


def _echo(layer, q, k_new, v_new, carry):
    return q, carry


def test_prefill_kv_layout_is_named():
    def swapped(params, tokens):
        logits, k, v = prefill(params, tokens)
        return logits, k.swapaxes(0, 1), v

    with pytest.raises(ValueError, match=re.escape("FunctionalModel.prefill's k has shape (1, 2,")):
        _bound(prefill=swapped).prefill(jnp.zeros((1, 5), jnp.int32))


def test_prefill_must_return_three_arrays():
    with pytest.raises(
        ValueError, match=re.escape("returned a tuple of 2: expected (logits, k, v)")
    ):
        _bound(prefill=lambda p, t: prefill(p, t)[:2]).prefill(jnp.zeros((1, 5), jnp.int32))


def _step(bound, attend=_echo, carry=()):
    tokens = jnp.zeros((2,), jnp.int32)
    return bound.decode_step(tokens, tokens, attend, carry)


def test_attend_query_shape_is_named():
    def flat_q(params, tokens, positions, attend, carry):
        q = jnp.zeros((2, CFG.num_heads * CFG.head_dim))
        return attend(0, q, q, q, carry)

    with pytest.raises(ValueError, match=re.escape("passed attend q of shape (2, 96): expected")):
        _step(_bound(decode_step=flat_q))


def test_attend_key_shape_is_named():
    def no_head_axis(params, tokens, positions, attend, carry):
        q, kv = jnp.zeros((2, 4, CFG.head_dim)), jnp.zeros((2, CFG.head_dim))
        return attend(0, q, kv, kv, carry)

    msg = "decode_step's attend k_new has shape (2, 24): expected (2, 1, 24)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        _step(_bound(decode_step=no_head_axis))


def test_decode_logits_shape_is_named():
    def last_hidden(params, tokens, positions, attend, carry):
        return jnp.zeros((2, 96)), carry

    msg = "FunctionalModel.decode_step's logits has shape (2, 96): expected (2, 64)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        _step(_bound(decode_step=last_hidden))


def test_decode_must_return_the_carry():
    def drops_carry(params, tokens, positions, attend, carry):
        logits, carry = decode_step(params, tokens, positions, attend, carry)
        return logits, None

    with pytest.raises(ValueError, match="returned a carry of another structure"):
        _step(_bound(decode_step=drops_carry), carry=(jnp.zeros(()),))


def test_decode_must_return_logits_and_carry():
    msg = "FunctionalModel.decode_step returned an array of shape (2, 64): expected (logits, carry)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        _step(_bound(decode_step=lambda p, t, pos, attend, c: jnp.zeros((2, 64))))


# ---- the state handed back to the Decoder ------------------------------------------------------


@pytest.fixture(scope="module")
def decoded():
    """(a decoder, a state it consumed, the state it returned), at 25% HBM."""
    dec = Decoder(
        MODEL, _cache(0.25), PlacementConfig(policy="lru-plan", window=3), max_new_tokens=4
    )
    first = dec.prefill(PARAMS, _prompts(), LENGTHS)
    return dec, first, dec.generate(PARAMS, first)


def test_a_donated_state_is_named(decoded):
    dec, consumed, _ = decoded
    with pytest.raises(ValueError, match="Decoder.generate: the state was donated to an earlier"):
        dec.generate(PARAMS, consumed)


def test_a_state_of_another_geometry_is_named(decoded):
    _, _, state = decoded
    other = Decoder(
        MODEL, _cache(0.25, block_size=16), PlacementConfig(policy="lru-plan", window=3)
    )
    msg = "Decoder.step: the state comes from another Decoder, whose cache config has block_size=8"
    with pytest.raises(ValueError, match=re.escape(msg)):
        other.step(PARAMS, state)


def test_a_state_of_another_length_is_named(decoded):
    _, _, state = decoded
    other = Decoder(
        MODEL, _cache(0.25), PlacementConfig(policy="lru-plan", window=3), max_new_tokens=9
    )
    msg = "Decoder.with_window: state.sampling.tokens has shape (2, 4) and dtype int32, this "
    with pytest.raises(ValueError, match=re.escape(msg)):
        other.with_window(state, 2)


def test_a_state_of_another_policy_is_named(decoded):
    _, _, state = decoded
    other = Decoder(MODEL, _cache(0.25), PlacementConfig(policy="anneal", window=3))
    with pytest.raises(ValueError, match="Decoder.plan_seconds: the state's structure differs"):
        other.plan_seconds(PARAMS, state)


def test_not_a_state_is_named(decoded):
    dec, _, _ = decoded
    with pytest.raises(ValueError, match="Decoder.score: expected a DecodeState .* got a dict"):
        dec.score(PARAMS, {}, jnp.zeros((2, 1), jnp.int32))


def test_the_mesh_decoder_names_a_model_it_cannot_split():
    from jaxkv.decode import sharded

    msg = (
        "ShardedDecoder: model is a FunctionalModel: expected a model that says how it splits "
        "over the mesh (jaxkv.model_api.TensorParallel"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        sharded.ShardedDecoder(MODEL, _cache(0.25), PlacementConfig(), mesh=sharded.make_mesh(1, 1))


# ---- every layer attended; shape errors that name the call's own rows -------------------------


def _decode_layers(layers, batch_of=lambda tokens: tokens.shape[0]):
    """`decode_step` calling attend for `layers` only, its q reshaped to `batch_of(tokens)`."""

    def step(params, tokens, positions, attend, carry):
        B, H, hd = batch_of(tokens), CFG.num_heads, CFG.head_dim
        h = params["embed"][tokens] + params["pos"][positions]
        for i in layers:
            x = _norm(h)
            q = (x @ params["wq"][i]).reshape(B, -1, hd)
            k = (x @ params["wk"][i]).reshape(tokens.shape[0], 1, hd)
            out, carry = attend(i, q, k, k, carry)
            h = h + out.reshape(tokens.shape[0], H * hd) @ params["wo"][i]
        return _norm(h) @ params["out"], carry

    return dataclasses.replace(MODEL, decode_step=step)


def test_a_layer_never_attended_is_named():
    """A decode_step that skipped layer 1 was accepted and decoded (its KV never written)."""
    dec = Decoder(_decode_layers([0]), _cache(1.0), PlacementConfig(), max_new_tokens=4)
    msg = "called attend for 1 of config.num_layers=2 layers: never for layer 1; expected one"
    with pytest.raises(ValueError, match=re.escape(msg)):
        dec.prefill(PARAMS, _prompts(), LENGTHS)


def test_a_layer_attended_twice_or_out_of_range_is_named():
    with pytest.raises(ValueError, match=re.escape("called attend 2 times for layer 0: expected")):
        _step(_bound(decode_step=_decode_layers([0, 0, 1]).decode_step))
    msg = "attend for layer 2: expected a layer in [0, 2)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        _step(_bound(decode_step=_decode_layers([0, 1, 2]).decode_step))


def test_a_fixed_batch_is_named_by_the_calls_rows():
    """A model fixing its batch at 1, decoded at batch 1: the error said `batch=32` (the rows
    of the prefill's own call), which the caller never asked for."""
    model = _decode_layers([0, 1], batch_of=lambda tokens: 1)
    cache = _cache(1.0, batch=1)
    dec = Decoder(model, cache, PlacementConfig(), max_new_tokens=4)
    with pytest.raises(ValueError) as e:
        dec.prefill(PARAMS, _prompts()[:1], [LENGTHS[0]])
    msg = str(e.value)
    assert "passed attend q of shape (1, 128, 24): expected (32, heads, head_dim=24)" in msg
    assert "batch=32" not in msg
    assert "32 is the rows of this call, tokens.shape[0]" in msg
    assert "prefill on batch x 32 or more rows" in msg and "never fix it" in msg
