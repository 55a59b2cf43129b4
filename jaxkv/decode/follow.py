"""The in-step rule inside a decode step (`jaxkv.Decoder` with a policy that has a `rule`: lrfu,
the field's rules, "+follow").

At every step, inside each layer's body, `follow_layer` runs the policy's rule through
`jaxkv.placement.admission.admit`, the function the simulators run on masks: it promotes host
blocks the layer reads, from the copies the read has just fetched (no second link read), and
demotes, to make room, resident blocks the rule picks. The layers' moves are gathered in
per-layer lists, `FollowMoves`, carried through the layer scan with the rule's state; after the
layers `apply_follow_moves` applies them all in one bulk migration. Without a rule the scan
carries None in their place (`jaxkv.Decoder._run_layers`).

The lookahead (`Lrfu.lookahead`, with a model that gives `first_query`): layer 0's queries depend
on the token and its position only, so once the step has sampled the next token, `look_ahead`
selects the blocks layer 0 will read at the next step and re-decides layer 0's moves with them
added to the value (lrfu's rule keeps no state, so deciding twice is deciding once). The scan
keeps layer 0's staged host blocks for that (`keep_first`): the promotions still come from the
copies this step's read fetched, so no link traffic is added. The statistics keep the mask
(`Statistics.ahead`), which `jaxkv.sim.loop` replays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv import cache as kvc
from jaxkv._pytree import pytree_dataclass, replace
from jaxkv.attention.select import select_blocks
from jaxkv.attention.tiered import AttentionStats, fetch_host_blocks, staging_blocks
from jaxkv.config import TIER_HBM, CacheConfig
from jaxkv.model_api import bind
from jaxkv.placement.admission import StepView, admit
from jaxkv.placement.charging import read_bytes


@pytree_dataclass
class FollowMoves:
    """Every layer's follow moves of one step, K = min(max_moves, batch * max_blocks) a layer;
    row l is layer l's (`follow_layer` writes it), entries past its count are unused."""

    promote: jax.Array  # [layers, K] int32: the blocks (of batch * max_blocks) promoted to HBM
    num_promote: jax.Array  # [layers] int32: entries of `promote` in use
    demote: jax.Array  # [layers, K] int32: the resident blocks demoted to make room
    num_demote: jax.Array  # [layers] int32: entries of `demote` in use
    # [layers, K, block_size, kv_heads, head_dim] cache dtype: the keys of each promoted block,
    # from the copies the layer's host read fetched (no second link read)
    promoted_k: jax.Array
    promoted_v: jax.Array  # [layers, K, block_size, kv_heads, head_dim]: their values


def empty_follow_moves(c: CacheConfig, max_moves: int) -> FollowMoves:
    """No moves yet, for every layer: the carry the layer scan starts from."""
    L, N = c.num_layers, c.batch * c.max_blocks
    K = max(0, min(max_moves, N))
    blk = (c.block_size, c.kv_heads, c.head_dim)
    zi, zn = jnp.zeros((L, K), jnp.int32), jnp.zeros((L,), jnp.int32)
    zb = jnp.zeros((L, K, *blk), c.jnp_dtype)
    return FollowMoves(
        promote=zi, num_promote=zn, demote=zi, num_demote=zn, promoted_k=zb, promoted_v=zb
    )


def follow_layer(
    cache, layer, st, staged, pstate, rstate, fol: FollowMoves, stats, step, *, num_blocks,
    rule, slack_of, ahead=None,
):  # fmt: skip
    """The policy's in-step rule for one layer (traced `layer`) after its read
    (`jaxkv.placement.admission.admit`, the function the simulators run): the promotions and
    the demotions that make room for them, and the fetched contents of the promoted blocks,
    written into the per-layer lists `fol`.

    Args:
      cache: the cache after this layer's token write.
      st, staged: the layer's read statistics and staged host blocks (`tiered_attention` with
        return_staging).
      pstate: the policy's state (e.g. a plan's `target` and `priority`, [layers, N]).
      rstate: the rule's state (every leaf [layers, ...]; () for a rule that keeps none).
      stats: the read statistics before this step (`jaxkv.placement.statistics.Stats`).
      step: [] int32, the decode step.
      num_blocks: N = batch * max_blocks.
      rule: the policy's `rule`.
      slack_of: (hbm bytes [1], host bytes [1]) -> [1] int32, the promotions the layer's step
        hides (`jaxkv.placement.charging.loop_free_promotions` under the decoder's profile).
      ahead: [N] bool, the blocks layer 0 reads at the next step (`look_ahead`), or None.

    Returns:
      (fol, the rule's state with row `layer` updated)."""
    N = num_blocks
    K = fol.promote.shape[1]
    sealed = cache.sealed[layer].reshape(1, N)
    hbm_b, host_b = read_bytes(cache.config, st.read_hbm[None], st.read_host[None], cache.lengths)
    view = StepView(
        in_hbm=sealed & (cache.tier[layer].reshape(1, N) == TIER_HBM),
        valid=sealed,
        reads=(st.read_hbm | st.read_host).reshape(1, N),
        room=jnp.sum(cache.hbm_free[layer])[None],
        step=step,
        stats=stats,
        pstate=pstate,
        layer=layer,
        ahead=ahead,
        slack=slack_of(hbm_b, host_b),
    )
    adm, rstate = admit(rule, rstate, view, K)
    sk, sv, stable = staged
    at = jnp.take(stable.reshape(-1), adm.promote[0])  # staging slot of each promoted block
    fol = replace(
        fol,
        promote=fol.promote.at[layer].set(adm.promote[0]),
        num_promote=fol.num_promote.at[layer].set(adm.num_promote[0]),
        demote=fol.demote.at[layer].set(adm.demote[0]),
        num_demote=fol.num_demote.at[layer].set(adm.num_demote[0]),
        promoted_k=fol.promoted_k.at[layer].set(sk[at].astype(fol.promoted_k.dtype)),
        promoted_v=fol.promoted_v.at[layer].set(sv[at].astype(fol.promoted_v.dtype)),
    )
    return fol, rstate


