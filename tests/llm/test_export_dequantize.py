"""`export-gguf --from-gguf Q.gguf --adapters RUN --dequantize`: a merge into a quantized base, on request. Each
merged weight is dequantized, merged in f32 and re-quantized to its own type with the byte-exact encoders (the file
keeps its mix), everything else is copied byte for byte, `--dtype` re-encodes every matrix instead, the measured
cost is printed; without the flag the refusal names it."""
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType
from test_export_fixtures import write_tiny_qwen3
from test_lora_serve import ALPHA, RANK, make_run

from pipeline.cli import main as fucina
from pipeline.llm.export import load_adapters
from pipeline.llm.gguf_write import dense_values, encode, is_matrix_weight, read_gguf, transcode


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("q")
    f32 = write_tiny_qwen3(d / "base.gguf")
    out = {}
    for dtype in ("q4_1", "q4_k_m"):
        out[dtype] = d / f"base-{dtype}.gguf"
        transcode(f32, out[dtype], dtype)
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("ft") / "run")


def _export(argv, capsys):
    code = fucina(["export-gguf", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("dtype", ["q4_1", "q4_k_m"])
def test_the_merged_file_keeps_its_mix_and_only_merged_weights_change(bases, run_dir, tmp_path, capsys, dtype):
    src, out = bases[dtype], tmp_path / "merged.gguf"
    code, stdout, _ = _export(["--from-gguf", str(src), "--adapters", str(run_dir), "--dequantize", "--out", str(out)],
                              capsys)
    assert code == 0
    before, after = read_gguf(src), read_gguf(out)
    pairs = {p.gguf_name: p for p in load_adapters(run_dir).pairs}
    types = {t.qtype for t in before.tensors if is_matrix_weight(t)}
    assert len(types) > (1 if dtype == "q4_k_m" else 0)  # q4_k_m: a real mix (Q4_K/Q5_0 + Q6_K/Q8_0)
    for t in before.tensors:
        u = after.tensor(t.name)
        assert u.qtype == t.qtype and u.shape == t.shape
        if t.name in pairs:
            p = pairs[t.name]
            want = encode(dense_values(t) + (p.b @ p.a) * np.float32(ALPHA / RANK), t.qtype)
            assert np.array_equal(u.data, want)  # dequantize -> merge in f32 -> the byte-exact encoder
            assert not np.array_equal(u.data, t.data)
        else:
            assert np.array_equal(u.data, t.data)  # verbatim
    m = re.search(r"measured cost: KL\(base\+adapter \|\| merged\) mean (\S+) nats/token, max (\S+), top-1 "
                  r"agreement (\S+)% over (\d+) positions of 4 held-out prompts", stdout)
    assert m, stdout
    kl_mean, kl_max, agree = float(m.group(1)), float(m.group(2)), float(m.group(3))
    assert 0 < kl_mean <= kl_max < 1.0 and agree > 50


def test_dtype_with_dequantize_re_encodes_every_matrix(bases, run_dir, tmp_path, capsys):
    out = tmp_path / "q8.gguf"
    code, _, _ = _export(["--from-gguf", str(bases["q4_1"]), "--adapters", str(run_dir), "--dequantize",
                          "--dtype", "q8_0", "--out", str(out)], capsys)
    assert code == 0
    contents = read_gguf(out)
    assert all(t.qtype == QT.Q8_0 for t in contents.tensors if is_matrix_weight(t))
    assert int(contents.metadata["general.file_type"].value) == LlamaFileType.MOSTLY_Q8_0


def test_without_dequantize_the_refusal_names_the_flag(bases, run_dir, tmp_path, capsys):
    out = tmp_path / "never.gguf"
    code, _, err = _export(["--from-gguf", str(bases["q4_1"]), "--adapters", str(run_dir), "--out", str(out)], capsys)
    assert code == 2 and "quantized base weights" in err and "--dequantize" in err and not out.exists()
    code, _, err = _export(["--from-gguf", str(bases["q4_1"]), "--dequantize", "--out", str(out)], capsys)
    assert code == 2 and "--dequantize only applies with --adapters" in err and not out.exists()
