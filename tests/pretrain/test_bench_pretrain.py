"""`fucina bench pretrain` smoke tests on tiny batches (the lead measures the real sizes on a quiet machine)."""
import json

import pytest

from pretrain_helpers import small_documents, write_jsonl
from pipeline.cli import main


def _bench(capsys, *flags):
    assert main(["bench", "pretrain", "--json", "--batch-tokens", "256", "--micro-batches", "2", "--steps", "1",
                 *flags]) == 0
    return json.loads(capsys.readouterr().out)["results"]


def test_bench_pretrain_reports_ms_and_tokens_per_s(capsys):
    # --row: the row measured in this process, as each row's subprocess does (the slow test runs those)
    (row,) = _bench(capsys, "--row", "--shapes", "lm", "--threads", "1", "--no-torch")
    assert row["case"] == "lm step (256 tokens), 1 thread(s)" and row["ms"] > 0 and row["baselines"] == {}
    assert row["tokens_per_s"] == pytest.approx(256 / row["ms"] * 1e3) and row["peak_rss_mb"] > 0
    assert row["gflops"] == pytest.approx(row["step_gflop"] / row["ms"] * 1e3) and row["gemm_peak_gflops"] > 0
    assert f"of the {row['gemm_peak_gflops']:.0f} GFLOP/s f32 GEMM peak measured here" in row["notes"]
    assert main(["bench", "pretrain", "--shapes", "d99", "--no-torch"]) == 2
    assert "unknown shape 'd99'" in capsys.readouterr().err
    assert main(["bench", "pretrain", "--threads", "1,0"]) == 2
    assert "expected thread counts >= 1" in capsys.readouterr().err


def test_step_flops_counts_every_weight_of_the_model():
    """The linear part of the count is 6 FLOPs per token for every matrix the model holds (head included,
    the embedding lookup not), checked against the parameters of the model the bench builds."""
    from pipeline.bench.pretrain import SHAPES, step_flops
    from pipeline.models.qwen3 import Qwen3, Qwen3Config
    for name in ("lm", "tiny"):
        layers, hidden, heads, kv, hd, ffn, vocab, seq, _, tied = shape = SHAPES[name]
        model = Qwen3.init_random(Qwen3Config(vocab_size=vocab, hidden=hidden, layers=layers, heads=heads,
                                              kv_heads=kv, head_dim=hd, ffn=ffn, context_length=seq,
                                              tied_output=tied), seed=0)
        weights = sum(p.data.size for n, p in model.named_parameters() if p.data.ndim == 2 and "embed" not in n)
        weights += hidden * vocab if tied else 0  # the tied head multiplies by the embedding
        attention = layers * 2 * 2 * seq * hd * heads
        model_flops, muon_flops = step_flops(shape, 1000)
        assert model_flops == 3 * 1000 * (2 * weights + attention) and muon_flops > 0


@pytest.mark.slow
def test_bench_pretrain_trainers_row(capsys, tmp_path):
    data = write_jsonl(tmp_path / "docs.jsonl", small_documents())
    rows = _bench(capsys, "--shapes", "tiny", "--threads", "1", "--trainers", "2", "--no-torch", "--data", data,
                  "--cache-dir", str(tmp_path / "cache"))
    assert [r["case"] for r in rows] == ["tiny step (256 tokens), 1 thread(s)", "tiny step (256 tokens), 2 trainers"]
    assert all(r["ms"] > 0 and r["peak_rss_mb"] > 0 for r in rows)
    # the runtime row's resident set is summed over its processes: more than one in-process row's
    assert rows[1]["peak_rss_mb"] > rows[0]["peak_rss_mb"]


@pytest.mark.parity
@pytest.mark.needs("torch")
def test_bench_pretrain_times_the_torch_baseline(capsys):
    (row,) = _bench(capsys, "--shapes", "lm", "--threads", "1")
    assert row["baselines"]["torch_eager"] > 0
