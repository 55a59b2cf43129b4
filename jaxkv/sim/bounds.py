"""Lower bounds on any placement's latency that count the blocks crossing the link ("cache").

The simulator's bounds (`jaxkv.cost.unlimited_step_time`, `capacity_bound_step_time`) re-choose
the placement before every step for free. Here a block that is not in HBM must cross the link
before HBM can serve it: this module counts the fewest crossings any policy needs (offline
caching with bypass, Belady) and turns them into a latency bound.

Crossing model, per layer (blocks 0..N-1, steps t = 0..T-1, capacity C blocks, R[t] = the blocks
step t reads; the always-HBM tail block is extra and not among them):
  * S_t (|S_t| <= C) is the HBM content during step t. Every block of R[t] \\ S_t costs one
    crossing (read over the link; it may then be admitted to HBM with no further crossing).
  * S_t is any subset of size <= C of K_t = S_{t-1} | R[t-1] | {new_t}, with S_{-1} | R[-1] =
    the initial content (write order after prefill) and new_t the block sealed at step t (the
    decode step wrote its tokens to HBM, so it is there for free; as in the simulator, a block
    is sealed once, and neither read nor held before). Putting any other block in S_t (a
    prefetch) costs one crossing.
Every simulated policy is such a schedule with at most as many crossings as link transfers:
take S_t = the simulator's HBM set during step t. A read from host is one link transfer; a block
of S_t outside K_t is a promotion that is not a kept fetch (those are reads of step t - 1, in
K_t), i.e. a link transfer (separate, or the host read of step t that it rides on).

Optimality of `min_link_crossings` (Belady's farthest-in-future rule with bypass: S_t = the C
blocks of K_t read soonest from step t on; never-read-again blocks are dropped; no prefetch):
  1. Prefetches never help: defer a prefetch of block x to x's next read at or after the
     prefetch (a host read there costs the one crossing the prefetch cost, and x is then in
     R, a free candidate; a block evicted before that read is simply not prefetched). HBM
     only holds fewer blocks meanwhile.
  2. Exchange: let an optimal schedule OPT agree with the rule up to S_{t-1} and keep at t a
     set S' != S (the rule's set, same candidates K_t). If |S'| < C add a block of S \\ S'
     (free). Else swap y in S' \\ S for x in S \\ S' (next use n_x <= n_y) and follow OPT with
     x in place of y: OPT cannot get x back before n_x without a crossing (x is sealed, not
     read before n_x), so it pays for x at or before n_x where the swapped schedule pays
     nothing; the swapped schedule pays at most one crossing to bring y back afterwards (a
     prefetch, deferred by 1.), or both coincide again as soon as OPT evicts y or reads y
     with x. So it is no worse, and by induction over t the rule is optimal.
     tests/test_bounds.py checks it against exhaustive search over HBM subsets (prefetches
     allowed) on random tiny instances.

Latency bound, per layer l: a step costs max(T_hbm, T_link) >= u_t (the Unlimited bound,
`cost.unlimited_step_time` of the same bytes D_t: reads incl. the tail, weights, the new token's
write) and >= link_bytes_t / B_link, where sum_t link_bytes_t >= F_l x block_bytes (every
crossing is one block over the link). Relaxing everything else,
  min sum_t max(u_t, L_t / B_link)  s.t.  sum_t L_t >= F_l b
  = sum_t u_t + max(0, F_l b - sum_t L*_t) / B_link = max(sum_t u_t, F_l b / B_link),
with L*_t = u_t x B_link the largest link load at which step t still costs u_t (each step's cost
is convex in L_t, flat at u_t up to L*_t, slope 1 / B_link above). When the reads dominate,
u_t = D_t / (B_hbm + B_link) and L*_t = D_t x B_link / (B_hbm + B_link), the ideal split
(alpha* = B_hbm / (B_hbm + B_link) on the HBM side); when the weights dominate, u_t = fixed /
B_hbm and L*_t is larger than the ideal split's link bytes. There the ideal split would
overstate the bound: a prefetch into such a step uses its idle link and costs only its HBM
write (tests/test_bounds.py::test_weight_dominated_steps_lend_their_link_time). The same
argument with the per-step capacity bound c_t >= u_t in place of u_t gives
max(sum_t c_t, F_l b / B_link): the "best" bound. Both are lower bounds on every policy's
latency in `jaxkv.sim.simulate` (tests/test_bounds.py).
"""

from __future__ import annotations

import numpy as np

NEVER = np.iinfo(np.int32).max


