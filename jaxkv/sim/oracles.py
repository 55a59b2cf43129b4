"""The oracles: policies and policy parts that read the true future (obs.forecast), for the
simulator only.

Policies: `Page` (the paper's Quest-like baseline, one-step lookahead), `PaperSA` (the paper's
SA-guided heuristic) and `Unlimited` (the Unlimited-HBM bound, not a placement).
Forecasters for `jaxkv.placement.policies.Anneal`: `Oracle` (the true future reads) and `Visits`
(the true reads of the visits in progress only: what an online forecaster that knows how long a
visit lasts, but not when one starts, could do).
Terminal values for `Anneal.values`, chained in order (each gets the value so far):
`BeladyTail` (a resident block needed again later is worth its next read), `Dual` (the LP
dual's value-to-go, `jaxkv.sim.lp.bound`) and `Overflow` (where the first step overflows the
pool or is link-bound, every block is worth all its later reads).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.config import check_number
from jaxkv.cost import CostModel
from jaxkv.placement import presets, registry
from jaxkv.placement import statistics as imp
from jaxkv.placement.forecasts import Forecast, require_forecast
from jaxkv.placement.policies import Observation, PolicyBase, top_capacity
from jaxkv.placement.registry import Modifier, knobs_of


def oracle_forecast(future_reads, window=None):
    """The true reads as a forecast: [Wmax, layers, N] float32 of future_reads [Wmax, layers, N]
    bool, rows >= window zeroed (None = all)."""
    a = future_reads.astype(jnp.float32)
    if window is None:
        return a
    return a * (jnp.arange(a.shape[0]) < window)[:, None, None]


def visits_forecast(future_reads, last_read, step):
    """The true future reads of the visits in progress: [W, layers, N] float32.

    A visit is a run of consecutive steps that read a block. Row j keeps block i's read at step
    `step` + j when i was read at `step` - 1 and at every step from `step` to `step` + j, and
    drops every read of a visit that starts at or after `step`.

    Args:
      future_reads: [W, layers, N] bool or 0/1 float, reads of steps `step` .. `step` + W - 1.
      last_read: [layers, N] int32 (`Stats.last_read`); step: [] int32.
    """
    f = (future_reads > 0).astype(jnp.float32)
    going = imp.read_last_step(last_read, step).astype(jnp.float32)
    return jnp.cumprod(f, axis=0) * going[None]


# ------------------------------------------------------------------------------ forecasters


@dataclasses.dataclass(frozen=True)
class Oracle:
    """The true future reads (obs.forecast), masked to the valid blocks."""

    name = "oracle"
    oracle = True
    knows_now = True
    needs_forecast = True

    def init(self, num_layers: int, num_blocks: int):
        return ()

    def _reads(self, obs: Observation, steps: int):
        require_forecast(self.name, obs)
        reads = obs.forecast * obs.valid[None]
        return jnp.pad(reads, ((0, max(steps - reads.shape[0], 0)), (0, 0), (0, 0)))

    def update(self, state, obs: Observation, env: CostModel, steps: int):
        return state, Forecast(self._reads(obs, steps)[:steps])


@dataclasses.dataclass(frozen=True)
class Visits(Oracle):
    """The oracle cut to the visits in progress (`visits_forecast`); the true count of the other
    reads that fall on host is charged to the link as a load no placement changes, and the
    terminal values see the visits only."""

    name = "visits"

    def update(self, state, obs: Observation, env: CostModel, steps: int):
        reads = self._reads(obs, steps)
        going = visits_forecast(reads, obs.last_read, obs.step)
        host = (~obs.in_hbm & obs.valid).astype(jnp.float32)
        unplaced = env.block_bytes * jnp.sum((reads - going)[:steps] * host, -1).T
        return state, Forecast(going[:steps], unplaced=unplaced, future=going)


# ------------------------------------------------------------------------- terminal values


def _future(obs: Observation, fc: Forecast):
    return obs.forecast if fc.future is None else fc.future


def _full(obs: Observation):
    """[layers, 1] bool: the pool cannot hold every valid block."""
    return jnp.sum(obs.valid, axis=-1, keepdims=True) > obs.capacity


def _check_oracle(part, policy) -> None:
    if not policy.forecast.oracle:
        raise ValueError(
            f"{type(part).__name__} values blocks from the true future: it needs an oracle "
            f"forecast (Oracle or Visits), got {policy.forecast!r}"
        )


@dataclasses.dataclass(frozen=True)
class BeladyTail:
    """The `steps` steps after the window give the plan a terminal value: a block resident in
    HBM whose next read falls at window step W + k costs, if the plan demotes it, value x
    decay^k x one block's link transfer. So a full pool evicts the blocks needed latest,
    Belady's rule. Only resident blocks get it (valuing host blocks buys prefetches for reads
    beyond the window), and only in layers whose pool cannot hold every block. The simulator's
    anneal-oracle uses 30 steps."""

    steps: int = 30
    value: float = 0.1
    decay: float = 0.9

    def __post_init__(self):
        check_number("BeladyTail steps", self.steps, integer=True, low=1)
        check_number("BeladyTail value", self.value, low=0.0)
        check_number("BeladyTail decay", self.decay, low=0.0, high=1.0, low_open=True)

    def check(self, policy) -> None:
        _check_oracle(self, policy)

    def __call__(self, value, obs: Observation, env: CostModel, fc: Forecast, h: int):
        f = _future(obs, fc)[h : h + self.steps] > 0  # [steps, layers, N]
        if f.shape[0] == 0:
            return None
        k = jnp.arange(f.shape[0], dtype=jnp.float32)[:, None, None]
        first = jnp.min(jnp.where(f, k, jnp.inf), axis=0)  # steps after the window to the read
        resident = obs.valid & obs.in_hbm & _full(obs)
        return jnp.where(resident, self.value * env.link_seconds * self.decay**first, 0.0)


@dataclasses.dataclass(frozen=True)
class Dual:
    """Every block's terminal value is obs.value_to_go at the window's last step
    (`jaxkv.sim.lp.dual.dual_values`: the block's cost after the window on host over in HBM,
    from the LP relaxation of the whole run priced by its Lagrangian dual), in place of the
    value so far. Needs the Oracle forecast and a fixed window."""

    needs_values = True

    def check(self, policy) -> None:
        if not isinstance(policy.forecast, Oracle) or isinstance(policy.forecast, Visits):
            raise ValueError(
                "Dual values blocks from the LP dual of the true future: it needs the Oracle "
                f"forecast, got {policy.forecast!r}"
            )
        if policy.adaptive is not None:
            raise ValueError("Dual needs a fixed window: got an adaptive one")

    def __call__(self, value, obs: Observation, env: CostModel, fc: Forecast, h: int):
        if obs.value_to_go is None or obs.value_to_go.shape[0] < h:
            got = None if obs.value_to_go is None else tuple(obs.value_to_go.shape)
            raise ValueError(
                f"the Dual terminal value needs obs.value_to_go of shape [>= {h}, layers, N] "
                f"(`jaxkv.sim.lp.dual.dual_values`); got {got}"
            )
        return jnp.where(obs.valid, obs.value_to_go[h - 1], 0.0)


@dataclasses.dataclass(frozen=True)
class Overflow:
    """In a layer whose pool the window's first step overflows (it reads more blocks than the
    pool holds), or whose first step the current placement leaves link-bound by `link_ratio`
    (its host reads take that many times as long as its HBM side; the pool cannot hold every
    block), every block that step reads and every resident block is worth value x sum_k decay^k
    x [read at window step W + k] link transfers over the next `steps` steps: its reads after
    the window, not only the next one. Elsewhere the value so far stands."""

    steps: int = 30
    value: float = 0.03
    decay: float = 0.9
    link_ratio: float = 1.2

    def __post_init__(self):
        check_number("Overflow steps", self.steps, integer=True, low=1)
        check_number("Overflow value", self.value, low=0.0)
        check_number("Overflow decay", self.decay, low=0.0, high=1.0, low_open=True)
        check_number("Overflow link_ratio", self.link_ratio, low=0.0, low_open=True)

    def check(self, policy) -> None:
        _check_oracle(self, policy)

    def __call__(self, value, obs: Observation, env: CostModel, fc: Forecast, h: int):
        fut = _future(obs, fc)
        f = fut[h : h + self.steps] > 0
        if not self.value or f.shape[0] == 0:
            return value
        k = jnp.arange(f.shape[0], dtype=jnp.float32)[:, None, None]
        full = _full(obs)
        resident = obs.valid & obs.in_hbm & full
        now = obs.valid & (fut[0] > 0)
        over = jnp.sum(now, axis=-1, keepdims=True) > obs.capacity  # [layers, 1]
        b, prof = env.block_bytes, env.priced_profile
        link0 = b * jnp.sum(now & ~obs.in_hbm, -1) / prof.link_bandwidth
        hbm0 = (env.fixed_bytes + b * jnp.sum(now & obs.in_hbm, -1)) / prof.hbm_bandwidth
        over = over | ((link0 > self.link_ratio * hbm0)[:, None] & full)
        reads = jnp.sum(jnp.where(f, self.decay**k, 0.0), axis=0)
        whole = jnp.where(resident | now, self.value * env.link_seconds * reads, 0.0)
        prev = jnp.zeros_like(whole) if value is None else value
        return jnp.where(over, whole, prev)


# -------------------------------------------------------------------------------- policies


def _pages(x, g: int, reduce):
    """[layers, N] -> [layers, ceil(N / g)] by `reduce` over groups of g blocks (zero padded)."""
    n = x.shape[-1]
    pad = -n % g
    xp = jnp.pad(x, ((0, 0), (0, pad)))
    return reduce(xp.reshape(x.shape[0], -1, g), axis=-1)


def _unpage(p, g: int, n: int):
    """[layers, P] -> [layers, N]: each page's value on its blocks."""
    return jnp.repeat(p, g, axis=-1)[:, :n]


