"""Debug views of a TieredKVCache (for tests and debugging, re-exported by `jaxkv.cache`):
`to_dense` rebuilds the dense K and V, `check_invariants` checks the block table against the
free masks and pages (and each HBM copy against its host copy), `fragmentation` measures the
holes of the HBM pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.layout import TieredKVCache, read_hbm, read_host, ring_ids, ring_window
from jaxkv.config import TIER_HBM, TIER_HOST, TIER_NONE


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
    L, S = c.num_layers, c.host_slots
    host_k, host_v = read_host(cache, jnp.arange(L * S, dtype=jnp.int32))
    host_k = host_k.reshape(L, S, *host_k.shape[1:])
    host_v = host_v.reshape(L, S, *host_v.shape[1:])

    lay = jnp.arange(L)[:, None, None]
    hk, hv = read_hbm(cache, lay, jnp.clip(cache.slot, 0, c.hbm_slots - 1))  # [L, B, M, ...]
    xs = jnp.clip(cache.slot, 0, S - 1)
    on_host = (cache.tier == TIER_HOST)[..., None, None, None]
    bk = jnp.where(on_host, host_k[lay, xs], hk)
    bv = jnp.where(on_host, host_v[lay, xs], hv)
    if c.ring_blocks:  # blocks inside the ring window are read from the ring
        ids = ring_ids(c, cache.lengths, ring_window(c, cache.lengths))  # [B, W]
        b = jnp.arange(c.batch)[:, None]
        at = jnp.where(ids >= 0, ids, c.max_blocks)  # -> dropped
        bk = bk.at[:, b, at].set(cache.ring_k, mode="drop")
        bv = bv.at[:, b, at].set(cache.ring_v, mode="drop")
    shape = (c.num_layers, c.batch, c.max_blocks * c.block_size, c.kv_heads, c.head_dim)
    live = jnp.arange(shape[2])[None, :] < cache.lengths[:, None]  # [B, T]
    mask = live[None, :, :, None, None]
    return jnp.where(mask, bk.reshape(shape), 0), jnp.where(mask, bv.reshape(shape), 0)


def check_invariants(cache: TieredKVCache, *, contents: bool = False, windows=None) -> None:
    """Raises AssertionError if the table and free masks disagree (host-side, for tests).

    Under a write-through host tier: every sealed block has its host copy at its page
    (`host_page`: its flat index, or under `paged_host` a page of its own) and no other host
    slot is used; with `contents`, every sealed block in HBM is also checked to be
    bit-identical to its host copy (values, and FP8 scales where both are FP8). `windows`: the
    model's layer windows when the blocks that passed every one were dropped
    (`jaxkv.cache.rows.drop_passed`): exactly those hold no slot in either tier."""
    from jaxkv.cache.rows import passed_blocks, passed_window

    c = cache.config
    tier, slot = np.asarray(cache.tier), np.asarray(cache.slot)
    hbm_free, host_free = np.asarray(cache.hbm_free), np.asarray(cache.host_free)
    lengths = np.asarray(cache.lengths)
    B, M = c.batch, c.max_blocks
    w = passed_window(windows)
    gone = np.zeros((B, M), bool)
    if w is not None:
        gone = np.arange(M)[None] < np.asarray(passed_blocks(lengths, c.block_size, w))[:, None]
    sealed = np.arange(M)[None] < (lengths // c.block_size)[:, None]  # [B, M]
    sealed = sealed & ~gone  # the sealed blocks still held
    flat = np.asarray(cache.host_page)
    if c.write_through and not c.paged_host:
        assert (flat == np.arange(B * M).reshape(B, M)).all(), "host pages are not flat indices"
    if c.paged_host:
        assert (flat[gone] == -1).all(), "a block past every window keeps its host page"
        pages = flat[sealed]
        assert ((pages >= 0) & (pages < c.host_slots)).all(), "a sealed block has no host page"
        assert len(np.unique(pages)) == len(pages), "a host page is shared by two blocks"
    for layer in range(c.num_layers):
        owners = slot[layer][tier[layer] == TIER_HBM]
        assert len(np.unique(owners)) == len(owners), f"layer {layer}: hbm slot shared"
        used = np.zeros(hbm_free.shape[1], bool)
        used[owners] = True
        assert (used == ~hbm_free[layer]).all(), f"layer {layer}: hbm free mask disagrees"
        if c.write_through:
            on_host = tier[layer] == TIER_HOST
            assert (slot[layer][on_host] == flat[on_host]).all(), (
                f"layer {layer}: a host block is not at its page"
            )
            used = np.zeros(host_free.shape[1], bool)
            used[flat[sealed]] = True
            assert (used == ~host_free[layer]).all(), (
                f"layer {layer}: host copies are not exactly the sealed blocks"
            )
        else:
            owners = slot[layer][tier[layer] == TIER_HOST]
            assert len(np.unique(owners)) == len(owners), f"layer {layer}: host slot shared"
            used = np.zeros(host_free.shape[1], bool)
            used[owners] = True
            assert (used == ~host_free[layer]).all(), f"layer {layer}: host free mask disagrees"
        for b in range(c.batch):
            n = lengths[b] // c.block_size
            written = -(-lengths[b] // c.block_size)
            tail = n if n < c.max_blocks else None
            for j in range(c.max_blocks):
                t = tier[layer, b, j]
                if gone[b, j]:
                    assert t == TIER_NONE, f"layer {layer} seq {b} block {j} past every window"
                elif j < written or j == tail:
                    assert t != TIER_NONE, f"layer {layer} seq {b} block {j} lost"
                else:
                    assert t == TIER_NONE, f"layer {layer} seq {b} block {j} unexpectedly placed"
            if tail is not None:
                assert tier[layer, b, tail] == TIER_HBM, f"layer {layer} seq {b}: tail not in HBM"
    if contents and c.write_through:
        _check_copies(cache, sealed)


def _check_copies(cache: TieredKVCache, sealed) -> None:
    """Every sealed HBM block equals its host copy bit for bit (FP8 values and scales where
    both pools are FP8; under fp8="host" the HBM copy equals the host copy dequantized)."""
    c = cache.config
    tier, slot = np.asarray(cache.tier), np.asarray(cache.slot)
    lay, b, j = np.nonzero((tier == TIER_HBM) & sealed[None])
    if not len(lay):
        return
    hs, xs = slot[lay, b, j], np.asarray(cache.host_page)[b, j]
    both_fp8 = c.fp8_in("hbm") and c.fp8_in("host")
    pairs = [("hbm_k", "host_k"), ("hbm_v", "host_v")]
    if both_fp8:
        pairs += [("hbm_ks", "host_ks"), ("hbm_vs", "host_vs")]
    if both_fp8 or not c.fp8_in("host"):
        for h, x in pairs:
            hv = np.asarray(getattr(cache, h))[lay, hs].view(np.uint8)
            xv = np.asarray(getattr(cache, x))[lay, xs].view(np.uint8)
            bad = np.flatnonzero((hv != xv).reshape(len(lay), -1).any(axis=1))
            assert not len(bad), (
                f"{h} differs from its host copy for (layer, seq, block) "
                f"{(int(lay[bad[0]]), int(b[bad[0]]), int(j[bad[0]]))}"
            )
        return
    rows = jnp.asarray(lay * c.host_slots + xs, jnp.int32)
    xk, xv = read_host(cache, rows)
    for name, pool, copy in (("hbm_k", cache.hbm_k, xk), ("hbm_v", cache.hbm_v, xv)):
        hv = np.asarray(pool)[lay, hs].view(np.uint8)
        bad = np.flatnonzero((hv != np.asarray(copy).view(np.uint8)).reshape(len(lay), -1).any(1))
        assert not len(bad), (
            f"{name} differs from its dequantized host copy for (layer, seq, block) "
            f"{(int(lay[bad[0]]), int(b[bad[0]]), int(j[bad[0]]))}"
        )
