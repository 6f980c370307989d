"""export-gguf / export-peft: verbatim re-emit, transcode policy, merge, adapter GGUF, PEFT, refusals."""
import ctypes
import filecmp
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from llama_oracle import CHILD_PRELUDE
from test_export_fixtures import write_adapters, write_tiny_qwen3

from pipeline.kernels.quantize import quantize, to_bf16_bits
from pipeline.cli import main as fucina
from pipeline.errors import UserError
from pipeline.llm.export import load_adapters, merge, resolve_alpha, write_lora_gguf, write_peft
from pipeline.llm.gguf_write import read_gguf, transcode

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("bases")
    return {dt: write_tiny_qwen3(d / f"{dt}.gguf", dtype=dt) for dt in ("f32", "f16", "bf16")}


def _run(argv, capsys):
    code = fucina(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# --- verbatim re-emit ----------------------------------------------------------

def test_verbatim_re_emit_is_byte_identical(bases, tmp_path):
    sources = list(bases.values()) + sorted(FIXTURES.glob("*.gguf"))
    for src in sources:
        dst = tmp_path / f"re-{Path(src).name}"
        transcode(src, dst, None)
        assert filecmp.cmp(src, dst, shallow=False), f"{src} re-emit differs"


def test_verbatim_re_emit_through_the_cli(bases, tmp_path, capsys):
    code, out, _ = _run(["export-gguf", "--from-gguf", str(bases["f16"]), "--out", str(tmp_path / "c.gguf")], capsys)
    assert code == 0 and "0 converted" in out
    assert filecmp.cmp(bases["f16"], tmp_path / "c.gguf", shallow=False)


# --- transcode -----------------------------------------------------------------

@pytest.mark.parametrize("dtype,qt", [("q4_k", QT.Q4_K), ("q8_0", QT.Q8_0), ("bf16", QT.BF16), ("q6_k", QT.Q6_K)])
def test_transcode_converts_matrix_weights_only_with_our_encoder(bases, tmp_path, dtype, qt):
    dst = tmp_path / f"{dtype}.gguf"
    transcode(bases["f16"], dst, dtype)
    src, out = read_gguf(bases["f16"]), read_gguf(dst)
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    for t in out.tensors:
        s = src.tensor(t.name)
        if len(t.shape) == 1 or "norm" in t.name:
            assert t.qtype == s.qtype and np.array_equal(t.data, s.data), t.name
            continue
        assert t.qtype == qt, t.name
        expected = to_bf16_bits(s.dense()).view(np.uint8).reshape(t.data.shape) if dtype == "bf16" \
            else quantize(s.dense(), dtype)
        np.testing.assert_array_equal(t.data, expected, err_msg=t.name)
    assert int(out.metadata["general.file_type"].value) != int(src.metadata["general.file_type"].value)


def test_k_quant_falls_back_to_source_type_on_rows_not_multiple_of_256(tmp_path):
    src = write_tiny_qwen3(tmp_path / "odd.gguf", dtype="f16", ffn=320)  # ffn_down rows are 320 long
    lines = []
    rows = transcode(src, tmp_path / "q.gguf", "q5_k", log=lines.append)
    kinds = {name: (old, new) for name, old, new, _ in rows}
    assert kinds["blk.0.ffn_down.weight"] == ("F16", "F16")
    assert kinds["blk.0.ffn_up.weight"] == ("F16", "Q5_K")
    assert any("blk.0.ffn_down.weight" in line and "320" in line for line in lines)
    rows = transcode(src, tmp_path / "q8.gguf", "q8_0")  # 320 % 32 == 0: Q8_0 applies
    assert {new for name, _, new, _ in rows if "ffn_down" in name} == {"Q8_0"}


def test_quantized_sources_are_re_emitted_verbatim_never_requantized(tmp_path):
    src = write_tiny_qwen3(tmp_path / "odd.gguf", dtype="f16", ffn=320)  # ffn_down rows stay F16 under q5_k
    q5 = tmp_path / "q5.gguf"
    transcode(src, q5, "q5_k")
    q8 = tmp_path / "q8.gguf"
    rows = transcode(q5, q8, "q8_0")  # converts only the F16 ffn_down
    assert {name for name, old, new, _ in rows if old != new} == {"blk.0.ffn_down.weight", "blk.1.ffn_down.weight"}
    assert any("re-emitted verbatim" in reason for *_, reason in rows)
    a, b = read_gguf(q5), read_gguf(q8)
    for t in a.tensors:
        if "ffn_down" not in t.name:
            np.testing.assert_array_equal(t.data, b.tensor(t.name).data)
    with pytest.raises(UserError, match="no tensor of .* converts to Q6_K .*already quantized \\(Q5_K\\)"):
        transcode(q8, tmp_path / "q6.gguf", "q6_k")  # nothing left to convert
    assert not (tmp_path / "q6.gguf").exists()


def test_transcode_to_f32_widens_exactly(bases, tmp_path):
    transcode(bases["bf16"], tmp_path / "f32.gguf", "f32")
    src, out = read_gguf(bases["bf16"]), read_gguf(tmp_path / "f32.gguf")
    w = out.tensor("blk.0.attn_q.weight")
    assert w.qtype == QT.F32
    np.testing.assert_array_equal(w.dense(), src.tensor("blk.0.attn_q.weight").dense())


# --- merge ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_merge_adds_scaled_b_at_a_and_keeps_everything_else(bases, tmp_path, dtype):
    tensors = write_adapters(tmp_path / "run", targets=("q", "v", "down"), rank=4, alpha=8.0)
    adapters = load_adapters(tmp_path / "run")
    alpha = resolve_alpha(None, adapters)
    assert alpha == 8.0
    out = tmp_path / "merged.gguf"
    names = merge(bases[dtype], adapters, alpha, out)
    assert sorted(names) == sorted(f"blk.{i}.{t}.weight" for i in range(2) for t in ("attn_q", "attn_v", "ffn_down"))
    src, got = read_gguf(bases[dtype]), read_gguf(out)
    for t in got.tensors:
        s = src.tensor(t.name)
        assert t.qtype == s.qtype and t.shape == s.shape
        if t.name not in names:
            np.testing.assert_array_equal(t.data, s.data, err_msg=t.name)
    layer, target = 1, "down"
    a, b = tensors[f"layers.{layer}.{target}.lora_a"], tensors[f"layers.{layer}.{target}.lora_b"]
    reference = s_dense = src.tensor("blk.1.ffn_down.weight").dense()
    reference = s_dense + (b.astype(np.float64) @ a.astype(np.float64) * (8.0 / 4)).astype(np.float32)
    merged = got.tensor("blk.1.ffn_down.weight").dense()
    ulp = {"f32": 1e-6, "f16": 1e-3, "bf16": 8e-3}[dtype]
    np.testing.assert_allclose(merged, reference, rtol=ulp, atol=ulp * np.abs(reference).max())
    assert not np.array_equal(merged, s_dense)


def test_merge_via_cli_defaults_alpha_from_trainer_state(bases, tmp_path, capsys):
    write_adapters(tmp_path / "run", alpha=16)
    out = tmp_path / "m.gguf"
    code, stdout, _ = _run(["export-gguf", "--from-gguf", str(bases["f16"]), "--adapters", str(tmp_path / "run"),
                            "--out", str(out)], capsys)
    assert code == 0 and "alpha=16" in stdout and out.is_file()
    code, stdout, _ = _run(["export-gguf", "--from-gguf", str(bases["f16"]), "--adapters", str(tmp_path / "run"),
                            "--alpha", "4", "--out", str(tmp_path / "m4.gguf")], capsys)
    assert code == 0 and "alpha=4" in stdout
    d16 = (read_gguf(out).tensor("blk.0.attn_q.weight").dense()
           - read_gguf(bases["f16"]).tensor("blk.0.attn_q.weight").dense())
    d4 = (read_gguf(tmp_path / "m4.gguf").tensor("blk.0.attn_q.weight").dense()
          - read_gguf(bases["f16"]).tensor("blk.0.attn_q.weight").dense())
    assert np.abs(d16).max() > 3 * np.abs(d4).max()


# --- refusals ------------------------------------------------------------------

def _refused(argv, capsys, tmp_path, *needles):
    code, out, err = _run(argv, capsys)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) >= 1 and "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)
    return err


