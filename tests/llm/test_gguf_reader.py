"""GGUF reading: metadata, tensor table, formats, and the bad-file errors."""
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from fuzz_cases import GGML_F32, GGML_Q8_0, STRING, U8, U32, array, gguf_bytes, kv, small_gguf, string, u32

from pipeline.cli import main
from pipeline.errors import GGUFError, UserError
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
                                        r"\(supported: gemma3, llama, qwen2, qwen3\)$"):
        Qwen3.from_gguf(_write(tmp_path / "gemma.gguf", arch="gemma"))
    with pytest.raises(UserError, match="architecture 'qwen3moe' is not supported"):
        Qwen3.from_gguf(_write(tmp_path / "moe.gguf", arch="qwen3moe"))
    with pytest.raises(UserError, match="mixture of experts"):
        Qwen3.from_gguf(_write(tmp_path / "moe2.gguf", extra={"qwen3.expert_count": 8}))
    with pytest.raises(UserError, match="qwen3.attention.head_count' is missing"):
        Qwen3.from_gguf(_write(tmp_path / "nometa.gguf"))


def test_unsupported_quant_type(tmp_path):
    q = gguf.quants.quantize(np.ones((4, 256), np.float32), gguf.GGMLQuantizationType.TQ2_0)
    wr = gguf.GGUFWriter(str(tmp_path / "q5.gguf"), arch="qwen3")
    wr.add_tensor("w", q, raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(UserError, match="'w' has type TQ2_0, which Fucina cannot read"):
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


# --- malformed headers: one GGUFError naming the file and the field -------------------------------

def test_the_hand_built_fixture_reads_as_gguf_py_reads_it(tmp_path):
    path = tmp_path / "small.gguf"
    path.write_bytes(small_gguf())
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert ours.get("tokenizer.ggml.tokens") == ["a", "bc", "<|x|>"] and ours.get("general.alignment") == 32
    for t in theirs.tensors:
        w = ours.weight(t.name)
        assert (ours.tensor_type(t.name), w.nbytes) == (t.tensor_type.name, t.n_bytes)
        assert np.array_equal(w.raw.reshape(-1).view(np.uint8), t.data.reshape(-1).view(np.uint8))


F32_8 = np.arange(8, dtype=np.float32).tobytes()
ONE_F32 = [("w", [8], GGML_F32, 0)]


def _refused(tmp_path, data, match):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=match) as err:
        GGUFFile(path)
    assert str(err.value).startswith(f"{path}: not a readable GGUF file: ")
    return str(err.value)


@pytest.mark.parametrize("entry,shown", [
    (u32("general.alignment", 0), "0"),                                   # was ZeroDivisionError
    (array("general.alignment", U32, [32, 64]), r"\[32, 64\]"),          # was TypeError
    (u32("general.alignment", 48), "48"),                                 # not a power of two
    (kv("general.alignment", 10, struct.pack("<Q", 32)), "32"),           # a u64, not the u32 the spec says
    (string("general.alignment", "32"), "'32'"),
])
def test_alignment_must_be_a_u32_power_of_two(tmp_path, entry, shown):
    _refused(tmp_path, gguf_bytes([entry], ONE_F32, F32_8),
             f"metadata key 'general.alignment' must be a u32 power of two, got {shown}")


def test_a_valid_non_default_alignment_is_used(tmp_path):
    path = tmp_path / "a64.gguf"
    path.write_bytes(gguf_bytes([u32("general.alignment", 64)], [("a", [8], GGML_F32, 0), ("b", [8], GGML_F32, 64)],
                                F32_8 + bytes(32) + F32_8, align=64))
    assert np.array_equal(GGUFFile(path).vector("b"), np.arange(8, dtype=np.float32))


