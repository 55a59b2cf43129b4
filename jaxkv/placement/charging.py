"""What a step costs, in the two accountings the executors use (`jaxkv.cost`'s step model,
max(HBM time, link time) per layer, applied to their bytes).

The decode loop's (`jaxkv.Decoder` and its replay, `jaxkv.sim.loop`): a step reads its blocks
(the tail as a whole block, in HBM), writes its token, and pays for the migrations of its
window's plan (each promoted block read over the link again) and of its in-step rule (each
promotion rides the step's host read: an HBM write only); under a write-through host tier a
demotion only frees its slot. `read_bytes`, `step_latency` and their parts.

The paper's (the trace simulator, `jaxkv.sim.replay`): a plan at the start of a step, charged
to that step, whose promotions of blocks the step reads ride the read; a partial tail; a
demotion costs `demote_cost` blocks on each side. `paper_step_time`, `paper_plan_charges`,
`paper_rule_charges`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.cache.layout import ring_window
from jaxkv.config import CacheConfig
from jaxkv.cost import layer_step_time

# ---- the decode loop's -------------------------------------------------------------------------


def read_bytes(c: CacheConfig, read_hbm, read_host, lengths):
    """([layers] f32, [layers] f32): the KV bytes a step reads from HBM and over the link,
    from its block reads [layers, batch, max_blocks] bool (the tail in read_hbm) by sequences
    `lengths` [batch] tokens long before the step. FP8 blocks count their FP8 bytes; under
    fp8="age" the ring's reads are at full precision."""
    hbm_b = read_hbm.sum(axis=(1, 2)) * float(c.hbm_block_bytes)
    if c.ring_blocks:
        ring = (read_hbm & ring_window(c, lengths)[None]).sum(axis=(1, 2))
        hbm_b += ring * float(c.block_bytes - c.hbm_block_bytes)
    host_b = read_host.sum(axis=(1, 2)) * float(c.host_block_bytes)
    return hbm_b, host_b


def copied_demotions(c: CacheConfig, demoted):
    """The follow demotions that copy a block: all under an exclusive host tier, none under a
    write-through one (the block's host copy is already there)."""
    return jnp.zeros_like(demoted) if c.write_through else demoted


def link_migration_bytes(c: CacheConfig, moved, demoted):
    """[layers] f32 link bytes of a step's migrations: the blocks `migrate` copied (`moved`) and
    the follow demotions, written back under an exclusive host tier and free under a
    write-through one (a follow promotion rides on the step's host read)."""
    crossed = moved if c.write_through else moved + demoted
    return crossed.astype(jnp.float32) * float(c.host_block_bytes)


def token_write_bytes(c: CacheConfig) -> float:
    """HBM bytes a step writes per layer for the new tokens (fp8="age": into the ring, plus
    their FP8 copy at sealing, amortized)."""
    extra = c.hbm_block_bytes if c.ring_blocks else 0
    return float(c.batch * (c.block_bytes + extra) / c.block_size)


def step_latency(
    c: CacheConfig, profile, weight_bytes, hbm_b, host_b, moved, promoted, demoted, link_mig=None
):
    """[] f32: a step's modeled seconds (`jaxkv.cost.layer_step_time`, summed over the layers)
    from its reads, its token write and its migrations ([layers] blocks each); `link_mig`: the
    link's migration bytes [layers] when others share it (jaxkv.decode.sharded)."""
    bb = float(c.hbm_block_bytes)  # what a migration writes or reads in the HBM pool
    write_b = token_write_bytes(c)
    # as in the simulator (docs/paper.md): a copied block crosses the link once and touches HBM
    # once, in its step; a follow promotion rides on the step's host read (HBM only); a
    # write-through demotion only frees its HBM slot (no copy)
    mig_h = (moved + promoted + copied_demotions(c, demoted)).astype(jnp.float32) * bb  # [L]
    mig_l = link_mig if link_mig is not None else link_migration_bytes(c, moved, demoted)
    return layer_step_time(
        hbm_b,
        host_b,
        profile=profile,
        weight_bytes=weight_bytes,
        hbm_write_bytes=write_b,
        hbm_migration_bytes=mig_h,
        link_migration_bytes=mig_l,
    ).sum()