def test_quantized_merge_base_is_refused_with_the_two_pass_recipe(bases, tmp_path, capsys):
    q = tmp_path / "q8.gguf"
    transcode(bases["f32"], q, "q8_0")
    write_adapters(tmp_path / "run", alpha=16)
    out = tmp_path / "never.gguf"
    _refused(["export-gguf", "--from-gguf", str(q), "--adapters", str(tmp_path / "run"), "--out", str(out)],
             capsys, tmp_path, "quantized", "Q8_0", "--dtype q4_k", "compound")
    assert not out.exists() and not list(tmp_path.glob(".never.gguf*"))


def test_adapters_matching_no_tensor_are_refused(bases, tmp_path, capsys):
    write_adapters(tmp_path / "run", layers=4, alpha=16)  # the base has 2 layers
    _refused(["export-gguf", "--from-gguf", str(bases["f32"]), "--adapters", str(tmp_path / "run"),
              "--out", str(tmp_path / "x.gguf")], capsys, tmp_path, "blk.2.attn_q.weight", "match no tensor")
    write_adapters(tmp_path / "wide", dims={"q": (256, 512), "v": (128, 512)}, alpha=16)
    _refused(["export-gguf", "--from-gguf", str(bases["f32"]), "--adapters", str(tmp_path / "wide"),
              "--out", str(tmp_path / "x.gguf")], capsys, tmp_path, "[out, in]", "another model")
    assert not (tmp_path / "x.gguf").exists()


