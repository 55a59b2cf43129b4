"""Named placement presets: every policy name, resolved in one place for the decode loop, the
simulator and the command line.

A name is a base with optional modifiers, e.g. "anneal+reuse+follow":
  static, lru (reactive)     online; `jaxkv.placement.policies.Static`, `Reactive`
  lrfu                       online, the live policy; `jaxkv.placement.policies.Lrfu` (a per-step
                             rule)
  anneal                     online; `jaxkv.placement.policies.Anneal` with the EMA forecast
  page, paper-sa, paper-sa[W,R], anneal-oracle, unlimited
                             oracles and the bound: simulator only (`jaxkv.sim.oracles`)
Modifiers (`MODIFIERS`) switch parts of an anneal policy on: +reuse (the re-read law, with the
reads it cannot place charged to the link), +now (the plan knows its step's reads), +follow (a
target planned between steps, followed by a per-step rule), +aw (the seed's adaptive window),
+ec (forecast-error compensation); for anneal-oracle +visits and +dual.

`resolve(name, env, settings, **overrides)` builds the policy: `env` is the cost model the plan
is priced in, `settings` the knobs a caller sets for every preset (each preset takes what
applies to it: the simulator gives the oracles their own W), and `overrides` set knobs of one
policy by their flat names (`KNOBS`: e.g. spread=1.0, budget=8, follow_admit="read"), mapped to
parts by `anneal_policy`. Resolving an online name never imports the research package.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from jaxkv.config import AnnealConfig, check_number
from jaxkv.cost import CostModel
from jaxkv.placement.forecasts import EMA, Now, Reuse
from jaxkv.placement.policies import Anneal, Follow, Lrfu, Policy, Reactive, Static
from jaxkv.placement.pricing import (
    AdaptiveWindow,
    Compensate,
    LinkReserve,
    Ride,
    Spread,
    Unforeseen,
)

# `+now`'s lookahead W (3 beat 10) and the `+now` / `+follow` presets' `Spread` (1.5 against 1.0
# and 2.0); measured: bench/RESULTS.md
NOW_WINDOW = 3
NOW_SPREAD = 1.5


@dataclasses.dataclass(frozen=True)
class Base:
    """A base name: whether a live decode can run it, which modifiers it takes, what it is."""

    online: bool
    modifiers: tuple[str, ...]
    doc: str


BASES: dict[str, Base] = {
    "static": Base(True, (), "fill HBM in write order, never migrate"),
    "lru": Base(True, (), "promote on read, evict the least recently used"),
    "reactive": Base(True, (), "the same as lru"),
    "lrfu": Base(
        True, (), "inside each step, promote a read block over a less often read one (live)"
    ),
    "anneal": Base(
        True, ("aw", "ec", "reuse", "now", "follow"), "simulated annealing, online forecast"
    ),
    "page": Base(False, (), "the paper's Quest-like baseline, one-step lookahead (oracle)"),
    "paper-sa": Base(False, (), "the paper's SA-guided heuristic (oracle); paper-sa[W,R]"),
    "anneal-oracle": Base(
        False, ("aw", "ec", "visits", "dual"), "simulated annealing, the true future (oracle)"
    ),
    "unlimited": Base(False, (), "the Unlimited-HBM bound (not a placement)"),
}

# modifier -> (what it does, the knobs it sets)
MODIFIERS: dict[str, tuple[str, dict]] = {
    "aw": ("the seed's adaptive window", dict(adaptive=True)),
    "ec": ("forecast-error compensation and rollback", dict(compensate=True)),
    # the re-read law learned online, with the reads it cannot place charged to the link in
    # place of the fixed link reserve
    "reuse": ("the re-read law", dict(forecast="reuse", unforeseen=True, link_reserve=0.0)),
    # the plan knows each step's reads, so a host block is promoted at its first read (ride 1),
    # and it prices the later steps at their expected time under the forecast's spread
    "now": ("the planned step's reads known", dict(now=True, ride=1.0, spread=NOW_SPREAD)),
    # the per-step rule promotes a target block at its first read: the same pricing
    "follow": ("a target followed per step", dict(follow=True, ride=1.0, spread=NOW_SPREAD)),
    "visits": ("the oracle cut to visits in progress", dict(forecast="visits")),
    "dual": ("the LP dual's value-to-go as terminal value", dict(dual=True)),
}

FORECASTS = ("ema", "reuse", "learned", "oracle", "visits")

# the flat knobs of `anneal_policy` and their defaults: the runtime parts' own defaults; the
# oracle parts' (BeladyTail, Overflow) live in jaxkv.sim.oracles, which this module must not
# import, so theirs are restated here (tests/test_policies.py checks they agree)
_A, _AW, _EC = Anneal(), AdaptiveWindow(), Compensate()
KNOBS: dict[str, Any] = dict(
    name=_A.name,
    forecast="ema",
    learned=None,
    now=False,
    window=_A.window,
    interval=_A.interval,
    discount=_A.discount,
    hysteresis=_A.hysteresis,
    budget=_A.budget,
    config=_A.config,
    seed=_A.seed,
    link_reserve=LinkReserve().share,
    unforeseen=False,
    ride=0.0,
    spread=0.0,
    tail=0,
    tail_value=0.1,  # BeladyTail().value
    tail_decay=0.9,  # BeladyTail().decay, Overflow().decay
    overflow_value=0.03,  # Overflow().value
    overflow_link_ratio=1.2,  # Overflow().link_ratio
    dual=False,
    adaptive=False,
    min_window=_AW.low,
    max_window=_AW.high,
    window_step=_AW.step,
    compensate=False,
    error_threshold=_EC.threshold,
    rollback=_EC.rollback,
    follow=False,
    follow_admit=Follow().admit,
)


# `Lrfu`'s fields a caller may set (`resolve`'s overrides)
LRFU_KNOBS = ("prompt_prior", "steady_queries", "lookahead")


def split_policies(text: str, label: str = "--policies") -> list[str]:
    """The policy names of a comma-separated list, split at top-level commas only, so
    "static,paper-sa[10,0.5]" is two names, each stripped of spaces; [] for a list of blanks
    only (the caller says what it expected). Raises ValueError naming `label` on unbalanced
    brackets and on an empty item ("static,,lru": a name left out or a stray comma). The names
    themselves are checked by `split_name`."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            break
        if ch == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"{label}={text!r}: unbalanced brackets (expected e.g. paper-sa[10,0.5])")
    names.append(text[start:])
    names = [n.strip() for n in names]
    if not any(names):
        return []
    if not all(names):
        i = names.index("")
        raise ValueError(
            f"{label}={text!r}: item {i + 1} of {len(names)} is empty (two commas in a row, or "
            "one at an end): expected comma-separated policy names, e.g. static,lru"
        )
    return names


