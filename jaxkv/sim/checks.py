"""The checks `jaxkv.sim.simulate.simulate` runs on its arguments before any work, shared with
`jaxkv simulate` (`jaxkv.sim.cli`), which checks its options by the same bounds.

`ARG_BOUNDS` / `check_args`: the numeric arguments; `check_policies`: the policies (names or
policy objects, in a list or under labels); `check_policy_kwargs`: per-policy knob overrides;
`check_follow_admit`: the follow rule's admit; `load_policy`: a policy object the command line
names as module:attribute.
The memory check (`check_memory`, `available_memory`) lives in `jaxkv.sim.simulate`.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

from jaxkv.config import check_number
from jaxkv.placement import presets
from jaxkv.placement.policies import FOLLOW_ADMITS
from jaxkv.placement.presets import split_name

# The numeric arguments `simulate` checks: name -> `jaxkv.config.check_number` bounds (None is
# allowed where the argument's default is None). `jaxkv simulate` checks its options by them.
ARG_BOUNDS: dict[str, dict] = {
    "sparsity": dict(low=0.0, high=1.0, high_open=True),
    "batch": dict(integer=True, low=1),
    "hbm_budget": dict(low=0.0, low_open=True),
    "capacity_blocks": dict(integer=True, low=0),
    "hbm_fraction": dict(low=0.0, high=1.0, low_open=True),
    "chunk": dict(integer=True, low=1),
    "demote_cost": dict(low=0.0),
    "window": dict(integer=True, low=1),
    "interval": dict(integer=True, low=1),
    "discount": dict(low=0.0, high=1.0, low_open=True),
    "now_window": dict(integer=True, low=1),
    "now_spread": dict(low=0.0),
    "oracle_window": dict(integer=True, low=1),
    "oracle_discount": dict(low=0.0, high=1.0, low_open=True),
    "oracle_tail": dict(integer=True, low=0),
    "dual_window": dict(integer=True, low=1),
    "follow_window": dict(integer=True, low=1),
    "ride": dict(low=0.0, high=1.0),
    "steps": dict(integer=True, low=1),
    "seed": dict(integer=True, low=0, high=2**32 - 1),  # a uint32: synthetic traces hash it
}


def check_args(values: dict, label=lambda name: name) -> None:
    """Checks the `simulate` arguments in `values` (name -> value; None passes) against
    ARG_BOUNDS; errors name each by `label(name)` (the CLI passes its option names)."""
    for name, bounds in ARG_BOUNDS.items():
        if values.get(name) is not None:
            check_number(label(name), values[name], **bounds)


def check_policies(policies, label: str = "policies") -> dict:
    """Checks `simulate`'s policies before any work and returns them as {label: a preset name
    or a policy object}. `policies` is a list whose items are preset names (see
    `jaxkv.sim.simulate`'s module docstring) or policy objects (`jaxkv.placement.policies.Policy`,
    e.g. a composed `Anneal`: labelled by their `name`), or a dict {label: name or policy} (two
    variants of one preset side by side). "paper-sa" (its grid) and "unlimited" (the bound)
    are labelled by their own names only. ValueError / TypeError names the bad entry and
    what is expected."""
    example = "e.g. ['static', 'lru-plan', 'anneal', 'unlimited'] or {'mine': policies.Anneal(...)}"
    if isinstance(policies, str) or not isinstance(policies, list | tuple | dict) or not policies:
        raise ValueError(f"{label}={policies!r}: expected a non-empty list of policies, {example}")
    if isinstance(policies, dict):
        items = list(policies.items())
        for key, _ in items:
            if not isinstance(key, str) or not key:
                raise ValueError(f"{label}: key {key!r}: expected a non-empty str label")
    else:
        items = [(p if isinstance(p, str) else _name(p, label), p) for p in policies]
    out = {}
    for key, spec in items:
        where = f"{label}[{key!r}]" if isinstance(policies, dict) else label
        if isinstance(spec, str):
            _check_name(spec, where)
            if key != spec and (spec == "unlimited" or spec == "paper-sa"):
                raise ValueError(
                    f"{where}: {spec!r} is reported under its own name only (expected "
                    f"{{{spec!r}: {spec!r}}}, or a tuned pair 'paper-sa[W,R]' under any label)"
                )
        else:
            presets.check_policy(spec, where)
        if key in ("unlimited", "paper-sa") and spec != key:
            raise ValueError(
                f"{where}: the label {key!r} is the preset's own (its bound or its tuned grid): "
                f"expected the name {key!r} there, or another label"
            )
        if key in out:
            raise ValueError(
                f"{label}: two policies are labelled {key!r}: expected distinct labels (a dict "
                "{label: policy}, or distinct names: Anneal(name=...))"
            )
        out[key] = spec
    return out


def _name(policy, label: str) -> str:
    """A policy object's label in a list: its name (checked)."""
    return presets.check_policy(policy, label).name