class PackedReads:
    """A [steps, layers, N] bool read mask stored bit-packed along blocks (np.packbits).

    Filled chunk by chunk (`put`); `min_link_crossings` unpacks it a slab at a time.
    """

    def __init__(self, steps: int, layers: int, num_blocks: int):
        self.shape = (steps, layers, num_blocks)
        self.bits = np.zeros((steps, layers, (num_blocks + 7) // 8), np.uint8)

    @staticmethod
    def nbytes(steps: int, layers: int, num_blocks: int) -> int:
        """Bytes the packed mask of this shape takes."""
        return steps * layers * ((num_blocks + 7) // 8)

    def put(self, t0: int, packed) -> None:
        """Stores steps t0 .. t0 + n - 1 from an already packed [n, layers, ceil(N / 8)] array."""
        packed = np.asarray(packed, np.uint8)
        self.bits[t0 : t0 + packed.shape[0]] = packed

    def get(self, t0: int, t1: int, l0: int, l1: int) -> np.ndarray:
        """[t1 - t0, l1 - l0, N] bool."""
        n = self.shape[2]
        return np.unpackbits(self.bits[t0:t1, l0:l1], axis=-1, count=n).astype(bool)


def initial_hbm(prompt_len: int, block_size: int, num_blocks: int, capacity: int) -> np.ndarray:
    """[N] bool: the simulator's `init_state`, blocks idx < min(prompt_len // block_size, C)."""
    return np.arange(num_blocks) < min(prompt_len // block_size, capacity)


def new_blocks(prompt_len: int, block_size: int, steps: int, num_blocks: int) -> np.ndarray:
    """[steps] int: the block sealed at each step (the simulator's `new`), -1 for none."""
    t = np.arange(steps)
    sealed = (prompt_len + t) // block_size
    new = (sealed > (prompt_len + t - 1) // block_size) & (t > 0) & (sealed - 1 < num_blocks)
    return np.where(new, sealed - 1, -1)


def min_link_crossings(
    reads, init_in_hbm, new_blocks, capacity: int, *, max_elements: int = 1 << 23
) -> np.ndarray:
    """Fewest link crossings any placement needs, per layer (see the module docstring).

    Args:
      reads: [T, layers, N] bool (array-like) or a `PackedReads`.
      init_in_hbm: [N] or [layers, N] bool, HBM content before step 0.
      new_blocks: [T] int, the block sealed at step t (free in HBM at step t), -1 for none,
        or a [T, N] bool mask of the blocks sealed at each step (several sequences); a block
        is sealed at most once and neither read nor in `init_in_hbm` before (the optimality
        argument needs it; the simulator's blocks are so).
      capacity: C, HBM blocks per layer.
      max_elements: working-set size (steps x layers x N) of one slab.
    Returns:
      [layers] int64 crossings.
    """
    if isinstance(reads, PackedReads):
        T, L, N = reads.shape
        get = reads.get
    else:
        reads = np.asarray(reads, bool)
        T, L, N = reads.shape

        def get(t0, t1, l0, l1):
            return reads[t0:t1, l0:l1]

    new_blocks = np.asarray(new_blocks)
    if new_blocks.shape == (T,):  # one block index per step: as a mask
        idx = new_blocks.astype(np.int64)
        new_blocks = np.zeros((T, N), bool)
        new_blocks[np.flatnonzero(idx >= 0), idx[idx >= 0]] = True
    elif new_blocks.shape != (T, N) or new_blocks.dtype != bool:
        raise ValueError(
            f"new_blocks has shape {new_blocks.shape} and dtype {new_blocks.dtype}: expected "
            f"({T},) ints (a block index per step, -1 for none) or a ({T}, {N}) bool mask"
        )
    init = np.broadcast_to(np.asarray(init_in_hbm, bool), (L, N))
    C = int(capacity)
    if C < 0:
        raise ValueError(f"capacity must be >= 0, got {C}")
    out = np.zeros(L, np.int64)
    if T == 0:
        return out
    g = L if L * N * min(T, 64) <= max_elements else max(1, max_elements // (64 * N))
    g = min(g, L)
    s = max(1, min(T, max_elements // (g * N)))
    starts = list(range(0, T, s))
    for l0 in range(0, L, g):
        l1 = min(l0 + g, L)
        out[l0:l1] = _belady(get, T, N, starts, s, l0, l1, init[l0:l1], new_blocks, C)
    return out


def _belady(get, T, N, starts, s, l0, l1, init, new_blocks, C):
    """Belady with bypass for layers l0 .. l1 - 1, slab by slab of `s` steps."""
    g = l1 - l0
    # backward: next read at or after each slab's first step
    snaps = [None] * (len(starts) + 1)
    snaps[-1] = np.full((g, N), NEVER, np.int32)
    for j in range(len(starts) - 1, -1, -1):
        a = starts[j]
        r = get(a, min(a + s, T), l0, l1)
        hit = r.any(0)
        snaps[j] = np.where(hit, a + np.argmax(r, 0), snaps[j + 1]).astype(np.int32)
    rows = np.arange(g)[:, None]
    crossings = np.zeros(g, np.int64)
    cand = init.copy()  # K_t before adding the sealed block: S_{t-1} | R[t-1]
    for j, a in enumerate(starts):
        b = min(a + s, T)
        r = get(a, b, l0, l1)
        nu = np.empty((b - a + 1, g, N), np.int32)  # nu[i] = next read at or after step a + i
        nu[-1] = snaps[j + 1]
        for i in range(b - a - 1, -1, -1):
            nu[i] = np.where(r[i], a + i, nu[i + 1])
        for i in range(b - a):
            cand |= new_blocks[a + i]
            key = np.where(cand, nu[i], NEVER)
            keep = key < NEVER  # candidates read again (at this step or later)
            if C == 0:
                keep[:] = False
            elif C < N and (keep.sum(-1) > C).any():
                idx = np.argpartition(key, C - 1, axis=-1)[:, :C]
                top = np.zeros_like(keep)
                top[rows, idx] = True
                keep &= top
            crossings += np.sum(r[i] & ~keep, axis=-1)
            cand = keep | r[i]
    return crossings


def cache_bound_seconds(crossings, base_s, block_bytes: float, link_bandwidth: float):
    """Per-layer bound max(base_l, F_l x block_bytes / B_link) (see the module docstring).

    Args:
      crossings: [layers] F_l from `min_link_crossings`.
      base_s: [layers] sum over steps of a per-step lower bound of the step's cost (Unlimited
        for the "cache" bound, the capacity bound for the "best" one).
      block_bytes: bytes of one block of one layer.
      link_bandwidth: B_link, bytes per second.
    Returns:
      [layers] float64 seconds.
    """
    link_s = np.asarray(crossings, np.float64) * float(block_bytes) / float(link_bandwidth)
    return np.maximum(np.asarray(base_s, np.float64), link_s)


__all__ = [
    "PackedReads",
    "cache_bound_seconds",
    "initial_hbm",
    "min_link_crossings",
    "new_blocks",
]
