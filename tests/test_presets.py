"""Policy names as people type them (`jaxkv.placement.presets`): lists with an empty item and
names with a modifier twice are refused; `describe` lists every policy with its kind, one line
and its knobs (`jaxkv policies` prints it)."""

import json

import pytest

from jaxkv.placement import presets


@pytest.mark.parametrize("text, item", [("static,,lru", 2), ("static,lru,", 3), (",lru,ok", 1)])
def test_an_empty_item_in_a_policy_list_is_refused(text, item):
    """`static,,lru` ran as two policies without a word."""
    with pytest.raises(ValueError, match=f"item {item} of 3 is empty"):
        presets.split_policies(text)


def test_a_list_of_blanks_is_left_to_the_caller():
    assert presets.split_policies(" , ") == []  # the caller says what it expected


@pytest.mark.parametrize("name", ["anneal+reuse+reuse", "anneal+aw+reuse+aw"])
def test_a_modifier_given_twice_is_refused(name):
    """`anneal+reuse+reuse` was accepted (and resolved as anneal+reuse)."""
    with pytest.raises(ValueError, match=r"is given 2 times: expected each modifier once"):
        presets.split_name(name)


def test_describe_lists_every_base_once_with_its_kind():
    import jaxkv.sim  # noqa: F401  (the oracles register from the research side)
    from jaxkv.placement import registry

    rows = presets.describe()
    assert [r["name"] for r in rows] == registry.names() and rows[0]["name"] == "lrfu"
    kinds = {r["name"]: r["kind"] for r in rows}
    assert kinds["lrfu"] == "live" and kinds["unlimited"] == "bound"
    assert {kinds[n] for n in ("lru", "arc", "slru", "lfu", "tinylfu")} == {"field"}
    assert {kinds[n] for n in ("static", "lru-plan", "anneal")} == {"online"}
    assert {kinds[n] for n in ("page", "paper-sa", "anneal-oracle", "belady")} == {"oracle"}
    for r in rows:
        assert set(r) == {"name", "kind", "doc", "knobs", "modifiers"}
        assert r["doc"] and "\n" not in r["doc"]
        json.dumps(r, default=str)  # printable as JSON


def test_describe_knobs_are_the_policies_own_defaults():
    """The knobs' defaults are read from the parts (the oracles' restated ones agree)."""
    from jaxkv.placement.policies import Lrfu
    from jaxkv.sim import oracles

    rows = {r["name"]: r for r in presets.describe()}
    assert rows["lrfu"]["knobs"] == {
        k: getattr(Lrfu(), k) for k in ("prompt_prior", "steady_queries", "lookahead", "slack")
    }
    sa = oracles.PaperSA()
    knobs = rows["paper-sa"]["knobs"]
    assert (knobs["lookahead"], knobs["fraction"]) == (sa.lookahead, sa.fraction)
    assert "[W,R]" in knobs  # the bracketed name's arguments
    assert rows["tinylfu"]["knobs"] == dict(window=0.01, protected=0.8, period=16)
    oracle = rows["anneal-oracle"]["knobs"]
    assert oracle["tail_value"] == oracles.BeladyTail().value
    assert oracle["overflow_link_ratio"] == oracles.Overflow().link_ratio
    assert "tail" not in rows["anneal"]["knobs"] and "window" in rows["anneal"]["knobs"]
    assert set(rows["anneal"]["modifiers"]) == {"+aw", "+ec", "+reuse", "+now", "+follow"}
    # every knob a caller may set resolves
    presets.resolve("lrfu", presets.CostModel(), **rows["lrfu"]["knobs"])