def apply_follow_moves(cache, fol: FollowMoves, after_reads):
    """The layers' follow moves, all at once, from the blocks they fetched (after the reads
    of `after_reads`, the step's logits).

    Returns:
      (cache, promoted [layers] int32, demoted [layers] int32)."""
    with jax.named_scope("follow"):
        before = cache.in_hbm
        moves = kvc.Moves(
            demote=fol.demote,
            promote=fol.promote,
            num_demote=fol.num_demote,
            num_promote=fol.num_promote,
        )
        fetched = (fol.promoted_k, fol.promoted_v)
        cache, _ = kvc.migrate(cache, moves, after_reads=after_reads, fetched=fetched)
        now = cache.in_hbm
        promoted = jnp.sum(now & ~before, axis=(1, 2)).astype(jnp.int32)
        demoted = jnp.sum(before & ~now, axis=(1, 2)).astype(jnp.int32)
    return cache, promoted, demoted


def first_staging(cache, placement):
    """The scan's carry for layer 0's staged host blocks (`keep_first`): zeros shaped as two
    layers' `fetch_host_blocks` (K, V, staging table); row 0 is layer 0's."""
    c = cache.config
    n = staging_blocks(placement, c.max_blocks)
    none = jnp.zeros((c.batch, c.max_blocks), bool)
    shapes = jax.eval_shape(lambda ca: fetch_host_blocks(ca, 0, none, n)[:3], cache)
    return tuple(jnp.zeros((2, *x.shape), x.dtype) for x in shapes)


def keep_first(buf, layer, staged):
    """`buf` with layer 0's `staged` triple in row 0 (the other layers write row 1, unread):
    a dynamic update, no branch on the traced `layer`."""
    i = jnp.minimum(jnp.asarray(layer, jnp.int32), 1)
    return tuple(b.at[i].set(x.astype(b.dtype)) for b, x in zip(buf, staged, strict=True))


def look_ahead(dec, params, state, cache, scanned, sampled):
    """Layer 0's reads at the next step and its follow moves re-decided with them, after the
    step has sampled (`jaxkv.Decoder._step_impl` with `lookahead`).

    Args:
      dec: the Decoder; params: the model's; state: the state before the step.
      cache: the cache after the layer scan (layer 0's tiers as its follow rule saw them).
      scanned: the scan's (`StepReads`, `FollowMoves`, `keep_first`'s buffer).
      sampled: the sampling state after this step (its `last`: the next tokens).

    Returns:
      (ahead [batch, max_blocks] bool, the moves with layer 0's row re-decided)."""
    reads, fol, staged0 = scanned
    c = dec.cache_config
    N = c.batch * c.max_blocks
    lengths = state.cache.lengths + dec._active(state).astype(jnp.int32)  # the next positions
    active = dec._active(state, sampled, lengths)  # the sequences the next step decodes
    windows = dec._layer_windows()
    with jax.named_scope("look_ahead"):
        q = bind(dec.graphdef, params).first_query(sampled.last, lengths)
        nxt = lengths + active.astype(jnp.int32)
        window = None if windows is None else windows[0]
        ahead = select_blocks(q, cache, 0, nxt, dec.placement, window=window) & active[:, None]
        st = AttentionStats(read_hbm=reads.read_hbm[0], read_host=reads.read_host[0], mass=None)
        fol, _ = follow_layer(
            cache, 0, st, tuple(b[0] for b in staged0), state.placement.policy,
            state.placement.rule, fol, state.statistics.blocks, state.sampling.step,
            num_blocks=N, rule=dec.policy.rule, slack_of=dec._slack_of, ahead=ahead.reshape(N),
        )  # fmt: skip
    return ahead, fol
