"""GGUF reading: metadata, tensor table, formats, and the bad-file errors."""
from pathlib import Path

import gguf
import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.llm.gguf import GGUFFile
from pipeline.models.qwen3 import Qwen3, Qwen3Config

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MINI = FIXTURES / "qwen3-mini-f32.gguf"


def test_metadata_and_tensors():
    gg = GGUFFile(MINI)
    assert gg.architecture == "qwen3"
    assert gg.get("qwen3.block_count") == 2
    assert gg.get("tokenizer.ggml.model") == "gpt2"
    assert isinstance(gg.get("tokenizer.ggml.tokens"), list)
    w = gg.weight("blk.0.attn_k.weight")
    assert w.shape == (32, 64) and w.format.name == "F32"
    cfg = Qwen3Config.from_gguf(gg)
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn) == (64, 2, 4, 2, 16, 128)
    assert cfg.tied_output and cfg.rope_base == 1_000_000.0


def test_quantized_weights_stay_quantized():
    gg = GGUFFile(FIXTURES / "qwen3-tied-q4_k_s.gguf")
    w = gg.weight("blk.0.ffn_gate.weight")
    assert w.format.name == "Q4_K" and w.raw.dtype == np.uint8
    assert w.nbytes == w.shape[0] * w.shape[1] // 256 * 144
    model = Qwen3.from_gguf(gg)
    assert model.blocks[0].mlp.gate.weight is not None and model.weight_bytes < 0.3 * 4 * sum(
        a * b for a, b in [gg.weight(n).shape for n in gg.tensor_names])


def _write(path, arch="qwen3", extra=None, tensors=None):
    wr = gguf.GGUFWriter(str(path), arch=arch)
    for k, v in (extra or {}).items():
        wr.add_uint32(k, v)
    for name, a in (tensors or {"token_embd.weight": np.zeros((8, 4), np.float32)}).items():
        wr.add_tensor(name, a)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def test_truncated_file(tmp_path):
    data = MINI.read_bytes()
    for cut in (10, 3000, len(data) // 2):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(UserError, match=f"cut{cut}.gguf: not a readable GGUF"):
            GGUFFile(p)


def test_not_gguf_and_missing(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello")
    with pytest.raises(UserError, match="x.gguf: not a readable GGUF"):
        GGUFFile(p)
    with pytest.raises(UserError, match="no such GGUF"):
        GGUFFile(tmp_path / "absent.gguf")


def test_other_architecture_and_moe(tmp_path):
    with pytest.raises(UserError, match=r"gemma.gguf: architecture 'gemma' is not supported "
                                        r"\(supported: llama, qwen2, qwen3\)$"):
        Qwen3.from_gguf(_write(tmp_path / "gemma.gguf", arch="gemma"))
    with pytest.raises(UserError, match="architecture 'qwen3moe' is not supported"):
        Qwen3.from_gguf(_write(tmp_path / "moe.gguf", arch="qwen3moe"))
    with pytest.raises(UserError, match="mixture of experts"):
        Qwen3.from_gguf(_write(tmp_path / "moe2.gguf", extra={"qwen3.expert_count": 8}))
    with pytest.raises(UserError, match="qwen3.attention.head_count' is missing"):
        Qwen3.from_gguf(_write(tmp_path / "nometa.gguf"))


def test_unsupported_quant_type(tmp_path):
    q = gguf.quants.quantize(np.ones((4, 32), np.float32), gguf.GGMLQuantizationType.Q5_0)
    wr = gguf.GGUFWriter(str(tmp_path / "q5.gguf"), arch="qwen3")
    wr.add_tensor("w", q, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(UserError, match="'w' has type Q5_0, which Fucina cannot read"):
        GGUFFile(tmp_path / "q5.gguf").weight("w")


def test_shape_mismatch_is_named(tmp_path):
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import make_tiny_model as mk
    shape = mk.SHAPES["mini"]
    w = mk.make_weights(shape, 0)
    w["blk.1.ffn_up.weight"] = w["blk.1.ffn_up.weight"][:64]
    p = mk.write_gguf(tmp_path / "bad.gguf", shape, weights=w)
    with pytest.raises(UserError, match="'blk.1.ffn_up.weight' has shape \\(64, 64\\)"):
        Qwen3.from_gguf(p)