def test_wrong_alpha_types_are_refused(bases, tmp_path, capsys):
    write_adapters(tmp_path / "run", alpha=16)
    common = ["export-gguf", "--from-gguf", str(bases["f32"]), "--adapters", str(tmp_path / "run"),
              "--out", str(tmp_path / "x.gguf")]
    _refused(common + ["--alpha", "sixteen"], capsys, tmp_path, "--alpha", "must be a number")
    _refused(common + ["--alpha", "-2"], capsys, tmp_path, "positive")
    write_adapters(tmp_path / "bad", alpha="16")
    adapters = load_adapters(tmp_path / "bad")
    assert resolve_alpha(None, adapters) == 16.0  # a numeric string is still a number
    write_adapters(tmp_path / "worse", alpha=[16])
    with pytest.raises(UserError, match="config.lora.alpha: alpha must be a number"):
        resolve_alpha(None, load_adapters(tmp_path / "worse"))
    from pipeline.train.trainer_state import TrainerState
    (tmp_path / "bad" / "trainer_state.json").write_text(TrainerState(step=1, config={"lora_alpha": 2.5}).to_json())
    assert resolve_alpha(None, load_adapters(tmp_path / "bad")) == 2.5  # the flat key is read too
    write_adapters(tmp_path / "none")  # no alpha recorded
    _refused(common[:4] + [str(tmp_path / "none"), "--out", str(tmp_path / "x.gguf")], capsys, tmp_path,
             "pass --alpha", "never stores it")


def test_checkpoint_without_sentinel_is_refused(bases, tmp_path, capsys):
    write_adapters(tmp_path / "run", alpha=16, sentinel=False)
    _refused(["export-gguf", "--from-gguf", str(bases["f32"]), "--adapters", str(tmp_path / "run"),
              "--out", str(tmp_path / "x.gguf")], capsys, tmp_path, "not a committed checkpoint", "trainer_state.json")
    _refused(["export-peft", "--adapters", str(tmp_path / "run"), "--out", str(tmp_path / "peft")],
             capsys, tmp_path, "not a committed checkpoint")
    write_adapters(tmp_path / "run" / "checkpoint-step-20", alpha=16)  # a periodic save inside the run directory
    _refused(["export-peft", "--adapters", str(tmp_path / "run"), "--out", str(tmp_path / "peft")],
             capsys, tmp_path, "not a committed checkpoint", "checkpoint-step-20")
    assert not (tmp_path / "peft" / "adapter_config.json").exists()


def test_merge_and_dtype_in_one_pass_is_refused(bases, tmp_path, capsys):
    write_adapters(tmp_path / "run", alpha=16)
    _refused(["export-gguf", "--from-gguf", str(bases["f32"]), "--adapters", str(tmp_path / "run"),
              "--dtype", "q4_k", "--out", str(tmp_path / "x.gguf")], capsys, tmp_path, "separate passes")