def split_name(name: str) -> tuple[str, tuple[str, ...]]:
    """(base, modifiers) of a policy name such as "anneal+reuse+now", validated. Raises
    ValueError naming the valid choices."""
    if not isinstance(name, str):
        raise ValueError(f"policy name must be a string, got {name!r}")
    base, *mods = name.split("+")
    if base.startswith("paper-sa[") and base.endswith("]") and not mods:
        _paper_sa_knobs(base)
        return "paper-sa", ()
    hint = "(anneal takes +aw, +ec, +reuse, +now, +follow; anneal-oracle +aw, +ec, +visits, +dual)"
    if base not in BASES:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(BASES)} {hint}")
    allowed = BASES[base].modifiers
    if mods and not allowed:
        raise ValueError(
            f"policy {name!r}: modifiers (+{', +'.join(mods)}) apply to anneal and "
            f"anneal-oracle only, not {base!r} {hint}"
        )
    twice = sorted({m for m in mods if mods.count(m) > 1})
    if twice:
        raise ValueError(
            f"policy {name!r}: +{twice[0]} is given {mods.count(twice[0])} times: expected each "
            "modifier once"
        )
    bad = [m for m in mods if m not in MODIFIERS]
    if bad:
        known = [repr(m) for m in MODIFIERS]
        raise ValueError(
            f"policy {name!r}: unknown modifier {bad[0]!r}; expected "
            f"{', '.join(known[:-1])} or {known[-1]}"
        )
    if {"now", "follow"} <= set(mods):
        raise ValueError(
            f"policy {name!r}: +now plans each step, +follow plans a target between steps and "
            "follows it: choose one"
        )
    for m in ("reuse", "now", "follow"):
        if m in mods and base != "anneal":
            raise ValueError(f"policy {name!r}: +{m} refines the online forecast, for anneal only")
    if "visits" in mods and base != "anneal-oracle":
        raise ValueError(f"policy {name!r}: +visits cuts the oracle, for anneal-oracle only")
    if "dual" in mods and (base != "anneal-oracle" or {"visits", "aw"} & set(mods)):
        raise ValueError(
            f"policy {name!r}: +dual values blocks from the LP dual of the true future, for "
            "anneal-oracle only, without +visits or +aw"
        )
    return base, tuple(mods)


