"""`fucina bench finetune` runs and reports its rows (no timing assertions)."""
import argparse
import os

import pytest

from pipeline.bench import finetune as bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(*flags, fixture="qwen3-mini-q8_0.gguf"):
    """bench.run on a tiny committed fixture at sequence 16, one step, with `flags`."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return bench.run(p.parse_args(["--model", os.path.join(ROOT, "tests", "fixtures", fixture),
                                   "--seq", "16", "--steps", "1", *flags]))


def test_bench_rows_on_the_tiny_fixture():
    rows = _rows("--threads", "0", "--no-torch", "--no-trainers")
    assert [r["case"] for r in rows] == ["step/in-process"]
    assert all(r["ms"] > 0 and r["peak_rss_mb"] > 0 and r["supervised_tok_s"] > 0 for r in rows)


def test_bench_pack_rows_time_one_per_micro_batch_and_packed():
    rows = _rows("--threads", "0", "--no-torch", "--no-trainers", "--pack", "6")
    assert [r["case"] for r in rows[1:]] == ["pack 6 short/one per micro-batch", "pack 6 short/packed"]
    assert rows[2]["baselines"]["one_per_micro_batch"] == rows[1]["ms"] > 0 and rows[2]["tokens_s"] > 0
    assert "6 micro-batches" in rows[1]["notes"] and "windows of 16" in rows[2]["notes"]


@pytest.mark.parity
@pytest.mark.needs("torch")
@pytest.mark.parametrize("fixture", ["qwen3-mini-q8_0.gguf", "llama-mini-f32.gguf", "qwen2-mini-f32.gguf",
                                     "gemma3-gemma-mini-f32.gguf"])
def test_bench_torch_baseline_and_cpu_times_on_the_tiny_fixture(fixture):
    rows = _rows("--threads", "0", "--no-trainers", fixture=fixture)
    for r in rows:
        assert r["baselines"]["torch_f32"] > 0 and r["baseline_cpu_ms"]["torch_f32"] > 0 and r["cpu_ms"] > 0
        assert "CPU" in r["notes"]


@pytest.mark.slow
def test_runtime_rows_in_process_and_one_and_two_trainers():
    rows = _rows("--threads", "2", "--no-torch")
    runtime = rows[1:]
    assert [r["case"] for r in runtime] == ["runtime window accum2/in-process", "runtime window accum2/trainers 1",
                                            "runtime window accum2/trainers 2"]
    assert all(r["ms"] > 0 and r["tokens_s"] > 0 for r in runtime)
    assert runtime[2]["baselines"]["trainers_1"] == runtime[1]["ms"]


def test_bench_rows_per_length_named_by_label_with_each_sides_memory():
    rows = _rows("--threads", "0", "--no-torch", "--no-trainers", "--seq", "16,24", "--label", "tiny", "--memory",
                 "--checkpoint", "on")
    assert [r["case"] for r in rows] == ["tiny/seq16", "tiny/seq24"]
    assert [r["seq"] for r in rows] == [16, 24] and all(r["checkpoint_layers"] for r in rows)
    for r in rows:  # the child's steps ran after the reset: their peak is at least the resident set they started at
        assert r["step_peak_rss_mb"] >= r["step_start_rss_mb"] > 0 and r["process_peak_rss_mb"] >= r["step_peak_rss_mb"]
        assert r["baseline_step_peak_rss_mb"] == {"torch_f32": None} and "peak RSS of the steps" in r["notes"]
