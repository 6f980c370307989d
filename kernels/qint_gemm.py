"""Register-blocked integer GEMM for no-grad many-row products (prefill): x @ W.T with x quantized as llama.cpp does.

Trade-off: kernels/qint.py's row kernels take one (activation row, weight row)
pair at a time, as llama.cpp's plain mul_mat does, so every weight block is
unpacked again (nibble shifts and masks, the 6-bit scale unpacking, the scale
broadcasts) for every activation row. Here one weight block is unpacked once
and multiplied into ROWS activation rows while its sub-blocks sit in registers;
the ROWS activation rows (ROWS x n_in bytes: 4-12 KB) stay in L1 while the
piece's weight rows stream past them from L2. The arithmetic of each output
element is exactly the row kernels' (the same exact i32 lane sums per block,
the same one fused multiply-add per block and lane, hsum_float_8's order), so
the bits equal qint.matmul_t_many's, i.e. llama.cpp's, for any grouping of the
rows; a tail of fewer than ROWS rows runs through the row kernels themselves.
Only the Q8_K formats (Q4_K, Q5_K, Q6_K) have a blocked kernel; the others
keep the row kernels (see FrozenWeight.uses_integer_dot for where each pays).
Pieces are whole ROW_CHUNKs of weight rows on a grid fixed by the shapes, each
element computed by the same serial code whatever thread takes it: bitwise
independent of the thread count.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .dequant import HALF_TO_FLOAT, Q4_K, Q5_K, Q6_K, ROW_CHUNK, _check, _half
from .qblocks import _I32, _I64, _IR, _V8I, _V16I, _V16S, _VB, _k4_scale_bytes, _lane_sums, _scale16, o_arg
from .qint import PARTNER, _hsum8, _mm_q4_k, _mm_q5_k, _mm_q6_k, quantize_activations
from .workpool import run_dynamic

ROWS = 4  # activation rows per inner kernel: 4 i32 totals + weight + scale + temporaries fit the 16 ymm registers
PIECE_ROWS = 8 * ROW_CHUNK  # weight rows per piece (128): ~72-220 KB of Q4_K-Q6_K bytes, an L2's share


def _row_offset(h, arg_offset, arg_stride, r, extra=0):
    """i64 offset arg_offset + r * arg_stride + extra (argument indices into h.ptrs)."""
    off = h.b.add(h.ptrs[arg_offset], h.b.mul(h.ptrs[arg_stride], ir.Constant(_I64, r)))
    return h.b.add(off, ir.Constant(_I64, extra)) if extra else off


def _fma_at(h, arg, at, scale, lanes):
    """acc[arg][at:at + n] = fma(scale, float(lanes), acc[at:at + n]) (as qblocks._fma_into, at an offset)."""
    vf = ir.VectorType(ir.FloatType(), lanes.type.count)
    p = h.b.bitcast(h.b.gep(h.ptrs[arg], [ir.Constant(_I64, at)]), vf.as_pointer())
    fn = cgutils.get_or_insert_function(h.b.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{vf.count}f32")
    h.b.store(h.b.call(fn, [h.splat(scale, vf), h.b.sitofp(lanes, vf), h.b.load(p, align=4)]), p, align=4)


def _scalar_fma_at(h, arg, at, scale, value):
    """accm[arg][at] = fma(scale, float(value), accm[at]) for an i32 value (Q5_K's mins)."""
    f32 = ir.FloatType()
    p = h.b.gep(h.ptrs[arg], [ir.Constant(_I64, at)])
    fn = cgutils.get_or_insert_function(h.b.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
    h.b.store(h.b.call(fn, [scale, h.b.sitofp(value, f32), h.b.load(p)]), p)


# Argument layout of the blocked intrinsics (one weight block, ROWS activation rows):
#   0 acc f32 [ROWS * 8]   1 b uint8 (the weight row)   2 o (block offset in b)
#   3 q int8 (activations, any shape: flat offsets)      4 qo (row 0's block start in q)   5 q_stride (per row)
#   6 d f32 (the activations' Q8_K scales, flat)         7 do (row 0's)   8 d_stride   9 wd (the weight's d)
#   Q4_K / Q5_K only: 10 accm f32 [ROWS * 4 | ROWS]   11 sums int32 (flat)   12 so   13 s_stride   14 wmin
# Row r's block scale is d[do + r * d_stride] * wd and its min scale (-d[...]) * wmin: the f32 products the
# row kernels form in numba (qint._mm_q4_k), formed here so no scale goes through memory.
def _row_scale(h, r, weight_arg):
    """f32 d[do + r * d_stride] * h.ptrs[weight_arg] (weight_arg 14, the min scale: its negation first)."""
    a = h.b.load(h.b.gep(h.ptrs[6], [_row_offset(h, 7, 8, r)]))
    if weight_arg == 14:
        a = h.b.fneg(a)
    return h.b.fmul(a, h.ptrs[weight_arg])


def _k_mins(h, m, r):
    """<8 x i32> min_j * sum(q8_j) of activation row r (the Q8_K block's 32-element sums, args 11-13)."""
    p = h.b.bitcast(h.b.gep(h.ptrs[11], [_row_offset(h, 12, 13, r)]), _V8I.as_pointer())
    return h.b.mul(h.b.zext(m, _V8I), h.b.load(p, align=1))


def _k_block_rows(high_bit):
    """codegen of the Q4_K (high_bit False) / Q5_K (True) block x ROWS rows: each sub-block's weights and scale
    unpacked once; per row the row kernels' i32 lanes, fma into acc, and the mins (Q4_K: 4 pair lanes, as
    idot_q4_k; Q5_K: one scalar, as idot_q5_k)."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        s, m = _k4_scale_bytes(h)
        qh = h.vload(1, o_arg(h), _VB, 16) if high_bit else None
        totals = [None] * ROWS
        for j in range(8):
            w = h.bits(h.vload(1, o_arg(h), _VB, (48 if high_bit else 16) + (j // 2) * 32), 4 * (j % 2), 0xF)
            if high_bit:
                w = h.b.or_(w, h.b.shl(h.bits(qh, j, 1), h.bytes_const(4)))
            sc = _scale16(h, s, j)
            for r in range(ROWS):
                x = h.vload(3, _row_offset(h, 4, 5, r, 32 * j), _VB)
                part = _lane_sums(h, w, x, sc, w_unsigned=True)
                totals[r] = part if totals[r] is None else h.b.add(totals[r], part)
        und = ir.Constant(_V8I, ir.Undefined)
        v4i = ir.VectorType(_I32, 4)
        for r in range(ROWS):
            _fma_at(h, 0, 8 * r, _row_scale(h, r, 9), totals[r])
            prod = _k_mins(h, m, r)
            if high_bit:
                mins = h.b.extract_element(prod, ir.Constant(_I32, 0))
                for k in range(1, 8):  # an exact integer sum: any order
                    mins = h.b.add(mins, h.b.extract_element(prod, ir.Constant(_I32, k)))
                _scalar_fma_at(h, 10, r, _row_scale(h, r, 14), mins)
            else:
                pairs = h.b.add(h.b.shuffle_vector(prod, und, ir.Constant(v4i, [0, 2, 4, 6])),
                                h.b.shuffle_vector(prod, und, ir.Constant(v4i, [1, 3, 5, 7])))
                _fma_at(h, 10, 4 * r, _row_scale(h, r, 14), pairs)
        return context.get_dummy_value()
    return codegen


@intrinsic
def idot_q4_k_rows(typingctx, acc, b, o, q, qo, q_stride, d, do, d_stride, wd, accm, sums, so, s_stride,
                   wmin):
    """One Q4_K block x ROWS Q8_K rows: for row r, what idot_q4_k does into acc[8r:8r+8] and accm[4r:4r+4]."""
    sig = types.void(acc, b, o, q, qo, q_stride, d, do, d_stride, wd, accm, sums, so, s_stride, wmin)
    return sig, _k_block_rows(False)


@intrinsic
def idot_q5_k_rows(typingctx, acc, b, o, q, qo, q_stride, d, do, d_stride, wd, accm, sums, so, s_stride,
                   wmin):
    """One Q5_K block x ROWS Q8_K rows: for row r, what idot_q5_k does into acc[8r:8r+8] and accm[r]."""
    sig = types.void(acc, b, o, q, qo, q_stride, d, do, d_stride, wd, accm, sums, so, s_stride, wmin)
    return sig, _k_block_rows(True)


@intrinsic
def idot_q6_k_rows(typingctx, acc, b, o, q, qo, q_stride, d, do, d_stride, wd):
    """One Q6_K block x ROWS Q8_K rows: for row r, what idot_q6_k does into acc[8r:8r+8]."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        scales = h.vload(1, o_arg(h), ir.VectorType(ir.IntType(8), 16), 192)
        totals = [None] * ROWS
        for hh in range(2):
            qh = h.vload(1, o_arg(h), _VB, 128 + hh * 32)
            for t in range(4):
                ql = h.bits(h.vload(1, o_arg(h), _VB, hh * 64 + (t & 1) * 32), 4 * (t >> 1), 0xF)
                w = h.b.sub(h.b.or_(ql, h.b.shl(h.bits(qh, 2 * t, 3), h.bytes_const(4))), h.bytes_const(32))
                g = hh * 8 + t * 2  # pair lanes 0..7 are weights 0..15 (scale g), 8..15 weights 16..31 (g + 1)
                sc = h.b.sext(h.b.shuffle_vector(scales, ir.Constant(scales.type, ir.Undefined),
                                                 ir.Constant(_V16I, [g] * 8 + [g + 1] * 8)), _V16S)
                for r in range(ROWS):
                    x = h.vload(3, _row_offset(h, 4, 5, r, 32 * (hh * 4 + t)), _VB)
                    part = _lane_sums(h, w, x, sc)
                    totals[r] = part if totals[r] is None else h.b.add(totals[r], part)
        for r in range(ROWS):
            _fma_at(h, 0, 8 * r, _row_scale(h, r, 9), totals[r])
        return context.get_dummy_value()
    return types.void(acc, b, o, q, qo, q_stride, d, do, d_stride, wd), codegen


@njit(cache=True, nogil=True)
def _gemm_q4_k(raw, q, d, sums, out, lut, r0, r1):
    """out[:, r0:r1] for Q4_K raw against Q8_K activations q/d/sums: groups of ROWS rows through idot_q4_k_rows,
    the tail through qint's row kernel; each element as qint._mm_q4_k computes it."""
    m, n = q.shape
    nb, groups = n // 256, m // ROWS * ROWS
    acc, accm = np.empty(ROWS * 8, np.float32), np.empty(ROWS * 4, np.float32)
    for i in range(0, groups, ROWS):
        for r in range(r0, r1):
            b = raw[r]
            acc[:] = 0.0
            accm[:] = 0.0
            for blk in range(nb):
                o = blk * 144
                idot_q4_k_rows(acc, b, o, q, i * n + blk * 256, n, d, i * nb + blk, nb, _half(lut, b, o), accm, sums,
                               i * (n // 32) + blk * 8, n // 32, _half(lut, b, o + 2))
            for k in range(ROWS):
                a = accm[4 * k:4 * k + 4]
                out[i + k, r] = _hsum8(acc[8 * k:8 * k + 8]) + ((a[0] + a[2]) + (a[1] + a[3]))
    if groups < m:
        _mm_q4_k(raw, q[groups:], d[groups:], sums[groups:], out[groups:], lut, r0, r1)


@njit(cache=True, nogil=True)
def _gemm_q5_k(raw, q, d, sums, out, lut, r0, r1):
    """As _gemm_q4_k for Q5_K (each element as qint._mm_q5_k)."""
    m, n = q.shape
    nb, groups = n // 256, m // ROWS * ROWS
    acc, accm = np.empty(ROWS * 8, np.float32), np.empty(ROWS, np.float32)
    for i in range(0, groups, ROWS):
        for r in range(r0, r1):
            b = raw[r]
            acc[:] = 0.0
            accm[:] = 0.0
            for blk in range(nb):
                o = blk * 176
                idot_q5_k_rows(acc, b, o, q, i * n + blk * 256, n, d, i * nb + blk, nb, _half(lut, b, o), accm, sums,
                               i * (n // 32) + blk * 8, n // 32, _half(lut, b, o + 2))
            for k in range(ROWS):
                out[i + k, r] = _hsum8(acc[8 * k:8 * k + 8]) + accm[k]
    if groups < m:
        _mm_q5_k(raw, q[groups:], d[groups:], sums[groups:], out[groups:], lut, r0, r1)


@njit(cache=True, nogil=True)
def _gemm_q6_k(raw, q, d, sums, out, lut, r0, r1):
    """As _gemm_q4_k for Q6_K (each element as qint._mm_q6_k)."""
    m, n = q.shape
    nb, groups = n // 256, m // ROWS * ROWS
    acc = np.empty(ROWS * 8, np.float32)
    for i in range(0, groups, ROWS):
        for r in range(r0, r1):
            b = raw[r]
            acc[:] = 0.0
            for blk in range(nb):
                idot_q6_k_rows(acc, b, blk * 210, q, i * n + blk * 256, n, d, i * nb + blk, nb,
                               _half(lut, b, blk * 210 + 208))
            for k in range(ROWS):
                out[i + k, r] = _hsum8(acc[8 * k:8 * k + 8])
    if groups < m:
        _mm_q6_k(raw, q[groups:], d[groups:], sums[groups:], out[groups:], lut, r0, r1)


KERNELS = {Q4_K: _gemm_q4_k, Q5_K: _gemm_q5_k, Q6_K: _gemm_q6_k}


def supports(qtype: int) -> bool:
    return int(qtype) in KERNELS


def matmul_t_many(weights, x: np.ndarray) -> list:
    """[x @ W.T for (qtype, raw) in weights] (Q4_K/Q5_K/Q6_K), x f32 [m, n] quantized to Q8_K once; the same
    bits as kernels/qint.matmul_t_many. Every weight's rows are cut into pieces of PIECE_ROWS (a grid fixed by
    its shape) that the threads take dynamically."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"qint_gemm: x must be [m, n_cols], got shape {x.shape}")
    for qtype, raw in weights:
        if int(qtype) not in KERNELS:
            raise ValueError(f"qint_gemm: no blocked integer kernel for ggml type {qtype}")
        _check(qtype, raw, x.shape[1])
    q, d, sums = quantize_activations(PARTNER[Q4_K], x)
    outs, pieces = [], []
    for qtype, raw in weights:
        raw = np.ascontiguousarray(raw)
        out = np.empty((x.shape[0], raw.shape[0]), np.float32)
        pieces += [(KERNELS[int(qtype)], raw, out, r0, min(raw.shape[0], r0 + PIECE_ROWS))
                   for r0 in range(0, raw.shape[0], PIECE_ROWS)]
        outs.append(out)

    def piece(i):
        kernel, raw, out, r0, r1 = pieces[i]
        kernel(raw, q, d, sums, out, HALF_TO_FLOAT, r0, r1)

    run_dynamic(len(pieces), piece)
    return outs
