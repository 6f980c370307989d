"""GGML block unpacking written as LLVM vector IR, for numba: the hot inner code of the
decode matvec (kernels/qdot.py) and the dequantization tiles (kernels/dequant.py).

Trade-off: numba's loop vectorizer would not give us fast code here. A 32-step
loop with a compile-time trip count is fully unrolled into scalar code; with a
run-time one it vectorizes but pays alias checks and loop set-up on every
32-weight sub-block, and a float reduction into a scalar never vectorizes
without fastmath (which we do not allow: it made cold and cached code differ).
So each format's block is unpacked by a generator (`_w_*`) that emits the
block's weights as 32-wide f32 vectors, computed with exactly the f32 operations
of gguf-py's reference dequantization ((d*scale)*q - dmin*min, ...), no FMA
contraction. Two kinds of numba intrinsics consume them:
  * `_dot_*`:   acc[l] += w[l] * x[l] into 32 f32 lanes kept in registers for the block;
  * `_store_*`: y[l] = w[l] (a dequantized tile, element-exact vs gguf-py).
The numba drivers read the f16 block scales and run the loops. Every result is a
pure function of the inputs: the same for any thread count, cold or cached.
Cost: ~200 lines of IR building, pinned by tests/kernels/test_qdot.py (a numpy
lane emulation, bitwise) and the gguf-py exactness tests.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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


def _dot(sig, gen, n_scalars):
    """Intrinsic (acc, b, o, x, xo, *scalars): acc[l] += w_j[l] * x[xo + 32j + l] over the block's vectors."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        p = h.acc_ptr(0)
        a = builder.load(p, align=4)
        for j, w in enumerate(gen(h, h.ptrs[5:5 + n_scalars])):
            a = builder.fadd(a, builder.fmul(w, h.vload(3, h.ptrs[4], _VF, 32 * j)))
        builder.store(a, p, align=4)
        return context.get_dummy_value()
    return sig, codegen


