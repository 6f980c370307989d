"""GGML block unpacking written as LLVM vector IR, for numba: the hot inner code of the
decode matvec (pipeline/kernels/qdot.py) and the dequantization tiles (pipeline/kernels/dequant.py).

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

from .formats import BF16, BY_QTYPE, F16, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0

LANES = 32
# bytes ahead in the weight stream: the hardware prefetcher alone left decode at ~4.6 G weights/s from DRAM,
# this gives ~7
PREFETCH = 2048
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
    s_top = h.b.shl(h.b.lshr(pick([0, 1, 2, 3, 0, 1, 2, 3]), c(6)), c(4))
    m_top = h.b.shl(h.b.lshr(pick([0, 1, 2, 3, 4, 5, 6, 7]), c(6)), c(4))
    s = h.b.select(low, h.b.and_(s_src, c(63)), h.b.or_(h.b.and_(s_src, c(0xF)), s_top))
    m = h.b.select(low, h.b.and_(m_src, c(63)), h.b.or_(h.b.lshr(m_src, c(4)), m_top))
    return h.b.fmul(h.splat(d, v8f), h.b.uitofp(s, v8f)), h.b.fmul(h.splat(dmin, v8f), h.b.uitofp(m, v8f))


def _lane(h, v8, j):
    """Element j of an <8 x float> broadcast to 32 lanes."""
    return h.b.shuffle_vector(v8, ir.Constant(v8.type, ir.Undefined),
                              ir.Constant(ir.VectorType(_I32, LANES), [j] * LANES))


def _w_q4_k(h, scalars):
    """The 8 sub-blocks of the Q4_K block at b[o:]: (d*s_j) * q - dmin*m_j, q the nibbles at o+16."""
    ds, dm = _k4_scales(h, *scalars)
    h.prefetch_block(BY_QTYPE[Q4_K].block_bytes)
    out = []
    for j in range(8):
        q = h.bits(h.vload(1, o_arg(h), _VB, 16 + (j // 2) * 32), 4 * (j % 2), 0xF)
        out.append(h.b.fsub(h.b.fmul(_lane(h, ds, j), h.b.uitofp(q, _VF)), _lane(h, dm, j)))
    return out


def _w_q5_k(h, scalars):
    """As _w_q4_k for Q5_K: the fifth bit of sub-block j is bit j of the 32 qh bytes at b[o+16:]."""
    ds, dm = _k4_scales(h, *scalars)
    h.prefetch_block(BY_QTYPE[Q5_K].block_bytes)
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
    h.prefetch_block(BY_QTYPE[Q6_K].block_bytes)
    scales = h.b.fmul(h.splat(scalars[0], v16f), h.b.sitofp(h.vload(1, o_arg(h), ir.VectorType(_I8, 16), 192), v16f))
    return [h.b.fmul(_pair_lanes(h, scales, 2 * j), h.b.sitofp(h.b.sub(_q6_k_weights(h, j), h.bytes_const(32)), _VF))
            for j in range(8)]


def _w_q8_0(h, scalars):
    """The Q8_0 block at b[o:]: q * d, int8 weights at o+2."""
    return [h.b.fmul(h.b.sitofp(h.vload(1, o_arg(h), _VB, 2), _VF), h.splat(scalars[0], _VF))]


def _nibbles(h, off):
    """<32 x i8> of the 16 bytes at b[o+off:]: lanes 0..15 their low nibbles, 16..31 their high ones
    (the element order of every 32-weight block format: Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL, IQ4_XS sub-blocks)."""
    v16b = ir.VectorType(_I8, 16)
    raw = h.vload(1, o_arg(h), v16b, off)
    both = ir.Constant(ir.VectorType(_I32, LANES), list(range(32)))
    return h.b.shuffle_vector(h.bits(raw, 0, 0xF), h.bits(raw, 4, 0xF), both)


def _high_bits(h, off):
    """<32 x i8>: lane l is bit l of the little-endian 32-bit word at b[o+off:], moved to bit 4 (Q5_0/Q5_1's qh).
    The word bitcast to <32 x i1> and sign-extended: one mask move on AVX-512 (vpmovm2b), ggml's
    bytes_from_bits_32 compare otherwise, where per-lane byte shifts took ~20 instructions."""
    word = h.b.load(h.b.bitcast(h.b.gep(h.ptrs[1], [h.b.add(o_arg(h), ir.Constant(_I64, off))]),
                                ir.IntType(32).as_pointer()), align=1)
    mask = h.b.sext(h.b.bitcast(word, ir.VectorType(ir.IntType(1), LANES)), _VB)
    return h.b.and_(mask, h.bytes_const(16))


def _w_q4_0(h, scalars):
    """The Q4_0 block at b[o:]: d * (q - 8), q the nibbles of b[o+2:o+18]."""
    q = _nibbles(h, 2)
    return [h.b.fmul(h.splat(scalars[0], _VF), h.b.sitofp(h.b.sub(q, h.bytes_const(8)), _VF))]


def _w_q4_1(h, scalars):
    """The Q4_1 block at b[o:]: (d * q) + m, q the nibbles of b[o+4:o+20]; d, m given."""
    d, m = scalars
    q = _nibbles(h, 4)
    return [h.b.fadd(h.b.fmul(h.splat(d, _VF), h.b.uitofp(q, _VF)), h.splat(m, _VF))]


def _w_q5_0(h, scalars):
    """The Q5_0 block at b[o:]: d * (q - 16), q = nibbles of b[o+6:o+22] | bit l of the word at o+2 as bit 4."""
    q = h.b.or_(_nibbles(h, 6), _high_bits(h, 2))
    return [h.b.fmul(h.splat(scalars[0], _VF), h.b.sitofp(h.b.sub(q, h.bytes_const(16)), _VF))]


def _w_q5_1(h, scalars):
    """The Q5_1 block at b[o:]: (d * q) + m, q = nibbles of b[o+8:o+24] | bit l of the word at o+4 as bit 4."""
    d, m = scalars
    q = h.b.or_(_nibbles(h, 8), _high_bits(h, 4))
    return [h.b.fadd(h.b.fmul(h.splat(d, _VF), h.b.uitofp(q, _VF)), h.splat(m, _VF))]


def _pair_lanes(h, v16, g):
    """Lanes 0..15 element g of the <16 x float> v16, lanes 16..31 element g + 1 (two 16-weight sub-blocks)."""
    return h.b.shuffle_vector(v16, ir.Constant(v16.type, ir.Undefined),
                              ir.Constant(ir.VectorType(_I32, LANES), [g] * 16 + [g + 1] * 16))


def _w_q2_k(h, scalars):
    """The Q2_K block at b[o:]: (d * (sc & 15)) * q - dmin * (sc >> 4) per 16 weights, sc the bytes at o,
    q 2-bit fields of the 64 bytes at o+16 (vector 4*half + s: bits 2s of b[o+16+32*half+l])."""
    d, dmin = scalars
    v16b, v16f = ir.VectorType(_I8, 16), ir.VectorType(_F32, 16)
    h.prefetch_block(BY_QTYPE[Q2_K].block_bytes)
    sc = h.vload(1, o_arg(h), v16b, 0)
    dl = h.b.fmul(h.splat(d, v16f), h.b.uitofp(h.bits(sc, 0, 0xF), v16f))
    ml = h.b.fmul(h.splat(dmin, v16f), h.b.uitofp(h.bits(sc, 4, 0xF), v16f))
    out = []
    for half in range(2):
        raw = h.vload(1, o_arg(h), _VB, 16 + 32 * half)
        for s in range(4):
            g = (half * 4 + s) * 2
            q = h.b.uitofp(h.bits(raw, 2 * s, 3), _VF)
            out.append(h.b.fsub(h.b.fmul(_pair_lanes(h, dl, g), q), _pair_lanes(h, ml, g)))
    return out


def _q3_k_scale_bytes(h):
    """The 16 6-bit scales of a Q3_K block minus 32 as <16 x i8> (signed): low nibbles from the 8 bytes at o+96
    (bytes 0..7, then their high nibbles), two high bits from the 4 bytes at o+104 (ggml's kmask1/kmask2 unpack).
    8 + 4 loads: the block ends at o+110, a 16-byte load would not."""
    v8b, v16b, v16i = ir.VectorType(_I8, 8), ir.VectorType(_I8, 16), ir.VectorType(_I32, 16)
    lo = h.vload(1, o_arg(h), v8b, 96)
    hi = h.vload(1, o_arg(h), ir.VectorType(_I8, 4), 104)
    low = h.b.shuffle_vector(lo, ir.Constant(v8b, ir.Undefined), ir.Constant(v16i, list(range(8)) * 2))
    low = h.b.and_(h.b.lshr(low, ir.Constant(v16b, [0] * 8 + [4] * 8)), ir.Constant(v16b, [0xF] * 16))
    high = h.b.shuffle_vector(hi, ir.Constant(hi.type, ir.Undefined), ir.Constant(v16i, [0, 1, 2, 3] * 4))
    high = h.b.lshr(high, ir.Constant(v16b, [0] * 4 + [2] * 4 + [4] * 4 + [6] * 4))
    high = h.b.and_(high, ir.Constant(v16b, [3] * 16))
    return h.b.sub(h.b.or_(low, h.b.shl(high, ir.Constant(v16b, [4] * 16))), ir.Constant(v16b, [32] * 16))


def _q3_k_weights(h, hmask, j):
    """<32 x i8> signed: vector j of the Q3_K block, ql - 4 * !hbit in -4..3; ql the 2-bit fields 2t of the 32
    bytes at o+32+32*half (j = 4 * half + t), hbit bit j of the hmask bytes."""
    raw = h.vload(1, o_arg(h), _VB, 32 + 32 * (j // 4))
    minus = h.b.shl(h.b.xor(h.bits(hmask, j, 1), h.bytes_const(1)), h.bytes_const(2))
    return h.b.sub(h.bits(raw, 2 * (j % 4), 3), minus)


def _w_q3_k(h, scalars):
    """The Q3_K block at b[o:]: (d * (s - 32)) * (ql - 4 * !hbit) per 16 weights; ql 2-bit fields of the 64
    bytes at o+32 (as Q2_K), hbit j of the 32 hmask bytes at o for vector j, the 16 6-bit s packed at o+96."""
    v16f = ir.VectorType(_F32, 16)
    h.prefetch_block(BY_QTYPE[Q3_K].block_bytes)
    dl = h.b.fmul(h.splat(scalars[0], v16f), h.b.sitofp(_q3_k_scale_bytes(h), v16f))
    hmask = h.vload(1, o_arg(h), _VB, 0)
    return [h.b.fmul(_pair_lanes(h, dl, 2 * j), h.b.sitofp(_q3_k_weights(h, hmask, j), _VF)) for j in range(8)]


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def _iq4_select(h, q):
    """IQ4_VALUES[q] as <32 x i8> for a <32 x i8> of nibbles: a tree of selects on q's four bits (portable IR, no
    gather or byte-shuffle intrinsic)."""
    level = [ir.Constant(_VB, [v] * LANES) for v in IQ4_VALUES]
    for bit in range(4):
        take_odd = h.b.icmp_unsigned("!=", h.b.and_(q, h.bytes_const(1 << bit)), h.bytes_const(0))
        level = [h.b.select(take_odd, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


def _iq4_values(h, q):
    """IQ4_VALUES[q] as f32 (exact int8 -> f32)."""
    return h.b.sitofp(_iq4_select(h, q), _VF)


def _w_iq4_nl(h, scalars):
    """The IQ4_NL block at b[o:]: d * IQ4_VALUES[q], q the nibbles of b[o+2:o+18]."""
    return [h.b.fmul(h.splat(scalars[0], _VF), _iq4_values(h, _nibbles(h, 2)))]


def _iq4_xs_scale_bytes(h):
    """The 8 sub-block scales of an IQ4_XS block minus 32 as <8 x i8> (signed): 4 bits of the bytes at o+4 (low
    nibble for even j) | 2 bits (2j) of the 16-bit word at o+2 as bits 4..5."""
    v8b, v8i = ir.VectorType(_I8, 8), ir.VectorType(_I32, 8)
    v8s = ir.VectorType(ir.IntType(16), 8)
    sl = h.vload(1, o_arg(h), ir.VectorType(_I8, 4), 4)
    low = h.b.shuffle_vector(sl, ir.Constant(sl.type, ir.Undefined), ir.Constant(v8i, [0, 0, 1, 1, 2, 2, 3, 3]))
    low = h.b.and_(h.b.lshr(low, ir.Constant(v8b, [0, 4] * 4)), ir.Constant(v8b, [0xF] * 8))
    sh = h.splat(h.b.load(h.b.bitcast(h.b.gep(h.ptrs[1], [h.b.add(o_arg(h), ir.Constant(_I64, 2))]),
                                      ir.IntType(16).as_pointer()), align=1), v8s)
    high = h.b.and_(h.b.lshr(sh, ir.Constant(v8s, [2 * j for j in range(8)])), ir.Constant(v8s, [3] * 8))
    high = h.b.trunc(high, v8b)
    return h.b.sub(h.b.or_(low, h.b.shl(high, ir.Constant(v8b, [4] * 8))), ir.Constant(v8b, [32] * 8))


def _w_iq4_xs(h, scalars):
    """The IQ4_XS block at b[o:]: (d * (s_j - 32)) * IQ4_VALUES[q] per 32 weights, q the nibbles of the 16
    bytes at o+8+16j (scales: _iq4_xs_scale_bytes)."""
    v8f = ir.VectorType(_F32, 8)
    h.prefetch_block(BY_QTYPE[IQ4_XS].block_bytes)
    dl = h.b.fmul(h.splat(scalars[0], v8f), h.b.sitofp(_iq4_xs_scale_bytes(h), v8f))
    return [h.b.fmul(_lane(h, dl, j), _iq4_values(h, _nibbles(h, 8 + 16 * j))) for j in range(8)]


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


def _block_intrinsics(gen, qtype):
    """(dot, store) intrinsics of the unpacker `gen` of format `qtype`, taking its row's f32 block scales (none
    for F16/BF16, d, or d and dmin / m: pipeline/kernels/formats.py): dot(acc, b, o, x, xo, *scales) as _dot,
    store(y, b, o, yo, *scales) as _store."""
    fmt = BY_QTYPE[qtype]
    n = 0 if not fmt.quantized else 1 if fmt.dmin_at < 0 else 2
    if n == 2:
        def dot(typingctx, acc, b, o, x, xo, d, m): return _dot(types.void(acc, b, o, x, xo, d, m), gen, 2)
        def store(typingctx, y, b, o, yo, d, m): return _store(types.void(y, b, o, yo, d, m), gen, 2)
    elif n == 1:
        def dot(typingctx, acc, b, o, x, xo, d): return _dot(types.void(acc, b, o, x, xo, d), gen, 1)
        def store(typingctx, y, b, o, yo, d): return _store(types.void(y, b, o, yo, d), gen, 1)
    else:
        def dot(typingctx, acc, b, o, x, xo): return _dot(types.void(acc, b, o, x, xo), gen, 0)
        def store(typingctx, y, b, o, yo): return _store(types.void(y, b, o, yo), gen, 0)
    return intrinsic(dot), intrinsic(store)


dot_q4_k, store_q4_k = _block_intrinsics(_w_q4_k, Q4_K)
dot_q5_k, store_q5_k = _block_intrinsics(_w_q5_k, Q5_K)
dot_q6_k, store_q6_k = _block_intrinsics(_w_q6_k, Q6_K)
dot_q8_0, store_q8_0 = _block_intrinsics(_w_q8_0, Q8_0)
dot_q4_0, store_q4_0 = _block_intrinsics(_w_q4_0, Q4_0)
dot_q4_1, store_q4_1 = _block_intrinsics(_w_q4_1, Q4_1)
dot_q5_0, store_q5_0 = _block_intrinsics(_w_q5_0, Q5_0)
dot_q5_1, store_q5_1 = _block_intrinsics(_w_q5_1, Q5_1)
dot_q2_k, store_q2_k = _block_intrinsics(_w_q2_k, Q2_K)
dot_q3_k, store_q3_k = _block_intrinsics(_w_q3_k, Q3_K)
dot_iq4_nl, store_iq4_nl = _block_intrinsics(_w_iq4_nl, IQ4_NL)
dot_iq4_xs, store_iq4_xs = _block_intrinsics(_w_iq4_xs, IQ4_XS)
dot_f16, store_f16 = _block_intrinsics(_w_f16, F16)
dot_bf16, store_bf16 = _block_intrinsics(_w_bf16, BF16)


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
                                                        ir.Constant(ir.VectorType(_I32, n),
                                                                    list(range(start, start + n))))
            v = builder.fadd(take(0), take(n))
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(acc), codegen




# --- integer block dot products (llama.cpp's ggml-cpu arithmetic) ------------------------------------------
# The weights of a block are unpacked as small integers, multiplied by the int8 activations of
# pipeline/kernels/qint.py (Q8_0 / Q8_K blocks) and summed exactly in i32. The i32 sums are kept in the 8 lanes
# llama.cpp's AVX2 kernels keep them in (lane k holds elements 4k..4k+3 of every 32-element chunk: what
# maddubs + madd leave), converted to f32 and added with one fused multiply-add per block and lane, so
# the f32 rounding is llama.cpp's own. Integer sums are exact, so the order inside a lane is free; the
# products are written as sign-extended i16 pairs so LLVM selects vpmaddwd on AVX2.
_V8F, _V8I, _V16I = ir.VectorType(_F32, 8), ir.VectorType(_I32, 8), ir.VectorType(_I32, 16)
_V16S = ir.VectorType(ir.IntType(16), 16)


def _target_has(*features: str) -> bool:
    """True when numba compiles for a CPU with every one of `features` (LLVM names: "avx2", "avx512bw", ...): its
    host, or NUMBA_CPU_NAME/NUMBA_CPU_FEATURES when set. FUCINA_INTEGER_ISA=portable forces the portable IR (to
    check it on an AVX2 machine); FUCINA_INTEGER_ISA=avx2 answers for AVX2 alone, nothing after it (the blocked
    GEMM's 4-row layout, checked on an AVX-512 machine)."""
    import os

    import llvmlite.binding as llvm
    from numba.core import config
    isa = os.environ.get("FUCINA_INTEGER_ISA", "").lower()
    if isa == "portable" or (isa == "avx2" and any(f != "avx2" for f in features)):
        return False
    if config.CPU_FEATURES:
        return all(f"+{f}" in config.CPU_FEATURES.split(",") for f in features)
    if config.CPU_NAME and config.CPU_NAME != "host":
        return False  # a named CPU without a feature list: we cannot tell, stay portable
    host = llvm.get_host_cpu_features()
    return all(bool(host.get(f, False)) for f in features)


# The integer kernels' two code paths compute the same exact i32 lane sums (so the same bits): on AVX2 the
# x86 intrinsics vpmaddubsw (u8 x s8 pairs -> i16) + vpmaddwd (i16 pairs x i16 scale -> i32), what llama.cpp
# runs; elsewhere portable sext/mul/shuffle IR. LLVM does not form vpmaddubsw from the portable IR inside
# the kernels (it proved the nibbles' ranges and chose zext/vpmullw chains), hence the explicit intrinsics.
AVX2 = _target_has("avx2")


def _pair_sums(h, w, x):
    """<16 x i32>: w[2i]*x[2i] + w[2i+1]*x[2i+1] for <32 x i8> signed w and x. Written as a product of
    sign-extended bytes and an even + odd lane add, the shape LLVM's x86 backend turns into
    vpmovsxbw + vpmaddwd (shuffling the bytes before extending them gave vpmulld chains instead)."""
    v32i = ir.VectorType(_I32, LANES)
    p = h.b.mul(h.b.sext(w, v32i), h.b.sext(x, v32i))
    und = ir.Constant(v32i, ir.Undefined)
    pick = lambda start: h.b.shuffle_vector(p, und, ir.Constant(_V16I, list(range(start, 32, 2))))
    return h.b.add(pick(0), pick(1))


def _fold_lanes(h, v16):
    """<8 x i32>: lane k = v16[2k] + v16[2k+1] (elements 4k..4k+3 of a chunk: llama.cpp's lane k)."""
    und = ir.Constant(v16.type, ir.Undefined)
    pick = lambda start: h.b.shuffle_vector(v16, und, ir.Constant(_V8I, list(range(start, 16, 2))))
    return h.b.add(pick(0), pick(1))


def _x86(h, name, ret, *args):
    fn = cgutils.get_or_insert_function(h.b.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return h.b.call(fn, list(args))


def _pair_products(h, w, x, w_unsigned):
    """AVX2: <16 x i16> w[2i]*x[2i] + w[2i+1]*x[2i+1] by vpmaddubsw; signed w as |w| . (x * sign(w)), the
    signed product as an unsigned x signed one (ggml's mul_sum_i8_pairs)."""
    if not w_unsigned:
        x = _x86(h, "llvm.x86.avx2.psign.b", _VB, x, w)
        w = h.b.select(h.b.icmp_signed("<", w, h.bytes_const(0)), h.b.sub(h.bytes_const(0), w), w)
    return _x86(h, "llvm.x86.avx2.pmadd.ub.sw", _V16S, w, x)


def _lane_sums(h, w, x, scale16=None, w_unsigned=False):
    """<8 x i32>: lane k = sum over elements 4k..4k+3 of w * x * scale (llama.cpp's lane k) for <32 x i8> w and
    signed x; scale16 (an i16 per pair of elements, <16 x i16>) defaults to 1. Exact: |w| <= 128 and |x| <= 127
    keep every u8 x s8 pair sum inside i16 (vpmaddubsw never saturates here), and |scale| < 256 keeps every i32
    lane far from overflow. w_unsigned: w holds 4/5-bit values (0..31, vpmaddubsw's unsigned side as is), else
    signed."""
    if not AVX2:
        part = _pair_sums(h, w, x)  # w_unsigned values are all < 128 (4/5-bit): sign extension reads them right
        if scale16 is not None:
            part = h.b.mul(part, h.b.sext(scale16, _V16I))
        return _fold_lanes(h, part)
    pairs = _pair_products(h, w, x, w_unsigned)
    if scale16 is None:
        scale16 = ir.Constant(_V16S, [1] * 16)
    return _x86(h, "llvm.x86.avx2.pmadd.wd", _V8I, pairs, scale16)


def _fma_into(h, arg, scale, lanes):
    """acc[arg][0:n] = fma(scale, float(lanes), acc): _mm256_fmadd_ps / _mm_fmadd_ps (llvm.fma, exact)."""
    vf = ir.VectorType(_F32, lanes.type.count)
    p = h.b.bitcast(h.ptrs[arg], vf.as_pointer())
    fn = cgutils.get_or_insert_function(h.b.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{vf.count}f32")
    h.b.store(h.b.call(fn, [h.splat(scale, vf), h.b.sitofp(lanes, vf), h.b.load(p, align=4)]), p, align=4)


def _scale16(h, s, j):
    """<16 x i16>: the unsigned 6-bit byte s[j] of <8 x i8> s in every lane (a K-quant sub-block scale)."""
    return h.splat(h.b.zext(h.b.extract_element(s, ir.Constant(_I32, j)), ir.IntType(16)), _V16S)


def _k4_scale_bytes(h):
    """The 8 6-bit scales and 8 6-bit mins of a Q4_K/Q5_K block (b[o+4:o+16]) as <8 x i8> (get_scale_min_k4)."""
    v8b = ir.VectorType(_I8, 8)
    sc = h.vload(1, o_arg(h), ir.VectorType(_I8, 16), 4)
    pick = lambda idx: h.b.shuffle_vector(sc, ir.Constant(sc.type, ir.Undefined), ir.Constant(_V8I, idx))
    low = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])  # j < 4
    c = lambda v: ir.Constant(v8b, [v] * 8)
    s_src, m_src = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([4, 5, 6, 7, 8, 9, 10, 11])
    s_top = h.b.shl(h.b.lshr(pick([0, 1, 2, 3, 0, 1, 2, 3]), c(6)), c(4))
    m_top = h.b.shl(h.b.lshr(pick([0, 1, 2, 3, 4, 5, 6, 7]), c(6)), c(4))
    s = h.b.select(low, h.b.and_(s_src, c(63)), h.b.or_(h.b.and_(s_src, c(0xF)), s_top))
    m = h.b.select(low, h.b.and_(m_src, c(63)), h.b.or_(h.b.lshr(m_src, c(4)), m_top))
    return s, m


def _idot_32(w_of_block, sig, w_unsigned=False):
    """(sig, codegen) of a 32-weight block intrinsic (acc, b, o, q, qo, d): acc[0:8] = fma(d, lanes(w . q), acc).
    w_unsigned: weights 0..31 (Q4_1/Q5_1: mul_sum_us8_pairs_float, vpmaddubsw's unsigned side as is). One
    prefetch PREFETCH bytes ahead per block (18-34 bytes: every line is asked for once or twice): without it a
    decode streaming these formats from DRAM ran at half the speed of the same products in cache."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        h.prefetch(1, o_arg(h), PREFETCH)
        _fma_into(h, 0, h.ptrs[5], _lane_sums(h, w_of_block(h), h.vload(3, h.ptrs[4], _VB), w_unsigned=w_unsigned))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def idot_q8_0(typingctx, acc, b, o, q, qo, d):
    """Q8_0 x Q8_0 as ggml_vec_dot_q8_0_q8_0 (AVX2)."""
    return _idot_32(lambda h: h.vload(1, o_arg(h), _VB, 2), types.void(acc, b, o, q, qo, d))


@intrinsic
def idot_q4_0(typingctx, acc, b, o, q, qo, d):
    """Q4_0 x Q8_0 as ggml_vec_dot_q4_0_q8_0 (AVX2): weights nibble - 8."""
    return _idot_32(lambda h: h.b.sub(_nibbles(h, 2), h.bytes_const(8)), types.void(acc, b, o, q, qo, d))


@intrinsic
def idot_q5_0(typingctx, acc, b, o, q, qo, d):
    """Q5_0 x Q8_0 as ggml_vec_dot_q5_0_q8_0 (AVX2): weights (nibble | high bit << 4) - 16."""
    return _idot_32(lambda h: h.b.sub(h.b.or_(_nibbles(h, 6), _high_bits(h, 2)), h.bytes_const(16)),
                    types.void(acc, b, o, q, qo, d))


@intrinsic
def idot_q4_k(typingctx, acc, b, o, q, qo, d, accm, sums, so, dmin):
    """Q4_K x Q8_K as ggml_vec_dot_q4_K_q8_K (AVX2): acc[0:8] = fma(d, lanes(sum_j scale_j * q4_j . q8_j), acc)
    and accm[0:4] = fma(dmin, pairs(min_j * sum(q8_j)), accm), sums = the Q8_K block's 32-element sums at so."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        h.prefetch_block(BY_QTYPE[Q4_K].block_bytes)
        s, m = _k4_scale_bytes(h)
        total = None
        for j in range(8):
            w = h.bits(h.vload(1, o_arg(h), _VB, 16 + (j // 2) * 32), 4 * (j % 2), 0xF)
            part = _lane_sums(h, w, h.vload(3, h.ptrs[4], _VB, 32 * j), _scale16(h, s, j), w_unsigned=True)
            total = part if total is None else h.b.add(total, part)
        _fma_into(h, 0, h.ptrs[5], total)
        prod = h.b.mul(h.b.zext(m, _V8I), h.vload(7, h.ptrs[8], _V8I))
        und = ir.Constant(_V8I, ir.Undefined)
        v4i = ir.VectorType(_I32, 4)
        pairs = h.b.add(h.b.shuffle_vector(prod, und, ir.Constant(v4i, [0, 2, 4, 6])),
                        h.b.shuffle_vector(prod, und, ir.Constant(v4i, [1, 3, 5, 7])))
        _fma_into(h, 6, h.ptrs[9], pairs)
        return context.get_dummy_value()
    return types.void(acc, b, o, q, qo, d, accm, sums, so, dmin), codegen


@intrinsic
def idot_q6_k(typingctx, acc, b, o, q, qo, d, bsums, so):
    """Q6_K x Q8_K as ggml_vec_dot_q6_K_q8_K (AVX2): acc[0:8] = fma(d, lanes(sum_g scale_g * q6 . q8) - 32 *
    madd(scales, bsums), acc), q6 the unsigned 6-bit weights, one int8 scale per 16 weights; the -32 offset
    comes from the Q8_K block's 16-element sums at so (lane k: 32 * (s_2k * bsum_2k + s_2k+1 * bsum_2k+1)), so
    the lanes are llama.cpp's, not those of (q6 - 32) . q8."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        h.prefetch_block(BY_QTYPE[Q6_K].block_bytes)
        scales = h.vload(1, o_arg(h), ir.VectorType(_I8, 16), 192)
        total = None
        for j in range(8):
            part = _lane_sums(h, _q6_k_weights(h, j), h.vload(3, h.ptrs[4], _VB, 32 * j),
                              _pair_scales16(h, scales, 2 * j), w_unsigned=True)
            total = part if total is None else h.b.add(total, part)
        _fma_into(h, 0, h.ptrs[5], h.b.sub(total, q6_k_offset(h, scales, h.vload(6, h.ptrs[7], _V16I))))
        return context.get_dummy_value()
    return types.void(acc, b, o, q, qo, d, bsums, so), codegen


def _q6_k_weights(h, j):
    """<32 x i8>: vector j (= 4 * half + t) of the Q6_K block's unsigned 6-bit weights: 4 bits of the ql bytes at
    o + 64 * half + 32 * (t & 1) (shifted by 4 * (t >> 1)), 2 bits (2t) of the qh bytes at o + 128 + 32 * half."""
    half, t = divmod(j, 4)
    ql = h.bits(h.vload(1, o_arg(h), _VB, half * 64 + (t & 1) * 32), 4 * (t >> 1), 0xF)
    return h.b.or_(ql, h.b.shl(h.bits(h.vload(1, o_arg(h), _VB, 128 + half * 32), 2 * t, 3), h.bytes_const(4)))


def q6_k_offset(h, scales, bsums):
    """<8 x i32>: Q6_K's -32 offset per lane, 32 * (s_2k * bsum_2k + s_2k+1 * bsum_2k+1), for the 16 int8 scales
    and a <16 x i32> of the activation block's 16-element sums."""
    prod = h.b.mul(h.b.sext(scales, _V16I), bsums)
    return h.b.shl(_fold_lanes(h, prod), ir.Constant(_V8I, [5] * 8))


@intrinsic
def idot_q5_k(typingctx, acc, b, o, q, qo, d, accm, sums, so, dmin):
    """Q5_K x Q8_K as ggml_vec_dot_q5_K_q8_K (AVX2): acc[0:8] as Q4_K (the fifth bit of sub-block j is bit j
    of the qh bytes), but the mins go to one scalar, accm[0] = fma(dmin, sum_j min_j * sum(q8_j), accm[0])."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        h.prefetch_block(BY_QTYPE[Q5_K].block_bytes)
        s, m = _k4_scale_bytes(h)
        qh = h.vload(1, o_arg(h), _VB, 16)
        total = None
        for j in range(8):
            lo = h.bits(h.vload(1, o_arg(h), _VB, 48 + (j // 2) * 32), 4 * (j % 2), 0xF)
            w = h.b.or_(lo, h.b.shl(h.bits(qh, j, 1), h.bytes_const(4)))
            part = _lane_sums(h, w, h.vload(3, h.ptrs[4], _VB, 32 * j), _scale16(h, s, j), w_unsigned=True)
            total = part if total is None else h.b.add(total, part)
        _fma_into(h, 0, h.ptrs[5], total)
        prod = h.b.mul(h.b.zext(m, _V8I), h.vload(7, h.ptrs[8], _V8I))
        mins = h.b.extract_element(prod, ir.Constant(_I32, 0))
        for k in range(1, 8):  # an exact integer sum: any order
            mins = h.b.add(mins, h.b.extract_element(prod, ir.Constant(_I32, k)))
        fn = cgutils.get_or_insert_function(h.b.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        h.b.store(h.b.call(fn, [h.ptrs[9], h.b.sitofp(mins, _F32), h.b.load(h.ptrs[6])]), h.ptrs[6])
        return context.get_dummy_value()
    return types.void(acc, b, o, q, qo, d, accm, sums, so, dmin), codegen


@intrinsic
def idot_q4_1(typingctx, acc, b, o, q, qo, d):
    """The Q8_1-scaled half of ggml_vec_dot_q4_1_q8_1 (AVX2): acc[0:8] = fma(d, lanes(nibbles . q), acc); the
    caller adds the block's min times the activations' fp16 sum (summs) in f32 beside it."""
    return _idot_32(lambda h: _nibbles(h, 4), types.void(acc, b, o, q, qo, d), w_unsigned=True)


@intrinsic
def idot_q5_1(typingctx, acc, b, o, q, qo, d):
    """As idot_q4_1 for Q5_1 (ggml_vec_dot_q5_1_q8_1): weights nibble | high bit << 4, 0..31."""
    return _idot_32(lambda h: h.b.or_(_nibbles(h, 8), _high_bits(h, 4)), types.void(acc, b, o, q, qo, d),
                    w_unsigned=True)


def _iq4_lookup(h, q):
    """IQ4_VALUES[q] as <32 x i8>: on AVX2 one vpshufb from the 16 values (in both 128-bit halves, as ggml's
    _mm_shuffle_epi8(values128, ...)), else the portable select tree; the same bytes."""
    if not AVX2:
        return _iq4_select(h, q)
    table = ir.Constant(_VB, list(IQ4_VALUES) * 2)
    return _x86(h, "llvm.x86.avx2.pshuf.b", _VB, table, q)


@intrinsic
def idot_iq4_nl(typingctx, acc, b, o, q, qo, d):
    """IQ4_NL x Q8_0 as one block of ggml_vec_dot_iq4_nl_q8_0 (AVX2): acc[0:8] = fma(d, lanes(values . q), acc)
    (the caller alternates two accumulators, as llama.cpp does)."""
    return _idot_32(lambda h: _iq4_lookup(h, _nibbles(h, 2)), types.void(acc, b, o, q, qo, d))


@intrinsic
def idot_iq4_xs(typingctx, acc, b, o, q, qo, d):
    """IQ4_XS x Q8_K as ggml_vec_dot_iq4_xs_q8_K (AVX2): acc[0:8] = fma(d, lanes(sum_j (s_j - 32) * values_j . q8_j),
    acc), one 6-bit scale per 32 weights."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        h.prefetch_block(BY_QTYPE[IQ4_XS].block_bytes)
        s = _iq4_xs_scale_bytes(h)
        total = None
        for j in range(8):
            w = _iq4_lookup(h, _nibbles(h, 8 + 16 * j))
            sc = h.splat(h.b.sext(h.b.extract_element(s, ir.Constant(_I32, j)), ir.IntType(16)), _V16S)
            part = _lane_sums(h, w, h.vload(3, h.ptrs[4], _VB, 32 * j), sc)
            total = part if total is None else h.b.add(total, part)
        _fma_into(h, 0, h.ptrs[5], total)
        return context.get_dummy_value()
    return types.void(acc, b, o, q, qo, d), codegen


def _pair_scales16(h, s16, g):
    """<16 x i16>: pair lanes 0..7 (weights 0..15 of a 32-weight vector) s16[g], 8..15 s16[g + 1], sign-extended."""
    return h.b.sext(h.b.shuffle_vector(s16, ir.Constant(s16.type, ir.Undefined),
                                       ir.Constant(_V16I, [g] * 8 + [g + 1] * 8)), _V16S)


@intrinsic
def idot_q3_k(typingctx, acc, b, o, q, qo, d):
    """Q3_K x Q8_K as ggml_vec_dot_q3_K_q8_K (AVX2): acc[0:8] = fma(d, lanes(sum_g (s_g - 32) * w . q8), acc), w
    = ql - 4 * !hbit, one 6-bit scale per 16 weights (llama.cpp's maddubs(ql) - maddubs(4 * !hbit) is the same
    exact i16)."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        h.prefetch_block(BY_QTYPE[Q3_K].block_bytes)
        scales = _q3_k_scale_bytes(h)
        hmask = h.vload(1, o_arg(h), _VB, 0)
        total = None
        for j in range(8):
            part = _lane_sums(h, _q3_k_weights(h, hmask, j), h.vload(3, h.ptrs[4], _VB, 32 * j),
                              _pair_scales16(h, scales, 2 * j))
            total = part if total is None else h.b.add(total, part)
        _fma_into(h, 0, h.ptrs[5], total)
        return context.get_dummy_value()
    return types.void(acc, b, o, q, qo, d), codegen


@intrinsic
def idot_q2_k(typingctx, acc, b, o, q, qo, d, bsums, so, dmin):
    """Q2_K x Q8_K as ggml_vec_dot_q2_K_q8_K (AVX2): first acc[0:8] = fma(dmin, madd(mins, bsums), acc) (lane k:
    m_2k * bsum_2k + m_2k+1 * bsum_2k+1, bsums = the Q8_K block's 16-element sums at so), then acc[0:8] =
    fma(d, lanes(sum_g s_g * q2 . q8), acc); scale s_g and min m_g the nibbles of byte g at o."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        h.prefetch_block(BY_QTYPE[Q2_K].block_bytes)
        sc = h.vload(1, o_arg(h), ir.VectorType(_I8, 16), 0)
        prod = h.b.mul(h.b.zext(h.bits(sc, 4, 0xF), _V16I), h.vload(6, h.ptrs[7], _V16I))
        _fma_into(h, 0, h.ptrs[8], _fold_lanes(h, prod))
        scales = h.bits(sc, 0, 0xF)
        total = None
        for j in range(8):
            w = h.bits(h.vload(1, o_arg(h), _VB, 16 + 32 * (j // 4)), 2 * (j % 4), 3)
            part = _lane_sums(h, w, h.vload(3, h.ptrs[4], _VB, 32 * j), _pair_scales16(h, scales, 2 * j),
                              w_unsigned=True)
            total = part if total is None else h.b.add(total, part)
        _fma_into(h, 0, h.ptrs[5], total)
        return context.get_dummy_value()
    return types.void(acc, b, o, q, qo, d, bsums, so, dmin), codegen
