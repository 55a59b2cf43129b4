"""TieredKVCache: a paged KV cache split over HBM (memory kind `device`) and host memory
(memory kind `pinned_host`).

A block is `block_size` consecutive tokens of one sequence in one layer (all KV heads, K and V).
Every written logical block lives in exactly one slot of one tier; the block table maps
(layer, sequence, logical block) -> (tier, slot). The block a sequence is filling (its *tail*,
logical index `lengths[b] // block_size`) always lives in HBM and is allocated before its first
token arrives; when it fills up it is *sealed*: it stays in HBM when a free HBM slot is left for
the next tail, otherwise it spills to host (so with no migration the cache fills HBM in write
order and spills the rest, the paper's Static policy).

Host arrays are only ever touched by copies: per-block `dynamic_slice` + `device_put` to read,
`dynamic_update_slice` of a `device_put` value to write (GPU rejects gathers on pinned_host).
All operations are pure functions returning a new cache and run inside or outside jit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, replace, static_field
from jaxkv.config import HBM_KIND, TIER_HBM, TIER_HOST, TIER_NONE, CacheConfig


def _sharding(kind: str):
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def to_kind(x: jax.Array, kind: str) -> jax.Array:
    """Places `x` in memory kind `kind` (works inside and outside jit)."""
    return jax.device_put(x, _sharding(kind))


@pytree_dataclass
class TieredKVCache:
    hbm_k: jax.Array  # [layers, hbm_slots, block, kv_heads, head_dim]  memory kind "device"
    hbm_v: jax.Array  # [layers, hbm_slots, block, kv_heads, head_dim]  memory kind "device"
    host_k: jax.Array  # [layers, host_slots, block, kv_heads, head_dim]  "pinned_host"
    host_v: jax.Array  # [layers, host_slots, block, kv_heads, head_dim]  "pinned_host"
    tier: jax.Array  # [layers, batch, max_blocks] int32: TIER_HBM / TIER_HOST / TIER_NONE
    slot: jax.Array  # [layers, batch, max_blocks] int32: slot in that tier's pool (0 if none)
    hbm_free: jax.Array  # [layers, hbm_slots] bool
    host_free: jax.Array  # [layers, host_slots] bool
    lengths: jax.Array  # [batch] int32: tokens written per sequence
    kmin: jax.Array  # [layers, batch, max_blocks, kv_heads, head_dim] f32: per-channel key min
    kmax: jax.Array  # [layers, batch, max_blocks, kv_heads, head_dim] f32: per-channel key max
    config: CacheConfig = static_field()

    # ---- construction -------------------------------------------------------------------------

    @staticmethod
    def create(config: CacheConfig) -> TieredKVCache:
        """An empty cache: every sequence has length 0 and its tail block allocated in HBM."""
        c = config
        L, B, M = c.num_layers, c.batch, c.max_blocks
        blk = (c.block_size, c.kv_heads, c.head_dim)
        hbm = jnp.zeros((L, c.hbm_blocks, *blk), c.jnp_dtype)
        host = jnp.zeros((L, c.host_blocks, *blk), c.jnp_dtype)
        tier = jnp.full((L, B, M), TIER_NONE, jnp.int32).at[:, :, 0].set(TIER_HBM)
        slot = jnp.zeros((L, B, M), jnp.int32).at[:, :, 0].set(jnp.arange(B, dtype=jnp.int32))
        hbm_free = jnp.ones((L, c.hbm_blocks), bool).at[:, :B].set(False)
        summary = jnp.zeros((L, B, M, c.kv_heads, c.head_dim), jnp.float32)
        return TieredKVCache(
            hbm_k=to_kind(hbm, HBM_KIND),
            hbm_v=to_kind(hbm, HBM_KIND),
            host_k=to_kind(host, c.host_memory_kind),
            host_v=to_kind(jnp.zeros_like(host), c.host_memory_kind),
            tier=tier,
            slot=slot,
            hbm_free=hbm_free,
            host_free=jnp.ones((L, c.host_blocks), bool),
            lengths=jnp.zeros((B,), jnp.int32),
            kmin=summary,
            kmax=summary,
            config=c,
        )

    # ---- derived views ------------------------------------------------------------------------

    @property
    def sealed(self) -> jax.Array:
        """[layers, batch, max_blocks] bool: full blocks, placeable by policies."""
        c = self.config
        j = jnp.arange(c.max_blocks)
        full = j[None, :] < (self.lengths // c.block_size)[:, None]  # [batch, max_blocks]
        return jnp.broadcast_to(full[None], self.tier.shape)

    @property
    def in_hbm(self) -> jax.Array:
        """[layers, batch, max_blocks] bool: sealed blocks resident in HBM."""
        return self.sealed & (self.tier == TIER_HBM)


def _check_kv(name: str, x, shape, dtype) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if x.dtype != dtype:
        raise ValueError(f"{name} has dtype {x.dtype}, expected {jnp.dtype(dtype)}")


def prefill(cache: TieredKVCache, k: jax.Array, v: jax.Array, lengths) -> TieredKVCache:
    """Writes each sequence's prompt into an empty cache, filling HBM in write order.

    Sealed blocks are ranked by (logical block, sequence); the first ones fill the HBM slots not
    reserved for tails, the rest go to host. Each sequence's tail (its next, possibly partial,
    block) is placed in HBM.

    Args:
      cache: an empty cache (from `TieredKVCache.create`).
      k, v: [layers, batch, T, kv_heads, head_dim] prompt keys (after RoPE) and values; positions
        at or beyond a sequence's length are ignored.
      lengths: [batch] int prompt lengths, 1 <= length <= min(T, max_len). Checked eagerly when
        concrete.
    Returns:
      The cache holding the prompts.
    """
    c = cache.config
    L, B = c.num_layers, c.batch
    T = k.shape[2]
    _check_kv("k", k, (L, B, T, c.kv_heads, c.head_dim), c.jnp_dtype)
    _check_kv("v", v, (L, B, T, c.kv_heads, c.head_dim), c.jnp_dtype)
    if T > c.max_len:
        raise ValueError(f"prompt length T={T} exceeds max_len={c.max_len}")
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (B,):
        raise ValueError(f"lengths has shape {lengths.shape}, expected ({B},)")
    if not isinstance(lengths, jax.core.Tracer):
        bad = [int(x) for x in lengths if not 1 <= int(x) <= T]
        if bad:
            raise ValueError(f"prompt lengths {bad} out of range: expected 1 <= length <= T={T}")
    return _prefill(cache, k, v, lengths)


@jax.jit
def _prefill(cache: TieredKVCache, k, v, lengths) -> TieredKVCache:
    c = cache.config
    L, B, M, bs = c.num_layers, c.batch, c.max_blocks, c.block_size
    S_h, S_x = c.hbm_blocks, c.host_blocks
    T = k.shape[2]
    pad = M * bs - T
    kb = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))).reshape(L, B, M, bs, *k.shape[3:])
    vb = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))).reshape(L, B, M, bs, *v.shape[3:])
    tok = jnp.arange(M * bs).reshape(M, bs)
    live = tok[None] < lengths[:, None, None]  # [B, M, bs]
    kb = jnp.where(live[None, ..., None, None], kb, 0)
    vb = jnp.where(live[None, ..., None, None], vb, 0)

    j = jnp.arange(M)
    n_sealed = lengths // bs  # [B]
    sealed = j[None] < n_sealed[:, None]  # [B, M]
    has_tail = n_sealed < M
    tail = (j[None] == n_sealed[:, None]) & has_tail[:, None]  # [B, M]
    # write order: (logical block, sequence); sealed blocks first fill HBM minus the tails
    order_key = jnp.where(sealed, j[None] * B + jnp.arange(B)[:, None], M * B)  # [B, M]
    rank = jnp.argsort(jnp.argsort(order_key.reshape(-1))).reshape(B, M)
    hbm_for_sealed = S_h - jnp.sum(has_tail)
    to_hbm = sealed & (rank < hbm_for_sealed)
    to_host = sealed & ~to_hbm
    n_hbm_sealed = jnp.sum(to_hbm)
    tail_rank = jnp.cumsum(has_tail) - 1  # [B]
    hbm_slot = jnp.where(to_hbm, rank, n_hbm_sealed + tail_rank[:, None])
    host_slot = rank - hbm_for_sealed
    tier = jnp.where(to_hbm | tail, TIER_HBM, jnp.where(to_host, TIER_HOST, TIER_NONE))
    slot = jnp.where(to_hbm | tail, hbm_slot, jnp.where(to_host, host_slot, 0)).astype(jnp.int32)

    # pools: gather each slot's source block (device side), then place host pools in one copy
    flat_k = kb.reshape(L, B * M, bs, *k.shape[3:])
    flat_v = vb.reshape(L, B * M, bs, *v.shape[3:])
    src = jnp.arange(B * M)

    def pool_for(mask, n_slots):
        m = mask.reshape(-1)
        s = jnp.where(m, slot.reshape(-1), n_slots)  # out of range -> dropped
        owner = jnp.full((n_slots,), B * M, jnp.int32).at[s].set(src, mode="drop")
        used = owner < B * M
        pk = jnp.where(used[None, :, None, None, None], flat_k[:, jnp.minimum(owner, B * M - 1)], 0)
        pv = jnp.where(used[None, :, None, None, None], flat_v[:, jnp.minimum(owner, B * M - 1)], 0)
        return pk, pv, used

    hk, hv, hbm_used = pool_for(to_hbm | tail, S_h)
    xk, xv, host_used = pool_for(to_host, S_x)
    written = sealed | tail
    kf = kb.astype(jnp.float32)
    kmin = jnp.where(live[None, ..., None, None], kf, jnp.inf).min(axis=3)
    kmax = jnp.where(live[None, ..., None, None], kf, -jnp.inf).max(axis=3)
    has_tok = jnp.any(live, axis=-1)[None, ..., None, None]
    return replace(
        cache,
        hbm_k=to_kind(hk, HBM_KIND),
        hbm_v=to_kind(hv, HBM_KIND),
        host_k=to_kind(xk, c.host_memory_kind),
        host_v=to_kind(xv, c.host_memory_kind),
        tier=jnp.broadcast_to(jnp.where(written, tier, TIER_NONE), (L, B, M)).astype(jnp.int32),
        slot=jnp.broadcast_to(slot, (L, B, M)),
        hbm_free=jnp.broadcast_to(~hbm_used, (L, S_h)),
        host_free=jnp.broadcast_to(~host_used, (L, S_x)),
        lengths=lengths,
        kmin=jnp.where(has_tok, kmin, 0.0),
        kmax=jnp.where(has_tok, kmax, 0.0),
    )


def write_token(cache: TieredKVCache, layer: int, k, v, active) -> TieredKVCache:
    """Writes one token's K and V per sequence into `layer`'s tail block at position `lengths`.

    Lengths do not change: call `advance` once after all layers are written.

    Args:
      layer: python int.
      k, v: [batch, kv_heads, head_dim] in the cache dtype.
      active: [batch] bool; inactive sequences (finished or full) are not written.
    """
    c = cache.config
    b = jnp.arange(c.batch)
    pos = cache.lengths
    j = jnp.minimum(pos // c.block_size, c.max_blocks - 1)
    off = pos % c.block_size
    ok = active & (pos < c.max_len)
    s = jnp.where(ok, cache.slot[layer, b, j], c.hbm_blocks)  # out of range -> dropped
    hbm_k = cache.hbm_k.at[layer, s, off].set(k.astype(c.jnp_dtype), mode="drop")
    hbm_v = cache.hbm_v.at[layer, s, off].set(v.astype(c.jnp_dtype), mode="drop")
    kf = k.astype(jnp.float32)
    first = (off == 0)[:, None, None]
    old_min, old_max = cache.kmin[layer, b, j], cache.kmax[layer, b, j]
    new_min = jnp.where(first, kf, jnp.minimum(old_min, kf))
    new_max = jnp.where(first, kf, jnp.maximum(old_max, kf))
    okx = ok[:, None, None]
    kmin = cache.kmin.at[layer, b, j].set(jnp.where(okx, new_min, old_min))
    kmax = cache.kmax.at[layer, b, j].set(jnp.where(okx, new_max, old_max))
    return replace(cache, hbm_k=hbm_k, hbm_v=hbm_v, kmin=kmin, kmax=kmax)


def _copy_block(src_k, src_v, dst_k, dst_v, layer, src_slot, dst_slot, dst_kind):
    """Copies one block between pools (any tiers) with dynamic_slice + device_put."""
    start = (layer, src_slot, 0, 0, 0)
    size = (1, 1, *src_k.shape[2:])
    bk = to_kind(jax.lax.dynamic_slice(src_k, start, size), dst_kind)
    bv = to_kind(jax.lax.dynamic_slice(src_v, start, size), dst_kind)
    at = (layer, dst_slot, 0, 0, 0)
    return jax.lax.dynamic_update_slice(dst_k, bk, at), jax.lax.dynamic_update_slice(dst_v, bv, at)


def _first_free(free_row):
    """(index of the first free slot, whether there is one) of a [slots] bool row."""
    return jnp.argmax(free_row).astype(jnp.int32), jnp.any(free_row)


def advance(cache: TieredKVCache, active) -> TieredKVCache:
    """Advances lengths of active sequences by one token and seals tails that filled up.

    A sealed tail keeps its HBM slot when another free HBM slot exists for the new tail; otherwise
    it spills to a host slot and its HBM slot becomes the new tail's.

    Args:
      active: [batch] bool.
    """
    c = cache.config
    L, B, M, bs = c.num_layers, c.batch, c.max_blocks, c.block_size
    ok = active & (cache.lengths < c.max_len)
    lengths = cache.lengths + ok.astype(jnp.int32)
    seal = ok & (lengths % bs == 0) & (lengths // bs < M)  # [B]: needs a new tail
    new_j = jnp.minimum(lengths // bs, M - 1)

    def seal_one(i, cache):
        layer, b = i // B, i % B
        j_old = new_j[b] - 1
        old_slot = cache.slot[layer, b, j_old]
        free_slot, has_free = _first_free(cache.hbm_free[layer])
        host_slot, _ = _first_free(cache.host_free[layer])

        def keep(cache):  # sealed block stays; new tail takes a free HBM slot
            return replace(
                cache,
                tier=cache.tier.at[layer, b, new_j[b]].set(TIER_HBM),
                slot=cache.slot.at[layer, b, new_j[b]].set(free_slot),
                hbm_free=cache.hbm_free.at[layer, free_slot].set(False),
            )

        def spill(cache):  # sealed block goes to host; its HBM slot is reused by the new tail
            host_k, host_v = _copy_block(
                cache.hbm_k,
                cache.hbm_v,
                cache.host_k,
                cache.host_v,
                layer,
                old_slot,
                host_slot,
                c.host_memory_kind,
            )
            tier = (
                cache.tier.at[layer, b, j_old].set(TIER_HOST).at[layer, b, new_j[b]].set(TIER_HBM)
            )
            slot = (
                cache.slot.at[layer, b, j_old].set(host_slot).at[layer, b, new_j[b]].set(old_slot)
            )
            return replace(
                cache,
                host_k=host_k,
                host_v=host_v,
                tier=tier,
                slot=slot,
                host_free=cache.host_free.at[layer, host_slot].set(False),
            )

        return jax.lax.cond(has_free, keep, spill, cache)

    # only (layer, sequence) pairs that seal are visited
    todo = jnp.broadcast_to(seal[None], (L, B)).reshape(-1)
    order = jnp.argsort(~todo, stable=True).astype(jnp.int32)
    cache = jax.lax.fori_loop(
        0, jnp.sum(todo), lambda n, cc: seal_one(order[n], cc), replace(cache, lengths=lengths)
    )
    return cache


@pytree_dataclass
class Moves:
    """Migrations per layer, flattened block index n = sequence * max_blocks + logical block."""

    demote: jax.Array  # [layers, max_moves] int32: HBM -> host
    promote: jax.Array  # [layers, max_moves] int32: host -> HBM
    num_demote: jax.Array  # [layers] int32: leading valid entries of `demote`
    num_promote: jax.Array  # [layers] int32: leading valid entries of `promote`


def plan_moves(cache: TieredKVCache, target: jax.Array, max_moves: int) -> Moves:
    """Turns a target placement into at most `max_moves` promotions per layer, paired with the
    demotions that make room for them (HBM capacity is never exceeded).

    Promotions are taken in block order; demotions of blocks outside the target are taken only as
    needed to free room, plus any surplus when the target asks for fewer HBM blocks.

    Args:
      target: [layers, batch * max_blocks] or [layers, batch, max_blocks] bool, the sealed blocks
        that should live in HBM. Entries for unsealed blocks are ignored.
      max_moves: static migration budget per layer (promotions; demotions bounded the same way).
    """
    c = cache.config
    L = c.num_layers
    N = c.batch * c.max_blocks
    target = target.reshape(L, N)
    sealed = cache.sealed.reshape(L, N)
    in_hbm = cache.in_hbm.reshape(L, N)
    want_in = target & sealed & ~in_hbm
    want_out = in_hbm & ~target
    n_free = jnp.sum(cache.hbm_free, axis=1)  # [L]
    k = max(0, min(max_moves, N))

    def first_k(mask):  # indices of the first k set entries per layer (vectorized, top_k)
        if k == 0:
            return jnp.zeros((L, 0), jnp.int32), jnp.zeros((L,), jnp.int32)
        score = jnp.where(mask, -jnp.arange(N)[None], -N - 1)
        _, idx = jax.lax.top_k(score, k)
        return idx.astype(jnp.int32), jnp.minimum(jnp.sum(mask, axis=1), k).astype(jnp.int32)

    promote, n_in = first_k(want_in)
    demote, n_out = first_k(want_out)
    # demote what is needed for the promotions (beyond free slots), at least; all surplus if room
    n_out = jnp.minimum(n_out, jnp.maximum(n_in - n_free, 0) + jnp.maximum(n_out - n_in, 0))
    n_in = jnp.minimum(n_in, n_free + n_out)
    return Moves(demote=demote, promote=promote, num_demote=n_out, num_promote=n_in)


def migrate(cache: TieredKVCache, moves: Moves, layers=None) -> tuple[TieredKVCache, jax.Array]:
    """Applies `moves`: per layer all demotions (HBM -> host), then promotions (host -> HBM).

    Contents are copied bit for bit; table and free masks are updated. When HBM has no free slot
    for a promotion it first demotes the resident sealed block of the lowest flat index (use
    `plan_moves` to control which blocks leave). Entries that no longer apply (a block already in
    the destination tier, or not sealed) are skipped.

    Args:
      layers: python ints, the layers whose moves to apply (default: all); the others' moves
        are not traced at all (the decode loop's in-step plans move one layer at a time).
    Returns:
      (new cache, [layers] int32 number of blocks actually moved; 0 outside `layers`).
    """
    c = cache.config
    L, M = c.num_layers, c.max_blocks
    N = c.batch * M
    sealed = cache.sealed.reshape(L, N)

    def move_one(layer, n, carry, to_hbm: bool):
        """Moves flat block n of `layer` to the other tier (skipped if it does not apply)."""
        cache, count = carry
        b, j = n // M, n % M
        src_tier, dst_tier = (TIER_HOST, TIER_HBM) if to_hbm else (TIER_HBM, TIER_HOST)
        applies = sealed[layer, n] & (cache.tier[layer, b, j] == src_tier)
        if to_hbm:  # no room: swap out the first resident sealed block
            resident = (cache.tier[layer] == TIER_HBM).reshape(-1) & sealed[layer]
            victim = jnp.argmax(resident).astype(jnp.int32)
            need_swap = applies & ~jnp.any(cache.hbm_free[layer]) & jnp.any(resident)
            cache, count = jax.lax.cond(
                need_swap,
                lambda cc: move_one(layer, victim, cc, False),
                lambda cc: cc,
                (cache, count),
            )
        src = cache.slot[layer, b, j]
        dst, has_room = _first_free((cache.hbm_free if to_hbm else cache.host_free)[layer])

        def do(cache):
            hbm, host = (cache.hbm_k, cache.hbm_v), (cache.host_k, cache.host_v)
            src_pool, dst_pool = (host, hbm) if to_hbm else (hbm, host)
            kind = HBM_KIND if to_hbm else c.host_memory_kind
            nk, nv = _copy_block(*src_pool, *dst_pool, layer, src, dst, kind)
            hbm_slot, host_slot = (dst, src) if to_hbm else (src, dst)
            pools = dict(hbm_k=nk, hbm_v=nv) if to_hbm else dict(host_k=nk, host_v=nv)
            return replace(
                cache,
                **pools,
                tier=cache.tier.at[layer, b, j].set(dst_tier),
                slot=cache.slot.at[layer, b, j].set(dst),
                hbm_free=cache.hbm_free.at[layer, hbm_slot].set(not to_hbm),
                host_free=cache.host_free.at[layer, host_slot].set(to_hbm),
            )

        go = applies & has_room
        return jax.lax.cond(go, do, lambda cc: cc, cache), count + go

    chosen = range(L) if layers is None else tuple(layers)
    bad = [x for x in chosen if not 0 <= x < L]
    if bad:
        raise ValueError(f"migrate layers {bad} out of range: expected ints in [0, {L})")
    counts = [jnp.int32(0)] * L
    for layer in chosen:  # layers are few and static; moves per layer are dynamic
        carry = (cache, jnp.int32(0))
        carry = jax.lax.fori_loop(
            0,
            moves.num_demote[layer],
            lambda i, cc, layer=layer: move_one(layer, moves.demote[layer, i], cc, False),
            carry,
        )
        carry = jax.lax.fori_loop(
            0,
            moves.num_promote[layer],
            lambda i, cc, layer=layer: move_one(layer, moves.promote[layer, i], cc, True),
            carry,
        )
        cache, counts[layer] = carry
    return cache, jnp.stack(counts).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("impl",))
def compact(cache: TieredKVCache, impl: str = "xla") -> TieredKVCache:
    """Renumbers occupied HBM slots into a dense prefix (stable order), per layer.

    Blocks move in place (`pallas_kernels.compaction`: the Mosaic GPU kernel for impl="pallas",
    its pure-jnp reference for "xla"); only slots that change are written. Jitted without
    donation, so an eager call leaves its input intact; inside a jitted step whose state is
    donated (the decode loop) the pool is updated in place.

    Args:
      impl: "xla" | "pallas" ("auto" means "xla" until the kernel is measured on a GPU).
    Returns:
      A cache with identical logical contents whose HBM pool holds its blocks in slots
      [0, occupied) and whose free slots form the suffix.
    """
    from pallas_kernels.compaction import compaction, compaction_moves, compaction_reference

    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"unknown compaction impl {impl!r}; expected 'auto', 'xla' or 'pallas'")
    move = compaction if impl == "pallas" else compaction_reference
    used = ~cache.hbm_free  # [L, S]
    src, dst, num_moves, new_of_old = compaction_moves(used)
    hbm_k = move(cache.hbm_k, src, dst, num_moves)
    hbm_v = move(cache.hbm_v, src, dst, num_moves)
    in_hbm = cache.tier == TIER_HBM
    renum = jnp.take_along_axis(new_of_old, cache.slot.reshape(cache.config.num_layers, -1), 1)
    slot = jnp.where(in_hbm, renum.reshape(cache.slot.shape), cache.slot)
    n_used = jnp.sum(used, axis=1, keepdims=True)
    hbm_free = jnp.arange(cache.config.hbm_blocks)[None] >= n_used
    return replace(cache, hbm_k=hbm_k, hbm_v=hbm_v, slot=slot, hbm_free=hbm_free)


def fragmentation(cache: TieredKVCache) -> jax.Array:
    """[layers] float: fraction of free HBM slots lying below the highest occupied slot."""
    used = ~cache.hbm_free
    S = used.shape[1]
    top = S - jnp.argmax(used[:, ::-1], axis=1)  # one past the highest occupied slot
    holes = jnp.sum(cache.hbm_free & (jnp.arange(S)[None] < top[:, None]), axis=1)
    return holes / jnp.maximum(top, 1)


def to_dense(cache: TieredKVCache) -> tuple[jax.Array, jax.Array]:
    """Reconstructs dense K and V (for tests and debugging).

    Returns:
      k, v: [layers, batch, max_blocks * block_size, kv_heads, head_dim] on the device, zeros at
      positions >= lengths.
    """
    c = cache.config
    host_k = to_kind(cache.host_k, HBM_KIND)
    host_v = to_kind(cache.host_v, HBM_KIND)

    def layer_blocks(hk, hv, xk, xv, tier, slot):
        sk = jnp.where((tier == TIER_HOST)[..., None, None, None], xk[slot], hk[slot])
        sv = jnp.where((tier == TIER_HOST)[..., None, None, None], xv[slot], hv[slot])
        return sk, sv

    bk, bv = jax.vmap(layer_blocks)(
        cache.hbm_k,
        cache.hbm_v,
        host_k,
        host_v,
        cache.tier,
        jnp.minimum(cache.slot, jnp.maximum(c.hbm_blocks, c.host_blocks) - 1),
    )
    shape = (c.num_layers, c.batch, c.max_blocks * c.block_size, c.kv_heads, c.head_dim)
    live = jnp.arange(shape[2])[None, :] < cache.lengths[:, None]  # [B, T]
    mask = live[None, :, :, None, None]
    return jnp.where(mask, bk.reshape(shape), 0), jnp.where(mask, bv.reshape(shape), 0)


def check_invariants(cache: TieredKVCache) -> None:
    """Raises AssertionError if the table and free masks disagree (host-side, for tests)."""
    import numpy as np

    c = cache.config
    tier, slot = np.asarray(cache.tier), np.asarray(cache.slot)
    hbm_free, host_free = np.asarray(cache.hbm_free), np.asarray(cache.host_free)
    lengths = np.asarray(cache.lengths)
    for layer in range(c.num_layers):
        for kind, free, code in (("hbm", hbm_free, TIER_HBM), ("host", host_free, TIER_HOST)):
            owners = slot[layer][tier[layer] == code]
            assert len(np.unique(owners)) == len(owners), f"layer {layer}: {kind} slot shared"
            used = np.zeros(free.shape[1], bool)
            used[owners] = True
            assert (used == ~free[layer]).all(), f"layer {layer}: {kind} free mask disagrees"
        for b in range(c.batch):
            n = lengths[b] // c.block_size
            written = -(-lengths[b] // c.block_size)
            tail = n if n < c.max_blocks else None
            for j in range(c.max_blocks):
                t = tier[layer, b, j]
                if j < written or j == tail:
                    assert t != TIER_NONE, f"layer {layer} seq {b} block {j} lost"
                else:
                    assert t == TIER_NONE, f"layer {layer} seq {b} block {j} unexpectedly placed"
            if tail is not None:
                assert tier[layer, b, tail] == TIER_HBM, f"layer {layer} seq {b}: tail not in HBM"