@pytest.mark.parametrize("dims,ttype,match", [
    ([2**32, 2**32], GGML_F32, r"dims \[4294967296, 4294967296\]: more than 2\^63 - 1 elements"),  # was ValueError
    ([2**62, 0], GGML_F32, r"dims \[4611686018427387904, 0\]: more than 2\^63 - 1 elements or bytes"),  # numpy refuses
    ([31, 2], GGML_Q8_0, r"rows of 31 elements \(ne\[0\]\), not a multiple of Q8_0's block size 32"),
    ([1, 1, 1, 1, 1], GGML_F32, "n_dims 5, at most 4"),
])
def test_bad_dims_are_named(tmp_path, dims, ttype, match):
    _refused(tmp_path, gguf_bytes([], [("w", dims, ttype, 0)], F32_8), f"tensor 'w' has {match}")


@pytest.mark.parametrize("ttype", [4, 200, 2**32 - 1])
def test_unknown_ggml_type_is_named(tmp_path, ttype):
    _refused(tmp_path, gguf_bytes([], [("w", [8], ttype, 0)], F32_8), f"tensor 'w' has unknown ggml type {ttype}")


def test_tensor_data_must_be_aligned_inside_the_file_and_not_overlap(tmp_path):
    _refused(tmp_path, gguf_bytes([], [("w", [8], GGML_F32, 4)], F32_8 * 2), "'w' has offset 4, not a multiple of")
    _refused(tmp_path, gguf_bytes([], [("w", [16], GGML_F32, 0)], F32_8), r"'w' needs bytes \d+\.\.\d+, the file has")
    _refused(tmp_path, gguf_bytes([], [("w", [2**40], GGML_F32, 0)], F32_8), "'w' needs bytes")
    _refused(tmp_path, gguf_bytes([], [("a", [16], GGML_F32, 0), ("b", [8], GGML_F32, 32)], F32_8 * 2),
             "tensor 'b''s data overlaps tensor 'a''s")


def test_duplicates_are_refused(tmp_path):
    _refused(tmp_path, gguf_bytes([u32("k", 1), u32("k", 2)], ONE_F32, F32_8), "metadata key 'k' appears twice")
    _refused(tmp_path, gguf_bytes([], ONE_F32 * 2, F32_8), "tensor 'w' appears twice")


def test_counts_and_lengths_are_bounded_by_the_file_before_allocation(tmp_path):
    valid = gguf_bytes([string("general.name", "x"), array("t", STRING, ["a"])], ONE_F32, F32_8)
    header_end = 4 + 4 + 8 + 8
    for at, field in [(8, "tensor count"), (16, "metadata count")]:
        huge = valid[:at] + struct.pack("<Q", 2**60) + valid[at + 8:]
        _refused(tmp_path, huge, f"{field} is {2**60}: that many need at least")
    key_length = valid[:header_end] + struct.pack("<Q", 2**63) + valid[header_end + 8:]
    _refused(tmp_path, key_length, f"metadata key #0 needs {2**63} bytes at offset {header_end + 8}, only")
    for etype in (STRING, U8):
        entry = kv("t", 9, struct.pack("<IQ", etype, 2**62))
        _refused(tmp_path, gguf_bytes([entry], []), f"metadata key 't' count is {2**62}: that many need at least")
    _refused(tmp_path, gguf_bytes([kv("t", 9, struct.pack("<IQ", 9, 1))], []), "'t': array of unknown value type 9")
    _refused(tmp_path, gguf_bytes([kv("t", 13, b"")], []), "metadata key 't': unknown value type 13")


def test_empty_file_and_other_version(tmp_path):
    _refused(tmp_path, b"", "magic needs 4 bytes at offset 0, only 0 are left")
    _refused(tmp_path, gguf_bytes([], [], version=1), "version 1 is not supported")


def test_a_malformed_gguf_is_one_line_and_exit_code_2(tmp_path, capsys):
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_bytes([u32("general.alignment", 0)], ONE_F32, F32_8))
    assert main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.gguf: not a readable GGUF file: metadata key 'general.alignment'" in err
    assert issubclass(GGUFError, UserError)