POLICY_ATTRIBUTES = (
    "name",
    "horizon",
    "needs_forecast",
    "needs_values",
    "follow",
    "budget",
    "adapts_window",
)
POLICY_METHODS = ("init", "plan", "next_window")


def check_policy(policy, label: str = "policy") -> Policy:
    """Returns `policy`, a policy object given where a preset name is accepted, after checking
    it has what the decode loop and the simulator use (`jaxkv.placement.policies.Policy`: its
    attributes and methods, `name` a non-empty string) and is hashable (they compile for it).
    TypeError naming `label`, the object's type and what it lacks."""
    kind = type(policy).__name__
    what = f"{label}: {'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind}"
    lacks = [a for a in POLICY_ATTRIBUTES if not hasattr(policy, a)]
    lacks += [m for m in POLICY_METHODS if not callable(getattr(policy, m, None))]
    if lacks:
        raise TypeError(
            f"{what} is neither a policy name nor a policy: it lacks {', '.join(lacks)}; "
            "expected a preset name (jaxkv.placement.presets) or a "
            "jaxkv.placement.policies.Policy, e.g. "
            "policies.Anneal(...)"
        )
    if not isinstance(policy.name, str) or not policy.name:
        raise TypeError(f"{what} has name={policy.name!r}: expected a non-empty string")
    try:
        hash(policy)
    except TypeError:
        raise TypeError(
            f"{what} (policy {policy.name!r}) is not hashable: the decode loop and the "
            "simulator compile for it; expected a frozen dataclass, as "
            "jaxkv.placement.policies' own"
        ) from None
    return policy


def is_online(name: str) -> bool:
    """The policy can run in a live decode (it needs no future reads); validates the name."""
    base, mods = split_name(name)
    return BASES[base].online and "now" not in mods


def names(online_only: bool = False) -> list[str]:
    """The base names (a live decode's when online_only)."""
    return [n for n, b in BASES.items() if b.online or not online_only]


def _paper_sa_knobs(name: str) -> tuple[int, float]:
    try:
        w, r = name[len("paper-sa[") : -1].split(",")
        return int(w), float(r)
    except ValueError:
        raise ValueError(
            f"policy {name!r}: expected paper-sa[W,R], W an integer lookahead, R a fraction"
        ) from None


@dataclasses.dataclass(frozen=True)
class Settings:
    """The knobs a caller sets for every preset; each takes what applies to it.

    window, interval, discount: the anneal presets' W, steps between plans (0: every W) and
      per-step discount. now_window: W of the +now presets. follow_window: W of the +follow
      presets (None: window); they plan every W steps (interval 0). follow_admit: their admit
      rule (None: `Follow`'s default). oracle_window, oracle_discount, oracle_tail: anneal-oracle's
      W, discount and the steps its terminal values look past the window (0: none);
      dual_window: W of anneal-oracle+dual. ride: every anneal preset's `Ride` share (None:
      the preset's own, 0 or 1). adaptive: the +aw bounds (None: W / 2 .. 2 W by W / 5, the
      seed's 20 .. 100 by 10 around W = 50). budget: blocks moved per layer per plan. config:
      the annealing schedule (None: AnnealConfig()). seed: the PRNG seed. page_blocks: Page's
      blocks per page (None: 16 tokens' worth).
    """

    window: int = 50
    interval: int = 0
    discount: float = 1.0
    now_window: int = NOW_WINDOW
    now_spread: float = NOW_SPREAD
    follow_window: int | None = None
    follow_admit: str | None = None
    oracle_window: int = 3
    oracle_discount: float = 0.4
    oracle_tail: int = 30
    dual_window: int = 2
    ride: float | None = None
    adaptive: AdaptiveWindow | None = None
    budget: int | None = None
    config: AnnealConfig | None = None
    seed: int = 0
    page_blocks: int | None = None


