"""The `_K_M` mixes: our per-tensor type choice equals the one llama_model_quantize made (committed golden)."""
import ctypes
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from test_export_fixtures import write_tiny_qwen3

from pipeline.llm.gguf_write import encode, read_gguf, transcode
from pipeline.llm.quant_mix import mix_types, use_more_bits, visit_order

GOLDEN = Path(__file__).resolve().parent.parent / "goldens" / "quant" / "mix_types.json"
FTYPES = {"Q4_K_M": "q4_k_m", "Q5_K_M": "q5_k_m"}


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def _matrices(tensors):
    return [(name, shape[-1]) for name, shape, _ in tensors if len(shape) >= 2 and "norm" not in name]


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_plan_equals_llama_quantize_on_every_golden_model(golden, ftype):
    seen = Counter()
    for case, entry in golden.items():
        tensors = entry["tensors"][ftype]
        plan = mix_types(_matrices(tensors), FTYPES[ftype], entry["layers"])
        for name, shape, theirs in tensors:
            ours = plan[name][0].name if name in plan else "F32"  # the rest stays as stored (F32 here)
            assert ours == theirs, f"{case} {ftype}: {name} {shape}: ours {ours}, llama.cpp {theirs}"
            seen[theirs] += 1
    # the golden models reach the mix's rules and every shape fallback, so the comparison means something
    base = "Q4_K" if ftype == "Q4_K_M" else "Q5_K"
    assert {base, "Q6_K", "Q8_0", "F16", "Q5_0" if base == "Q4_K" else "Q5_1"} <= set(seen), seen


def test_more_bits_layers_and_visit_order():
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    names = ["output.weight", "blk.10.attn_v.weight", "blk.2.ffn_down.weight", "blk.2.attn_v.weight",
             "token_embd.weight"]
    assert visit_order(names) == ["output.weight", "token_embd.weight", "blk.2.attn_v.weight",
                                  "blk.2.ffn_down.weight", "blk.10.attn_v.weight"]


def test_transcode_writes_the_mix_with_our_encoders(golden, tmp_path):
    """The file --dtype q4_k_m writes: llama.cpp's types for the same model, each tensor our byte-exact encoding."""
    src = write_tiny_qwen3(tmp_path / "f32.gguf", hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, ffn=320)
    theirs = {name: t for name, _, t in golden["untied_ffn320"]["tensors"]["Q4_K_M"]}
    transcode(src, tmp_path / "mix.gguf", "q4_k_m")
    base, out = read_gguf(src), read_gguf(tmp_path / "mix.gguf")
    assert int(out.metadata["general.file_type"].value) == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    for t in out.tensors:
        assert t.qtype.name == theirs[t.name], t.name
        np.testing.assert_array_equal(t.data, encode(base.tensor(t.name).dense(), t.qtype), err_msg=t.name)


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
@pytest.mark.parametrize("ftype", list(FTYPES))
def test_mix_file_equals_llama_model_quantize_byte_for_byte(tmp_path, ftype):
    """Fresh data, tied output, ffn rows of 320: same types and same bytes as llama-quantize."""
    import llama_cpp
    fresh = int(np.random.SeedSequence().entropy % 1000)  # new data every run: not a golden
    src = write_tiny_qwen3(tmp_path / "f32.gguf", layers=8, ffn=320, tied=True, seed=fresh)
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    transcode(src, ours, FTYPES[ftype])
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    a, b = read_gguf(ours), read_gguf(theirs)
    assert sorted(t.name for t in a.tensors) == sorted(t.name for t in b.tensors)
    for t in b.tensors:
        mine = a.tensor(t.name)
        assert mine.qtype == t.qtype, f"{t.name}: ours {mine.qtype.name}, llama.cpp {t.qtype.name}"
        np.testing.assert_array_equal(mine.data, t.data, err_msg=t.name)


def test_export_gguf_offers_the_mixes_and_the_legacy_types(tmp_path, capsys):
    from pipeline.cli import main as fucina
    src = write_tiny_qwen3(tmp_path / "f32.gguf", layers=2)
    for dtype, expect in (("q5_k_m", {"Q5_K", "Q6_K"}), ("q4_1", {"Q4_1"})):
        out = tmp_path / "o.gguf"
        assert fucina(["export-gguf", "--from-gguf", str(src), "--dtype", dtype, "--out", str(out)]) == 0
        types = {t.qtype.name for t in read_gguf(out).tensors if len(t.shape) == 2}
        assert types == expect, (dtype, types)
