"""The policy names' front door for the decode loop, the simulator and the command line:
`resolve(name, env, settings, **knobs)` and the name checks delegate to
`jaxkv.placement.registry`, where every policy registers itself; `split_policies` reads a
command line's list; `check_policy` checks a policy object given where a name is accepted.
The anneal family's flat knobs (`anneal_policy`, `KNOBS`, `MODIFIERS`) live in
`jaxkv.placement.policies.anneal_knobs` and are importable from here too; `Settings` (the knobs a
caller sets for every preset) lives in the registry.
"""

from __future__ import annotations

from jaxkv.cost import CostModel
from jaxkv.placement import registry
from jaxkv.placement.policies import Policy
from jaxkv.placement.policies.anneal_knobs import (  # noqa: F401  (the anneal family's, here too)
    FORECASTS,
    KNOBS,
    MODIFIERS,
    NOW_SPREAD,
    NOW_WINDOW,
    Extension,
    all_knobs,
    anneal_knobs,
    anneal_policy,
    extend_knobs,
    register_forecast,
)
from jaxkv.placement.registry import Settings


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


# the names' front door: the registry's
split_name = registry.split_name
is_online = registry.is_online


def names(online_only: bool = False) -> list[str]:
    """The base names (a live decode's when online_only)."""
    return registry.names(registry.ONLINE_KINDS if online_only else None)


POLICY_ATTRIBUTES = (
    "name",
    "horizon",
    "needs_forecast",
    "needs_values",
    "rule",
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
            "expected a registered name (jaxkv.placement.registry) or a "
            "jaxkv.placement.policies.Policy, e.g. policies.Anneal(...)"
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


def resolve(name: str, env: CostModel, settings: Settings = Settings(), **overrides) -> Policy:
    """The policy `name` under `settings`, with `overrides` (its knobs: `KNOBS` for the anneal
    family, the class's fields for the others) applied last (`registry.resolve`). ValueError
    for a bad name or knob."""
    return registry.resolve(name, env, settings, **overrides)


def describe() -> list[dict]:
    """Every registered policy, for people (`jaxkv policies`) and tools: a list of dict(name,
    kind, doc, knobs, modifiers), the live policy first (`jaxkv.placement.registry.describe`).

    kind: "live" (the policy to use in a decode), "field" (the field's rules, in the step: the
    baselines), "online" (a decode can run it), "oracle" (reads the future: the simulators
    only) or "bound" (not a placement). doc: one line. knobs: {knob: default} a caller may set
    (`resolve`'s keyword overrides; a bracketed name's arguments, e.g. paper-sa[W,R], are
    named as "[W,R]"). modifiers: {"+name": what it does}. Callers depend on these keys only."""
    out = []
    for r in registry.describe():
        knobs = dict(r["knobs"])
        if r["args"]:
            knobs = {f"[{r['args'].split(':')[0]}]": r["args"].split(": ", 1)[-1], **knobs}
        out.append(
            dict(
                name=r["name"],
                kind=r["kind"],
                doc=r["doc"],
                knobs=knobs,
                modifiers={f"+{m}": d for m, d in r["modifiers"].items()},
            )
        )
    return out
