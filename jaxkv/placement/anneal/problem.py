"""The annealer's placement problem and its energy: `AnnealProblem` (one window, every layer)
and the loads and window energy of an assignment (`loads`, `energy`), used by the init
(`jaxkv.placement.anneal.greedy`) and the chains (`jaxkv.placement.anneal`).

Problem (per layer): choose x in {0, 1}^N (1 = HBM) with x <= valid, sum x <= capacity and at most
`budget` blocks differing from the current assignment x0, minimizing the window energy

  E(x) = sum_t w_t max((fixed_t + hbm_t(x)) / B_hbm, link_t(x) / B_link) + sum_i v_i (1 - x_i)
  hbm_t(x)  = b * sum_i (A[t, i] x_i + H[t, i] (1 - x_i)) + [t = 0] b * (sum_{i in P} h_i + d |D|)
  link_t(x) = b * sum_i G[t, i] (1 - x_i)                 + [t = 0] b * (sum_{i in P} l_i + d |D|)
              + u_t

with w_t a per-step weight (1, or a discount for receding-horizon planning; 0 on padding), u_t an
optional link load no assignment changes (`fixed_link`: e.g. the reads a forecast cannot place),
A[t, i] the forecast (probability or 0/1) that block i is read at step t, H and G the HBM-side
and link-side loads of block i at step t when the plan leaves it on host (`host_hbm`, default
0, and `host_link`, default A: the placement held for the whole window), b the block bytes,
P = x & ~x0 the promotions (h_i = promote_hbm, l_i = promote_link: per block, so the caller can
price a block that crosses the link anyway, see `jaxkv.placement.policies.Anneal`) and D = x0 & ~x
the demotions (d = 0 when host memory keeps a copy of every block, the default; 1 for an exclusive
cache), all charged to the window's first step
(see `jaxkv.cost`), and v_i >= 0 an optional terminal value (seconds): what leaving block i on host
costs after the window (e.g. the link transfer of a read beyond it), so that among placements
the window alone cannot tell apart the planner keeps the blocks needed soonest (Belady's rule).
With an optional spread s_t > 0 (`spread`: the loads are forecasts, uncertain), a step costs its
expected time, E max(T_hbm, T_link + s_t Z) with Z standard normal, in place of the max of the
loads; it keeps the plan's link time below the HBM time by a margin that grows with s_t.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, static_field
from jaxkv.config import HardwareProfile


@pytree_dataclass
class AnnealProblem:
    """One window's placement problem for every layer."""

    forecast: jax.Array  # [layers, W, N] float32: A[t, i], expected reads of block i at step t
    x0: jax.Array  # [layers, N] bool: current assignment (True = HBM)
    valid: jax.Array  # [layers, N] bool: placeable blocks
    fixed: jax.Array  # [W] float32: HBM bytes every step reads anyway (weights + write)
    weight: jax.Array  # [W] float32: weight of each step in the energy (discount; 0 = padding)
    promote_hbm: jax.Array  # [layers, N] float32: HBM-side bytes of promoting a block, x b
    promote_link: jax.Array  # [layers, N] float32: link-side bytes of promoting a block, x b
    profile: HardwareProfile = static_field()
    block_bytes: float = static_field(default=1.0)
    capacity: int = static_field(default=0)  # HBM pool blocks per layer
    budget: int = static_field(default=1 << 30)  # max blocks moved per layer per window
    demote_cost: float = static_field(default=0.0)  # d: demotion bytes per side, x block bytes
    # [layers, N] float32 seconds, or None (zeros): what leaving block i out of HBM at the
    # window's end costs later (a terminal value for reads beyond the window; see `energy`)
    value: jax.Array | None = None
    # [layers, W] float32 bytes, or None (zeros): link load every assignment has at each step,
    # e.g. the expected reads the forecast cannot place (blocks entering the read set unforeseen)
    fixed_link: jax.Array | None = None
    # [layers, W, N] float32, or None: the loads (x block bytes) block i puts on the HBM side
    # (host_hbm; None = 0) and on the link (host_link; None = forecast) at step t when the plan
    # leaves it on host. The defaults price a plan as one placement held for the whole window;
    # a receding-horizon plan can price the later re-plans instead, e.g. a host block promoted
    # at its first read (the read carries it to HBM, later reads hit): see
    # `jaxkv.placement.policies`.
    host_hbm: jax.Array | None = None
    host_link: jax.Array | None = None
    # [layers, W] float32 seconds, or None (zeros): the deviation of each step's link time minus
    # its HBM time around the loads' values (the loads are forecasts); a step then costs its
    # expected time, not the max of its expected loads (see `energy_of_loads`)
    spread: jax.Array | None = None


def energy_of_loads(hbm, link, fixed, weight, profile: HardwareProfile, spread=None):
    """hbm, link: [..., W] bytes; fixed, weight: [W]; spread: None or broadcastable to [..., W]
    seconds -> [...] seconds: the weighted sum of `step_times`."""
    return jnp.sum(step_times(hbm, link, fixed, profile, spread) * weight, axis=-1)


def step_times(hbm, link, fixed, profile: HardwareProfile, spread=None):
    """hbm, link: [..., W] bytes; fixed: [W]; spread: None or broadcastable to [..., W] seconds
    -> [..., W] seconds per step.

    Each step costs max(HBM time, link time), or with a spread s > 0 its expectation when the
    link time minus the HBM time is Gaussian around the loads' difference d with deviation s:
    HBM time + s phi(d / s) + d Phi(d / s) (>= the max of the means; equal at s = 0).
    """
    th = (hbm + fixed) / profile.hbm_bandwidth
    tl = link / profile.link_bandwidth
    t = jnp.maximum(th, tl)
    if spread is not None:
        s = jnp.broadcast_to(spread, t.shape)
        safe = jnp.maximum(s, 1e-30)
        z = (tl - th) / safe
        smooth = th + safe * jax.scipy.stats.norm.pdf(z) + (tl - th) * jax.scipy.special.ndtr(z)
        t = jnp.where(s > 0, jnp.maximum(smooth, t), t)
    return t