def _check_name(n: str, label: str) -> None:
    """ValueError naming `label` unless `n` is a preset name (paper-sa[W,R] included)."""
    if n.startswith("paper-sa["):
        w, r, *rest = (n[len("paper-sa[") : -1] + ",,").split(",")
        try:
            ok = n.endswith("]") and not any(rest) and int(w) >= 1 and 0 < float(r) <= 1
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"{label}: policy {n!r}: expected paper-sa[W,R], W an integer lookahead "
                ">= 1 and R a fraction in (0, 1], e.g. paper-sa[10,0.5]"
            )
        return
    try:
        split_name(n)
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None


def load_policy(spec: str, label: str = "--policies"):
    """The policy object named by `spec`, "module:attribute" (`jaxkv simulate --policies`):
    the module imported as Python would from the working directory (or an installed
    package), or a file, "path/to/file.py:attribute"; the attribute may be dotted. ValueError
    naming `label`, the spec and what failed (import, attribute, not a policy)."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ValueError(f"{label}: {spec!r}: expected module:attribute or file.py:attribute")
    try:
        if where.endswith(".py"):
            path = pathlib.Path(where)
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if not path.is_file() or loader is None:
                raise ImportError(f"no file {where!r}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` would: the working directory
            module = importlib.import_module(where)
    except ImportError as e:
        raise ValueError(
            f"{label}: {spec!r}: cannot import {where!r} ({e}); expected module:attribute with "
            "the module importable from the working directory, or path/to/file.py:attribute"
        ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{label}: {spec!r}: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    try:
        return presets.check_policy(obj, f"{label}: {spec!r}")
    except TypeError as e:
        raise ValueError(str(e)) from None


def check_policy_kwargs(policy_kwargs: dict | None, entries: dict) -> None:
    """Checks `simulate`'s policy_kwargs ({label: {knob: value}}): each label one of
    `entries` (`check_policies`) whose value is an anneal preset name, each knob one of
    `jaxkv.placement.presets.KNOBS`. (A policy object carries its knobs itself.)"""
    named = [k for k, v in entries.items() if isinstance(v, str) and v.startswith("anneal")]
    for n, kw in (policy_kwargs or {}).items():
        if n in entries and not isinstance(entries[n], str):
            raise ValueError(
                f"policy_kwargs[{n!r}]: {n!r} is a policy object; set its knobs on the object "
                "(dataclasses.replace(policy, ...))"
            )
        if n not in named:
            raise ValueError(
                f"policy_kwargs[{n!r}]: expected one of the anneal policies run here {named}"
            )
        bad = sorted(set(kw) - set(presets.KNOBS))
        if bad:
            raise ValueError(
                f"policy_kwargs[{n!r}]: {bad} are not anneal knobs "
                "(`jaxkv.placement.presets.KNOBS`)"
            )


def check_follow_admit(follow_admit: str | None) -> None:
    """Checks `simulate`'s follow_admit: None or one of `jaxkv.placement.policies.FOLLOW_ADMITS`."""
    if follow_admit is not None and follow_admit not in FOLLOW_ADMITS:
        raise ValueError(f"follow_admit must be one of {FOLLOW_ADMITS}, got {follow_admit!r}")
