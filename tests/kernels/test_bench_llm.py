"""`fucina bench llm` end to end on a tiny committed fixture: the whole-model rows and the per-kernel rows
(no timing assertions: benchmarks are commands, not tests)."""
import argparse
import json
import os

from pipeline.bench import llm as bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_llm_reports_kernel_rows_beside_the_machine_limits():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--model", os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf"), "--no-llama",
                         "--repeat", "1", "--decode-tokens", "1", "--threads", "1"])
    rows = bench.run(args)
    json.dumps(rows)  # the --json document must serialise
    cases = [r["case"] for r in rows]
    assert cases[:4] == [f"qwen3-mini-q8_0.gguf/{c}" for c in ("prefill64", "prefill256", "decode", "peak_rss")]
    assert rows[3]["tile_mb"] > 0  # Q8_0: an inference prompt packs its projections' tiles (prompt_tiles)
    mem = rows[3]  # measured in a fresh process (imports, then the load, then the cases): each figure the next's floor
    assert 0 < mem["import_rss_mb"] <= mem["load_rss_mb"] <= mem["peak_rss_mb"], mem
    accuracy = rows[4]  # KL to the exact forward (the F32 copy; no llama.cpp here, so Fucina runs it)
    assert accuracy["case"] == "qwen3-mini-q8_0.gguf/kl_exact" and accuracy["reference"] == "Fucina on the F32 copy"
    kl = accuracy["kl"]
    # the prompt on the tiles and the decode on the row kernels both round activations to Q8_0: neither exact
    assert min(kl["fucina"], kl["fucina decode"], kl["fucina --llama-numerics"]) > 1e-6, kl
    assert kl["fucina"] != kl["fucina decode"], kl  # the tiles' arithmetic is their own (one fma per block)
    assert kl["positions"] >= 50  # the bench text in the fixture's tokens
    limits = rows[5]
    assert limits["case"] == "machine/memory_read" and limits["gbps"] > 0 and limits["peak_gflops"] > 0
    dispatch = rows[6]
    assert dispatch["case"] == "machine/dispatch" and dispatch["ms"] > 0 and dispatch["python_ms"] > 0
    assert dispatch["dispatches_per_token"] == 4 * 2 + 1  # the fixture's two layers, then the output head
    kernels = rows[7:]
    assert kernels and all(r["case"].startswith("kernel/Q8_0/") and r["gbps"] > 0 and r["gflops"] > 0
                           for r in kernels)
    paths = {r["case"].rsplit("/", 1)[1]: r["path"] for r in kernels}
    assert paths == {"decode": "integer", "prefill64": "integer", "prefill256": "integer", "decode_f32": "f32",
                     "prefill64_f32": "f32", "prefill256_f32": "f32",  # an inference prompt: Q8_0's tiles
                     "decode_head": "integer"}
    args.no_kernels = True
    assert len(bench.run(args)) == 5
    args.no_accuracy = True
    assert len(bench.run(args)) == 4


def test_bench_llm_kernel_rows_of_a_k_quant_take_the_blocked_integer_gemm():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--model", os.path.join(ROOT, "tests", "fixtures", "qwen3-tied-q4_k_s.gguf"), "--no-llama",
                         "--repeat", "1", "--decode-tokens", "1", "--threads", "1", "--no-accuracy"])
    rows = bench.run(args)
    assert rows[3]["case"].endswith("/peak_rss") and rows[3]["tile_mb"] > 0  # the prompts packed K-quant tiles
    kernels = [r for r in rows if r["case"].startswith("kernel/Q4_K/")]
    paths = {r["case"].rsplit("/", 1)[1]: r["path"] for r in kernels}
    assert paths == {"decode": "integer", "prefill64": "integer", "prefill256": "integer", "decode_f32": "f32",
                     "prefill64_f32": "f32", "prefill256_f32": "f32"}


def test_the_dequantized_copy_holds_every_tensor_as_f32_with_the_dequantized_values(tmp_path):
    """write_dequantized: the accuracy row's reference file, every block tensor dequantized, dense ones verbatim."""
    from pipeline.kernels import dequant
    from pipeline.llm.gguf_write import read_gguf, write_dequantized
    from gguf import GGMLQuantizationType as QT
    src = os.path.join(ROOT, "tests", "fixtures", "qwen3-tied-q4_k_s.gguf")
    n = write_dequantized(src, tmp_path / "f32.gguf")
    before, after = read_gguf(src), read_gguf(tmp_path / "f32.gguf")
    assert n == sum(t.qtype not in (QT.F32, QT.F16, QT.BF16) for t in before.tensors) > 0
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for a, b in zip(before.tensors, after.tensors):
        assert b.qtype == QT.F32 and b.shape == a.shape
        want = a.dense() if a.qtype in (QT.F32, QT.F16, QT.BF16) else \
            dequant.dequantize_rows(int(a.qtype), a.data.reshape(-1, a.data.shape[-1]), a.shape[-1]).reshape(a.shape)
        assert (b.dense() == want).all(), a.name