def step_slopes(hbm, link, fixed, weight, profile: HardwareProfile, spread=None):
    """A subgradient of `energy_of_loads` in the loads: (seconds per HBM byte, seconds per link
    byte), [..., W] each (shapes as `step_times`).

    A step bound on one side charges that side's bytes alone (a tie charges HBM); with a spread
    s > 0 the expected step time's gradient splits them as 1 - Phi(d / s) and Phi(d / s). The
    energy is convex in the loads, so energy(loads + delta) >= energy(loads) + slopes . delta
    for every delta: the bound behind `jaxkv.placement.anneal.moves.certify`.
    """
    th = (hbm + fixed) / profile.hbm_bandwidth
    tl = link / profile.link_bandwidth
    on_link = (tl > th).astype(jnp.float32)
    if spread is not None:
        s = jnp.broadcast_to(spread, th.shape)
        z = (tl - th) / jnp.maximum(s, 1e-30)
        on_link = jnp.where(s > 0, jax.scipy.special.ndtr(z), on_link)
    return (
        weight * (1.0 - on_link) / profile.hbm_bandwidth,
        weight * on_link / profile.link_bandwidth,
    )


def spread_of(problem: AnnealProblem, ndim: int):
    """problem.spread [layers, W] reshaped to broadcast with [layers, ..., W] (ndim axes)."""
    if problem.spread is None:
        return None
    sp = problem.spread.astype(jnp.float32)
    return sp.reshape(sp.shape[:1] + (1,) * (ndim - 2) + sp.shape[1:])


def loads(problem: AnnealProblem, x):
    """Per-step loads of assignments x: [layers, ..., N] bool -> (hbm, link) [layers, ..., W].

    A full recomputation (used by init and by tests to check the O(W) deltas).
    """
    b, d = problem.block_bytes, problem.demote_cost
    a = problem.forecast  # [L, W, N]
    lead = x.shape[:-1]
    xb = x.reshape(x.shape[0], -1, x.shape[-1])  # [L, M, N]
    xf = xb.astype(jnp.float32)
    hh, hl = host_hbm_of(problem), host_link_of(problem)
    hbm = b * jnp.einsum("ltn,lmn->lmt", a - hh, xf) + b * jnp.sum(hh, -1)[:, None, :]
    link = b * (jnp.sum(hl, -1)[:, None, :] - jnp.einsum("ltn,lmn->lmt", hl, xf))  # [L, M, W]
    x0 = problem.x0[:, None, :]
    pro = (xb & ~x0).astype(jnp.float32)  # [L, M, N]
    dem = jnp.sum(x0 & ~xb, axis=-1).astype(jnp.float32)  # [L, M]
    mig_h = b * (jnp.sum(pro * problem.promote_hbm[:, None, :], -1) + d * dem)
    mig_l = b * (jnp.sum(pro * problem.promote_link[:, None, :], -1) + d * dem)
    first = (jnp.arange(a.shape[1]) == 0).astype(jnp.float32)  # [W]
    shape = lead + (a.shape[1],)
    return (
        (hbm + mig_h[..., None] * first).reshape(shape),
        (link + mig_l[..., None] * first + fixed_link_of(problem)[:, None]).reshape(shape),
    )


def host_hbm_of(problem: AnnealProblem):
    """[layers, W, N]: HBM-side load of a block left on host (zeros when None)."""
    if problem.host_hbm is None:
        return jnp.zeros_like(problem.forecast)
    return problem.host_hbm.astype(jnp.float32)


def host_link_of(problem: AnnealProblem):
    """[layers, W, N]: link-side load of a block left on host (the forecast when None)."""
    if problem.host_link is None:
        return problem.forecast
    return problem.host_link.astype(jnp.float32)


def fixed_link_of(problem: AnnealProblem):
    """[layers, W] float32 bytes: the assignment-independent link load (zeros when none)."""
    shape = problem.forecast.shape[:2]
    if problem.fixed_link is None:
        return jnp.zeros(shape, jnp.float32)
    return jnp.broadcast_to(problem.fixed_link.astype(jnp.float32), shape)


def value_of(problem: AnnealProblem):
    """[layers, N] float32: the terminal value (zeros when the problem has none)."""
    if problem.value is None:
        return jnp.zeros(problem.x0.shape, jnp.float32)
    return problem.value.astype(jnp.float32)


def miss_of(problem: AnnealProblem, x):
    """Terminal value of the blocks out of HBM: [layers, ..., N] bool -> [layers, ...] seconds."""
    v = value_of(problem)
    xb = x.reshape(x.shape[0], -1, x.shape[-1])
    miss = jnp.einsum("ln,lmn->lm", v, 1.0 - xb.astype(jnp.float32))
    return miss.reshape(x.shape[:-1])


def energy(problem: AnnealProblem, x):
    """Window energy of assignments x: [layers, ..., N] bool -> [layers, ...] seconds.

    The window's step times plus the terminal value of every block left out of HBM.
    """
    hbm, link = loads(problem, x)
    sp = spread_of(problem, hbm.ndim)
    e = energy_of_loads(hbm, link, problem.fixed, problem.weight, problem.profile, sp)
    return e + miss_of(problem, x)