@dataclasses.dataclass(frozen=True)
class Page(PolicyBase):
    """The paper's Quest-like baseline: pages of `page_blocks` blocks (16 tokens), perfect
    one-step lookahead, re-planned every step: the pages the next step reads go to HBM (promoted
    as that step reads them), then resident pages ranked by that step's attention mass
    (`obs.forecast_mass`; by recency without it); a page the step does not read is never
    promoted. Needs `obs.forecast` (the true reads of the next step, row 0)."""

    name: str = "page"
    page_blocks: int = 1
    window: int = 1
    needs_forecast = True

    def plan(self, state, obs: Observation, env: CostModel | None = None):
        require_forecast(self.name, obs)
        g, n = self.page_blocks, obs.valid.shape[-1]
        nxt = _pages(obs.forecast[0] * obs.valid, g, jnp.sum) > 0
        res = _pages(obs.in_hbm.astype(jnp.float32), g, jnp.mean)
        if obs.forecast_mass is not None:
            heat = _pages(obs.forecast_mass[0] * obs.valid, g, jnp.sum)
        else:
            heat = _pages(obs.last_read.astype(jnp.float32), g, jnp.max)
        heat = heat / (1.0 + jnp.max(heat, axis=-1, keepdims=True))
        score = jnp.where(nxt, 4.0, 0.0) + 2.0 * res + heat
        any_valid = _pages(obs.valid, g, jnp.any) & (nxt | (res > 0))
        pages = top_capacity(score, any_valid, obs.capacity // g)
        return state, _unpage(pages, g, n) & obs.valid


@dataclasses.dataclass(frozen=True)
class PaperSA(PolicyBase):
    """The paper's SA-guided heuristic with perfect future knowledge.

    Every `window` steps: score each block by sum over the next `lookahead` steps of
    read / offset; promote the top `fraction` (R) of the host blocks that will be read, evict HBM
    blocks not read within the lookahead; when HBM is short, the highest scores win. The paper
    tunes (W, R) by annealing over whole runs with perfect knowledge; the simulator tunes them
    by exhaustive search over a small grid (`jaxkv.sim.simulate.PAPER_SA_GRID`).
    """

    name: str = "paper-sa"
    lookahead: int = 10
    fraction: float = 0.5
    window: int = 1
    needs_forecast = True

    @property
    def horizon(self) -> int:
        return self.lookahead

    def plan(self, state, obs: Observation, env: CostModel | None = None):
        require_forecast(self.name, obs)
        f = obs.forecast[: self.lookahead]
        offset = jnp.arange(1, f.shape[0] + 1, dtype=jnp.float32)[:, None, None]
        score = jnp.sum(f / offset, axis=0) * obs.valid  # [layers, N]
        read_soon = score > 0
        cand = read_soon & ~obs.in_hbm & obs.valid
        ncand = jnp.sum(cand, axis=-1, keepdims=True)
        rank = jnp.argsort(jnp.argsort(jnp.where(cand, -score, jnp.inf), axis=-1), axis=-1)
        promote = cand & (rank < jnp.ceil(self.fraction * ncand))
        keep = obs.in_hbm & read_soon & obs.valid
        # keep every resident block read soon, then the promotions by score, within capacity
        pri = jnp.where(keep, 1e6 + score, jnp.where(promote, score, -jnp.inf))
        return state, top_capacity(pri, keep | promote, obs.capacity)


@dataclasses.dataclass(frozen=True)
class Unlimited(PolicyBase):
    """The Unlimited-HBM bound. It is not a placement: the simulator computes it with
    `jaxkv.cost.unlimited_step_time`; planning with it raises ValueError."""

    name: str = "unlimited"

    def plan(self, state, obs: Observation, env: CostModel | None = None):
        raise ValueError(
            "policy 'unlimited' is a bound computed by jaxkv.cost.unlimited_step_time, not a "
            "placement: expected a placing policy, e.g. 'anneal+reuse+follow' in the decode "
            "loop (the simulator reports unlimited as a bound)"
        )


# ---------------------------------------------------------------------------- registration


def _build_page(name, env, s, mods, args, overrides):
    g = overrides.pop("page_blocks", None) or s.page_blocks or max(1, 16 // env.block_size)
    return Page(page_blocks=g, **overrides)


def _paper_sa_args(name: str, args: str) -> tuple[int, float]:
    try:
        w, r = args.split(",")
        return int(w), float(r)
    except ValueError:
        raise ValueError(
            f"policy {name!r}: expected paper-sa[W,R], W an integer lookahead, R a fraction"
        ) from None


def _build_paper_sa(name, env, s, mods, args, overrides):
    if args is None:
        return PaperSA(**overrides)
    w, r = _paper_sa_args(name, args)
    return PaperSA(name=name, lookahead=w, fraction=r, window=1, **overrides)


def _check_paper_sa(name, mods):
    if "[" in name:
        _paper_sa_args(name, name[name.index("[") + 1 : -1])


# anneal-oracle's modifiers: +aw and +ec as anneal's, +visits and +dual its own
ORACLE_MODIFIERS = {
    "aw": presets.MODIFIERS["aw"],
    "ec": presets.MODIFIERS["ec"],
    "visits": Modifier("the oracle cut to the visits in progress", dict(forecast="visits")),
    "dual": Modifier("the LP dual's value-to-go as terminal value", dict(dual=True)),
}


def _build_anneal_oracle(name, env, s, mods, args, overrides):
    w = s.dual_window if "dual" in mods else s.oracle_window
    base = dict(forecast="oracle", window=w, discount=s.oracle_discount, interval=s.interval)
    base["tail"] = s.oracle_tail
    knobs = presets.anneal_knobs(name, mods, s, ORACLE_MODIFIERS, base)
    return presets.anneal_policy(**{**knobs, **overrides})


def _check_anneal_oracle(name, mods):
    if "dual" in mods and {"visits", "aw"} & set(mods):
        raise ValueError(
            f"policy {name!r}: +dual values blocks from the LP dual of the true future, for "
            "anneal-oracle only, without +visits or +aw"
        )


_TAIL, _OVERFLOW = BeladyTail(), Overflow()
# the knobs the oracles' parts add to `presets.anneal_policy`, their defaults read from the parts
ORACLE_KNOBS = dict(
    tail=0,
    tail_value=_TAIL.value,
    tail_decay=_TAIL.decay,
    overflow_value=_OVERFLOW.value,
    overflow_link_ratio=_OVERFLOW.link_ratio,
    dual=False,
)


def _check_oracle_knobs(k: dict) -> None:
    check_number("Anneal tail", k["tail"], integer=True, low=0)
    # the tail's knobs are checked even when the tail is off, as a typo should not hide
    check_number("Anneal tail_value", k["tail_value"], low=0.0)
    check_number("Anneal tail_decay", k["tail_decay"], low=0.0, high=1.0, low_open=True)
    check_number("Anneal overflow_value", k["overflow_value"], low=0.0)
    check_number("Anneal overflow_link_ratio", k["overflow_link_ratio"], low=0.0, low_open=True)


def _oracle_values(k: dict) -> list:
    values = []
    if k["tail"]:
        values.append(BeladyTail(k["tail"], k["tail_value"], k["tail_decay"]))
    if k["dual"]:
        values.append(Dual())
    if k["tail"] and k["overflow_value"]:
        values.append(
            Overflow(k["tail"], k["overflow_value"], k["tail_decay"], k["overflow_link_ratio"])
        )
    return values


presets.register_forecast("oracle", lambda k: Oracle())
presets.register_forecast("visits", lambda k: Visits())
presets.extend_knobs("oracles", ORACLE_KNOBS, _check_oracle_knobs, _oracle_values)
registry.register(
    "page",
    kind="oracle",
    doc="the paper's Quest-like baseline, one-step lookahead",
    build=_build_page,
    knobs=dict(page_blocks=None),
)
registry.register(
    "paper-sa",
    kind="oracle",
    doc="the paper's SA-guided heuristic with the future known; paper-sa[W,R] fixes its knobs",
    build=_build_paper_sa,
    knobs=knobs_of(PaperSA),
    check=_check_paper_sa,
    args="W,R: lookahead steps and promoted fraction",
)
registry.register(
    "anneal-oracle",
    kind="oracle",
    doc="simulated annealing with the true future as its forecast",
    build=_build_anneal_oracle,
    modifiers=ORACLE_MODIFIERS,
    knobs=lambda: {k: v for k, v in presets.all_knobs().items() if k != "name"},
    check=_check_anneal_oracle,
)
registry.register(
    "unlimited",
    kind="bound",
    doc="the Unlimited-HBM bound (every read split ideally between the tiers; not a placement)",
    build=lambda name, env, s, mods, args, overrides: Unlimited(**overrides),
)
