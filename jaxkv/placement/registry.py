"""Every placement policy's name, registered once by the module that defines the policy.

A name is a base, optional modifiers and, for some bases, bracketed arguments:
"anneal+reuse+follow", "paper-sa[10,0.5]". `register` records a base: what kind of policy it
is, one line about it, its modifiers, its knobs (keyword arguments of its factory, with their
defaults read from the class) and the factory. `resolve(name, env, settings, **knobs)` builds
the policy; `split_name` validates a name; `describe` lists them all (`jaxkv policies`).

Kinds:
  live     the policy README recommends for a live decode (`DEFAULT_LIVE`)
  field    the field's own rules, in the step (LRU, ARC, SLRU, LFU, W-TinyLFU): the baselines
  online   the other policies a live decode can run (static, lru-plan, anneal)
  oracle   policies that read the future: the simulators only (Belady, page, paper-sa,
           anneal-oracle)
  bound    a bound, not a placement (unlimited)
The runtime's policies register when `jaxkv.placement.policies` is imported (this module imports
it on first use); the oracles register from `jaxkv.sim` when it is imported. The runtime never
imports `jaxkv.sim`: a name it does not know is an error naming the registered ones.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

KINDS = ("live", "field", "online", "oracle", "bound")
ONLINE_KINDS = ("live", "field", "online")
DEFAULT_LIVE = "lrfu"  # `PlacementConfig()`'s policy: the live policy README recommends


@dataclasses.dataclass(frozen=True)
class Modifier:
    """A modifier "+name" of a base: one line, the knobs it sets, and whether a policy with it
    reads the future (then only the simulators run it)."""

    doc: str
    knobs: dict = dataclasses.field(default_factory=dict)
    offline: bool = False

    def __hash__(self):
        return hash((self.doc, self.offline, tuple(sorted(self.knobs))))


@dataclasses.dataclass(frozen=True, eq=False)
class Entry:
    """A registered base name.

    build(name, env, settings, modifiers, args, knobs) -> Policy: the factory; `args` is the
      bracketed argument text (None without brackets), `knobs` the caller's overrides.
    knobs: knob name -> default, the keyword overrides `resolve` accepts (or a function
      returning them, for a base whose knobs other packages extend: `knob_defaults`).
    check: (name, modifiers) -> None, raising ValueError for a combination the base refuses.
    args: the bracket syntax's one-line description (None: the base takes no brackets).
    """

    name: str
    kind: str
    doc: str
    build: Callable[..., Any]
    modifiers: dict = dataclasses.field(default_factory=dict)
    knobs: dict = dataclasses.field(default_factory=dict)
    check: Callable[..., None] | None = None
    args: str | None = None
    aliases: tuple = ()

    @property
    def online(self) -> bool:
        return self.kind in ONLINE_KINDS

    def knob_defaults(self) -> dict:
        """knob name -> default, as of now (`knobs`, called when it is a function)."""
        return dict(self.knobs() if callable(self.knobs) else self.knobs)


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
    now_window: int = 3  # `+now`'s lookahead W (3 beat 10; bench/RESULTS.md)
    now_spread: float = 1.5  # the +now / +follow presets' `Spread` (1.5 beat 1.0 and 2.0)
    follow_window: int | None = None
    follow_admit: str | None = None
    oracle_window: int = 3
    oracle_discount: float = 0.4
    oracle_tail: int = 30
    dual_window: int = 2
    ride: float | None = None
    adaptive: Any = None  # a jaxkv.placement.pricing.AdaptiveWindow, or None
    budget: int | None = None
    config: Any = None  # a jaxkv.config.AnnealConfig, or None
    seed: int = 0
    page_blocks: int | None = None


_ENTRIES: dict[str, Entry] = {}
_ALIASES: dict[str, str] = {}


def register(
    name: str,
    *,
    kind: str,
    doc: str,
    build: Callable[..., Any],
    modifiers: dict | None = None,
    knobs: dict | None = None,
    check: Callable[..., None] | None = None,
    args: str | None = None,
    aliases: tuple = (),
) -> Entry:
    """Records base `name` (see `Entry`); ValueError for an unknown kind or a name taken by
    another factory (registering the same one again, as a module reload does, is allowed)."""
    if kind not in KINDS:
        raise ValueError(f"register({name!r}): kind={kind!r}, expected one of {KINDS}")
    if not name or "+" in name or "[" in name or "," in name:
        raise ValueError(f"register({name!r}): a base name has no '+', '[' or ','")
    old = _ENTRIES.get(name)
    if old is not None and getattr(old.build, "__qualname__", None) != getattr(
        build, "__qualname__", None
    ):
        raise ValueError(f"policy {name!r} is registered already (by {old.build!r})")
    knobs = knobs if callable(knobs) else dict(knobs or {})
    e = Entry(name, kind, doc, build, dict(modifiers or {}), knobs, check, args, aliases)
    _ENTRIES[name] = e
    for a in aliases:
        _ALIASES[a] = name
    return e


def knobs_of(cls, skip=("name",)) -> dict:
    """{field: default} of a policy dataclass `cls`: the knobs a name of it takes, read from
    a default instance (a default its constructor resolves, e.g. `Lrfu.steady_queries`, is
    the resolved value), `skip` left out."""
    default = cls()
    return {
        f.name: getattr(default, f.name)
        for f in dataclasses.fields(cls)
        if f.name not in skip and not f.name.startswith("_")
    }


def register_class(cls, *, kind: str, doc: str, skip=("name",), aliases: tuple = ()) -> Entry:
    """Registers a policy dataclass under its default `name`: its knobs are its other fields
    (their defaults read from the class), its factory `cls(**knobs)`."""
    name = cls().name
    knobs = knobs_of(cls, skip)

    def build(name_, env, settings, mods, args, overrides):
        return cls(**overrides) if name_ == name else cls(name=name_, **overrides)

    build.__qualname__ = f"{cls.__module__}.{cls.__qualname__}"
    return register(name, kind=kind, doc=doc, build=build, knobs=knobs, aliases=aliases)


def _load() -> None:
    """The runtime's policies register when their package is imported."""
    import jaxkv.placement.policies  # noqa: F401


