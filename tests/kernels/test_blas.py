"""pipeline/kernels/blas.py: one single-threaded sgemm call, MKL when installed, numpy's OpenBLAS otherwise."""
import os
import subprocess
import sys

import numpy as np
import pytest

from pipeline.kernels import blas

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
has_mkl = blas.backend() == "mkl"


def _within_rounding(got, a, b):
    """|got - a@b| <= 1e-5 * (|a| @ |b|) elementwise, against float64."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert np.all(np.abs(got - a64 @ b64) <= 1e-5 * (np.abs(a64) @ np.abs(b64)) + 1e-30)


@pytest.fixture
def mats():
    r = np.random.default_rng(5)
    return r.standard_normal((70, 300)).astype(np.float32), r.standard_normal((300, 90)).astype(np.float32)


@pytest.mark.parametrize("layout", ["nn", "a_transposed", "b_transposed", "both_transposed", "sliced"])
def test_gemm_layouts_match_float64(mats, layout):
    a, b = mats
    if layout in ("a_transposed", "both_transposed"):
        a = np.ascontiguousarray(a.T).T
    if layout in ("b_transposed", "both_transposed"):
        b = np.ascontiguousarray(b.T).T
    if layout == "sliced":  # a column slice of a wider operand and of the output: leading dims > widths
        wide = np.zeros((300, 200), np.float32)
        wide[:, 50:140] = b
        b = wide[:, 50:140]
        out_wide = np.full((70, 150), 7.0, np.float32)
        got = blas.gemm(a, b, out_wide[:, 20:110])
        assert np.shares_memory(got, out_wide)
        assert np.all(out_wide[:, :20] == 7.0) and np.all(out_wide[:, 110:] == 7.0)  # nothing outside written
        _within_rounding(out_wide[:, 20:110], a, b)
        return
    out = np.empty((a.shape[0], b.shape[1]), np.float32)
    assert blas.gemm(a, b, out) is out
    _within_rounding(out, a, b)


def test_gemm_falls_back_for_what_blas_cannot_take(mats):
    a, b = mats
    out64 = np.empty((a.shape[0], b.shape[1]), np.float64)  # not float32: numpy does it
    blas.gemm(a.astype(np.float64), b.astype(np.float64), out64)
    np.testing.assert_allclose(out64, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-12)
    strided = np.repeat(a, 2, axis=1)[:, ::2]  # no unit stride
    out = np.empty((a.shape[0], b.shape[1]), np.float32)
    blas.gemm(strided, b, out)
    _within_rounding(out, a, b)
    with pytest.raises(ValueError):  # numpy's own shape error when shapes do not fit
        blas.gemm(a, b[:-1], out)


@pytest.mark.skipif(not has_mkl, reason="MKL not installed (pip install 'fucina[mkl]')")
def test_mkl_bits_do_not_depend_on_alignment():
    """A tile is computed with whatever buffer its thread owns: the bits must not
    depend on where the operands sit in memory."""
    r = np.random.default_rng(9)
    a = r.standard_normal((176, 3072)).astype(np.float32)
    b = r.standard_normal((3072, 128)).astype(np.float32)

    def placed(x, offset_bytes):
        buf = np.empty(x.size + 64, np.float32)
        start = (-buf.ctypes.data % 64) // 4 + offset_bytes // 4
        view = buf[start:start + x.size].reshape(x.shape)
        view[...] = x
        return view

    results = []
    for off_a, off_b, off_o in [(0, 0, 0), (4, 8, 12), (16, 32, 48), (52, 4, 0)]:
        out = placed(np.zeros((176, 128), np.float32), off_o)
        blas.gemm(placed(a, off_a), placed(b, off_b), out)
        results.append(out.copy())
    for r_ in results[1:]:
        np.testing.assert_array_equal(results[0], r_)


def _backend_in_subprocess(value):
    env = dict(os.environ, FUCINA_BLAS=value)
    return subprocess.run([sys.executable, "-c", "from pipeline.kernels.blas import backend; print(backend())"],
                          cwd=ROOT, env=env, capture_output=True, text=True)


def test_env_forces_openblas_and_rejects_unknown_values():
    forced = _backend_in_subprocess("openblas")
    assert forced.returncode == 0 and forced.stdout.strip() == "openblas"
    bad = _backend_in_subprocess("atlas")
    assert bad.returncode != 0 and "FUCINA_BLAS must be 'mkl' or 'openblas'" in bad.stderr


def test_env_asks_for_mkl():
    asked = _backend_in_subprocess("mkl")
    if has_mkl:
        assert asked.returncode == 0 and asked.stdout.strip() == "mkl"
    else:
        assert asked.returncode != 0 and "no libmkl_rt" in asked.stderr
