"""The anneal family's flat knobs: the names the presets, the command line and the benchmarks'
sweeps use, turned into `Anneal` parts in one place (`anneal_policy`), and the "anneal" name
with its modifiers, registered here (`jaxkv.placement.registry`).

"anneal" takes the modifiers (`MODIFIERS`) +reuse (the re-read law, with the reads it cannot
place charged to the link), +now (the plan knows its step's reads; simulator only), +follow (a
target planned between steps, followed by an in-step rule), +aw (the seed's adaptive window)
and +ec (forecast-error compensation). The simulator extends the knobs when `jaxkv.sim` is
imported (`register_forecast`, `extend_knobs`: the oracle and learned forecasts, the
Belady-tail, overflow and LP-dual terminal values, with their defaults read from their
classes) and registers anneal-oracle; this module never imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxkv.placement import registry
from jaxkv.placement.forecasts import EMA, Now, Reuse
from jaxkv.placement.policies.anneal import Anneal
from jaxkv.placement.policies.follow import Follow
from jaxkv.placement.pricing import (
    AdaptiveWindow,
    Compensate,
    LinkReserve,
    Ride,
    Spread,
    Unforeseen,
)
from jaxkv.placement.registry import Modifier, Settings

NOW_WINDOW = 3
NOW_SPREAD = 1.5

# anneal's modifiers -> (what it does, the knobs it sets); anneal-oracle's are the simulator's
MODIFIERS: dict[str, Modifier] = {
    "aw": Modifier("the seed's adaptive window", dict(adaptive=True)),
    "ec": Modifier("forecast-error compensation and rollback", dict(compensate=True)),
    # the re-read law learned online, with the reads it cannot place charged to the link in
    # place of the fixed link reserve
    "reuse": Modifier(
        "the re-read law learned online",
        dict(forecast="reuse", unforeseen=True, link_reserve=0.0),
    ),
    # the plan knows each step's reads, so a host block is promoted at its first read (ride 1),
    # and it prices the later steps at their expected time under the forecast's spread
    "now": Modifier(
        "the planned step's reads known (simulator only)",
        dict(now=True, ride=1.0, spread=NOW_SPREAD),
        offline=True,
    ),
    # the in-step rule promotes a target block at its first read: the same pricing
    "follow": Modifier(
        "a target planned between steps, followed inside them",
        dict(follow=True, ride=1.0, spread=NOW_SPREAD),
    ),
}

# the forecasters a knob names: the online ones here; the simulator adds its own
FORECASTS: dict[str, Callable[[dict], Any]] = {"ema": lambda k: EMA(), "reuse": lambda k: Reuse()}

# anneal's flat knobs and their defaults, the runtime parts' own
_A, _AW, _EC = Anneal(), AdaptiveWindow(), Compensate()
KNOBS: dict[str, Any] = dict(
    name=_A.name,
    forecast="ema",
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


@dataclasses.dataclass(frozen=True)
class Extension:
    """Knobs a research package adds to `anneal_policy` (`extend_knobs`): their defaults, a
    check of the merged knobs, the terminal values they add (`Anneal.values`), and whether an
    online policy may set them (a forecaster's parameters) or only an oracle (the oracles'
    terminal values)."""

    knobs: dict
    check: Callable[[dict], None]
    values: Callable[[dict], list]
    online: bool = False


_EXTENSIONS: dict[str, Extension] = {}


def register_forecast(name: str, build: Callable[[dict], Any]) -> None:
    """Makes `forecast=name` a knob value of `anneal_policy`: `build(knobs)` -> a forecaster."""
    FORECASTS[name] = build


def extend_knobs(owner: str, knobs: dict, check, values, online: bool = False) -> None:
    """Adds `knobs` (name -> default) to `anneal_policy` (`Extension`); `owner` names the
    extension (registering it again replaces it)."""
    _EXTENSIONS[owner] = Extension(dict(knobs), check, values, online)


def all_knobs(online_only: bool = False) -> dict[str, Any]:
    """`KNOBS` and every extension's (an online policy's only, with `online_only`), with their
    defaults."""
    out = dict(KNOBS)
    for ext in _EXTENSIONS.values():
        if ext.online or not online_only:
            out.update(ext.knobs)
    return out


def anneal_knobs(name: str, mods, s: Settings, modifiers: dict, base: dict) -> dict:
    """The flat knobs of an anneal-family name under `s`: `base` (its W, discount, ...), the
    modifiers' knobs (`modifiers`: name -> Modifier) and the settings every anneal preset
    takes (seed, budget, ride, follow_admit, the adaptive bounds, config)."""
    kw = dict(name=name, seed=s.seed, budget=s.budget, **base)
    for m in mods:
        kw.update(modifiers[m].knobs)
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


def _build_anneal(name, env, s: Settings, mods, args, overrides) -> Anneal:
    if "now" in mods:
        base = dict(window=s.now_window, interval=s.interval, discount=s.discount)
    elif "follow" in mods:
        base = dict(window=s.follow_window or s.window, interval=0, discount=s.discount)
    else:
        base = dict(window=s.window, interval=s.interval, discount=s.discount)
    return anneal_policy(**{**anneal_knobs(name, mods, s, MODIFIERS, base), **overrides})


def _check_anneal(name: str, mods) -> None:
    if {"now", "follow"} <= set(mods):
        raise ValueError(
            f"policy {name!r}: +now plans each step, +follow plans a target between steps and "
            "follows it: choose one"
        )


def anneal_policy(**knobs) -> Anneal:
    """An `Anneal` composed from flat knobs (`KNOBS` and the extensions', `all_knobs`): the one
    place knobs become parts. Raises ValueError for an unknown knob or a combination the parts
    refuse."""
    known = all_knobs()
    bad = sorted(set(knobs) - set(known))
    if bad:
        hint = ""
        if not _EXTENSIONS:
            hint = (
                " (the simulator's knobs, e.g. tail and dual, register when jaxkv.sim is imported)"
            )
        raise ValueError(f"{bad} are not anneal knobs; expected some of {sorted(known)}{hint}")
    k = {**known, **knobs}
    if k["forecast"] not in FORECASTS:
        raise ValueError(
            f"Anneal forecast must be one of {tuple(FORECASTS)}, got {k['forecast']!r}"
            + ("" if _EXTENSIONS else " (the simulator's register when jaxkv.sim is imported)")
        )
    for ext in _EXTENSIONS.values():
        ext.check(k)
    forecast = FORECASTS[k["forecast"]](k)
    if k["now"]:
        if k["forecast"] not in ("ema", "reuse"):
            raise ValueError(
                f"Anneal now=True refines an online forecast ('ema' or 'reuse'), got "
                f"{k['forecast']!r}"
            )
        forecast = Now(forecast)
    # each part checks its knob; a part at 0 adds nothing and is left out
    reserve, ride, spread = LinkReserve(k["link_reserve"]), Ride(k["ride"]), Spread(k["spread"])
    terms = [reserve] if reserve.share else []
    if k["unforeseen"]:
        terms.append(Unforeseen())
    terms += ([ride] if ride.share else []) + ([spread] if spread.k else [])
    values = []
    for ext in _EXTENSIONS.values():
        values += ext.values(k)
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


registry.register(
    "anneal",
    kind="online",
    doc="simulated annealing over block placements, planned every W steps (online forecast)",
    build=_build_anneal,
    modifiers=MODIFIERS,
    knobs=lambda: {k: v for k, v in all_knobs(online_only=True).items() if k != "name"},
    check=_check_anneal,
)
