"""A trace as the per-layer LPs of `jaxkv.sim.lp.bound` see it, charged as `jaxkv.sim.simulate`
charges it: the read mask per step and layer (`trace_reads`), the step's bytes besides the placed
blocks, the sealing steps, the initial placement and the units (`trace_inputs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv import cost
from jaxkv.sim import bounds as bnd
from jaxkv.sim.trace import read_mask


def trace_reads(trace, sparsity: float, steps: int, layers: Sequence[int], chunk: int = 128):
    """[steps, len(layers), N] bool: the simulator's read mask (`trace.read_mask`) per step."""
    out = []
    idx = np.asarray(layers, np.int64)
    for t0 in range(0, steps, chunk):
        c = min(chunk, steps - t0)
        r = read_mask(trace.mass(t0, c), trace.prompt_len, trace.block_size, sparsity, t0)
        out.append(np.asarray(r)[:, idx])
    return np.concatenate(out, 0)


def trace_inputs(trace, sparsity, geometry, profile, capacity_blocks, hbm_budget, steps, idx):
    """The per-layer LP's data for a trace, as `jaxkv.sim.simulate` charges it.

    Returns:
      {"reads": [T, layers, N] bool, "fixed": [T] HBM bytes of each step besides the placed
       blocks / block bytes, "tail": [T] the tail block's bytes, "capacity": C, "T",
       "valid_from": [N] the step each block is sealed at, "init": [N] HBM content after
       prefill, "rho": B_hbm / B_link, "scale": seconds per block unit, "geometry" (its pool
       capacity resolved), "block_bytes"}.
    """
    geometry, capacity_blocks = cost.pool_capacity(
        geometry, hbm_budget, trace.num_layers, trace.block_size, capacity_blocks
    )
    P, bs, N = trace.prompt_len, trace.block_size, trace.num_blocks
    C = int(min(capacity_blocks, N))
    T = min(steps or trace.steps, trace.steps)
    reads = trace_reads(trace, sparsity, T, idx)
    b = float(geometry.token_bytes * bs)
    t = np.arange(T)
    tail = geometry.token_bytes * ((P + t) % bs + 1)
    fixed = (float(geometry.weight_bytes) + geometry.token_bytes + tail) / b
    new = bnd.new_blocks(P, bs, T, N)
    valid_from = np.where(np.arange(N) < P // bs, 0, T)
    valid_from[new[new >= 0]] = np.flatnonzero(new >= 0)
    return dict(
        reads=reads,
        fixed=fixed,
        tail=tail,
        capacity=C,
        T=T,
        valid_from=valid_from,
        init=bnd.initial_hbm(P, bs, N, C),
        rho=profile.hbm_bandwidth / profile.link_bandwidth,
        scale=b / profile.hbm_bandwidth,
        geometry=geometry,
        block_bytes=b,
    )


def layer_progress(n: int, desc: str, progress: bool):
    """range(n), with a tqdm bar over layers when `progress`."""
    bar = range(n)
    if progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc=desc, unit="layer")
    return bar


__all__ = ["layer_progress", "trace_inputs", "trace_reads"]