def _store(sig, gen, n_scalars):
    """Intrinsic (y, b, o, yo, *scalars): y[yo + 32j + l] = w_j[l]."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        for j, w in enumerate(gen(h, h.ptrs[4:4 + n_scalars])):
            off = builder.add(h.ptrs[3], ir.Constant(_I64, 32 * j))
            builder.store(w, builder.bitcast(builder.gep(h.ptrs[0], [off]), _VF.as_pointer()), align=4)
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


def _w_q4_k(h, scalars):
    """The 8 sub-blocks of the Q4_K block at b[o:]: (d*s_j) * q - dmin*m_j, q the nibbles at o+16."""
    ds, dm = _k4_scales(h, *scalars)
    h.prefetch_block(144)
    out = []
    for j in range(8):
        q = h.bits(h.vload(1, o_arg(h), _VB, 16 + (j // 2) * 32), 4 * (j % 2), 0xF)
        out.append(h.b.fsub(h.b.fmul(_lane(h, ds, j), h.b.uitofp(q, _VF)), _lane(h, dm, j)))
    return out


def _w_q5_k(h, scalars):
    """As _w_q4_k for Q5_K: the fifth bit of sub-block j is bit j of the 32 qh bytes at b[o+16:]."""
    ds, dm = _k4_scales(h, *scalars)
    h.prefetch_block(176)
    qh = h.vload(1, o_arg(h), _VB, 16)
    out = []
    for j in range(8):
        lo = h.bits(h.vload(1, o_arg(h), _VB, 48 + (j // 2) * 32), 4 * (j % 2), 0xF)
        q = h.b.or_(lo, h.b.shl(h.bits(qh, j, 1), h.bytes_const(4)))
        out.append(h.b.fsub(h.b.fmul(_lane(h, ds, j), h.b.uitofp(q, _VF)), _lane(h, dm, j)))
    return out


def _w_q6_k(h, scalars):
    """The Q6_K block at b[o:]: (d * scale_16) * (q - 32), int8 scales at o+192, d given."""
    v16f = ir.VectorType(_F32, 16)
    h.prefetch_block(210)
    scales = h.b.fmul(h.splat(scalars[0], v16f), h.b.sitofp(h.vload(1, o_arg(h), ir.VectorType(_I8, 16), 192), v16f))
    out = []
    for hh in range(2):
        qh = h.vload(1, o_arg(h), _VB, 128 + hh * 32)
        for t in range(4):
            ql = h.bits(h.vload(1, o_arg(h), _VB, hh * 64 + (t & 1) * 32), 4 * (t >> 1), 0xF)
            q = h.b.sub(h.b.or_(ql, h.b.shl(h.bits(qh, 2 * t, 3), h.bytes_const(4))), h.bytes_const(32))
            g = hh * 8 + t * 2
            sc = h.b.shuffle_vector(scales, ir.Constant(v16f, ir.Undefined),
                                    ir.Constant(ir.VectorType(_I32, LANES), [g] * 16 + [g + 1] * 16))
            out.append(h.b.fmul(sc, h.b.sitofp(q, _VF)))
    return out


def _w_q8_0(h, scalars):
    """The Q8_0 block at b[o:]: q * d, int8 weights at o+2."""
    return [h.b.fmul(h.b.sitofp(h.vload(1, o_arg(h), _VB, 2), _VF), h.splat(scalars[0], _VF))]


def _w_q4_0(h, scalars):
    """The Q4_0 block at b[o:]: d * (q - 8); lanes 0..15 the low nibbles of b[o+2:o+18], 16..31 the high."""
    v16b = ir.VectorType(_I8, 16)
    raw = h.vload(1, o_arg(h), v16b, 2)
    q = h.b.shuffle_vector(h.bits(raw, 0, 0xF), h.bits(raw, 4, 0xF), ir.Constant(ir.VectorType(_I32, LANES), list(range(32))))
    return [h.b.fmul(h.splat(scalars[0], _VF), h.b.sitofp(h.b.sub(q, h.bytes_const(8)), _VF))]


def _w_f16(h, scalars):
    """32 f16 weights at b[o:] (b uint16): widened exactly (vcvtph2ps)."""
    v = h.vload(1, o_arg(h), ir.VectorType(ir.IntType(16), LANES))
    return [h.b.fpext(h.b.bitcast(v, ir.VectorType(ir.HalfType(), LANES)), _VF)]


def _w_bf16(h, scalars):
    """32 bf16 weights at b[o:] (b uint16): the high halves of f32s."""
    v = h.b.zext(h.vload(1, o_arg(h), ir.VectorType(ir.IntType(16), LANES)), ir.VectorType(_I32, LANES))
    return [h.b.bitcast(h.b.shl(v, ir.Constant(v.type, [16] * LANES)), _VF)]


def o_arg(h):
    """The block offset argument (arg 2) of every block intrinsic."""
    return h.ptrs[2]


@intrinsic
def dot_q4_k(typingctx, acc, b, o, x, xo, d, dmin):
    return _dot(types.void(acc, b, o, x, xo, d, dmin), _w_q4_k, 2)


@intrinsic
def dot_q5_k(typingctx, acc, b, o, x, xo, d, dmin):
    return _dot(types.void(acc, b, o, x, xo, d, dmin), _w_q5_k, 2)


@intrinsic
def dot_q6_k(typingctx, acc, b, o, x, xo, d):
    return _dot(types.void(acc, b, o, x, xo, d), _w_q6_k, 1)


@intrinsic
def dot_q8_0(typingctx, acc, b, o, x, xo, d):
    return _dot(types.void(acc, b, o, x, xo, d), _w_q8_0, 1)


@intrinsic
def dot_q4_0(typingctx, acc, b, o, x, xo, d):
    return _dot(types.void(acc, b, o, x, xo, d), _w_q4_0, 1)


@intrinsic
def dot_f16(typingctx, acc, b, o, x, xo):
    return _dot(types.void(acc, b, o, x, xo), _w_f16, 0)


@intrinsic
def dot_bf16(typingctx, acc, b, o, x, xo):
    return _dot(types.void(acc, b, o, x, xo), _w_bf16, 0)


@intrinsic
def store_f16(typingctx, y, b, o, yo):
    return _store(types.void(y, b, o, yo), _w_f16, 0)


@intrinsic
def store_bf16(typingctx, y, b, o, yo):
    return _store(types.void(y, b, o, yo), _w_bf16, 0)


@intrinsic
def store_q4_k(typingctx, y, b, o, yo, d, dmin):
    return _store(types.void(y, b, o, yo, d, dmin), _w_q4_k, 2)


@intrinsic
def store_q5_k(typingctx, y, b, o, yo, d, dmin):
    return _store(types.void(y, b, o, yo, d, dmin), _w_q5_k, 2)


@intrinsic
def store_q6_k(typingctx, y, b, o, yo, d):
    return _store(types.void(y, b, o, yo, d), _w_q6_k, 1)


@intrinsic
def store_q8_0(typingctx, y, b, o, yo, d):
    return _store(types.void(y, b, o, yo, d), _w_q8_0, 1)


@intrinsic
def store_q4_0(typingctx, y, b, o, yo, d):
    return _store(types.void(y, b, o, yo, d), _w_q4_0, 1)


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


