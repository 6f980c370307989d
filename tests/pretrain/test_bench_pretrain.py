"""`fucina bench pretrain` smoke test on a tiny batch (the lead measures the real sizes on a quiet machine)."""
import json

import pytest

from pipeline.cli import main


def _bench(capsys, *flags):
    assert main(["bench", "pretrain", "--json", "--shapes", "lm", "--batch-tokens", "256", "--micro-batches", "2",
                 "--steps", "1", *flags]) == 0
    return json.loads(capsys.readouterr().out)["results"]


def test_bench_pretrain_reports_ms_and_tokens_per_s(capsys):
    (row,) = _bench(capsys, "--no-torch")
    assert row["case"] == "lm step (256 tokens)" and row["ms"] > 0 and row["baselines"] == {}
    assert row["tokens_per_s"] == pytest.approx(256 / row["ms"] * 1e3)
    assert main(["bench", "pretrain", "--shapes", "d99", "--no-torch"]) == 2
    assert "unknown shape 'd99'" in capsys.readouterr().err


@pytest.mark.parity
@pytest.mark.needs("torch")
def test_bench_pretrain_times_the_torch_baseline(capsys):
    (row,) = _bench(capsys)
    assert row["baselines"]["torch_eager"] > 0