def free_promotions(profile, hbm_bytes, host_bytes, fixed_bytes, block_bytes):
    """[rows] int32: the promotions whose HBM writes a (step, layer) hides under its link time,
    floor(max(T_link - T_hbm, 0) x B_hbm / block_bytes) (`jaxkv.cost.layer_step_time`'s two
    sides before any migration): promoting more lengthens the step by one HBM write each. The
    in-step rule's slack (`StepView.slack`, lrfu's `slack`).

    Args:
      profile: bandwidths; hbm_bytes, host_bytes: [rows] the step's reads from each tier;
      fixed_bytes: HBM bytes it reads and writes besides (weights, the token's write);
      block_bytes: what one promotion writes to HBM.
    """
    t_hbm = (jnp.asarray(hbm_bytes, jnp.float32) + fixed_bytes) / profile.hbm_bandwidth
    t_link = jnp.asarray(host_bytes, jnp.float32) / profile.link_bandwidth
    free = jnp.maximum(t_link - t_hbm, 0.0) * (profile.hbm_bandwidth / float(block_bytes))
    return jnp.floor(free).astype(jnp.int32)


def loop_free_promotions(c: CacheConfig, profile, weight_bytes, hbm_b, host_b):
    """`free_promotions` in the decode loop's accounting: a layer's reads `hbm_b`, `host_b`
    ([rows] bytes, `read_bytes`), its weights and the tokens' write on the HBM side, a
    promotion one HBM block's write."""
    fixed = float(weight_bytes) + token_write_bytes(c)
    return free_promotions(profile, hbm_b, host_b, fixed, c.hbm_block_bytes)


# ---- the paper's -------------------------------------------------------------------------------


def paper_step_time(
    reads,
    in_hbm,
    riding,
    mig_h,
    mig_l,
    *,
    block_bytes,
    tail_bytes,
    token_bytes,
    weight_bytes,
    profile,
):
    """A step's time per layer in the paper's accounting: ([L] seconds, `jaxkv.cost.
    layer_step_time`; [L] HBM reads and [L] reads of placed blocks).

    Args:
      reads, in_hbm: [L, N] bool: the blocks the step reads, and where they are when it reads.
      riding: [L, N] bool: reads that carry a promotion (host reads, whatever `in_hbm` says).
      mig_h, mig_l: [L] migration bytes on the HBM side and on the link.
      block_bytes: a placed block's bytes; tail_bytes: the partial tail's ([] or [L]), always
        an HBM read; token_bytes: the new token's write; weight_bytes: a layer's weights;
        profile: the hardware (its link scaled to a host block's bytes, `cost.link_profile`).
    """
    n_hbm = jnp.sum(reads & in_hbm & ~riding, axis=-1).astype(jnp.float32)
    n_all = jnp.sum(reads, axis=-1).astype(jnp.float32)
    lat = layer_step_time(
        block_bytes * n_hbm + tail_bytes,
        block_bytes * (n_all - n_hbm),
        profile=profile,
        weight_bytes=weight_bytes,
        hbm_write_bytes=float(token_bytes),
        hbm_migration_bytes=mig_h,
        link_migration_bytes=mig_l,
    )
    return lat, n_hbm, n_all


def paper_plan_charges(target, in_hbm, reads, kept, block_bytes: float, demote_cost: float):
    """The moves from `in_hbm` to a plan's `target` ([L, N] bool each) at the start of a step
    that reads `reads`, in the paper's accounting: (mig_h [L], mig_l [L] bytes, moved [] blocks,
    riding [L, N] bool). Every move writes HBM; a promotion crosses the link unless the step
    reads the block (it rides the read, which is then a host read: `riding`) or `kept` marks it
    (a copy fetched at the last step); a demotion costs `demote_cost` blocks each side."""
    pro = target & ~in_hbm
    dem = in_hbm & ~target
    n_dem = demote_cost * jnp.sum(dem, -1)
    riding = pro & reads & ~kept
    mig_h = block_bytes * (jnp.sum(pro, -1) + n_dem)
    mig_l = block_bytes * (jnp.sum(pro & ~riding & ~kept, -1) + n_dem)
    return mig_h, mig_l, (jnp.sum(pro) + jnp.sum(dem)).astype(jnp.float32), riding


def paper_rule_charges(pro, dem, block_bytes: float, demote_cost: float):
    """An in-step rule's promotions and demotions ([L, N] bool) in the paper's accounting: (mig_h
    [L], mig_l [L] bytes): a promotion rides the step's host read (an HBM write only), a
    demotion costs `demote_cost` blocks on each side."""
    n_dem = demote_cost * jnp.sum(dem, -1).astype(jnp.float32)
    return block_bytes * (jnp.sum(pro, -1) + n_dem), block_bytes * n_dem
