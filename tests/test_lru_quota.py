"""`LruQuota` (jaxkv.placement.policies.lru_quota): a fixed LRU hot buffer per sequence, checked
against a plain Python reference over random read streams."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.placement.admission import StepView, admit
from jaxkv.placement.policies.lru_quota import LruQuota


def _reference(in_hbm, valid, reads, room, quota, m, stamp, t):
    """One step for one row: hits restamped in block order, then each miss in block order
    admitted, evicting its sequence's least recent block at quota, else taking a free slot,
    else the row's least recent block."""
    res = set(np.flatnonzero(in_hbm & valid))
    cap = len(res) + max(room, 0)
    clock = t * 1000
    for b in np.flatnonzero(reads & valid & in_hbm):
        stamp[b], clock = clock, clock + 1
    for b in np.flatnonzero(reads & valid & ~in_hbm):
        mine = [x for x in res if x // m == b // m]
        if len(mine) >= quota:
            if mine:
                res.discard(min(mine, key=lambda x: (stamp[x], x)))
        elif len(res) >= cap:
            res.discard(min(res, key=lambda x: (stamp[x], x)))
        if cap > 0 and quota > 0:
            res.add(b)
            stamp[b], clock = clock, clock + 1
    return res


@pytest.mark.parametrize("seed", range(4))
def test_lru_quota_keeps_each_sequence_within_its_buffer(seed):
    rng = np.random.default_rng(seed)
    seqs, m, quota = 3, 6, 2
    n = seqs * m
    policy = LruQuota(quota=quota, seq_blocks=m)
    rule = policy.rule
    state = rule.init(1, n)
    step = jax.jit(lambda st, v: admit(rule, st, v, 64))
    in_hbm = np.zeros(n, bool)
    valid = np.ones(n, bool)
    stamp = np.zeros(n, np.int64)
    for t in range(25):
        reads = rng.random(n) < 0.35
        room = seqs * quota - int(in_hbm.sum())
        view = StepView(in_hbm=jnp.asarray(in_hbm[None]), valid=jnp.asarray(valid[None]),
                        reads=jnp.asarray(reads[None]), room=jnp.asarray([room], jnp.int32),
                        step=jnp.int32(t), stats=None)  # fmt: skip
        adm, state = step(state, view)
        new = np.asarray(adm.apply(jnp.asarray(in_hbm[None])))[0]
        want = _reference(in_hbm, valid, reads, room, quota, m, stamp, t)
        assert set(np.flatnonzero(new)) == want, (seed, t)
        per_seq = new.reshape(seqs, m).sum(1)
        assert (per_seq <= quota).all(), per_seq  # no request takes another's slots
        in_hbm = new


def test_lru_quota_refuses_bad_sizes():
    with pytest.raises(ValueError, match=r"LruQuota.quota=-1: expected an int >= 0"):
        LruQuota(quota=-1, seq_blocks=4)
    with pytest.raises(ValueError, match=r"LruQuota.seq_blocks=0: expected an int >= 1"):
        LruQuota(quota=2, seq_blocks=0)