def test_bf16_adapters_are_widened_exactly(tmp_path):
    import ml_dtypes

    from pipeline.train.state_dict import save_state_dict
    tensors = write_adapters(tmp_path / "run", alpha=16)
    save_state_dict(tmp_path / "run" / "adapters.safetensors",
                    {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()})
    pair = load_adapters(tmp_path / "run").pairs[0]
    assert pair.a.dtype == np.float32
    np.testing.assert_array_equal(pair.a, tensors["layers.0.q.lora_a"].astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bad_adapter_files_are_refused(tmp_path):
    write_adapters(tmp_path / "run", alpha=16)
    from pipeline.train.state_dict import save_state_dict
    save_state_dict(tmp_path / "run" / "adapters.safetensors",
                    {"layers.0.q.lora_a": np.zeros((4, 256), np.float32)})
    with pytest.raises(UserError, match="lora_b is missing"):
        load_adapters(tmp_path / "run")
    save_state_dict(tmp_path / "run" / "adapters.safetensors", {"layers.0.qkv.lora_a": np.zeros((4, 256), np.float32)})
    with pytest.raises(UserError, match="not an adapter name"):
        load_adapters(tmp_path / "run")


def test_not_a_gguf_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    _refused(["export-gguf", "--from-gguf", str(bad), "--out", str(tmp_path / "x.gguf")], capsys, tmp_path,
             str(bad))


# --- adapter GGUF and PEFT -------------------------------------------------------

def test_lora_gguf_layout(bases, tmp_path, capsys):
    tensors = write_adapters(tmp_path / "run", targets=("q", "k", "v", "o", "gate", "up", "down"), rank=4, alpha=8)
    out = tmp_path / "adapter.gguf"
    code, _, _ = _run(["export-gguf", "--adapters", str(tmp_path / "run"), "--base", str(bases["f16"]),
                       "--lora-out", str(out)], capsys)
    assert code == 0
    g = read_gguf(out)
    meta = {k: v.value for k, v in g.metadata.items()}
    assert meta["general.type"] == b"adapter" and meta["adapter.type"] == b"lora"
    assert meta["general.architecture"] == b"qwen3" and float(meta["adapter.lora.alpha"]) == 8.0
    assert len(g.tensors) == 2 * 2 * 7
    a = g.tensor("blk.1.ffn_down.weight.lora_a")
    b = g.tensor("blk.1.ffn_down.weight.lora_b")
    assert a.shape == (4, 512) and b.shape == (256, 4) and a.qtype == QT.F32
    np.testing.assert_array_equal(a.dense(), tensors["layers.1.down.lora_a"])
    np.testing.assert_array_equal(b.dense(), tensors["layers.1.down.lora_b"])


def test_peft_directory_names_shapes_and_config(tmp_path, capsys):
    tensors = write_adapters(tmp_path / "run", targets=("q", "v", "gate"), rank=4, alpha=16)
    code, _, _ = _run(["export-peft", "--adapters", str(tmp_path / "run"), "--out", str(tmp_path / "peft"),
                       "--base-model", "Qwen/Qwen3-0.6B"], capsys)
    assert code == 0
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 16.0
    assert cfg["target_modules"] == ["q_proj", "v_proj", "gate_proj"]
    from safetensors.numpy import load_file
    st = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert len(st) == 2 * 2 * 3
    np.testing.assert_array_equal(st["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"],
                                  tensors["layers.1.v.lora_a"])
    np.testing.assert_array_equal(st["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"],
                                  tensors["layers.0.gate.lora_b"])


# --- llama.cpp parity ------------------------------------------------------------

_LLAMA_EVAL = CHILD_PRELUDE + """
import numpy as np
model, out, lora, tokens = sys.argv[1], sys.argv[2], sys.argv[3], [int(t) for t in sys.argv[4].split(",")]
kw = {"lora_path": lora} if lora else {}
llm = llama(model, n_ctx=64, logits_all=True, n_threads=2, type_k=0, type_v=0, **kw)  # f32 KV cache for tight parity
llm.eval(tokens)
np.save(out, np.array(llm.scores[:len(tokens)], np.float32))
"""


def _llama_logits(model, tokens, lora=None):
    """llama.cpp's logits for every position, evaluated in a child process.

    A child, because llama-cpp-python's native backend can die with SIGILL in
    quantized matmul kernels (AMX advertised but not enabled); we turn its
    extra buffer types off, and a SIGILL anyway is a skip, not a crash."""
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "logits.npy"
        proc = subprocess.run([sys.executable, "-c", _LLAMA_EVAL, str(model), str(out), str(lora or ""),
                               ",".join(map(str, tokens))], capture_output=True, text=True)
        if proc.returncode == -4:
            pytest.skip(f"llama.cpp died with SIGILL evaluating {Path(model).name} (its CPU kernels use an "
                        "instruction this machine lacks)")
        assert proc.returncode == 0, proc.stderr[-2000:]
        return np.load(out)


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
def test_adapter_gguf_in_llama_cpp_matches_our_merged_model(bases, tmp_path):
    """llama.cpp(base + adapter GGUF) == llama.cpp(our merged GGUF), within float tolerance."""
    write_adapters(tmp_path / "run", targets=("q", "k", "v", "o", "gate", "up", "down"), rank=4, alpha=8, scale=0.3)
    adapters = load_adapters(tmp_path / "run")
    merge(bases["f32"], adapters, 8.0, tmp_path / "merged.gguf")
    write_lora_gguf(adapters, 8.0, bases["f32"], tmp_path / "adapter.gguf")
    tokens = [5, 80, 200, 33, 17, 250, 91, 4]
    base = _llama_logits(bases["f32"], tokens)
    merged = _llama_logits(tmp_path / "merged.gguf", tokens)
    served = _llama_logits(bases["f32"], tokens, lora=tmp_path / "adapter.gguf")
    assert np.abs(merged - base).max() > 1e-2  # the adapters change the model
    np.testing.assert_allclose(served, merged, atol=2e-3 * np.abs(merged).max(), rtol=0)


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
def test_our_q6_k_transcode_matches_llama_quantize_and_loads_in_llama_cpp(bases, tmp_path):
    """Our --dtype q6_k file: every tensor byte-equal to llama.cpp's own encoding of it, and llama.cpp serves it."""
    import llama_cpp
    ours = tmp_path / "ours.gguf"
    transcode(bases["f32"], ours, "q6_k")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K  # uniform Q6_K for matrix weights in llama.cpp too
    theirs = tmp_path / "theirs.gguf"
    assert llama_cpp.llama_model_quantize(str(bases["f32"]).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    a, b = read_gguf(ours), read_gguf(theirs)
    for t in b.tensors:
        if t.qtype == QT.Q6_K:
            np.testing.assert_array_equal(a.tensor(t.name).data, t.data, err_msg=t.name)
    tokens = [5, 80, 200, 33]
    served = _llama_logits(ours, tokens)  # skips on machines where llama.cpp's quantized kernels SIGILL
    np.testing.assert_allclose(served, _llama_logits(theirs, tokens), atol=1e-4)


@pytest.mark.parity
@pytest.mark.needs("peft")
@pytest.mark.needs("transformers")
@pytest.mark.needs("torch")
def test_peft_export_loads_in_peft(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tensors = write_adapters(tmp_path / "run", targets=("q", "v", "down"), rank=4, alpha=16)
    write_peft(load_adapters(tmp_path / "run"), 16.0, tmp_path / "peft")
    cfg = Qwen3Config(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(cfg)
    before = {k: v.detach().clone() for k, v in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, tmp_path / "peft").merge_and_unload().state_dict()
    for i, target, module in ((1, "v", "self_attn.v_proj"), (0, "q", "self_attn.q_proj"), (1, "down", "mlp.down_proj")):
        key = f"model.layers.{i}.{module}.weight"
        delta = (merged[key] - before[key]).numpy()
        expected = tensors[f"layers.{i}.{target}.lora_b"] @ tensors[f"layers.{i}.{target}.lora_a"] * (16.0 / 4)
        np.testing.assert_allclose(delta, expected, atol=1e-5, err_msg=key)
    untouched = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(merged[untouched], before[untouched])