def _anneal_knobs(name: str, base: str, mods, s: Settings) -> dict:
    """The flat knobs of an anneal-family preset under `s`."""
    oracle = base == "anneal-oracle"
    kw = dict(name=name, seed=s.seed, budget=s.budget)
    if oracle:
        kw.update(forecast="oracle", window=s.dual_window if "dual" in mods else s.oracle_window)
        kw.update(discount=s.oracle_discount, interval=s.interval, tail=s.oracle_tail)
    elif "now" in mods:
        kw.update(window=s.now_window, interval=s.interval, discount=s.discount)
    elif "follow" in mods:
        kw.update(window=s.follow_window or s.window, interval=0, discount=s.discount)
    else:
        kw.update(window=s.window, interval=s.interval, discount=s.discount)
    for m in mods:
        kw.update(MODIFIERS[m][1])
    if "now" in mods:
        kw["spread"] = s.now_spread
    if s.ride is not None:
        kw["ride"] = float(s.ride)
    if "follow" in mods and s.follow_admit is not None:
        kw["follow_admit"] = s.follow_admit
    if "aw" in mods:
        w = kw["window"]
        a = s.adaptive or AdaptiveWindow(max(1, w // 2), 2 * w, max(1, w // 5))
        kw.update(min_window=a.low, max_window=a.high, window_step=a.step)
    if s.config is not None:
        kw["config"] = s.config
    return kw


def resolve(name: str, env: CostModel, settings: Settings = Settings(), **overrides) -> Policy:
    """The policy `name` under `settings`, with `overrides` (flat knobs, `KNOBS`) applied last;
    overrides apply to anneal presets only. Raises ValueError for a bad name or knob."""
    base, mods = split_name(name)
    if base == "lrfu" and set(overrides) <= set(LRFU_KNOBS):
        return Lrfu(**overrides)
    if overrides and not base.startswith("anneal"):
        raise ValueError(
            f"policy {name!r}: knob overrides {sorted(overrides)} apply to anneal presets "
            f"only (and lrfu's {', '.join(LRFU_KNOBS)})"
        )
    if base == "static":
        return Static()
    if base in ("lru", "reactive"):
        return Reactive()
    if base in ("page", "paper-sa", "unlimited"):
        oracles = importlib.import_module("jaxkv.sim.oracles")  # research code, on demand
        if base == "page":
            g = settings.page_blocks or max(1, 16 // env.block_size)
            return oracles.Page(page_blocks=g)
        if base == "unlimited":
            return oracles.Unlimited()
        if name == "paper-sa":
            return oracles.PaperSA()
        w, r = _paper_sa_knobs(name)
        return oracles.PaperSA(name=name, lookahead=w, fraction=r, window=1)
    return anneal_policy(**{**_anneal_knobs(name, base, mods, settings), **overrides})


def anneal_policy(**knobs) -> Anneal:
    """An `Anneal` composed from flat knobs (`KNOBS`, the names the presets, the command line
    and the benchmarks' sweeps use): the one place knobs become parts. Raises ValueError for an
    unknown knob or a combination the parts refuse."""
    bad = sorted(set(knobs) - set(KNOBS))
    if bad:
        raise ValueError(f"{bad} are not anneal knobs; expected some of {sorted(KNOBS)}")
    k = {**KNOBS, **knobs}
    if k["forecast"] not in FORECASTS:
        raise ValueError(f"Anneal forecast must be one of {FORECASTS}, got {k['forecast']!r}")
    check_number("Anneal tail", k["tail"], integer=True, low=0)
    # the tail's knobs are checked even when the tail is off, as a typo should not hide
    check_number("Anneal tail_value", k["tail_value"], low=0.0)
    check_number("Anneal tail_decay", k["tail_decay"], low=0.0, high=1.0, low_open=True)
    check_number("Anneal overflow_value", k["overflow_value"], low=0.0)
    check_number("Anneal overflow_link_ratio", k["overflow_link_ratio"], low=0.0, low_open=True)
    oracles = None
    if k["forecast"] in ("oracle", "visits") or k["tail"] or k["dual"]:
        oracles = importlib.import_module("jaxkv.sim.oracles")  # research code, on demand
    forecast = _forecaster(k, oracles)
    # each part checks its knob; a part at 0 adds nothing and is left out
    reserve, ride, spread = LinkReserve(k["link_reserve"]), Ride(k["ride"]), Spread(k["spread"])
    terms = [reserve] if reserve.share else []
    if k["unforeseen"]:
        terms.append(Unforeseen())
    terms += ([ride] if ride.share else []) + ([spread] if spread.k else [])
    values = []
    if k["tail"]:
        values.append(oracles.BeladyTail(k["tail"], k["tail_value"], k["tail_decay"]))
    if k["dual"]:
        values.append(oracles.Dual())
    if k["tail"] and k["overflow_value"]:
        values.append(
            oracles.Overflow(
                k["tail"], k["overflow_value"], k["tail_decay"], k["overflow_link_ratio"]
            )
        )
    adaptive = None
    if k["adaptive"]:
        adaptive = AdaptiveWindow(k["min_window"], k["max_window"], k["window_step"])
    compensate = Compensate(k["error_threshold"], k["rollback"]) if k["compensate"] else None
    return Anneal(
        name=k["name"],
        forecast=forecast,
        terms=tuple(terms),
        values=tuple(values),
        adaptive=adaptive,
        compensate=compensate,
        window=k["window"],
        interval=k["interval"],
        discount=k["discount"],
        hysteresis=k["hysteresis"],
        budget=k["budget"],
        config=k["config"],
        follow=Follow(k["follow_admit"]) if k["follow"] else None,
        seed=k["seed"],
    )


def _forecaster(k: dict, oracles):
    f = k["forecast"]
    if f == "learned":
        if k["learned"] is None:
            raise ValueError("Anneal forecast='learned' needs learned=(w_0, ..., w_5, b), got None")
        learned = importlib.import_module("jaxkv.sim.learned")  # research code, on demand
        forecast = learned.LearnedForecast(tuple(k["learned"]))
    elif f in ("oracle", "visits"):
        forecast = oracles.Oracle() if f == "oracle" else oracles.Visits()
    else:
        forecast = EMA() if f == "ema" else Reuse()
    if k["now"]:
        if f not in ("ema", "reuse"):
            raise ValueError(
                f"Anneal now=True refines an online forecast ('ema' or 'reuse'), got {f!r}"
            )
        forecast = Now(forecast)
    return forecast


# which kind each base is, for `describe`: the live policy README recommends, other online
# policies a decode can run, oracles (the simulator only: they read the future) and bounds
LIVE = "lrfu"
_ORACLE_KNOBS = ("tail", "tail_value", "tail_decay", "overflow_value", "overflow_link_ratio")
_ONLINE_ANNEAL_KNOBS = tuple(
    k for k in KNOBS if k not in ("name", "forecast", "learned", "now", "dual", *_ORACLE_KNOBS)
)


def describe() -> list[dict]:
    """Every base policy name, for people (`jaxkv policies`) and tools: a list of
    dict(name, kind, doc, knobs, modifiers), in `BASES` order.

    kind: "live" (the policy to use in a decode), "online" (a decode can run it), "oracle"
    (reads the future: the simulator only) or "bound" (not a placement). doc: one line. knobs:
    {knob: default} a caller may set (`resolve`'s overrides; paper-sa's W and R and page's
    blocks per page are written in the name or set through `Settings`). modifiers: {"+name":
    what it does} the base takes. Callers depend on these keys only, not on this module's
    tables, which may change."""
    lrfu = Lrfu()
    out = []
    for name, b in BASES.items():
        kind = "live" if name == LIVE else "online" if b.online else "oracle"
        knobs: dict[str, Any] = {}
        if name == "unlimited":
            kind = "bound"
        elif name == "lrfu":
            knobs = {k: getattr(lrfu, k) for k in LRFU_KNOBS}
        elif name == "anneal":
            knobs = {k: KNOBS[k] for k in _ONLINE_ANNEAL_KNOBS}
        elif name == "anneal-oracle":
            knobs = {k: KNOBS[k] for k in _ONLINE_ANNEAL_KNOBS + _ORACLE_KNOBS}
            knobs["tail"] = Settings().oracle_tail
        elif name == "paper-sa":
            knobs = {"W (paper-sa[W,R])": 10, "R (paper-sa[W,R])": 0.5}
        elif name == "page":
            knobs = {"page_blocks (Settings)": "16 tokens' worth"}
        out.append(
            dict(
                name=name,
                kind=kind,
                doc=b.doc,
                knobs=knobs,
                modifiers={f"+{m}": MODIFIERS[m][0] for m in b.modifiers},
            )
        )
    return out
