"""Quantization encoders: byte-exact against llama.cpp (committed goldens + live parity), thread-invariant,
checked input."""
import ctypes
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from pipeline.kernels.quantize import BLOCK, quantize, to_bf16_bits, to_f16
from pipeline.threads import numba_threads

GOLDENS = Path(__file__).resolve().parent.parent / "goldens" / "quant" / "quant_goldens.npz"
QTYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "q8_0": QT.Q8_0,
          "q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K}
LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1"]


@pytest.fixture(scope="module")
def goldens():
    with np.load(GOLDENS) as z:
        return {k: z[k] for k in z.files}


def _cases(goldens):
    return sorted({k.split("/")[0] for k in goldens})


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_encoders_match_llama_cpp_goldens_byte_for_byte(goldens, qtype):
    cases = _cases(goldens)
    assert len(cases) >= 6
    for case in cases:
        ours = quantize(goldens[f"{case}/input"], qtype)
        expected = goldens[f"{case}/{qtype}"]
        assert ours.shape == expected.shape
        bad = np.flatnonzero((ours != expected).any(-1))
        assert bad.size == 0, f"{qtype}/{case}: rows {bad.tolist()} differ from llama.cpp"


def test_f16_and_bf16_rounding_match_llama_cpp_goldens(goldens):
    for case in _cases(goldens):
        x = goldens[f"{case}/input"]
        np.testing.assert_array_equal(to_f16(x).view(np.uint16), goldens[f"{case}/f16"], err_msg=case)
        np.testing.assert_array_equal(to_bf16_bits(x), goldens[f"{case}/bf16"], err_msg=case)


def _q8_0_numpy(x):
    """Reference: d = amax/127 (fp16-stored), q = round-half-away(x / d)."""
    blocks = x.reshape(-1, 32)
    d = (np.abs(blocks).max(1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    scaled = blocks * inv[:, None]
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8)
    # floor(|v| + 0.5) is roundf except where |v| + 0.5 rounds up in float32; use trunc-based where they differ
    t = np.trunc(scaled)
    exact = np.where(np.abs(scaled - t) >= 0.5, t + np.sign(scaled), t).astype(np.int8)
    assert np.abs(q.astype(int) - exact).max() <= 1
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), exact.view(np.uint8)], axis=1)
    return out.reshape(*x.shape[:-1], -1)


def test_q8_0_matches_numpy_reference_and_gguf_py():
    x = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32) * 3
    ours = quantize(x, "q8_0")
    np.testing.assert_array_equal(ours, _q8_0_numpy(x))
    np.testing.assert_array_equal(ours, gguf_quantize(x, QT.Q8_0))


@pytest.mark.parametrize("qtype", LEGACY)
def test_legacy_encoders_match_gguf_py_numpy_ports(goldens, qtype):
    """gguf-py's numpy ports of quantize_row_q{4,5}_{0,1}_ref are a second oracle: they give llama.cpp's
    bytes on every golden case (subnormal blocks whose 1/d overflows included), and ours on fresh data."""
    for case in _cases(goldens):
        with np.errstate(all="ignore"):
            ported = gguf_quantize(goldens[f"{case}/input"], QTYPES[qtype])
        np.testing.assert_array_equal(ported, goldens[f"{case}/{qtype}"], err_msg=case)
    x = np.random.default_rng(6).standard_normal((16, 512)).astype(np.float32) * 3
    x[3, :32] = 0
    x[5, 32:64] = 1.5
    np.testing.assert_array_equal(quantize(x, qtype), gguf_quantize(x, QTYPES[qtype]))


@pytest.mark.parametrize("qtype,rel_rmse", [("q4_0", 0.1), ("q4_1", 0.09), ("q5_0", 0.05), ("q5_1", 0.045),
                                            ("q8_0", 0.01), ("q4_k", 0.12), ("q5_k", 0.06), ("q6_k", 0.03)])
def test_decoded_values_are_close_to_the_input(qtype, rel_rmse):
    x = np.random.default_rng(4).standard_normal((16, 512)).astype(np.float32)
    y = dequantize(quantize(x, qtype), QTYPES[qtype]).reshape(x.shape)
    assert np.sqrt(np.mean((y - x) ** 2)) < rel_rmse
    zero = np.zeros((2, 512), np.float32)
    assert (dequantize(quantize(zero, qtype), QTYPES[qtype]) == 0).all()


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_bytes_do_not_depend_on_thread_count(qtype):
    x = np.random.default_rng(5).standard_normal((300, 256)).astype(np.float32)  # > 1 chunk of blocks
    with numba_threads(1):
        one = quantize(x, qtype)
    with numba_threads(2):
        two = quantize(x, qtype)
    np.testing.assert_array_equal(one, two)


