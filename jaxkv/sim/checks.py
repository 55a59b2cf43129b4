"""The checks `jaxkv.sim.simulate.simulate` runs on its arguments before any work, shared with
`jaxkv simulate` (`jaxkv.sim.cli`), which checks its options by the same bounds.

`ARG_BOUNDS` / `check_args`: the numeric arguments; `check_policies`: the policy names;
`check_policy_kwargs`: per-policy knob overrides; `check_follow_admit`: the follow rule's admit.
The memory check (`check_memory`, `available_memory`) lives in `jaxkv.sim.simulate`.
"""

from __future__ import annotations

from jaxkv import presets
from jaxkv.config import check_number
from jaxkv.policies import FOLLOW_ADMITS
from jaxkv.presets import split_name

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


def check_policies(names, label: str = "policies") -> None:
    """Checks a list of policy names (see `jaxkv.sim.simulate`'s module docstring) before any
    work; ValueError names the bad one and what is expected."""
    if isinstance(names, str) or not names:
        raise ValueError(
            f"{label}={names!r}: expected a non-empty list of policy names, e.g. "
            "['static', 'lru', 'anneal', 'unlimited']"
        )
    for n in names:
        if not isinstance(n, str):
            raise ValueError(f"{label}: policy {n!r} is not a name (expected a str)")
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
            continue
        try:
            split_name(n)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None


def check_policy_kwargs(policy_kwargs: dict | None, policies) -> None:
    """Checks `simulate`'s policy_kwargs ({name: {knob: value}}): each name an anneal policy
    among `policies`, each knob one of `jaxkv.presets.KNOBS`."""
    for n, kw in (policy_kwargs or {}).items():
        if n not in policies or not n.startswith("anneal"):
            raise ValueError(
                f"policy_kwargs[{n!r}]: expected one of the anneal policies run here "
                f"{[p for p in policies if p.startswith('anneal')]}"
            )
        bad = sorted(set(kw) - set(presets.KNOBS))
        if bad:
            raise ValueError(
                f"policy_kwargs[{n!r}]: {bad} are not anneal knobs (`jaxkv.presets.KNOBS`)"
            )


def check_follow_admit(follow_admit: str | None) -> None:
    """Checks `simulate`'s follow_admit: None or one of `jaxkv.policies.FOLLOW_ADMITS`."""
    if follow_admit is not None and follow_admit not in FOLLOW_ADMITS:
        raise ValueError(f"follow_admit must be one of {FOLLOW_ADMITS}, got {follow_admit!r}")
