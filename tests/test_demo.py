import json
import re

import pytest

import models.demo as demo
from jaxkv import cli


@pytest.mark.slow  # about 60 s: the whole demo (the short runs below stay in the default suite)
def test_demo_json_is_lossless_and_shows_placement(capsys, tmp_path):
    """Both runs: exact attention (lossless) and sparse attention on a slow link, where the
    policies' hit rates and modeled tokens/s differ but their tokens do not; the figure."""
    rc = cli.main(
        [
            "demo",
            "--model",
            "default",
            "--json",
            "--prompt-len",
            "200",
            "--new-tokens",
            "20",
            "--policies",
            "static,lru-plan,lru",
            "--replay",
            "lfu",
            "--window",
            "4",
            "--plot",
            str(tmp_path / "demo.png"),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["lossless"] is True and report["placement_free"] is True
    sparse = report["placement"]
    assert sparse["attention"] == "sparse" and sparse["profile"] == "h200-pcie"
    assert sparse["lossless"] is None and sparse["placement_free"] is True
    st, lru = sparse["policies"]["static"], sparse["policies"]["lru-plan"]
    assert st["hbm_hit_rate"] != lru["hbm_hit_rate"]
    assert st["modeled_tokens_per_s"] != lru["modeled_tokens_per_s"]
    pytest.importorskip("matplotlib")
    assert report["plot"] == str(tmp_path / "demo.png") and (tmp_path / "demo.png").stat().st_size
    decoded = {"all-hbm", "static", "lru-plan", "lru"}
    assert set(report["policies"]) == decoded | {"lfu", demo.LIMIT}
    for r in [*report["policies"].values(), *sparse["policies"].values()]:
        assert set(r) == {
            "hbm_hit_rate",
            "migrated_blocks",
            "modeled_tokens_per_s",
            "wall_tokens_per_s",
            "plan_ms",
            "plan_ms_per_step",
            "modeled_tokens_per_s_with_plan",
            "window",
            "replayed",
        }
        assert (r["wall_tokens_per_s"] is None) == r["replayed"]
        assert r["replayed"] or r["wall_tokens_per_s"] > 0
        assert r["modeled_tokens_per_s_with_plan"] <= r["modeled_tokens_per_s"]
    assert [n for n, r in sparse["policies"].items() if r["replayed"]] == ["lfu", demo.LIMIT]
    assert report["policies"]["static"]["plan_ms"] == 0.0  # static never plans
    # lru-plan plans every step (demo.OWN_WINDOWS); static and the in-step rules never
    windows = [report["policies"][n]["window"] for n in ("all-hbm", "static", "lru-plan", "lru")]
    assert windows == [None, None, 1, None]
    assert report["policies"]["lru-plan"]["plan_ms"] > 0.0
    # Belady's limit hits at least as often as every rule in the step (its reads are theirs)
    for name in ("lru", "lfu"):
        assert sparse["policies"][demo.LIMIT]["hbm_hit_rate"] >= sparse["policies"][name][
            "hbm_hit_rate"
        ] * (1 - 1e-9)
    assert report["policies"]["all-hbm"]["hbm_hit_rate"] == 1.0
    assert report["policies"]["static"]["hbm_hit_rate"] < 0.5
    # the bound (jaxkv.sim.loop): no placement of the policies' HBM size reads faster
    for r in (report, sparse):
        b = r["bound_tokens_per_s"]
        assert b["unlimited"] >= b["best"] >= b["capacity"] * (1 - 1e-6) and b["best"] > 0
        for name in ("static", "lru-plan", "lru", "lfu", demo.LIMIT):
            assert r["policies"][name]["modeled_tokens_per_s"] <= b["best"] * (1 + 1e-6)


def test_demo_table_is_readable(capsys):
    from models.demo import format_table

    report = {
        "lossless": True,
        "placement_free": True,
        "attention": "exact",
        "model": "m",
        "prompt_tokens": 10,
        "new_tokens": 5,
        "hbm_fraction": 0.25,
        "profile": "gh200",
        "device": "cpu",
        "jax": "x",
        "answer": " It parses command lines.",
        "chat": True,
        "policies": {
            "all-hbm": {
                "hbm_hit_rate": 1.0,
                "migrated_blocks": 0,
                "modeled_tokens_per_s": 10.0,
                "wall_tokens_per_s": 4.0,
                "plan_ms": 0.0,
                "plan_ms_per_step": 0.0,
                "modeled_tokens_per_s_with_plan": 10.0,
            },
            "lru": {
                "hbm_hit_rate": 0.5,
                "migrated_blocks": 3,
                "modeled_tokens_per_s": 5.0,
                "wall_tokens_per_s": 2.0,
                "plan_ms": 1.5,
                "plan_ms_per_step": 0.375,
                "modeled_tokens_per_s_with_plan": 4.5,
            },
        },
    }
    text = format_table(report)
    assert "policy" in text and "lru" in text and "(0.50x)" in text and "lossless" in text
    assert "1.50 (0.375)" in text and "plan charged" in text
    assert "the model's answer (all-HBM cache, exact attention): 'It parses command lines.'" in text
    assert "bound" not in text and "limit" not in text  # none measured
    replayed = dict(report["policies"]["lru"], wall_tokens_per_s=None, replayed=True)
    report["policies"]["lfu"] = dict(replayed, modeled_tokens_per_s_with_plan=4.5)
    report["policies"]["mine"] = dict(report["policies"]["lru"], modeled_tokens_per_s_with_plan=6)
    report["policies"][demo.LIMIT] = dict(replayed, modeled_tokens_per_s=7.5)
    report["bound_tokens_per_s"] = dict(unlimited=9.0, capacity=7.0, cache=6.5, best=8.5)
    text = format_table(report)
    assert re.search(r"\nbound \(any placement\)\s+8\s", text)  # 8.5 tok/s, rounded
    assert re.search(r"\nlfu .* replayed\n", text)
    # (6 - 4.5) / (7.5 - 4.5): from the best field rule (lru and lfu tie at 4.5) to Belady
    assert "to Belady closed, plan charged: mine 50%" in text
    report["policies"][demo.LIMIT]["modeled_tokens_per_s"] = 4.52  # no gap to speak of
    text = format_table(report)
    assert "the best field rule (lru) is within 1% of Belady's" in text
    assert "mine" not in text[-400:]


def test_demo_unknown_policy_is_a_clear_error(capsys):
    rc = cli.main(["demo", "--policies", "static,nope", "--prompt-len", "64", "--no-plot"])
    assert rc == 2  # checked before any model loads (the real model is the default)
    assert "--policies='nope': unknown policy 'nope'" in capsys.readouterr().err


def test_generate_cli_continues_the_prompt(capsys):
    rc = cli.main(["generate", "--prompt", "def main(args):", "--max-new-tokens", "8"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.startswith("def main(args):")
    assert "stopped: max new tokens reached (--max-new-tokens 8); HBM hit rate" in out.err


def test_demo_short_runs_and_bad_lengths(capsys):
    """A few new tokens still time at least one step (it was a ZeroDivisionError at <= 17);
    too few, or a prompt past the model's context, is a clear error before any work."""
    rc = cli.main(
        [
            "demo",
            "--model",
            "default",
            "--json",
            "--prompt-len",
            "64",
            "--new-tokens",
            "5",
            "--policies",
            "static",
            "--replay",
            "",
            "--attention",
            "exact",
            "--no-plot",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["lossless"] is True
    assert all(r["replayed"] or r["wall_tokens_per_s"] > 0 for r in report["policies"].values())
    assert cli.main(["demo", "--new-tokens", "2"]) == 2
    assert "--new-tokens=2: expected an integer >= 3" in capsys.readouterr().err
    argv = ["demo", "--model", "default", "--prompt-len", "100000", "--new-tokens", "8"]
    assert cli.main(argv) == 2
    assert "exceeds the model's context of 2048 tokens" in capsys.readouterr().err


def test_run_demo_checks_arguments_before_loading(monkeypatch):
    monkeypatch.setattr(demo, "load_model", lambda spec: pytest.fail("loaded the model"))
    with pytest.raises(ValueError, match=r"hbm_fraction=1.5: expected a finite number in \(0, 1\]"):
        demo.run_demo(hbm_fraction=1.5)
    with pytest.raises(ValueError, match=r"^hbm_fraction=0.5, hbm_blocks=3: expected at most one"):
        demo.run_demo(hbm_fraction=0.5, hbm_blocks=3)
    with pytest.raises(ValueError, match=r"policies='unlimited': the Unlimited-HBM bound"):
        demo.run_demo(policies=("unlimited",))
    with pytest.raises(ValueError, match=r"policies=\(\): expected one or more policy names"):
        demo.run_demo(policies=())
    with pytest.raises(ValueError, match=r"model='nope': not found \(nor a named model\)"):
        demo.run_demo(model="nope")


def test_demo_failure_mid_run_gets_its_own_line(capsys, monkeypatch, tiny):
    """An error raised while the progress bar is open is printed on a line of its own: the
    bar clears itself first (leave=False; so does a Ctrl-C's line)."""

    def boom(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(demo, "load_model", lambda spec: (tiny[0], None))
    monkeypatch.setattr(demo, "Decoder", boom)
    rc = cli.main(
        [
            "demo",
            "--model",
            "default",
            "--prompt-len",
            "16",
            "--new-tokens",
            "3",
            "--policies",
            "static",
            "--no-plot",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    bar, line = err.rsplit("\r", 1)
    assert "decoding" in bar and line == "jaxkv demo: error: boom\n"
    assert bar.rsplit("\r", 1)[-1].strip() == ""  # the bar's line blanked before the message


def test_decoded_text_stops_at_the_pad():
    """The token buffer pads a finished sequence with PAD_ID (-1, no token): the text stops."""
    from jaxkv.decode.state import PAD_ID
    from models.generate import decode_text

    assert decode_text(None, [104, 105, PAD_ID, PAD_ID]) == "hi"
    assert decode_text(None, [104, 105, 33, PAD_ID], stop=(33,)) == "hi"


def _tiny_demo(capsys, monkeypatch, tiny, *options):
    """`jaxkv demo --json` on the tiny random model (64-token prompt, 3 new tokens, static):
    (exit status, report, stderr)."""
    monkeypatch.setattr(demo, "load_model", lambda spec: (tiny[0], None))
    argv = ["demo", "--model", "default", "--prompt-len", "64", "--new-tokens", "3"]
    rc = cli.main([*argv, "--policies", "static", "--attention", "exact", "--json", *options])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc != 2 else None), out.err


@pytest.mark.parametrize("unit", ["blocks", pytest.param("bytes", marks=pytest.mark.slow)])
def test_demo_hbm_in_blocks_or_bytes(capsys, monkeypatch, tiny, unit):
    """--hbm-blocks / --hbm-bytes size the policies' HBM (the all-HBM run stays whole); the
    header says what was given, the blocks per layer it makes and their share of the KV."""
    from jaxkv.config import CacheConfig

    cfg = CacheConfig.for_model(tiny[0].config, batch=1, max_len=67, hbm_fraction=1.0)
    per = cfg.num_layers * cfg.block_bytes  # one block across layers
    value = 2 if unit == "blocks" else 2 * per + per // 2  # 2.5 blocks' bytes: 2 blocks
    rc, report, _ = _tiny_demo(capsys, monkeypatch, tiny, f"--hbm-{unit}", str(value), "--no-plot")
    assert rc == 0 and report["lossless"] is True
    assert report["hbm_capacity"] == {f"hbm_{unit}": value}
    assert report["hbm_blocks"] == 2 and report["total_blocks"] == cfg.total_blocks == 5
    assert report["hbm_fraction"] == 0.4
    assert report["policies"]["static"]["hbm_hit_rate"] < 1.0
    head = demo.format_table(report).splitlines()[0]
    said = (
        "2 blocks per layer of 5"
        if unit == "blocks"
        else f"{value:,} bytes: 2 blocks per layer of 5"
    )
    assert f"HBM {said}" in head and "40% of the KV footprint (all-hbm: 100%)" in head, head


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--hbm-blocks", "6", "hbm_blocks=6: more than the KV footprint of 5 blocks per layer"),
        ("--hbm-bytes", "1", "hbm_bytes=1 gives 0 HBM blocks per layer, but each of the batch=1"),
    ],
)
def test_demo_hbm_the_kv_cannot_take_fails_before_decoding(
    capsys, monkeypatch, tiny, option, value, expected
):
    """A capacity past the model's KV footprint, or under one block a layer, is known once the
    model is loaded: the error comes then, not after the all-HBM run."""
    monkeypatch.setattr(demo, "Decoder", lambda *a, **k: pytest.fail("decoded before checking"))
    rc, _, err = _tiny_demo(capsys, monkeypatch, tiny, option, value, "--no-plot")
    assert rc == 2 and f"jaxkv demo: error: {expected}" in err, err


def test_generate_hbm_in_blocks(capsys, monkeypatch, tiny):
    """`jaxkv generate --hbm-blocks 1`: the cache gets one HBM block a layer (the tail), so the
    prompt's sealed blocks are read from the host."""
    import models.generate as gen

    seen = []

    def decoder(model, cfg, *args, **kwargs):
        seen.append(cfg)
        return gen_decoder(model, cfg, *args, **kwargs)

    gen_decoder = gen.Decoder
    monkeypatch.setattr(gen, "load_model", lambda spec: (tiny[0], None))
    monkeypatch.setattr(gen, "Decoder", decoder)
    prompt = "def parse(args):  # forty bytes, 3 blocks"
    assert (
        cli.main(["generate", "--prompt", prompt, "--max-new-tokens", "3", "--hbm-blocks", "1"])
        == 0
    )
    [cfg] = seen
    assert cfg.hbm_blocks == 1 == cfg.hbm_slots and cfg.hbm_fraction is None
    assert "HBM hit rate 100.0%" not in capsys.readouterr().err


def test_the_footnote_names_only_the_baselines_that_ran():
    """The share of the gap is taken from the best of the field's rules that ran, named as run;
    a run without one (or without Belady's limit) says what the rows mean and no share (it was
    once max()'s error after the whole decode)."""
    from models.demo import LIMIT, gap_closed

    def report(**tps):
        pol = {n: {"modeled_tokens_per_s_with_plan": t} for n, t in tps.items()}
        pol[LIMIT] = {"modeled_tokens_per_s_with_plan": 10.0, "modeled_tokens_per_s": 10.0}
        return {"policies": pol, "bound_tokens_per_s": {"best": 11.0}}

    text = gap_closed(report(**{"all-hbm": 9.0, "lfu": 4.0, "mine": 7.0}))
    assert text.endswith("the best field rule (lfu) to Belady closed, plan charged: mine 50%")
    assert "lru" not in text.split("bound:")[0] and "static" not in text
    text = gap_closed(report(lfu=4.0, lru=6.0, mine=8.0, static=2.0))
    assert text.endswith("(lru) to Belady closed, plan charged: mine 50%, static -100%")
    assert gap_closed(report(lru=9.95, mine=8.0)).endswith("(lru) is within 1% of Belady's")
    assert gap_closed(report(mine=8.0, lrfu=9.0)).endswith("before each step)")  # no rule ran
