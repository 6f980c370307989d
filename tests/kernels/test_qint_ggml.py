"""The integer row kernels (pipeline/kernels/qint.py) and the blocked GEMM (qint_gemm.py) against llama.cpp itself:
llama-cpp-python's libggml-cpu exports quantize_row_q8_0/q8_1/q8_K and every ggml_vec_dot_*; each output element
must be the bits ggml's vec_dot computes for the same weight row and activation row, on the row lengths real
files use (hidden sizes of Qwen3-0.6B, Qwen2.5-0.5B, SmolLM2-135M, Gemma 3 270M, and an odd count of 32-blocks
for IQ4_NL's scalar tail). The numpy model of test_qint.py pins the same arithmetic without the oracle."""
import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pipeline.kernels import qint, qint_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "llm"))
from llama_oracle import ggml_cpu  # noqa: E402
from test_gguf_dequant import random_blocks  # noqa: E402

pytestmark = [pytest.mark.parity, pytest.mark.needs("llama_cpp")]

# weight format -> (ggml's vec_dot name, activation quantizer, activation block bytes, elements per block)
GGML = {QT.Q8_0: ("q8_0_q8_0", "q8_0", 34, 32), QT.Q4_0: ("q4_0_q8_0", "q8_0", 34, 32),
        QT.Q5_0: ("q5_0_q8_0", "q8_0", 34, 32), QT.IQ4_NL: ("iq4_nl_q8_0", "q8_0", 34, 32),
        QT.Q4_1: ("q4_1_q8_1", "q8_1", 36, 32), QT.Q5_1: ("q5_1_q8_1", "q8_1", 36, 32),
        QT.Q2_K: ("q2_K_q8_K", "q8_K", 292, 256), QT.Q3_K: ("q3_K_q8_K", "q8_K", 292, 256),
        QT.Q4_K: ("q4_K_q8_K", "q8_K", 292, 256), QT.Q5_K: ("q5_K_q8_K", "q8_K", 292, 256),
        QT.Q6_K: ("q6_K_q8_K", "q8_K", 292, 256), QT.IQ4_XS: ("iq4_xs_q8_K", "q8_K", 292, 256)}
ROW_LENGTHS = {32: (576, 640, 896, 1056), 256: (1024, 1536)}  # 1056: 33 blocks of 32


@pytest.fixture(scope="module")
def ggml():
    return ggml_cpu()


def ggml_matmul_t(lib, qt, raw, x):
    """out[i, r] = ggml_vec_dot(row r of raw, x[i] quantized by ggml), one call per element."""
    dot_name, partner, block_bytes, block = GGML[qt]
    quantize, dot = getattr(lib, f"quantize_row_{partner}"), getattr(lib, f"ggml_vec_dot_{dot_name}")
    n = x.shape[1]
    voidp = ctypes.c_void_p
    out = np.empty((x.shape[0], raw.shape[0]), np.float32)
    for i in range(x.shape[0]):
        xi = np.ascontiguousarray(x[i], np.float32)
        act = np.zeros(n // block * block_bytes, np.uint8)
        quantize(xi.ctypes.data_as(voidp), act.ctypes.data_as(voidp), ctypes.c_int64(n))
        for r in range(raw.shape[0]):
            row, value = np.ascontiguousarray(raw[r]), ctypes.c_float()
            dot(ctypes.c_int(n), ctypes.byref(value), ctypes.c_size_t(0), row.ctypes.data_as(voidp),
                ctypes.c_size_t(0), act.ctypes.data_as(voidp), ctypes.c_size_t(0), ctypes.c_int(1))
            out[i, r] = value.value
    return out


def activations(rows, n, seed):
    x = np.random.default_rng(seed).standard_normal((rows, n)).astype(np.float32)
    x[1, : n // 4] *= 1e-3  # quiet blocks: tiny scales, some fp16-subnormal
    x[2, 7] = 40.0  # one block dominated by an outlier, as real activations have
    return x


@pytest.mark.parametrize("qt", list(GGML), ids=lambda q: q.name)
def test_row_kernels_give_ggml_vec_dot_bits(ggml, qt):
    for n in ROW_LENGTHS[GGML[qt][3]]:
        raw = random_blocks(qt, 19, n, seed=n)
        x = activations(3, n, seed=n + 1)
        got = qint.matmul_t_many([(int(qt), raw)], x)[0]
        want = ggml_matmul_t(ggml, qt, raw, x)
        if qt == QT.IQ4_NL and (n // 32) % 2:
            assert_within_ulps(got, want, TAIL_ULPS, f"{qt.name}, n={n} (scalar tail)")
            continue
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{qt.name}, n={n}")


# ggml's IQ4_NL vec_dot ends an odd block count with plain C, `sumf += d * (sumi1 + sumi2)`, whose FMA contraction
# is the compiler's choice for the -march llama.cpp was built for: bit-equal to ours on AVX2-only AMD and on AVX-512
# Intel builds, 1-3 ulp apart on a Zen 4 build (8 of 57 elements). The lanes before the tail are the intrinsics'
# and stay pinned bitwise by the even block counts above; the tail's one rounding is held to a few ulps.
TAIL_ULPS = 4


def assert_within_ulps(got, want, ulps, msg):
    """Each f32 element within `ulps` units in the last place of ggml's (same sign, ordered as integers)."""
    assert np.array_equal(np.signbit(got), np.signbit(want)), msg
    gap = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert gap.max() <= ulps, f"{msg}: {int((gap > 0).sum())} elements differ, worst by {int(gap.max())} ulps"


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_blocked_gemm_gives_ggml_vec_dot_bits(ggml, qt):
    """The register-blocked GEMM (prefill rows below the tiles' 16, stacked ES members) is vec_dot too: 11 rows
    = groups of qint_gemm.ROWS and a tail."""
    raw = random_blocks(qt, 21, 1024, seed=3)
    x = activations(11, 1024, seed=4)
    got = qint_gemm.matmul_t_many([(int(qt), raw)], x)[0]
    np.testing.assert_array_equal(got.view(np.uint32), ggml_matmul_t(ggml, qt, raw, x).view(np.uint32))
