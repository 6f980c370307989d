"""Softmax row kernels for attention: in place over the [rows, keys] scores.

Trade-off: the score matrix is still materialized (BLAS does the two GEMMs on
each side, which beats hand-written loops at these sizes), but the softmax and
its backward are one fused pass per row instead of four numpy passes, using
the SIMD exp of kernels/fastexp.py. Rows are independent; the parallel loop
runs over a fixed grid of row chunks, so the bits do not depend on threads.
"""
import numpy as np
from numba import njit, prange

from kernels.fastexp import exp_shifted_sum_inplace, row_max
from kernels.nn import threads_for

ROW_CHUNK = 64


@njit(cache=True, nogil=True)
def _softmax_rows(s, i0, i1):
    for i in range(i0, i1):
        row = s[i]
        m = row_max(row)
        inv = np.float32(1.0 / exp_shifted_sum_inplace(row, m))
        for j in range(row.shape[0]):
            row[j] *= inv


@njit(cache=True, parallel=True)
def _softmax_inplace(s):
    """s [R, K] float32, each row replaced by its softmax (-inf entries give 0)."""
    n = s.shape[0]
    for c in prange((n + ROW_CHUNK - 1) // ROW_CHUNK):
        _softmax_rows(s, c * ROW_CHUNK, min(n, (c + 1) * ROW_CHUNK))


@njit(cache=True, nogil=True)
def _softmax_bwd_rows(p, dp, scale, i0, i1):
    for i in range(i0, i1):
        pr = p[i]
        dr = dp[i]
        dot = np.float32(0.0)
        for j in range(pr.shape[0]):
            dot += pr[j] * dr[j]
        for j in range(pr.shape[0]):
            dr[j] = pr[j] * (dr[j] - dot) * scale


@njit(cache=True, parallel=True)
def _softmax_bwd_inplace(p, dp, scale):
    """p, dp [R, K] float32: dp <- p * (dp - rowsum(p * dp)) * scale."""
    n = p.shape[0]
    for c in prange((n + ROW_CHUNK - 1) // ROW_CHUNK):
        _softmax_bwd_rows(p, dp, scale, c * ROW_CHUNK, min(n, (c + 1) * ROW_CHUNK))


def softmax_inplace(s):
    """Row softmax over the last axis of a C-contiguous array, in place (float32
    via the kernel, other dtypes via numpy). Returns s."""
    if s.dtype == np.float32 and s.flags.c_contiguous:
        with threads_for(s.size):
            _softmax_inplace(s.reshape(-1, s.shape[-1]))
        return s
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def softmax_backward_inplace(p, dp, scale=1.0):
    """dp <- p * (dp - sum(p * dp, last axis)) * scale, in place. Returns dp."""
    if p.dtype == np.float32 and dp.dtype == np.float32 and p.flags.c_contiguous and dp.flags.c_contiguous:
        with threads_for(p.size):
            _softmax_bwd_inplace(p.reshape(-1, p.shape[-1]), dp.reshape(-1, dp.shape[-1]), np.float32(scale))
        return dp
    dp -= (dp * p).sum(axis=-1, keepdims=True)
    dp *= p
    dp *= scale
    return dp


def softmax_rows_serial(s):
    """softmax_inplace on the calling thread only, GIL released (for callers that
    already run on several threads: a numba parallel launch is not re-entrant)."""
    if s.dtype == np.float32 and s.flags.c_contiguous:
        s2 = s.reshape(-1, s.shape[-1])
        _softmax_rows(s2, 0, s2.shape[0])
        return s
    return softmax_inplace(s)


def softmax_backward_rows_serial(p, dp, scale=1.0):
    """softmax_backward_inplace on the calling thread only, GIL released."""
    if p.dtype == np.float32 and dp.dtype == np.float32 and p.flags.c_contiguous and dp.flags.c_contiguous:
        p2, dp2 = p.reshape(-1, p.shape[-1]), dp.reshape(-1, dp.shape[-1])
        _softmax_bwd_rows(p2, dp2, np.float32(scale), 0, p2.shape[0])
        return dp
    return softmax_backward_inplace(p, dp, scale)
