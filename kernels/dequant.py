"""Dequantization and fused dequant-matvec kernels for the GGML block formats.

Trade-off: the kernels work on whole rows of raw block bytes (a weight of
shape [n_rows, n_cols] is stored as uint8 [n_rows, row_bytes]) and produce
float32. Two consumers, chosen by measurement (docs/models.md):
  * prefill / training: `dequantize_rows` into a scratch buffer, then BLAS;
  * decode (a handful of tokens): `matvec_rows`, which never materialises the
    f32 weight and reads only the quantized bytes (memory-bound work).
Dequantization is element-exact against gguf-py's `gguf.quants.dequantize`
(same f32 operation order: (d*scale)*q - dmin*min). The matvec regroups the
sums per 32-element sub-block, so it matches the dequant+dot path to float
rounding, not bitwise. Every parallel loop runs over rows on a fixed chunk
grid; each row is reduced serially, so results are bitwise independent of the
thread count. F16 scales are read through a 65536-entry exact lookup table.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

# qtype ids (gguf GGMLQuantizationType) handled here
F32, F16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 8, 12, 13, 14, 30
_BLOCK = {Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
ROW_CHUNK = 16  # rows per parallel work item (fixed grid, thread-count independent)

HALF_TO_FLOAT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, inline="always")
def _half(lut, b, o):
    return lut[np.int64(b[o]) | (np.int64(b[o + 1]) << 8)]


@njit(cache=True, inline="always")
def _scale_min_k4(sc, j, off):
    """(scale, min) of sub-block j from the 12 packed 6-bit bytes at sc[off:]."""
    if j < 4:
        return sc[off + j] & 63, sc[off + j + 4] & 63
    s = (sc[off + j + 4] & 0xF) | ((sc[off + j - 4] >> 6) << 4)
    m = (sc[off + j + 4] >> 4) | ((sc[off + j] >> 6) << 4)
    return s, m


@njit(cache=True)
def _dequant_row(qtype, b, out, lut):
    """Dequantize one row: b uint8[row_bytes] -> out f32[n_cols]."""
    n = out.shape[0]
    if qtype == Q8_0:
        for blk in range(n // 32):
            o = blk * 34
            d = _half(lut, b, o)
            for l in range(32):
                q = np.int32(b[o + 2 + l])
                if q > 127:
                    q -= 256
                out[blk * 32 + l] = np.float32(q) * d
    elif qtype == Q4_0:
        for blk in range(n // 32):
            o = blk * 18
            d = _half(lut, b, o)
            for l in range(16):
                v = b[o + 2 + l]
                out[blk * 32 + l] = d * np.float32(np.int32(v & 0xF) - 8)
                out[blk * 32 + 16 + l] = d * np.float32(np.int32(v >> 4) - 8)
    elif qtype == Q4_K or qtype == Q5_K:
        bs = 144 if qtype == Q4_K else 176
        for blk in range(n // 256):
            o = blk * bs
            d = _half(lut, b, o)
            dmin = _half(lut, b, o + 2)
            qs = o + 16 if qtype == Q4_K else o + 48
            for j in range(8):
                s, m = _scale_min_k4(b, j, o + 4)
                d1 = d * np.float32(s)
                m1 = dmin * np.float32(m)
                shift = 4 * (j & 1)
                base = qs + (j >> 1) * 32
                for l in range(32):
                    q = (b[base + l] >> shift) & 0xF
                    if qtype == Q5_K:
                        q |= ((b[o + 16 + l] >> j) & 1) << 4
                    out[blk * 256 + j * 32 + l] = d1 * np.float32(q) - m1
    elif qtype == Q6_K:
        for blk in range(n // 256):
            o = blk * 210
            d = _half(lut, b, o + 208)
            for h in range(2):
                for t in range(4):
                    for l in range(32):
                        pos = h * 128 + t * 32 + l
                        ql = (b[o + h * 64 + (t & 1) * 32 + l] >> (4 * (t >> 1))) & 0xF
                        qh = (b[o + 128 + h * 32 + l] >> (2 * t)) & 3
                        q = np.int32(ql | (qh << 4)) - 32
                        sc = np.int32(b[o + 192 + pos // 16])
                        if sc > 127:
                            sc -= 256
                        out[blk * 256 + pos] = (d * np.float32(sc)) * np.float32(q)


@njit(cache=True, parallel=True)
def _dequant_rows(qtype, raw, out, lut):
    """raw uint8[n_rows, row_bytes] -> out f32[n_rows, n_cols]."""
    n_rows = raw.shape[0]
    n_chunks = (n_rows + ROW_CHUNK - 1) // ROW_CHUNK
    for c in prange(n_chunks):
        for r in range(c * ROW_CHUNK, min(n_rows, (c + 1) * ROW_CHUNK)):
            _dequant_row(qtype, raw[r], out[r], lut)


@njit(cache=True, inline="always")
def _dot_row(qtype, b, x, lut):
    """sum_k dequant(b)[k] * x[k] for one row, in f32, serial order."""
    n = x.shape[0]
    acc = np.float32(0.0)
    if qtype == Q8_0:
        for blk in range(n // 32):
            o = blk * 34
            s = np.float32(0.0)
            for l in range(32):
                q = np.int32(b[o + 2 + l])
                if q > 127:
                    q -= 256
                s += np.float32(q) * x[blk * 32 + l]
            acc += _half(lut, b, o) * s
    elif qtype == Q4_0:
        for blk in range(n // 32):
            o = blk * 18
            s = np.float32(0.0)
            for l in range(16):
                v = b[o + 2 + l]
                s += np.float32(np.int32(v & 0xF) - 8) * x[blk * 32 + l]
                s += np.float32(np.int32(v >> 4) - 8) * x[blk * 32 + 16 + l]
            acc += _half(lut, b, o) * s
    elif qtype == Q4_K or qtype == Q5_K:
        bs = 144 if qtype == Q4_K else 176
        for blk in range(n // 256):
            o = blk * bs
            d = _half(lut, b, o)
            dmin = _half(lut, b, o + 2)
            qs = o + 16 if qtype == Q4_K else o + 48
            for j in range(8):
                s, m = _scale_min_k4(b, j, o + 4)
                shift = 4 * (j & 1)
                base = qs + (j >> 1) * 32
                xo = blk * 256 + j * 32
                sq = np.float32(0.0)
                sx = np.float32(0.0)
                for l in range(32):
                    q = (b[base + l] >> shift) & 0xF
                    if qtype == Q5_K:
                        q |= ((b[o + 16 + l] >> j) & 1) << 4
                    sq += np.float32(q) * x[xo + l]
                    sx += x[xo + l]
                acc += d * np.float32(s) * sq - dmin * np.float32(m) * sx
    elif qtype == Q6_K:
        for blk in range(n // 256):
            o = blk * 210
            d = _half(lut, b, o + 208)
            for h in range(2):
                for t in range(4):
                    for half in range(2):
                        s = np.float32(0.0)
                        for l in range(half * 16, half * 16 + 16):
                            ql = (b[o + h * 64 + (t & 1) * 32 + l] >> (4 * (t >> 1))) & 0xF
                            qh = (b[o + 128 + h * 32 + l] >> (2 * t)) & 3
                            s += np.float32(np.int32(ql | (qh << 4)) - 32) * x[blk * 256 + h * 128 + t * 32 + l]
                        sc = np.int32(b[o + 192 + (h * 128 + t * 32) // 16 + half])
                        if sc > 127:
                            sc -= 256
                        acc += d * np.float32(sc) * s
    return acc


@njit(cache=True, parallel=True)
def _matvec_rows(qtype, raw, x, out, lut):
    """raw uint8[n_rows, row_bytes], x f32[m, n_cols] -> out f32[m, n_rows]."""
    n_rows = raw.shape[0]
    n_chunks = (n_rows + ROW_CHUNK - 1) // ROW_CHUNK
    for c in prange(n_chunks):
        for r in range(c * ROW_CHUNK, min(n_rows, (c + 1) * ROW_CHUNK)):
            for i in range(x.shape[0]):
                out[i, r] = _dot_row(qtype, raw[r], x[i], lut)


def _check(qtype, raw, n_cols):
    if qtype not in _BLOCK:
        raise ValueError(f"dequant: no kernel for ggml type {qtype}")
    block, size = _BLOCK[qtype]
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"dequant: raw blocks must be uint8 [n_rows, row_bytes], got {raw.dtype} {raw.shape}")
    if n_cols % block or raw.shape[1] != n_cols // block * size:
        raise ValueError(f"dequant: row of {n_cols} elements needs {n_cols // block * size} bytes "
                         f"(block {block}, {size} B), got rows of {raw.shape[1]} bytes")


def dequantize_rows(qtype: int, raw: np.ndarray, n_cols: int, out: np.ndarray | None = None) -> np.ndarray:
    """Dequantize block rows: raw uint8 [n_rows, row_bytes] -> f32 [n_rows, n_cols]."""
    _check(qtype, raw, n_cols)
    if out is None:
        out = np.empty((raw.shape[0], n_cols), np.float32)
    elif out.dtype != np.float32 or out.shape != (raw.shape[0], n_cols) or not out.flags.c_contiguous:
        raise ValueError(f"dequant: out must be contiguous f32 {(raw.shape[0], n_cols)}, got {out.dtype} {out.shape}")
    _dequant_rows(qtype, np.ascontiguousarray(raw), out, HALF_TO_FLOAT)
    return out


def matvec_rows(qtype: int, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = x @ W.T for a block-quantized W (raw uint8 [n_rows, row_bytes]), x f32 [m, n_cols] -> [m, n_rows]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"matvec: x must be [m, n_cols], got shape {x.shape}")
    _check(qtype, raw, x.shape[1])
    out = np.empty((x.shape[0], raw.shape[0]), np.float32)
    _matvec_rows(qtype, np.ascontiguousarray(raw), x, out, HALF_TO_FLOAT)
    return out
