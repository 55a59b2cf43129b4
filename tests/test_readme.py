"""The README's Python examples run as printed."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_its_examples():
    assert any("Decoder(" in b for b in BLOCKS) and any("presets.resolve" in b for b in BLOCKS)
    # bring your own model: in plain JAX, no flax, decoded against the all-HBM tokens
    assert any("FunctionalModel(" in b and "flax" not in b and "assert" in b for b in BLOCKS)
    # a composed policy object in the simulator and in the decode loop
    assert any("simulate(" in b and "PlacementConfig(policy=mine" in b for b in BLOCKS)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i, capsys):
    code = BLOCKS[i]
    if "generate(" in code:  # the model example: a shorter decode keeps the suite quick
        code = code.replace("max_new_tokens=128", "max_new_tokens=8").replace(
            "(1, 1000)", "(1, 100)"
        )
    exec(compile(code, f"README.md example {i}", "exec"), {})


def test_every_policy_name_on_the_results_page_resolves():
    """Every policy name bench/RESULTS.md reports a figure for is still a preset."""
    from jaxkv.cost import CostModel
    from jaxkv.placement import presets

    text = (README.parent / "bench" / "RESULTS.md").read_text()
    found = set(re.findall(r"\b(anneal(?:-oracle)?(?:\+[a-z]+)*|paper-sa\[\d+,[\d.]+\])", text))
    assert {"anneal+reuse+follow", "anneal-oracle+dual"} <= found
    for name in sorted(found):
        policy = presets.resolve(name, CostModel())
        assert policy.name.startswith(name.split("+")[0].split("[")[0]), name
