"""Dequantization kernels for the GGML block formats, and the matvec entry points.

Trade-off: the kernels work on whole rows of raw block bytes (a weight of
shape [n_rows, n_cols] is stored as uint8 [n_rows, row_bytes]) and produce
float32. Three consumers, chosen by measurement (docs/models.md):
  * prefill / training: the per-format tile kernels `_dq_*` (one per format, no
    type branch in the hot loop; the block unpacking is pipeline/kernels/qblocks.py's
    vector IR) feed pipeline/kernels/qgemm.py's tiled BLAS products, and
    `dequantize_rows` makes a whole f32 copy;
  * decode (a handful of tokens): `matvec_rows` / `matvec_many` / `matvec_half`
    (pipeline/kernels/qdot.py), which never materialise the f32 weight.
Dequantization is element-exact against gguf-py's `gguf.quants.dequantize`
(same f32 operation order: (d*scale)*q - dmin*min). The matvec accumulates
in 32 fixed lanes, so it matches the dequant+dot path to float rounding, not
bitwise. Kernels are serial, GIL-free row-range functions run on a pool of
Python threads (pipeline/kernels/workpool.py); each row is reduced by the same
serial code whatever thread takes it, so results are bitwise independent of
the thread count, and nothing pays numba's parallel compile. F16 block scales
are read through a 65536-entry exact lookup table.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .formats import (BF16, BLOCK_FORMATS, BY_QTYPE, F16, F32, GEOMETRY, IQ4_NL, IQ4_XS, Q2_K, Q3_K,  # noqa: F401
                      Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, kernels)
from .qblocks import (store_bf16, store_f16, store_iq4_nl, store_iq4_xs, store_q2_k, store_q3_k, store_q4_0,
                      store_q4_1, store_q4_k, store_q5_0, store_q5_1, store_q5_k, store_q6_k, store_q8_0)
from .workpool import run_dynamic, split_range, threads as pool_threads

ROW_CHUNK = 16  # fewest rows worth a thread of their own

HALF_TO_FLOAT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, inline="always")
def _half(lut, b, o):
    return lut[np.int64(b[o]) | (np.int64(b[o + 1]) << 8)]


# Tile kernels: rows of raw blocks, blocks b0..b1 of each row -> out f32 [rows, (b1-b0)*block].
# The block formats unpack through pipeline/kernels/qblocks.py's vector IR (the same f32 operations as
# gguf-py, so element-exact; ~2x the speed of the best numba loops we could get vectorized). Each
# format's driver is a module-level function (numba caches it by name) around one of two inlined loops:
# blocks with one fp16 scale (d) or two (d and dmin / m), at the offsets of the format's row in
# pipeline/kernels/formats.py (GEOMETRY: constants folded into the driver).


@njit(inline="always")
def _tile_d(store, raw, out, lut, b0, b1, geometry):
    block, size, d_at, _ = geometry
    for r in range(raw.shape[0]):
        b, y = raw[r], out[r]
        for blk in range(b0, b1):
            o = blk * size
            store(y, b, o, (blk - b0) * block, _half(lut, b, o + d_at))


@njit(inline="always")
def _tile_dm(store, raw, out, lut, b0, b1, geometry):
    block, size, d_at, m_at = geometry
    for r in range(raw.shape[0]):
        b, y = raw[r], out[r]
        for blk in range(b0, b1):
            o = blk * size
            store(y, b, o, (blk - b0) * block, _half(lut, b, o + d_at), _half(lut, b, o + m_at))


@njit(cache=True, nogil=True)
def _dq_q8_0(raw, out, lut, b0, b1):
    _tile_d(store_q8_0, raw, out, lut, b0, b1, GEOMETRY[Q8_0])


@njit(cache=True, nogil=True)
def _dq_q4_0(raw, out, lut, b0, b1):
    _tile_d(store_q4_0, raw, out, lut, b0, b1, GEOMETRY[Q4_0])


@njit(cache=True, nogil=True)
def _dq_q4_1(raw, out, lut, b0, b1):
    _tile_dm(store_q4_1, raw, out, lut, b0, b1, GEOMETRY[Q4_1])


@njit(cache=True, nogil=True)
def _dq_q5_0(raw, out, lut, b0, b1):
    _tile_d(store_q5_0, raw, out, lut, b0, b1, GEOMETRY[Q5_0])


@njit(cache=True, nogil=True)
def _dq_q5_1(raw, out, lut, b0, b1):
    _tile_dm(store_q5_1, raw, out, lut, b0, b1, GEOMETRY[Q5_1])


@njit(cache=True, nogil=True)
def _dq_iq4_nl(raw, out, lut, b0, b1):
    _tile_d(store_iq4_nl, raw, out, lut, b0, b1, GEOMETRY[IQ4_NL])


@njit(cache=True, nogil=True)
def _dq_q2_k(raw, out, lut, b0, b1):
    _tile_dm(store_q2_k, raw, out, lut, b0, b1, GEOMETRY[Q2_K])


@njit(cache=True, nogil=True)
def _dq_q3_k(raw, out, lut, b0, b1):
    _tile_d(store_q3_k, raw, out, lut, b0, b1, GEOMETRY[Q3_K])


@njit(cache=True, nogil=True)
def _dq_q4_k(raw, out, lut, b0, b1):
    _tile_dm(store_q4_k, raw, out, lut, b0, b1, GEOMETRY[Q4_K])


@njit(cache=True, nogil=True)
def _dq_q5_k(raw, out, lut, b0, b1):
    _tile_dm(store_q5_k, raw, out, lut, b0, b1, GEOMETRY[Q5_K])


@njit(cache=True, nogil=True)
def _dq_q6_k(raw, out, lut, b0, b1):
    _tile_d(store_q6_k, raw, out, lut, b0, b1, GEOMETRY[Q6_K])


@njit(cache=True, nogil=True)
def _dq_iq4_xs(raw, out, lut, b0, b1):
    _tile_d(store_iq4_xs, raw, out, lut, b0, b1, GEOMETRY[IQ4_XS])


@njit(cache=True, nogil=True)
def _dq_f16(raw, out, lut, b0, b1):
    """raw uint16 [rows, n_cols] (f16 bits), 32-column groups b0..b1 -> out f32 [rows, <= (b1-b0)*32]."""
    for r in range(raw.shape[0]):
        b, y = raw[r], out[r]
        full = min(b1, b.shape[0] // 32)
        for blk in range(b0, full):
            store_f16(y, b, blk * 32, (blk - b0) * 32)
        for k in range(max(b0, full) * 32, min(b1 * 32, b.shape[0])):  # a ragged last group
            y[k - b0 * 32] = lut[b[k]]


@njit(cache=True, nogil=True)
def _dq_bf16(raw, out, lut, b0, b1):
    """raw uint16 [rows, n_cols] (bf16 bits), 32-column groups b0..b1 -> out f32 [rows, <= (b1-b0)*32]."""
    bits = out.view(np.uint32)
    for r in range(raw.shape[0]):
        b, y = raw[r], out[r]
        full = min(b1, b.shape[0] // 32)
        for blk in range(b0, full):
            store_bf16(y, b, blk * 32, (blk - b0) * 32)
        for k in range(max(b0, full) * 32, min(b1 * 32, b.shape[0])):
            bits[r, k - b0 * 32] = np.uint32(b[k]) << 16


HALF_GROUP = 32  # columns per F16/BF16 tile step
# qtype -> (tile kernel, elements per block, bytes per block), from pipeline.kernels/formats.py; F16/BF16 tiles count
# HALF_GROUP columns
TILE_KERNELS = {qtype: (kernel, *((BY_QTYPE[qtype].block, BY_QTYPE[qtype].block_bytes) if BY_QTYPE[qtype].quantized
                                  else (HALF_GROUP, HALF_GROUP * BY_QTYPE[qtype].block_bytes)))
                for qtype, kernel in kernels("dequant", globals()).items()}
# the block formats: qtype -> (elements per block, bytes per block)
_BLOCK = {f.qtype: (f.block, f.block_bytes) for f in BLOCK_FORMATS}


def matvec_half(raw: np.ndarray, x: np.ndarray, bf16: bool = False) -> np.ndarray:
    """y = x @ W.T for a 16-bit W (f16 or bf16 bits as uint16 [n_rows, n_cols]), x f32 [m, n_cols]."""
    raw = np.ascontiguousarray(raw).view(np.uint16)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if raw.ndim != 2 or x.ndim != 2 or x.shape[1] != raw.shape[1]:
        raise ValueError(f"matvec_half: W {raw.shape} and x {x.shape} do not align (x must be [m, {raw.shape[-1]}])")
    return matvec_many([(BF16 if bf16 else F16, raw)], x)[0]


def _over_rows(n_rows, kernel):
    """kernel(r0, r1) over [0, n_rows) in contiguous pieces of whole ROW_CHUNKs on the worker threads."""
    split_range(n_rows, -(-n_rows // ROW_CHUNK), kernel)


def _check(qtype, raw, n_cols):
    if qtype in (F16, BF16):
        if raw.dtype != np.uint16 or raw.ndim != 2 or raw.shape[1] != n_cols:
            raise ValueError(f"matvec: 16-bit rows must be uint16 [n_rows, {n_cols}], got {raw.dtype} {raw.shape}")
        return
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
    raw = np.ascontiguousarray(raw)
    kernel, n_blocks = TILE_KERNELS[qtype][0], n_cols // _BLOCK[qtype][0]
    _over_rows(raw.shape[0], lambda r0, r1: kernel(raw[r0:r1], out[r0:r1], HALF_TO_FLOAT, 0, n_blocks))
    return out


def matvec_rows(qtype: int, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = x @ W.T for a block-quantized W (raw uint8 [n_rows, row_bytes]), x f32 [m, n_cols] -> [m, n_rows]."""
    return matvec_many([(qtype, raw)], x)[0]


