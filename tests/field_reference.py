"""Textbook reference implementations of the field's cache rules, one access at a time on
Python ordered dicts, for tests/test_field_rules.py: the JAX rules
(`jaxkv.placement.policies`: Lru, Arc, Slru, Lfu, TinyLfu) must equal them step by step.

Each rule keeps its lists as `OrderedDict`s, least recent first. A step (`step`) is what the
in-step executor (`jaxkv.placement.admission`) defines: the blocks that entered HBM outside the
rule join it (in block order) and those that left it leave; the step's reads are counted;
its hits are touched in block order; then each of its first `budget` misses in block order is
admitted or bypassed by the rule, with capacity c = residents + free slots at the step's start.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np


def _f32_floor(share: float, n: int) -> int:
    return int(np.floor(np.float32(share) * np.float32(n)))


class Reference:
    """The executor's step around a rule's hooks (`sync`, `touch`, `miss`, `resident`)."""

    def step(self, resident: set, valid: set, reads: set, room: int, budget: int, t: int) -> set:
        cap = len(resident) + max(room, 0)
        self.sync(resident, valid, t, cap)
        read_valid = sorted(b for b in reads if b in valid)
        hits = [b for b in read_valid if b in resident]
        self.touch(hits, read_valid, cap)
        misses = [b for b in read_valid if b not in resident][:budget]
        for b in misses:
            self.miss(b, cap)
        return self.resident()

    @staticmethod
    def _sync_lists(held: list, ghosts: list, entry: OrderedDict, resident, valid):
        for d in held:
            for b in [b for b in d if b not in resident or b not in valid]:
                del d[b]
        for d in ghosts:
            for b in [b for b in d if b not in valid or b in resident]:
                del d[b]
        inside = set().union(*held)
        for b in sorted(resident - inside):
            entry[b] = None


class LruRef(Reference):
    def __init__(self):
        self.res = OrderedDict()

    def sync(self, resident, valid, t, cap):
        self._sync_lists([self.res], [], self.res, resident, valid)

    def touch(self, hits, reads, cap):
        for h in hits:
            self.res.move_to_end(h)

    def miss(self, b, cap):
        if cap == 0:
            return
        if len(self.res) >= cap:
            self.res.popitem(last=False)
        self.res[b] = None

    def resident(self):
        return set(self.res)


class ArcRef(Reference):
    """ARC as Megiddo and Modha's Fig. 4, with the two documented adaptations for a pool
    whose size varies (REPLACE only when T1 and T2 fill c; it takes T1's block when T2 is
    empty)."""

    def __init__(self):
        self.t1, self.t2, self.b1, self.b2 = (OrderedDict() for _ in range(4))
        self.p = 0.0

    def sync(self, resident, valid, t, cap):
        self._sync_lists([self.t1, self.t2], [self.b1, self.b2], self.t1, resident, valid)

    def touch(self, hits, reads, cap):
        for h in hits:  # case I
            (self.t1 if h in self.t1 else self.t2).pop(h)
            self.t2[h] = None

    def _replace(self, in_b2: bool, t1: int, t2: int):
        if (t1 >= 1 and ((in_b2 and t1 == self.p) or t1 > self.p)) or t2 == 0:
            if self.t1:
                k, _ = self.t1.popitem(last=False)
                self.b1[k] = None
        elif self.t2:
            k, _ = self.t2.popitem(last=False)
            self.b2[k] = None

    def miss(self, x, c):
        t1, t2, b1, b2 = len(self.t1), len(self.t2), len(self.b1), len(self.b2)
        p32 = np.float32
        in_b1, in_b2 = x in self.b1, x in self.b2
        full = t1 + t2 >= c
        if in_b1:  # case II
            self.p = float(min(p32(c), p32(self.p) + max(p32(b2) / p32(max(b1, 1)), p32(1))))
        elif in_b2:  # case III
            self.p = float(max(p32(0), p32(self.p) - max(p32(b1) / p32(max(b2, 1)), p32(1))))
        rep = False
        if not (in_b1 or in_b2):  # case IV
            l1 = t1 + b1
            if l1 >= c:
                if t1 < c:
                    self.b1.popitem(last=False)
                    rep = full
                elif self.t1:
                    self.t1.popitem(last=False)
            elif l1 + t2 + b2 >= c:
                if l1 + t2 + b2 >= 2 * c and self.b2:
                    self.b2.popitem(last=False)
                rep = full
        else:
            rep = full
        if rep:
            self._replace(in_b2, t1, t2)
        if c > 0:
            self.b1.pop(x, None)
            self.b2.pop(x, None)
            (self.t1 if not (in_b1 or in_b2) else self.t2)[x] = None

    def resident(self):
        return set(self.t1) | set(self.t2)


class SlruRef(Reference):
    def __init__(self, protected: float = 0.8):
        self.share = protected
        self.prob, self.prot = OrderedDict(), OrderedDict()

    def sync(self, resident, valid, t, cap):
        self._sync_lists([self.prob, self.prot], [], self.prob, resident, valid)

    def _spill(self, keep: int):
        while len(self.prot) > keep:
            k, _ = self.prot.popitem(last=False)
            self.prob[k] = None

    def touch(self, hits, reads, cap):
        keep = _f32_floor(self.share, cap)
        self._spill(keep)
        for h in hits:
            if h in self.prot:
                self.prot.move_to_end(h)
            else:
                self.prob.pop(h)
                self.prot[h] = None
                self._spill(keep)

    def miss(self, b, cap):
        if cap == 0:
            return
        if len(self.prob) + len(self.prot) >= cap:
            (self.prob if self.prob else self.prot).popitem(last=False)
        self.prob[b] = None

    def resident(self):
        return set(self.prob) | set(self.prot)


class LfuRef(Reference):
    def __init__(self, period: int = 16):
        self.period = period
        self.res = OrderedDict()
        self.count: dict[int, float] = {}

    def _age(self, valid, t):
        self.count = {b: c for b, c in self.count.items() if b in valid}
        if t > 0 and t % self.period == 0:
            self.count = {b: 0.5 * c for b, c in self.count.items()}

    def sync(self, resident, valid, t, cap):
        self._sync_lists([self.res], [], self.res, resident, valid)
        self._age(valid, t)

    def touch(self, hits, reads, cap):
        for r in reads:
            self.count[r] = self.count.get(r, 0.0) + 1.0
        for h in hits:
            self.res.move_to_end(h)

    def _least(self, d: OrderedDict):
        low = min(self.count.get(b, 0.0) for b in d)
        return next(b for b in d if self.count.get(b, 0.0) == low)  # least recent of them

    def miss(self, b, cap):
        if cap == 0:
            return
        if len(self.res) >= cap:
            del self.res[self._least(self.res)]
        self.res[b] = None

    def resident(self):
        return set(self.res)


class TinyLfuRef(LfuRef):
    """W-TinyLFU: an LRU window, TinyLFU's filter, an SLRU main cache (Caffeine's design),
    with exact counts halved every `period` steps."""

    def __init__(self, window: float = 0.01, protected: float = 0.8, period: int = 16):
        super().__init__(period)
        self.share_w, self.share_p = window, protected
        self.win, self.prob, self.prot = OrderedDict(), OrderedDict(), OrderedDict()

    def _w(self, cap: int) -> int:
        w = int(np.round(np.float32(self.share_w) * np.float32(cap)))
        return min(max(w, 1), cap)

    def sync(self, resident, valid, t, cap):
        lists = [self.win, self.prob, self.prot]
        self._sync_lists(lists, [], self.win, resident, valid)
        self._age(valid, t)
        while len(self.win) > self._w(cap):
            k, _ = self.win.popitem(last=False)
            self.prob[k] = None

    def touch(self, hits, reads, cap):
        for r in reads:
            self.count[r] = self.count.get(r, 0.0) + 1.0
        keep = _f32_floor(self.share_p, cap - self._w(cap))

        def spill():
            while len(self.prot) > keep:
                k, _ = self.prot.popitem(last=False)
                self.prob[k] = None

        spill()
        for h in hits:
            if h in self.win:
                self.win.move_to_end(h)
            elif h in self.prot:
                self.prot.move_to_end(h)
            else:
                self.prob.pop(h)
                self.prot[h] = None
                spill()

    def miss(self, b, cap):
        if cap == 0:
            return
        self.win[b] = None
        total = len(self.win) + len(self.prob) + len(self.prot)
        victim = next(iter(self.prob), None)
        if victim is None:
            victim = next(iter(self.prot), None)
        if len(self.win) > self._w(cap):
            cand = next(iter(self.win))
            if total <= cap:
                self.win.pop(cand)
                self.prob[cand] = None
            elif victim is not None and self.count.get(cand, 0.0) > self.count.get(victim, 0.0):
                (self.prob if victim in self.prob else self.prot).pop(victim)
                self.win.pop(cand)
                self.prob[cand] = None
            else:
                self.win.pop(cand)
        elif total > cap and victim is not None:
            (self.prob if victim in self.prob else self.prot).pop(victim)

    def resident(self):
        return set(self.win) | set(self.prob) | set(self.prot)


class BeladyRef:
    """MIN with bypass for one row: keep the `cap` blocks read soonest after this step among
    the residents and the step's misses (never a block not read again)."""

    def step(self, resident, valid, reads, room, next_use: dict, t: int) -> set:
        cap = len(resident) + max(room, 0)
        misses = {b for b in reads if b in valid and b not in resident}
        pool = set(resident) | {b for b in misses if next_use.get(b, math.inf) < math.inf}
        order = sorted(pool, key=lambda b: (next_use.get(b, math.inf), b))
        return set(order[:cap])


REFERENCES = {"lru": LruRef, "arc": ArcRef, "slru": SlruRef, "lfu": LfuRef, "tinylfu": TinyLfuRef}
