"""Fused dequant-dot kernels for decode: y = x @ W.T with W in GGML blocks, a few rows of x.

Trade-off: numba's loop vectorizer would not give us fast code here. A 32-step
loop with a compile-time trip count is fully unrolled into scalar code; with a
run-time one it vectorizes but pays alias checks and loop set-up on every
32-weight sub-block, and a float reduction into a scalar never vectorizes
without fastmath (which we do not allow: it made cold and cached code differ).
So the per-block arithmetic is written as explicit LLVM vector IR in numba
intrinsics (`_block_*`): a whole block's weights are unpacked, scaled and
multiplied with x in 32-wide vectors, accumulating into 32 f32 lanes that stay
in registers for the block (loaded and stored once per block). Each lane does
exactly the f32 operations of the reference formula in a fixed order, no FMA
contraction, so the result is a pure function of the inputs: the same as the
earlier scalar kernels, bit for bit, for any thread count, cold or cached.
The numba side reads the block header (f16 scales, packed 6-bit scales) and
drives the loops. Cost: the intrinsics are ~150 lines of IR building, checked
against a numpy reference in tests/kernels/test_qdot.py.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .dequant import HALF_TO_FLOAT, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, _half

LANES = 32
PREFETCH = 2048  # bytes ahead in the weight stream: the hardware prefetcher alone left decode at ~4.6 G weights/s from DRAM, this gives ~7
_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_VB, _VF = ir.VectorType(_I8, LANES), ir.VectorType(_F32, LANES)


class _IR:
    """Small helpers over an llvmlite builder for the block intrinsics."""

    def __init__(self, context, builder, sig, args):
        self.b = builder
        self.ptrs = [context.make_array(t)(context, builder, a).data if isinstance(t, types.Array) else a
                     for t, a in zip(sig.args, args)]

    def vload(self, arg, off, vt, extra=0):
        """Load a vector of type vt from array argument `arg` at element offset off + extra."""
        off = self.b.add(off, ir.Constant(_I64, extra)) if extra else off
        p = self.b.bitcast(self.b.gep(self.ptrs[arg], [off]), vt.as_pointer())
        return self.b.load(p, align=1)

    def scalar(self, arg, i):
        """Element i (a Python int) of f32 array argument `arg`."""
        return self.b.load(self.b.gep(self.ptrs[arg], [ir.Constant(_I64, i)]))

    def splat(self, v, vt):
        und = ir.Constant(vt, ir.Undefined)
        v0 = self.b.insert_element(und, v, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v0, und, ir.Constant(ir.VectorType(_I32, vt.count), [0] * vt.count))

    def bytes_const(self, value, n=LANES):
        return ir.Constant(ir.VectorType(_I8, n), [value] * n)

    def bits(self, v, shift, mask):
        """(v >> shift) & mask on a byte vector."""
        if shift:
            v = self.b.lshr(v, self.bytes_const(shift, v.type.count))
        return self.b.and_(v, self.bytes_const(mask, v.type.count))

    def prefetch(self, arg, off, ahead):
        """Hint the cache to fetch array argument `arg` at element off + ahead (never faults)."""
        p = self.b.gep(self.ptrs[arg], [self.b.add(off, ir.Constant(_I64, ahead))])
        p = self.b.bitcast(p, ir.PointerType(_I8))
        fnty = ir.FunctionType(ir.VoidType(), [p.type, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(self.b.module, fnty, "llvm.prefetch.p0")
        self.b.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])

    def prefetch_block(self, block_bytes):
        """Prefetch the weight bytes PREFETCH ahead of the block at b[o:] (arg 1, offset arg 2)."""
        for line in range(0, block_bytes, 64):
            self.prefetch(1, self.ptrs[2], PREFETCH + line)

    def acc_ptr(self, arg):
        return self.b.bitcast(self.ptrs[arg], _VF.as_pointer())


def _accumulate(sig, body):
    """An intrinsic whose codegen loads acc (arg 0, f32[32]), lets body(ir, acc) return the new
    lanes, and stores them back."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        p = h.acc_ptr(0)
        builder.store(body(h, builder.load(p, align=4)), p, align=4)
        return context.get_dummy_value()
    return sig, codegen