MATVEC_PIECES_PER_THREAD = 2  # row pieces per thread: a late-waking worker leaves its share to the others


def matvec_many(weights, x: np.ndarray) -> list:
    """[x @ W.T for (qtype, raw) in weights]: block-quantized or 16-bit weights that share one input
    (q/k/v, gate/up) in one dispatch. Each weight's rows are cut into a few pieces that the
    threads take dynamically; every row is computed by the same serial code whichever
    thread takes it, so the results do not depend on the thread count or the cut."""
    from .qdot import matvec_range
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"matvec: x must be [m, n_cols], got shape {x.shape}")
    weights = [(qtype, np.ascontiguousarray(raw).view(np.uint16) if qtype in (F16, BF16) else np.ascontiguousarray(raw))
               for qtype, raw in weights]
    for qtype, raw in weights:
        _check(qtype, raw, x.shape[1])
    outs = [np.empty((x.shape[0], raw.shape[0]), np.float32) for _, raw in weights]
    threads = pool_threads()
    pieces = []
    for (qtype, raw), out in zip(weights, outs):
        rows = raw.shape[0]
        parts = max(1, min(threads * MATVEC_PIECES_PER_THREAD if threads > 1 else 1, rows // ROW_CHUNK))
        step = -(-rows // parts)
        pieces += [(qtype, raw, out, r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    run_dynamic(len(pieces), lambda i: matvec_range(pieces[i][0], pieces[i][1], x, *pieces[i][2:]))
    return outs
