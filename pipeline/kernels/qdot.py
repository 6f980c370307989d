"""Fused dequant-dot kernels for decode: y = x @ W.T with W in GGML blocks, a few rows of x.

Trade-off: never materialise the f32 weight; read only the stored bytes once
(decode is memory-bound work). Per block, pipeline/kernels/qblocks.py's vector IR
unpacks the weights and accumulates w * x into 32 f32 lanes kept in registers;
a row's lanes are then summed as a fixed tree. So the result matches the
dequant-then-dot path to float rounding, not bitwise, but is a pure function of
the inputs (any thread count, cold or cached numba cache). The numba side reads
the f16 block scales and drives the loops; `dequant.matvec_rows` splits rows
over the threads.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .dequant import HALF_TO_FLOAT, _half
from .formats import GEOMETRY, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, kernels
from .qblocks import (LANES, _lane_sum, dot_bf16, dot_f16, dot_iq4_nl, dot_iq4_xs, dot_q2_k, dot_q3_k, dot_q4_0,
                      dot_q4_1, dot_q4_k, dot_q5_0, dot_q5_1, dot_q5_k, dot_q6_k, dot_q8_0)


# Each format's driver is a module-level function (numba caches it by name) around one of two inlined loops:
# blocks with one fp16 scale (d) or two (d and dmin / m), at the offsets of its pipeline/kernels/formats.py row.
@njit(inline="always")
def _rows_d(dot, raw, x, out, lut, r0, r1, geometry):
    """Rows r0..r1: raw uint8 [n_rows, row_bytes], x f32 [m, n_cols] -> out f32 [m, n_rows]."""
    block, size, d_at, _ = geometry
    acc = np.empty(LANES, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(x.shape[0]):
            xi = x[i]
            acc[:] = 0.0
            for blk in range(xi.shape[0] // block):
                o = blk * size
                dot(acc, b, o, xi, blk * block, _half(lut, b, o + d_at))
            out[i, r] = _lane_sum(acc)


@njit(inline="always")
def _rows_dm(dot, raw, x, out, lut, r0, r1, geometry):
    """As _rows_d for blocks with a second fp16 (dmin, or Q4_1/Q5_1's m)."""
    block, size, d_at, m_at = geometry
    acc = np.empty(LANES, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(x.shape[0]):
            xi = x[i]
            acc[:] = 0.0
            for blk in range(xi.shape[0] // block):
                o = blk * size
                dot(acc, b, o, xi, blk * block, _half(lut, b, o + d_at), _half(lut, b, o + m_at))
            out[i, r] = _lane_sum(acc)


@njit(cache=True, nogil=True)
def _mv_q4_k(raw, x, out, lut, r0, r1):
    _rows_dm(dot_q4_k, raw, x, out, lut, r0, r1, GEOMETRY[Q4_K])


@njit(cache=True, nogil=True)
def _mv_q5_k(raw, x, out, lut, r0, r1):
    _rows_dm(dot_q5_k, raw, x, out, lut, r0, r1, GEOMETRY[Q5_K])


@njit(cache=True, nogil=True)
def _mv_q6_k(raw, x, out, lut, r0, r1):
    _rows_d(dot_q6_k, raw, x, out, lut, r0, r1, GEOMETRY[Q6_K])


@njit(cache=True, nogil=True)
def _mv_q8_0(raw, x, out, lut, r0, r1):
    _rows_d(dot_q8_0, raw, x, out, lut, r0, r1, GEOMETRY[Q8_0])


@njit(cache=True, nogil=True)
def _mv_q4_0(raw, x, out, lut, r0, r1):
    _rows_d(dot_q4_0, raw, x, out, lut, r0, r1, GEOMETRY[Q4_0])


@njit(cache=True, nogil=True)
def _mv_q4_1(raw, x, out, lut, r0, r1):
    _rows_dm(dot_q4_1, raw, x, out, lut, r0, r1, GEOMETRY[Q4_1])


@njit(cache=True, nogil=True)
def _mv_q5_0(raw, x, out, lut, r0, r1):
    _rows_d(dot_q5_0, raw, x, out, lut, r0, r1, GEOMETRY[Q5_0])


@njit(cache=True, nogil=True)
def _mv_q5_1(raw, x, out, lut, r0, r1):
    _rows_dm(dot_q5_1, raw, x, out, lut, r0, r1, GEOMETRY[Q5_1])


@njit(cache=True, nogil=True)
def _mv_iq4_nl(raw, x, out, lut, r0, r1):
    _rows_d(dot_iq4_nl, raw, x, out, lut, r0, r1, GEOMETRY[IQ4_NL])


@njit(cache=True, nogil=True)
def _mv_q2_k(raw, x, out, lut, r0, r1):
    _rows_dm(dot_q2_k, raw, x, out, lut, r0, r1, GEOMETRY[Q2_K])


@njit(cache=True, nogil=True)
def _mv_q3_k(raw, x, out, lut, r0, r1):
    _rows_d(dot_q3_k, raw, x, out, lut, r0, r1, GEOMETRY[Q3_K])


@njit(cache=True, nogil=True)
def _mv_iq4_xs(raw, x, out, lut, r0, r1):
    _rows_d(dot_iq4_xs, raw, x, out, lut, r0, r1, GEOMETRY[IQ4_XS])


@njit(cache=True, nogil=True)
def _mv_f16(raw, x, out, lut, r0, r1):
    """Rows r0..r1: raw uint16 [n_rows, n_cols] f16 bits, x f32 [m, n_cols] -> out f32 [m, n_rows].
    Columns past the last whole 32-group are added after the lanes, in order."""
    acc = np.empty(LANES, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(x.shape[0]):
            xi = x[i]
            acc[:] = 0.0
            full = xi.shape[0] // 32
            for blk in range(full):
                dot_f16(acc, b, blk * 32, xi, blk * 32)
            total = _lane_sum(acc)
            for k in range(full * 32, xi.shape[0]):
                total += lut[b[k]] * xi[k]
            out[i, r] = total


@njit(cache=True, nogil=True)
def _mv_bf16(raw, x, out, lut, r0, r1):
    """As _mv_f16 for bf16 bits (the high halves of f32s)."""
    acc = np.empty(LANES, np.float32)
    one = np.empty(1, np.uint32)
    wide = one.view(np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(x.shape[0]):
            xi = x[i]
            acc[:] = 0.0
            full = xi.shape[0] // 32
            for blk in range(full):
                dot_bf16(acc, b, blk * 32, xi, blk * 32)
            total = _lane_sum(acc)
            for k in range(full * 32, xi.shape[0]):
                one[0] = np.uint32(b[k]) << 16
                total += wide[0] * xi[k]
            out[i, r] = total


MATVEC = kernels("dot", globals())  # qtype -> its driver, by the pipeline/kernels/formats.py row


def matvec_range(qtype: int, raw: np.ndarray, x: np.ndarray, out: np.ndarray, r0: int, r1: int):
    """out[:, r0:r1] = x @ W[r0:r1].T (inputs validated by dequant.matvec_rows)."""
    MATVEC[qtype](raw, x, out, HALF_TO_FLOAT, r0, r1)
