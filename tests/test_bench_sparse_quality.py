"""bench/sparse_quality.py on the small default model: a top-k share that reads every live block
agrees with exact attention, a small share reads fewer blocks, and bad shares are refused."""

import json
from pathlib import Path

import pytest
from conftest import load_bench

BENCH = Path(__file__).parents[1] / "bench"


@pytest.fixture(scope="module")
def sq():
    return load_bench("sparse_quality")


@pytest.mark.slow  # three decoders compiled: 12 s on 2 cores; the default suite is near 15 min
def test_shares_of_blocks_read_and_their_accuracy(sq, capsys):
    argv = "--model default --batch 1 --prompt-len 96 --steps 6 --topk 0.1,0.999 --json"
    assert sq.main(argv.split()) == 0
    out = json.loads(capsys.readouterr().out)
    small, every = out["rows"]
    assert every["read_share"] == pytest.approx(1.0)  # ceil(0.999 x live) = every live block
    assert every["top1_agreement"] == 1.0 and every["kl_max"] < 1e-4
    assert small["read_share"] < 0.5
    assert small["kl_mean"] >= 0.0 and 0.0 <= small["top1_agreement"] <= 1.0
    assert out["prompt_len"] == 96 and out["steps"] == 6


@pytest.mark.parametrize("topk", ["0", "1.0", "1.5", "a"])
def test_topk_outside_zero_one_is_refused(sq, topk):
    with pytest.raises(ValueError, match="--topk"):
        sq.parse_topk(topk)