def _k4_scales(h, d, dmin):
    """The 8 (d * scale, dmin * min) pairs of a Q4_K/Q5_K block as <8 x float> vectors: the 12
    packed 6-bit bytes at b[o+4:] unpacked with shuffles (ggml's get_scale_min_k4, all j at once)."""
    v8b, v8f, v8i = ir.VectorType(_I8, 8), ir.VectorType(_F32, 8), ir.VectorType(_I32, 8)
    sc = h.vload(1, o_arg(h), ir.VectorType(_I8, 16), 4)  # 12 bytes used; the block goes on well past 16
    pick = lambda idx: h.b.shuffle_vector(sc, ir.Constant(sc.type, ir.Undefined), ir.Constant(v8i, idx))
    low = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])  # j < 4
    c = lambda v: ir.Constant(v8b, [v] * 8)
    s_src, m_src = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([4, 5, 6, 7, 8, 9, 10, 11])
    s_top, m_top = h.b.shl(h.b.lshr(pick([0, 1, 2, 3, 0, 1, 2, 3]), c(6)), c(4)), h.b.shl(h.b.lshr(pick([0, 1, 2, 3, 4, 5, 6, 7]), c(6)), c(4))
    s = h.b.select(low, h.b.and_(s_src, c(63)), h.b.or_(h.b.and_(s_src, c(0xF)), s_top))
    m = h.b.select(low, h.b.and_(m_src, c(63)), h.b.or_(h.b.lshr(m_src, c(4)), m_top))
    return h.b.fmul(h.splat(d, v8f), h.b.uitofp(s, v8f)), h.b.fmul(h.splat(dmin, v8f), h.b.uitofp(m, v8f))


def _lane(h, v8, j):
    """Element j of an <8 x float> broadcast to 32 lanes."""
    return h.b.shuffle_vector(v8, ir.Constant(v8.type, ir.Undefined), ir.Constant(ir.VectorType(_I32, LANES), [j] * LANES))


