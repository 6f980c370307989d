"""Single-threaded float32 GEMM for the tiled products: Intel MKL when it is installed, numpy's OpenBLAS otherwise.

Trade-off: every big product in a training step is cut into tiles that each
make ONE single-threaded BLAS call on our own threads (pipeline/kernels/workpool.py),
so the per-thread speed of that call is most of a step's time. On the
training shapes (128 activation rows against 2 MB weight tiles) MKL's
sequential sgemm measured 10-30% faster per thread than the OpenBLAS numpy
ships (docs/BENCHMARKS.md), so MKL is used when the `mkl` wheel is importable
(`pip install 'fucina[mkl]'`, x86-64). It is loaded with its SEQUENTIAL
threading layer: no MKL threads exist, so nothing spins against our pool.
Its results do not depend on the operands' memory alignment (tested), and a
tile is always computed by one call on the same shapes, so results stay
bitwise independent of the thread count. The two libraries sum in different
orders: a run's bits depend on which one it used (`backend()` says; the
environment variable FUCINA_BLAS=openblas|mkl forces one).
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

import numpy as np

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_SEQUENTIAL = 1  # MKL_THREADING_SEQUENTIAL
_MKL = None      # (cblas_sgemm,) once loaded; False when unavailable


def _library_paths():
    roots = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(sys.executable))}
    for root in roots:
        yield from sorted(glob.glob(os.path.join(root, "lib", "libmkl_rt.so*")))


def _load_mkl():
    """cblas_sgemm from libmkl_rt with the sequential layer, or None (not installed or refused)."""
    choice = os.environ.get("FUCINA_BLAS", "").strip().lower()
    if choice not in ("", "mkl", "openblas"):
        raise ValueError(f"FUCINA_BLAS must be 'mkl' or 'openblas', got {choice!r}")
    if choice == "openblas":
        return None
    for path in _library_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
        lib.MKL_Set_Threading_Layer(_SEQUENTIAL)
        # and should MKL already run with threads (numpy linked against MKL picked its layer
        # first), one thread per call: the tiles are our threads' work
        lib.MKL_Set_Num_Threads.argtypes = [ctypes.c_int]
        lib.MKL_Set_Num_Threads(1)
        sgemm = lib.cblas_sgemm
        sgemm.restype = None
        sgemm.argtypes = ([ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                                ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                                ctypes.c_void_p, ctypes.c_int])
        return sgemm
    if choice == "mkl":
        raise RuntimeError("FUCINA_BLAS=mkl but no libmkl_rt.so was found (pip install 'fucina[mkl]')")
    return None


def _sgemm():
    global _MKL
    if _MKL is None:
        _MKL = _load_mkl() or False
    return _MKL


def backend() -> str:
    """'mkl' or 'openblas': the library `gemm` calls."""
    return "mkl" if _sgemm() else "openblas"


def _layout(a):
    """(transpose flag, leading dimension) of a 2-D float32 array for row-major BLAS, or None."""
    s0, s1 = a.strides
    if s1 == 4 and s0 >= 4 * max(1, a.shape[1]) and s0 % 4 == 0:
        return _NO_TRANS, s0 // 4
    if s0 == 4 and s1 >= 4 * max(1, a.shape[0]) and s1 % 4 == 0:
        return _TRANS, s1 // 4
    return None


def gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = a @ b for float32 a [M, K], b [K, N], out [M, N] (any may be a strided view
    with one unit stride, e.g. a transpose or a column slice); one BLAS call on this
    thread (the caller holds BLAS at one thread: workpool.single_thread_blas)."""
    sgemm = _sgemm()
    if not sgemm:
        return np.matmul(a, b, out=out)
    m, k = a.shape
    n = b.shape[1]
    la, lb, lo = _layout(a), _layout(b), _layout(out)
    if (la is None or lb is None or lo is None or lo[0] != _NO_TRANS or b.shape[0] != k
            or out.shape != (m, n) or not (a.dtype == b.dtype == out.dtype == np.float32) or 0 in (m, n, k)):
        return np.matmul(a, b, out=out)
    sgemm(_ROW_MAJOR, la[0], lb[0], m, n, k, 1.0, a.ctypes.data, la[1], b.ctypes.data, lb[1],
          0.0, out.ctypes.data, lo[1])
    return out