def entries() -> dict[str, Entry]:
    """Every registered base, by name."""
    _load()
    return dict(_ENTRIES)


def _unknown(name: str, base: str) -> ValueError:
    known = sorted(entries())
    hint = ""
    if "jaxkv.sim" not in sys.modules:
        hint = (
            "; the simulator's oracles (belady, page, paper-sa, anneal-oracle, unlimited) "
            "register when jaxkv.sim is imported"
        )
    what = f"unknown policy {name!r}" + (f" (base {base!r})" if base != name.split("+")[0] else "")
    return ValueError(f"{what}; expected one of {known}{hint}")


def entry(base: str, name: str | None = None) -> Entry:
    """The entry of a base name (or alias); ValueError naming `name` (the whole name the base
    came from) and the registered ones."""
    _load()
    base = _ALIASES.get(base, base)
    if base not in _ENTRIES:
        raise _unknown(name or base, base)
    return _ENTRIES[base]


def parse(name) -> tuple[Entry, tuple[str, ...], str | None]:
    """(entry, modifiers, bracketed args or None) of a policy name such as
    "anneal+reuse+now" or "paper-sa[10,0.5]", validated: ValueError naming the valid choices."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    head, *mods = name.split("+")
    args = None
    if "[" in head:
        if not head.endswith("]"):
            raise ValueError(f"policy {name!r}: expected base[args], e.g. paper-sa[10,0.5]")
        head, args = head[: head.index("[")], head[head.index("[") + 1 : -1]
    e = entry(head, name)
    if args is not None and e.args is None:
        raise ValueError(f"policy {name!r}: {e.name!r} takes no bracketed arguments")
    if args is not None and mods:
        raise ValueError(f"policy {name!r}: bracketed arguments take no modifiers")
    takers = [n for n, x in _ENTRIES.items() if x.modifiers]
    if mods and not e.modifiers:
        raise ValueError(
            f"policy {name!r}: modifiers (+{', +'.join(mods)}) apply to {' and '.join(takers)} "
            f"only, not {e.name!r} ({_modifier_hint()})"
        )
    bad = [m for m in mods if m not in e.modifiers]
    if bad:
        m = bad[0]
        owners = [n for n in takers if m in _ENTRIES[n].modifiers]
        if owners:
            doc = _ENTRIES[owners[0]].modifiers[m].doc
            raise ValueError(
                f"policy {name!r}: +{m} ({doc}) applies to {' and '.join(owners)} only, not "
                f"{e.name!r}"
            )
        known = list(dict.fromkeys(x for n in takers for x in _ENTRIES[n].modifiers))
        said = [repr(x) for x in known]
        raise ValueError(
            f"policy {name!r}: unknown modifier {m!r}; expected {', '.join(said[:-1])} or "
            f"{said[-1]}"
        )
    dup = sorted({m for m in mods if mods.count(m) > 1})
    if dup:
        raise ValueError(
            f"policy {name!r}: +{dup[0]} is given {mods.count(dup[0])} times: expected each "
            "modifier once"
        )
    if e.check is not None:
        e.check(name, tuple(mods))
    return e, tuple(mods), args


def _modifier_hint() -> str:
    have = [f"{n} takes +{', +'.join(e.modifiers)}" for n, e in _ENTRIES.items() if e.modifiers]
    return "; ".join(have) if have else "no base takes modifiers"


def split_name(name) -> tuple[str, tuple[str, ...]]:
    """(base, modifiers) of a policy name, validated (`parse`); "paper-sa[10,0.5]" is
    ("paper-sa", ())."""
    e, mods, _ = parse(name)
    return e.name, mods


def is_online(name) -> bool:
    """The policy can run in a live decode (it reads no future); validates the name."""
    e, mods, _ = parse(name)
    return e.online and not any(e.modifiers[m].offline for m in mods)


def _ordered() -> list[Entry]:
    """Every entry, by kind (`KINDS`' order: the live policy first), then registration."""
    return sorted(entries().values(), key=lambda e: KINDS.index(e.kind))


def names(kind: str | tuple | None = None) -> list[str]:
    """The registered base names (of `kind`, one or a tuple of `KINDS`), the live policy
    first, then the field's rules, the other online policies, the oracles, the bound."""
    kinds = (kind,) if isinstance(kind, str) else kind
    return [e.name for e in _ordered() if kinds is None or e.kind in kinds]


def resolve(name: str, env, settings=None, **knobs):
    """The policy `name` priced in `env` (a `jaxkv.cost.CostModel`) under `settings` (the
    knobs a caller sets for every preset, `jaxkv.placement.presets.Settings`), with `knobs`
    (the base's own, `Entry.knobs`) applied last. ValueError for a bad name or knob."""
    e, mods, args = parse(name)
    known = e.knob_defaults()
    bad = sorted(set(knobs) - set(known))
    if bad:
        raise ValueError(
            f"policy {name!r}: {bad} are not knobs of {e.name!r}; expected some of "
            f"{sorted(known) or 'none'}"
        )
    return e.build(name, env, settings or Settings(), mods, args, knobs)


def describe() -> list[dict]:
    """Every registered base: name, kind, one line, modifiers (name -> line), knobs (name ->
    default) and its bracket syntax, in `names`' order (`jaxkv policies`)."""
    out = []
    for e in _ordered():
        out.append(
            dict(
                name=e.name,
                kind=e.kind,
                doc=e.doc,
                modifiers={m: x.doc for m, x in e.modifiers.items()},
                knobs=e.knob_defaults(),
                args=e.args,
            )
        )
    return out