@intrinsic
def _block_q4_k(typingctx, acc, b, o, x, xo, d, dmin):
    """acc[l] += (d*s_j * q - dmin*m_j) * x[xo + 32j + l] over the 8 sub-blocks j of the Q4_K block at b[o:]."""
    def body(h, a):
        ds, dm = _k4_scales(h, h.ptrs[5], h.ptrs[6])
        h.prefetch_block(144)
        for j in range(8):
            q = h.bits(h.vload(1, o_arg(h), _VB, 16 + (j // 2) * 32), 4 * (j % 2), 0xF)
            w = h.b.fsub(h.b.fmul(_lane(h, ds, j), h.b.uitofp(q, _VF)), _lane(h, dm, j))
            a = h.b.fadd(a, h.b.fmul(w, h.vload(3, h.ptrs[4], _VF, 32 * j)))
        return a
    return _accumulate(types.void(acc, b, o, x, xo, d, dmin), body)


@intrinsic
def _block_q5_k(typingctx, acc, b, o, x, xo, d, dmin):
    """As _block_q4_k for Q5_K: the fifth bit of sub-block j is bit j of the 32 qh bytes at b[o+16:]."""
    def body(h, a):
        ds, dm = _k4_scales(h, h.ptrs[5], h.ptrs[6])
        h.prefetch_block(176)
        qh = h.vload(1, o_arg(h), _VB, 16)
        for j in range(8):
            lo = h.bits(h.vload(1, o_arg(h), _VB, 48 + (j // 2) * 32), 4 * (j % 2), 0xF)
            q = h.b.or_(lo, h.b.shl(h.bits(qh, j, 1), h.bytes_const(4)))
            w = h.b.fsub(h.b.fmul(_lane(h, ds, j), h.b.uitofp(q, _VF)), _lane(h, dm, j))
            a = h.b.fadd(a, h.b.fmul(w, h.vload(3, h.ptrs[4], _VF, 32 * j)))
        return a
    return _accumulate(types.void(acc, b, o, x, xo, d, dmin), body)


@intrinsic
def _block_q6_k(typingctx, acc, b, o, x, xo, d):
    """acc[l] += (d * scale[16-group]) * (q - 32) * x over the Q6_K block at b[o:] (scales: int8 at o+192)."""
    def body(h, a):
        v16f = ir.VectorType(_F32, 16)
        h.prefetch_block(210)
        scales = h.b.fmul(h.splat(h.ptrs[5], v16f), h.b.sitofp(h.vload(1, o_arg(h), ir.VectorType(_I8, 16), 192), v16f))
        for hh in range(2):
            qh = h.vload(1, o_arg(h), _VB, 128 + hh * 32)
            for t in range(4):
                ql = h.bits(h.vload(1, o_arg(h), _VB, hh * 64 + (t & 1) * 32), 4 * (t >> 1), 0xF)
                q = h.b.sub(h.b.or_(ql, h.b.shl(h.bits(qh, 2 * t, 3), h.bytes_const(4))), h.bytes_const(32))
                g = hh * 8 + t * 2
                sc = h.b.shuffle_vector(scales, ir.Constant(v16f, ir.Undefined),
                                        ir.Constant(ir.VectorType(_I32, LANES), [g] * 16 + [g + 1] * 16))
                w = h.b.fmul(sc, h.b.sitofp(q, _VF))
                a = h.b.fadd(a, h.b.fmul(w, h.vload(3, h.ptrs[4], _VF, hh * 128 + t * 32)))
        return a
    return _accumulate(types.void(acc, b, o, x, xo, d), body)


@intrinsic
def _block_q8_0(typingctx, acc, b, o, x, xo, d):
    """acc[l] += (q[l] * d) * x[xo + l] for the Q8_0 block at b[o:] (int8 weights at o+2)."""
    def body(h, a):
        h.prefetch_block(34)
        q = h.b.sitofp(h.vload(1, o_arg(h), _VB, 2), _VF)
        return h.b.fadd(a, h.b.fmul(h.b.fmul(q, h.splat(h.ptrs[5], _VF)), h.vload(3, h.ptrs[4], _VF)))
    return _accumulate(types.void(acc, b, o, x, xo, d), body)


@intrinsic
def _block_q4_0(typingctx, acc, b, o, x, xo, d):
    """acc[l] += (d * (q[l] - 8)) * x[xo + l]: lanes 0..15 are the low nibbles of b[o+2:o+18], 16..31 the high."""
    def body(h, a):
        v16b = ir.VectorType(_I8, 16)
        h.prefetch_block(18)
        raw = h.vload(1, o_arg(h), v16b, 2)
        q = h.b.shuffle_vector(h.bits(raw, 0, 0xF), h.bits(raw, 4, 0xF), ir.Constant(ir.VectorType(_I32, LANES), list(range(32))))
        w = h.b.fmul(h.splat(h.ptrs[5], _VF), h.b.sitofp(h.b.sub(q, h.bytes_const(8)), _VF))
        return h.b.fadd(a, h.b.fmul(w, h.vload(3, h.ptrs[4], _VF)))
    return _accumulate(types.void(acc, b, o, x, xo, d), body)


def o_arg(h):
    """The block offset argument (arg 2) of every _block_* intrinsic."""
    return h.ptrs[2]


@intrinsic
def _lane_sum(typingctx, acc):
    """sum of the 32 f32 lanes of acc as a fixed tree: halves added lane-wise (32 -> 16 -> 8 -> 4 -> 2 -> 1).
    A serial 32-add chain would cost ~130 cycles of latency per output row."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        v = builder.load(h.acc_ptr(0), align=4)
        n = LANES
        while n > 1:
            n //= 2
            take = lambda start: builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                                        ir.Constant(ir.VectorType(_I32, n), list(range(start, start + n))))
            v = builder.fadd(take(0), take(n))
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(acc), codegen


@njit(cache=True, nogil=True)
def _mv_q4_k(raw, x, out, lut, r0, r1):
    """Rows r0..r1: raw uint8 [n_rows, row_bytes] Q4_K, x f32 [m, n_cols] -> out f32 [m, n_rows]."""
    acc = np.empty(LANES, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(x.shape[0]):
            xi = x[i]
            acc[:] = 0.0
            for blk in range(xi.shape[0] // 256):
                o = blk * 144
                _block_q4_k(acc, b, o, xi, blk * 256, _half(lut, b, o), _half(lut, b, o + 2))
            out[i, r] = _lane_sum(acc)


@njit(cache=True, nogil=True)
def _mv_q5_k(raw, x, out, lut, r0, r1):
    """Rows r0..r1: raw uint8 [n_rows, row_bytes] Q5_K, x f32 [m, n_cols] -> out f32 [m, n_rows]."""
    acc = np.empty(LANES, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(x.shape[0]):
            xi = x[i]
            acc[:] = 0.0
            for blk in range(xi.shape[0] // 256):
                o = blk * 176
                _block_q5_k(acc, b, o, xi, blk * 256, _half(lut, b, o), _half(lut, b, o + 2))
            out[i, r] = _lane_sum(acc)


@njit(cache=True, nogil=True)
def _mv_q6_k(raw, x, out, lut, r0, r1):
    """Rows r0..r1: raw uint8 [n_rows, row_bytes] Q6_K, x f32 [m, n_cols] -> out f32 [m, n_rows]."""
    acc = np.empty(LANES, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(x.shape[0]):
            xi = x[i]
            acc[:] = 0.0
            for blk in range(xi.shape[0] // 256):
                _block_q6_k(acc, b, blk * 210, xi, blk * 256, _half(lut, b, blk * 210 + 208))
            out[i, r] = _lane_sum(acc)


@njit(cache=True, nogil=True)
def _mv_q8_0(raw, x, out, lut, r0, r1):
    """Rows r0..r1: raw uint8 [n_rows, row_bytes] Q8_0, x f32 [m, n_cols] -> out f32 [m, n_rows]."""
    acc = np.empty(LANES, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(x.shape[0]):
            xi = x[i]
            acc[:] = 0.0
            for blk in range(xi.shape[0] // 32):
                _block_q8_0(acc, b, blk * 34, xi, blk * 32, _half(lut, b, blk * 34))
            out[i, r] = _lane_sum(acc)


@njit(cache=True, nogil=True)
def _mv_q4_0(raw, x, out, lut, r0, r1):
    """Rows r0..r1: raw uint8 [n_rows, row_bytes] Q4_0, x f32 [m, n_cols] -> out f32 [m, n_rows]."""
    acc = np.empty(LANES, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(x.shape[0]):
            xi = x[i]
            acc[:] = 0.0
            for blk in range(xi.shape[0] // 32):
                _block_q4_0(acc, b, blk * 18, xi, blk * 32, _half(lut, b, blk * 18))
            out[i, r] = _lane_sum(acc)


MATVEC = {Q4_K: _mv_q4_k, Q5_K: _mv_q5_k, Q6_K: _mv_q6_k, Q8_0: _mv_q8_0, Q4_0: _mv_q4_0}


def matvec_range(qtype: int, raw: np.ndarray, x: np.ndarray, out: np.ndarray, r0: int, r1: int):
    """out[:, r0:r1] = x @ W[r0:r1].T (inputs validated by dequant.matvec_rows)."""
    MATVEC[qtype](raw, x, out, HALF_TO_FLOAT, r0, r1)