def test_output_layout_is_rows_by_row_bytes():
    x = np.zeros((3, 5, 512), np.float32)
    for qtype, (values, nbytes) in BLOCK.items():
        assert quantize(x, qtype).shape == (3, 5, 512 // values * nbytes)


@pytest.mark.parametrize("bad,msg", [
    (np.zeros((2, 300), np.float32), "not a multiple of 256"),
    (np.zeros((2, 256), np.float64), "must be float32"),
    (np.full((1, 256), np.nan, np.float32), "NaN or infinite"),
])
def test_bad_input_is_refused_with_a_clear_message(bad, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        quantize(bad, "q4_k")
    with pytest.raises(ValueError, match="unknown type"):
        quantize(np.zeros((1, 256), np.float32), "q3_k")
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), "q5_0")


# --- live parity against llama.cpp's quantizer on fresh data -------------------

def _ggml():
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from gen_quant_goldens import ggml_base, ggml_quantize
    return ggml_base(), ggml_quantize


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
@pytest.mark.parametrize("qtype", list(QTYPES))
def test_fresh_random_data_matches_ggml_quantize_chunk(qtype):
    lib, ggml_quantize = _ggml()
    rng = np.random.default_rng()  # fresh every run: not a golden
    values, nbytes = BLOCK[qtype]
    for trial in range(12):
        scale = 10.0 ** rng.uniform(-7, 6)
        x = (rng.standard_t(3, (24, 512)) * scale).astype(np.float32)
        x[rng.random(x.shape) < 0.05] = 0
        x[rng.integers(0, 24)] = 0
        expected = ggml_quantize(lib, x, qtype, nbytes, values)
        ours = quantize(x, qtype)
        bad = np.flatnonzero((ours != expected).any(-1))
        assert bad.size == 0, f"{qtype} trial {trial} (scale {scale:g}): rows {bad.tolist()} differ"


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
@pytest.mark.parametrize("ftype,expect", [("Q8_0", {"Q8_0"}), ("Q4_K_S", {"Q4_K", "Q5_K", "Q6_K"}),
                                          ("Q5_K_S", {"Q5_K", "Q6_K"}), ("Q6_K", {"Q6_K"}), ("Q4_0", {"Q4_0", "Q6_K"}),
                                          ("Q4_1", {"Q4_1"}), ("Q5_0", {"Q5_0"}), ("Q5_1", {"Q5_1"})])
def test_llama_model_quantize_tensors_equal_our_encoding(tmp_path, ftype, expect):
    """Quantize a tiny Qwen3 with llama.cpp; every tensor it encoded must equal our bytes for its type."""
    import llama_cpp
    from test_export_fixtures import write_tiny_qwen3

    from pipeline.llm.gguf_write import read_gguf

    src = write_tiny_qwen3(tmp_path / "f32.gguf", dtype="f32", seed=11)
    dst = tmp_path / f"{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0
    base, quantized = read_gguf(src), read_gguf(dst)
    seen = set()
    for t in quantized.tensors:
        name = t.qtype.name.lower()
        if name not in BLOCK:
            continue
        seen.add(t.qtype.name)
        ours = quantize(base.tensor(t.name).dense(), name)
        np.testing.assert_array_equal(ours, t.data, err_msg=f"{ftype}: {t.name} ({t.qtype.name})")
    assert expect <= seen, f"{ftype}: llama.cpp produced {seen}"


def test_nearest_int_matches_ggml_bit_trick_everywhere():
    """ggml: (bits(f + 1.5*2**23) & 0x7fffff) - 0x400000, including far outside its asserted range."""
    from numba import njit

    from pipeline.kernels.quantize import _nearest_int

    @njit
    def ours(values, out):
        for i in range(values.size):
            out[i] = _nearest_int(values[i])

    rng = np.random.default_rng(9)
    with np.errstate(over="ignore"):
        values = np.concatenate([
            rng.uniform(-40, 40, 20000), rng.uniform(-5e6, 5e6, 20000), rng.standard_normal(2000) * 1e30,
            np.arange(-8, 8) + 0.5, [4194303.5, -4194304.5, 8388608.0, -12582912.0, 3e38, -3e38, np.inf, -np.inf],
        ]).astype(np.float32)
    out = np.zeros(values.size, np.int64)
    ours(values, out)
    with np.errstate(over="ignore"):
        summed = (values + np.float32(12582912.0)).astype(np.float32)
    reference = (summed.view(np.int32).astype(np.int64) & 0x7FFFFF) - 0x400000
    np.testing.assert_array_equal(out, reference)
