"""Tiled frozen-weight GEMMs (pipeline/kernels/qgemm.py): against a numpy reference on the gguf-py dequant,
several tiles per call, bitwise across thread counts and tile-to-thread assignment."""
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, quants

from pipeline.kernels import qgemm
from pipeline.threads import numba_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "llm"))
from test_gguf_dequant import SCALE_OFFSETS, random_blocks  # noqa: E402

QUANTIZED = list(SCALE_OFFSETS)  # every block format


def weight(qt, n_out, n_in, seed=0):
    """(raw, f32 reference) for a random weight in format qt."""
    if qt in QUANTIZED:
        raw = random_blocks(qt, n_out, n_in, seed)
        return raw, quants.dequantize(raw, qt).astype(np.float32)
    w = np.random.default_rng(seed).standard_normal((n_out, n_in)).astype(np.float32)
    if qt == QT.F16:
        raw = w.astype(np.float16)
        return raw, raw.astype(np.float32)
    if qt == QT.BF16:
        raw = (w.view(np.uint32) >> 16).astype(np.uint16)
        return raw, (raw.astype(np.uint32) << 16).view(np.float32)
    return w, w


def f32_dot_bound(a, b):
    """Worst-case error of any f32 summation order of a @ b: gamma_n * (|a| @ |b|), n the inner length,
    gamma_n = n*u / (1 - n*u), u = 2**-24 (each product is rounded once too, hence n + 1)."""
    n = a.shape[1] + 1
    u = 2.0 ** -24
    return n * u / (1 - n * u) * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 64 rows / one block of columns, so every call below spans several tiles."""
    monkeypatch.setattr(qgemm, "TILE_BYTES", 1)


@pytest.mark.parametrize("qt", QUANTIZED + [QT.F16, QT.BF16, QT.F32], ids=lambda q: q.name)
def test_matmul_t_and_matmul_match_numpy(qt, small_tiles):
    n_out, n_in = 200, 512  # 200 rows: a ragged last row tile
    raw, w = weight(qt, n_out, n_in)
    r = np.random.default_rng(1)
    x = r.standard_normal((7, n_in)).astype(np.float32)
    g = r.standard_normal((9, n_out)).astype(np.float32)
    ref_t = x.astype(np.float64) @ w.astype(np.float64).T
    ref = g.astype(np.float64) @ w.astype(np.float64)
    got_t, got = qgemm.matmul_t(int(qt), raw, x, (n_out, n_in)), qgemm.matmul(int(qt), raw, g, (n_out, n_in))
    assert got_t.shape == (7, n_out) and got.shape == (9, n_in) and got.dtype == np.float32
    assert (np.abs(got_t - ref_t) <= f32_dot_bound(x, w.T)).all()
    assert (np.abs(got - ref) <= f32_dot_bound(g, w)).all()


def test_f16_ragged_columns(small_tiles):
    """A 16-bit weight whose row length is not a multiple of the 32-column group."""
    raw, w = weight(QT.F16, 70, 100)
    g = np.random.default_rng(2).standard_normal((3, 70)).astype(np.float32)
    x = np.random.default_rng(3).standard_normal((5, 100)).astype(np.float32)
    np.testing.assert_allclose(qgemm.matmul(int(QT.F16), raw, g, (70, 100)), g @ w, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(qgemm.matmul_t(int(QT.F16), raw, x, (70, 100)), x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.BF16, QT.Q5_0, QT.Q2_K, QT.IQ4_XS], ids=lambda q: q.name)
def test_bitwise_across_thread_counts(qt, small_tiles):
    raw, _ = weight(qt, 300, 768, seed=4)
    r = np.random.default_rng(5)
    x = r.standard_normal((33, 768)).astype(np.float32)
    g = r.standard_normal((33, 300)).astype(np.float32)
    outs = []
    for n in (1, 2, 1, 2):
        with numba_threads(n):
            outs.append((qgemm.matmul_t(int(qt), raw, x, (300, 768)), qgemm.matmul(int(qt), raw, g, (300, 768))))
    for a, b in outs[1:]:
        np.testing.assert_array_equal(a.view(np.uint32), outs[0][0].view(np.uint32))
        np.testing.assert_array_equal(b.view(np.uint32), outs[0][1].view(np.uint32))


@pytest.mark.parametrize("qt", [QT.Q5_K, QT.Q4_1, QT.Q5_0, QT.Q2_K, QT.IQ4_NL], ids=lambda q: q.name)
def test_frozen_weight_matmul_is_the_backward_of_matmul_t(qt):
    from pipeline.llm.quants import FORMATS, FrozenWeight
    raw, w = weight(qt, 64, 256)
    fw = FrozenWeight(FORMATS[qt], raw, (64, 256), "blk.0.ffn_up.weight")
    g = np.random.default_rng(6).standard_normal((2, 3, 64)).astype(np.float32)
    got = fw.matmul(g)
    assert got.shape == (2, 3, 256)
    assert (np.abs(got - g.astype(np.float64) @ w) <= f32_dot_bound(g.reshape(6, 64), w).reshape(2, 3, 256)).all()
    for rows in (2, 16):  # the fused decode matvec, then the tiled path
        x = np.random.default_rng(7).standard_normal((rows, 256)).astype(np.float32)
        assert (np.abs(fw.matmul_t(x) - x.astype(np.float64) @ w.T) <= f32_dot_bound(x, w.T)).all()


def test_bad_shapes_are_named():
    raw, _ = weight(QT.Q4_K, 8, 256)
    with pytest.raises(ValueError, match=r"x must be \[N, 256\]"):
        qgemm.matmul_t(int(QT.Q4_K), raw, np.zeros((2, 128), np.float32), (8, 256))
    with pytest.raises(ValueError, match=r"g must be \[N, 8\]"):
        qgemm.matmul(int(QT.Q4_K), raw, np.zeros((2, 7), np.float32), (8, 256))
    with pytest.raises(ValueError, match="must be uint8"):
        qgemm.matmul(int(QT.Q4_K), raw[:, :100], np.zeros((2, 8), np.float32), (8, 256))
    with pytest.raises(ValueError, match="no kernel for ggml type"):
        qgemm.matmul(int(QT.IQ2_XXS), raw, np.zeros((2, 8), np.float32), (8, 256))


@pytest.mark.parametrize("rows", [5, qgemm.TRANSPOSE_BELOW_ROWS + 3])
def test_matmul_t_many_equals_one_by_one(rows, small_tiles):
    """Both BLAS orientations (few rows: W @ x.T; many rows: x @ W.T), mixed formats in one dispatch."""
    ws = [(int(qt), *weight(qt, n, 256, seed=i))
          for i, (qt, n) in enumerate([(QT.Q4_K, 80), (QT.F32, 48), (QT.BF16, 40)])]
    x = np.random.default_rng(8).standard_normal((rows, 256)).astype(np.float32)
    outs = qgemm.matmul_t_many([(qt, raw, w.shape) for qt, raw, w in ws], x)
    for (qt, raw, w), got in zip(ws, outs):
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, qgemm.matmul_t(qt, raw, x, w.shape))
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-4, atol=1e-5 * np.abs(x @ w.T).max())
