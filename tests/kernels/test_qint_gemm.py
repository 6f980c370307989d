"""The register-blocked integer GEMM (pipeline/kernels/qint_gemm.py): bitwise the numpy model of llama.cpp's arithmetic
(test_qint.reference: int64 lanes, long-double FMAs) and so bitwise the row kernels, for any row grouping,
weight cut and thread count."""
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pipeline.kernels import qint, qint_gemm
from pipeline.threads import numba_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "llm"))
from test_gguf_dequant import random_blocks  # noqa: E402
from test_qint import reference  # noqa: E402

FORMATS = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_1, QT.Q5_1]
# where a block's fp16 d (and m) sit, kept when the other bytes are set to their largest
SCALARS = {QT.Q4_K: (0, 4), QT.Q5_K: (0, 4), QT.Q6_K: (208, 210), QT.Q8_0: (0, 2), QT.Q4_0: (0, 2), QT.Q5_0: (0, 2),
           QT.Q4_1: (0, 4), QT.Q5_1: (0, 4)}


@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_blocked_gemm_bitwise_equals_llama_model(qt):
    rows = 2 * qint_gemm.ROWS + 1  # two blocked groups and a tail row through the row kernel
    raw = random_blocks(qt, 37, 768, seed=3)
    x = np.random.default_rng(4).standard_normal((rows, 768)).astype(np.float32)
    x[1, :256] *= 1e-3  # a quiet block in a blocked group
    x[5, 256:512] = 0.0  # an all-zero block (d = 0, sums 0)
    x[6, 64:96] *= 1e4  # a loud 32-element block beside quiet ones
    got = qint_gemm.matmul_t_many([(int(qt), raw)], x)[0]
    with np.errstate(invalid="ignore"):  # the model's 0 * inf on the zero block, masked to q = 0 there
        want = reference(qt, raw, x)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(got.view(np.uint32), qint.matmul_t_many([(int(qt), raw)], x)[0].view(np.uint32))


@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_largest_weights_and_activations_stay_exact(qt):
    """Every weight quant and scale at its top (all bits set), every activation at +-127: the largest sums the
    blocked kernels' i16 steps can see (the VNNI path's running sums of sub-block pair dots: 4 * 4 * 15 * 127
    for Q4_K, 2 * 4 * 31 * 127 for Q5_K) must not saturate; Q8_0's weights at -128 too (the 32-element formats'
    offset weights, u = w + 128 = 0, against a start of 128 * 4 * 127)."""
    raw = random_blocks(qt, 9, 512, seed=8)
    per_block = raw.reshape(9, 512 // {QT.Q4_K: 256, QT.Q5_K: 256, QT.Q6_K: 256}.get(qt, 32), -1)
    scalars = SCALARS[qt]  # the f16 d (and dmin) keep their values
    keep = per_block[..., scalars[0]:scalars[1]].copy()
    per_block[...] = 0xFF if qt != QT.Q6_K else 0x7F  # Q6_K: the int8 scales at +127, the quants at 63
    if qt == QT.Q8_0:
        per_block[::2, :, 2:] = 0x80  # half the rows at -128
    per_block[..., scalars[0]:scalars[1]] = keep
    x = np.ones((2 * qint_gemm.ROWS, 512), np.float32)
    x[1::2] = -1.0
    got = qint_gemm.matmul_t_many([(int(qt), raw)], x)[0]
    np.testing.assert_array_equal(got.view(np.uint32), reference(qt, raw, x).view(np.uint32))


def test_bits_do_not_depend_on_threads_cut_or_grouping():
    """More weight rows than one piece, two weights in one dispatch, 1 vs 2 threads; a row's bits are the same
    whichever group of ROWS it falls in (computed alone, or after a shift of one row)."""
    raw_k, raw_6 = random_blocks(QT.Q4_K, qint_gemm.PIECE_ROWS + 20, 256, seed=5), random_blocks(QT.Q6_K, 24, 256)
    x = np.random.default_rng(6).standard_normal((11, 256)).astype(np.float32)
    outs = []
    for n in (1, 2):
        with numba_threads(n):
            outs.append(qint_gemm.matmul_t_many([(int(QT.Q4_K), raw_k), (int(QT.Q6_K), raw_6)], x))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    shifted = qint_gemm.matmul_t_many([(int(QT.Q4_K), raw_k)], x[1:])[0]
    np.testing.assert_array_equal(shifted, outs[0][0][1:])
    alone = qint.matmul_t_many([(int(QT.Q4_K), raw_k[:3])], x[6:7])[0]  # one row, the decode kernel
    np.testing.assert_array_equal(alone, outs[0][0][6:7, :3])


def test_partners_in_one_dispatch_and_threads():
    """Q8_0-, Q8_1- and Q8_K-partnered weights in one call (each partner's activations quantized once), over more
    than one piece of rows, at 1 and 2 threads: bitwise the row kernels one weight at a time."""
    weights = [(int(qt), random_blocks(qt, rows, 512, seed=rows)) for qt, rows in
               ((QT.Q5_0, qint_gemm.PIECE_ROWS + 9), (QT.Q4_K, 20), (QT.Q4_1, 12), (QT.Q8_0, 7))]
    x = np.random.default_rng(9).standard_normal((2 * qint_gemm.ROWS + 5, 512)).astype(np.float32)
    for n in (1, 2):
        with numba_threads(n):
            got = qint_gemm.matmul_t_many(weights, x)
        for w, y in zip(weights, got):
            np.testing.assert_array_equal(y.view(np.uint32), qint.matmul_t_many([w], x)[0].view(np.uint32))


def test_bad_input_is_refused():
    x = np.zeros((8, 256), np.float32)
    with pytest.raises(ValueError, match="no blocked integer kernel"):
        qint_gemm.matmul_t_many([(int(QT.IQ4_NL), random_blocks(QT.IQ4_NL, 4, 256))], x)
    with pytest.raises(ValueError, match="row of 256 elements"):
        qint_gemm.matmul_t_many([(int(QT.Q4_K), random_blocks(QT.Q4_K, 4, 512))], x)
    with pytest.raises(ValueError, match="must be"):
        qint_gemm.matmul_t_many([(int(QT.Q4_K), random_blocks(QT.Q4_K, 4, 256))], np.zeros(256, np.float32))


@pytest.mark.parametrize("n", [1, 3, 6, 16])
def test_groups_in_one_integer_call_equal_group_by_group(n):
    """quants.matmul_t_groups stacks the groups' rows into one integer call (ES members, lock-step decode):
    bitwise the per-group calls, for decode-sized and prefill-sized groups (16: Q4_K's tiles), K-quants, and
    Q8_0 / Q4_1 (integer for decode rows, the f32 tiles for prompts: their f32_prompt rows)."""
    from pipeline.autograd import no_grad
    from pipeline.llm.quants import FORMATS, FrozenWeight, matmul_t_groups, matmul_t_many
    for qt in (QT.Q4_K, QT.Q8_0, QT.Q4_1):
        weights = [FrozenWeight(FORMATS[qt], random_blocks(qt, rows, 256, seed=rows), (rows, 256)) for rows in (24, 40)]
        x3 = np.random.default_rng(n).standard_normal((5, n, 256)).astype(np.float32)
        with no_grad():
            assert all(w.uses_integer_dot(n) for w in weights) == (qt == QT.Q4_K or n <= 4)
            got = matmul_t_groups(weights, x3)
            for j in range(len(x3)):
                for y, want in zip(got, matmul_t_many(weights, x3[j])):
                    np.testing.assert_array_equal(y[j].view(np.uint32), want.view(np.uint32))
