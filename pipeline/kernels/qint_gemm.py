"""Register-blocked integer GEMM for no-grad many-row products (prefill): x @ W.T with x quantized as llama.cpp does.

Trade-off: pipeline/kernels/qint.py's row kernels take one (activation row, weight row)
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
Per block the ROWS rows' f32 scales are one vector product (the activations' scales are passed transposed, a
block's rows side by side) and Q4_K's mins of two rows are one vpmaddwd on i16 block sums. On AVX-512 targets
the same 256-bit code runs 8 rows, not 4: EVEX gives it 32 vector registers (measured on a Xeon with
AVX512-VNNI: 8 rows 52 GMAC/s per core against 45 for 4; 512-bit vectors gave no gain there, whose integer
multiplies issue on one port at 512 bits and two at 256); with VNNI a sub-block's scale product and lane add
are one vpdpwssd, and Q4_K/Q5_K take a pair of sub-blocks' unscaled dots by vpdpbusd (_k_totals_pairs). A
group's ROWS output sums are finished as vectors, eight rows at a time (_finish). The 32-element block formats
(Q8_0, Q4_0, Q5_0, Q4_1, Q5_1) have their own loop (W32, below: the block loop inside one call, two rows per
512-bit vpdpbusd with AVX512-VNNI); IQ4_NL, Q2_K, Q3_K and IQ4_XS keep the row kernels (or qtile's tiles; see
FrozenWeight.uses_integer_dot for where each pays).
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

from .dequant import HALF_TO_FLOAT, ROW_CHUNK, _check, _half
from .formats import GEOMETRY, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, Q8_K_PARTNER, kernels
from .qblocks import (AVX2, _F32, _I32, _I64, _IR, _V8I, _V16I, _V16S, _VB, _high_bits, _k4_scale_bytes, _lane_sums,
                      _nibbles, _pair_products, _pair_scales16, _q6_k_weights, _scale16, _target_has, _x86, o_arg,
                      q6_k_offset)
from .qint import (PARTNER, _bsums, _mm_q4_0, _mm_q4_1, _mm_q4_k, _mm_q5_0, _mm_q5_1, _mm_q5_k, _mm_q6_k, _mm_q8_0,
                   quantize_activations)
from .workpool import run_dynamic

# activation rows per inner kernel: 4 i32 totals + weight + scale + temporaries fit AVX2's 16 ymm registers;
# an AVX-512 target has 32 (EVEX), room for 8 rows' totals
ROWS = 8 if AVX2 and _target_has("avx512f") else 4
PIECE_ROWS = 8 * ROW_CHUNK  # weight rows per piece (128): ~72-220 KB of Q4_K-Q6_K bytes, an L2's share
_V8S = ir.VectorType(ir.IntType(16), 8)


def _row_offset(h, arg_offset, arg_stride, r, extra=0):
    """i64 offset arg_offset + r * arg_stride + extra (argument indices into h.ptrs)."""
    off = h.b.add(h.ptrs[arg_offset], h.b.mul(h.ptrs[arg_stride], ir.Constant(_I64, r)))
    return h.b.add(off, ir.Constant(_I64, extra)) if extra else off


def _fma_at(h, arg, at, scale, lanes):
    """acc[arg][at:at + n] = fma(scale, float(lanes), acc[at:at + n]) (as qblocks._fma_into, at an offset);
    scale is one f32 for every lane or a vector of the lanes' own."""
    vf = ir.VectorType(_F32, lanes.type.count)
    p = h.b.bitcast(h.b.gep(h.ptrs[arg], [ir.Constant(_I64, at)]), vf.as_pointer())
    fn = cgutils.get_or_insert_function(h.b.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{vf.count}f32")
    scale = scale if isinstance(scale.type, ir.VectorType) else h.splat(scale, vf)
    h.b.store(h.b.call(fn, [scale, h.b.sitofp(lanes, vf), h.b.load(p, align=4)]), p, align=4)


def _scalar_fma_at(h, arg, at, scale, value):
    """accm[arg][at] = fma(scale, float(value), accm[at]) for an i32 value (Q5_K's mins)."""
    p = h.b.gep(h.ptrs[arg], [ir.Constant(_I64, at)])
    fn = cgutils.get_or_insert_function(h.b.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
    h.b.store(h.b.call(fn, [scale, h.b.sitofp(value, _F32), h.b.load(p)]), p)


def _pick(h, v, lanes):
    """shufflevector of v into the given lanes."""
    return h.b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                              ir.Constant(ir.VectorType(_I32, len(lanes)), list(lanes)))


# Argument layout of the blocked intrinsics (one weight block, ROWS activation rows):
#   0 acc f32 [ROWS * 8]   1 b uint8 (the weight row)   2 o (block offset in b)
#   3 q int8 (activations, any shape: flat offsets)      4 qo (row 0's block start in q)   5 q_stride (per row)
#   6 dt f32 (the activations' Q8_K scales transposed, [blocks, rows] flat)   7 dto (row 0's at this block)
#   8 wd (the weight's d)
#   Q4_K / Q5_K only: 9 accm f32 [ROWS * 4 | ROWS]   10 sums int16 (flat)   11 so   12 s_stride   13 wmin
def _row_scales(h, weight_arg, negate=False):
    """<ROWS x f32>: the ROWS rows' dt[dto + r] * h.ptrs[weight_arg] (negate: the min scale (-d) * wmin, which
    is -(d * wmin) bit for bit): the f32 products the row kernels form one at a time (qint._mm_q4_k)."""
    vf = ir.VectorType(_F32, ROWS)
    d = h.b.load(h.b.bitcast(h.b.gep(h.ptrs[6], [h.ptrs[7]]), vf.as_pointer()), align=4)
    prod = h.b.fmul(d, h.splat(h.ptrs[weight_arg], vf))
    return h.b.fneg(prod) if negate else prod


def _madd16(h, a, b):
    """<8 x i32> lane i = a[2i] * b[2i] + a[2i+1] * b[2i+1] for <16 x i16> a, b (vpmaddwd; exact)."""
    if AVX2:
        return _x86(h, "llvm.x86.avx2.pmadd.wd", _V8I, a, b)
    p = h.b.mul(h.b.sext(a, _V16I), h.b.sext(b, _V16I))
    return h.b.add(_pick(h, p, range(0, 16, 2)), _pick(h, p, range(1, 16, 2)))


def _k_min_pairs(h, m16, r):
    """<8 x i32>: rows r and r + 1's 4 lanes each, lane i = min_2i * sum(q8_2i) + min_2i+1 * sum(q8_2i+1) (the
    Q8_K block's 32-element sums, args 10-12, as i16: a sum is at most 32 * 128 in magnitude, a min < 64)."""
    rows = [h.vload(10, _row_offset(h, 11, 12, k), _V8S) for k in (r, r + 1)]
    return _madd16(h, h.b.shuffle_vector(rows[0], rows[1], ir.Constant(_V16I, list(range(16)))),
                   _pick(h, m16, list(range(8)) * 2))


# vpdpwssd (AVX-VNNI, or AVX512-VNNI with VL): the scale product and the lane add in one instruction. It goes
# through inline asm because LLVM's machine combiner splits the intrinsic back into vpmaddwd + vpaddd here.
_EVEX_VNNI = AVX2 and _target_has("avx512vnni", "avx512vl")
VNNI = _EVEX_VNNI or (AVX2 and _target_has("avxvnni"))
if VNNI:  # numba's JIT emits object code directly; inline asm needs LLVM's x86 asm parser to be initialised
    import llvmlite.binding as _llvm
    _llvm.initialize_native_asmparser()


def _dpwssd(h, total, pairs, scale16):
    """<8 x i32> total + vpmaddwd(pairs, scale16), exact, as one vpdpwssd."""
    reg = "v" if _EVEX_VNNI else "x"
    op = "vpdpwssd" if _EVEX_VNNI else "{vex} vpdpwssd"
    asm = ir.InlineAsm(ir.FunctionType(_V8I, [_V16S, _V16S, _V8I]), f"{op} $2, $1, $0", f"={reg},{reg},{reg},0")
    return h.b.call(asm, [scale16, pairs, total])


def _add_lane_sums(h, total, w, x, scale16, w_unsigned=False):
    """total + qblocks._lane_sums(w, x, scale16) (total None: the lane sums alone); with VNNI the scale product
    and the add are one vpdpwssd."""
    if VNNI and total is not None:
        return _dpwssd(h, total, _pair_products(h, w, x, w_unsigned), scale16)
    part = _lane_sums(h, w, x, scale16, w_unsigned=w_unsigned)
    return part if total is None else h.b.add(total, part)


# With VNNI, a pair of sub-blocks (2c, 2c + 1) goes through vpdpbusd: the unscaled 4-element dot products of
# both, in the dword order PAIR_ORDER (the weights shuffled into it per block, the activations once per GEMM by
# pair_order), so that vpackssdw of the two results puts sub-block 2c's and 2c+1's sums of the same lane k side
# by side and one vpdpwssd with the scale pair (s_2c, s_2c+1) adds s_2c * D_2c,k + s_2c+1 * D_2c+1,k to lane k:
# three multiply-port instructions per pair and row where vpmaddubsw + vpdpwssd took four. Exact: |D| <= 4 * 31
# * 128 fits i16, and the lane totals are the row kernels' (integer sums in any order).
PAIR_ORDER = (0, 8, 1, 9, 4, 12, 5, 13, 2, 10, 3, 11, 6, 14, 7, 15)  # source dword (s * 8 + k) per position


def pair_order(q):
    """The int8 activations [m, n] with each 64-element pair of sub-blocks in PAIR_ORDER's dword order."""
    m, n = q.shape
    dwords = q.view(np.int32).reshape(m, n // 64, 16)[:, :, list(PAIR_ORDER)]
    return np.ascontiguousarray(dwords).view(np.int8).reshape(m, n)


def _k_totals_pairs(h, high_bit, s):
    """_k_totals by vpdpbusd on sub-block pairs (the activations, arg 3, in pair_order). The pairs' dot products
    accumulate in one register per chain of pairs (a new register per pair cost a zeroing instruction each),
    so pair c's packed values are the running sums D_0 + ... + D_c; the scale pair of c minus that of c + 1
    undoes the running sum (telescoping, exact in integers). A chain is as long as i16 allows: 4 pairs of Q4_K
    (4 * 4 * 15 * 128 = 30720), 2 of Q5_K."""
    qh = h.vload(1, o_arg(h), _VB, 16) if high_bit else None
    chain = 2 if high_bit else 4
    s16 = h.b.zext(s, ir.VectorType(ir.IntType(16), 8))
    totals, running = [None] * ROWS, [None] * ROWS
    zero = ir.Constant(_V8I, [0] * 8)
    for c in range(4):
        raw = h.vload(1, o_arg(h), _VB, (48 if high_bit else 16) + c * 32)
        halves = []
        for k in range(2):
            w = h.bits(raw, 4 * k, 0xF)
            if high_bit:
                w = h.b.or_(w, h.b.shl(h.bits(qh, 2 * c + k, 1), h.bytes_const(4)))
            halves.append(h.b.bitcast(w, _V8I))
        wa, wb = (h.b.shuffle_vector(halves[0], halves[1], ir.Constant(_V8I, PAIR_ORDER[8 * t:8 * t + 8]))
                  for t in range(2))
        sc = _pick(h, s16, [2 * c, 2 * c + 1] * 8)
        if (c + 1) % chain:
            sc = h.b.sub(sc, _pick(h, s16, [2 * c + 2, 2 * c + 3] * 8))
        for r in range(ROWS):
            xa, xb = (h.b.bitcast(h.vload(3, _row_offset(h, 4, 5, r, 64 * c + 32 * t), _VB), _V8I) for t in range(2))
            da, db = running[r] if c % chain else (zero, zero)
            da = _x86(h, "llvm.x86.avx512.vpdpbusd.256", _V8I, da, wa, xa)
            db = _x86(h, "llvm.x86.avx512.vpdpbusd.256", _V8I, db, wb, xb)
            running[r] = da, db
            packed = _x86(h, "llvm.x86.avx2.packssdw", _V16S, da, db)
            totals[r] = _madd16(h, packed, sc) if totals[r] is None else _dpwssd(h, totals[r], packed, sc)
    return totals


def _k_totals(h, high_bit, s):
    """Per activation row, the <8 x i32> lanes of a Q4_K/Q5_K block: sum over sub-blocks j of scale_j times the
    weight . activation products of elements 4k..4k+3 of sub-block j, in lane k (the row kernels' lanes)."""
    qh = h.vload(1, o_arg(h), _VB, 16) if high_bit else None
    totals = [None] * ROWS
    for j in range(8):
        w = h.bits(h.vload(1, o_arg(h), _VB, (48 if high_bit else 16) + (j // 2) * 32), 4 * (j % 2), 0xF)
        if high_bit:
            w = h.b.or_(w, h.b.shl(h.bits(qh, j, 1), h.bytes_const(4)))
        sc = _scale16(h, s, j)
        for r in range(ROWS):
            x = h.vload(3, _row_offset(h, 4, 5, r, 32 * j), _VB)
            totals[r] = _add_lane_sums(h, totals[r], w, x, sc, w_unsigned=True)
    return totals


def _k_block_rows(high_bit):
    """codegen of the Q4_K (high_bit False) / Q5_K (True) block x ROWS rows: each sub-block's weights and scale
    unpacked once; per row the row kernels' i32 lanes, fma into acc, and the mins (Q4_K: 4 pair lanes, as
    idot_q4_k, two rows per vector; Q5_K: one scalar, as idot_q5_k)."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        s, m = _k4_scale_bytes(h)
        scales, min_scales = _row_scales(h, 8), _row_scales(h, 13, negate=True)
        for r, total in enumerate((_k_totals_pairs if VNNI else _k_totals)(h, high_bit, s)):
            _fma_at(h, 0, 8 * r, h.b.extract_element(scales, ir.Constant(_I32, r)), total)
        m16 = h.b.zext(m, _V8S)
        for r in range(0, ROWS, 2):
            pairs = _k_min_pairs(h, m16, r)
            if high_bit:
                for k in (r, r + 1):
                    lanes = [h.b.extract_element(pairs, ir.Constant(_I32, 4 * (k - r) + i)) for i in range(4)]
                    mins = h.b.add(h.b.add(lanes[0], lanes[1]), h.b.add(lanes[2], lanes[3]))  # exact: any order
                    _scalar_fma_at(h, 9, k, h.b.extract_element(min_scales, ir.Constant(_I32, k)), mins)
            else:
                _fma_at(h, 9, 4 * r, _pick(h, min_scales, [r] * 4 + [r + 1] * 4), pairs)
        return context.get_dummy_value()
    return codegen


@intrinsic
def idot_q4_k_rows(typingctx, acc, b, o, q, qo, q_stride, dt, dto, wd, accm, sums, so, s_stride, wmin):
    """One Q4_K block x ROWS Q8_K rows: for row r, what idot_q4_k does into acc[8r:8r+8] and accm[4r:4r+4]."""
    return types.void(acc, b, o, q, qo, q_stride, dt, dto, wd, accm, sums, so, s_stride, wmin), _k_block_rows(False)


@intrinsic
def idot_q5_k_rows(typingctx, acc, b, o, q, qo, q_stride, dt, dto, wd, accm, sums, so, s_stride, wmin):
    """One Q5_K block x ROWS Q8_K rows: for row r, what idot_q5_k does into acc[8r:8r+8] and accm[r]."""
    return types.void(acc, b, o, q, qo, q_stride, dt, dto, wd, accm, sums, so, s_stride, wmin), _k_block_rows(True)


@intrinsic
def idot_q6_k_rows(typingctx, acc, b, o, q, qo, q_stride, dt, dto, wd, bsums, so, s_stride):
    """One Q6_K block x ROWS Q8_K rows: for row r, what idot_q6_k does into acc[8r:8r+8] (bsums: the rows'
    16-element sums, int32, row r's block at so + r * s_stride)."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        scales = h.vload(1, o_arg(h), ir.VectorType(ir.IntType(8), 16), 192)
        row_scales = _row_scales(h, 8)
        totals = [None] * ROWS
        for j in range(8):
            w, sc = _q6_k_weights(h, j), _pair_scales16(h, scales, 2 * j)
            for r in range(ROWS):
                x = h.vload(3, _row_offset(h, 4, 5, r, 32 * j), _VB)
                totals[r] = _add_lane_sums(h, totals[r], w, x, sc, w_unsigned=True)
        for r in range(ROWS):
            offset = q6_k_offset(h, scales, h.vload(9, _row_offset(h, 10, 11, r), _V16I))
            _fma_at(h, 0, 8 * r, h.b.extract_element(row_scales, ir.Constant(_I32, r)), h.b.sub(totals[r], offset))
        return context.get_dummy_value()
    return types.void(acc, b, o, q, qo, q_stride, dt, dto, wd, bsums, so, s_stride), codegen


# The 32-element block formats (Q8_0, Q4_0, Q5_0 against Q8_0 activations; Q4_1, Q5_1 against Q8_1): one weight
# row's blocks against ROWS activation rows in one call, the block loop inside (cgutils.for_range) so the rows'
# accumulators stay in registers. Per block the weights are unpacked once as unsigned bytes u = w + offset (the
# row kernels' qblocks readers), and per row the lanes of llama.cpp's mul_sum_i8_pairs / mul_sum_us8_pairs,
# lane k = sum of w * x over elements 4k..4k+3, then the row kernels' one fma by d_w * d_x; Q4_1/Q5_1's mins are
# their summs chain, fma(m, s_x, summs), ROWS rows in one vector. With AVX512-VNNI two rows take one 512-bit
# vpdpbusd of u against their x, started from -offset * (their 4-element sums of x) (exact in i32: the same
# integers as the signed products); elsewhere the row kernels' 256-bit lanes. Same bits as qint._rows_scaled /
# _rows_q8_1 (and so llama.cpp's vec_dot) for any grouping of the rows.
W32 = {  # format -> (its weights as unsigned <32 x i8> u from the block at b[o:], the offset: w = u - offset)
    Q8_0: (lambda h: h.b.xor(h.vload(1, o_arg(h), _VB, 2), h.bytes_const(-128)), 128),
    Q4_0: (lambda h: _nibbles(h, 2), 8),
    Q5_0: (lambda h: h.b.or_(_nibbles(h, 6), _high_bits(h, 2)), 16),
    Q4_1: (lambda h: _nibbles(h, 4), 0),
    Q5_1: (lambda h: h.b.or_(_nibbles(h, 8), _high_bits(h, 4)), 0),
}
WIDE = _EVEX_VNNI and _target_has("avx512bw") and ROWS % 2 == 0  # two rows per 512-bit vpdpbusd
_V64B, _V16F = ir.VectorType(ir.IntType(8), 64), ir.VectorType(_F32, 16)


def group_layout(q):
    """The int8 activations [m, n] of each whole group of ROWS rows interleaved by block, [groups, n / 32, ROWS,
    32] flat (a block's ROWS rows side by side), and the negated 4-element sums of x, [groups, n / 32, ROWS, 8]
    int32, from which a kernel starts the lanes of offset weights."""
    m, n = q.shape
    g = m // ROWS
    blocks = q[:g * ROWS].reshape(g, ROWS, n // 32, 32).transpose(0, 2, 1, 3)
    neg = -blocks.reshape(g, n // 32, ROWS, 8, 4).sum(-1, dtype=np.int32)
    return np.ascontiguousarray(blocks).reshape(-1), np.ascontiguousarray(neg).reshape(-1)


def _b32_lanes(h, w, x, w_unsigned):
    """<8 x i32> lane k = sum of w * x over elements 4k..4k+3 (qblocks._lane_sums with unit scales)."""
    if not VNNI:
        return _lane_sums(h, w, x, w_unsigned=w_unsigned)
    if not w_unsigned:  # |w| . (x * sign(w)), as _pair_products
        x = _x86(h, "llvm.x86.avx2.psign.b", _VB, x, w)
        w = h.b.select(h.b.icmp_signed("<", w, h.bytes_const(0)), h.b.sub(h.bytes_const(0), w), w)
    return _x86(h, "llvm.x86.avx512.vpdpbusd.256", _V8I, ir.Constant(_V8I, [0] * 8), h.b.bitcast(w, _V8I),
                h.b.bitcast(x, _V8I))


#   Argument layout: 0 acc f32 [ROWS * 8]   1 b uint8 (the weight row)   2 o (0)   3 qg int8 (group_layout)
#   4 qo (this group's start)   5 ns int32 (group_layout's sums)   6 so   7 dt f32 [blocks, rows]   8 dto (row 0's
#   at block 0)   9 dt_stride   10 nb (blocks)   11 lut (fp16 -> f32)   12 accm f32 [ROWS]   13 st f32 (Q8_1's
#   block sums transposed, as dt)
def _b32_row_group(kind):
    """codegen of one weight row of a W32 format x one group of ROWS activation rows, over all its blocks."""
    w_of_block, offset = W32[kind]
    _, size, d_at, m_at = GEOMETRY[kind]
    shift = offset.bit_length() - 1  # offsets are powers of two

    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        b = h.b
        width = 16 if WIDE else 8  # f32 lanes per accumulator: two rows or one
        vf, vr, vi = ir.VectorType(_F32, width), ir.VectorType(_F32, ROWS), ir.VectorType(_I32, width)
        fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{width}f32")
        fma_r = cgutils.get_or_insert_function(b.module, ir.FunctionType(vr, [vr] * 3), f"llvm.fma.v{ROWS}f32")
        vptr = lambda arg, at, vt: b.bitcast(b.gep(h.ptrs[arg], [at]), vt.as_pointer())
        const = lambda v: ir.Constant(_I64, v)
        per = width // 8  # rows per accumulator
        accs = []
        for a in range(ROWS // per):
            slot = cgutils.alloca_once(b, vf)
            b.store(b.load(vptr(0, const(width * a), vf), align=4), slot)
            accs.append(slot)
        mins = cgutils.alloca_once(b, vr)
        b.store(b.load(vptr(12, const(0), vr), align=4), mins)

        def half(at):  # the fp16 at b[o + at] through the lookup table (arg 11), as dequant._half
            bits = b.load(b.bitcast(b.gep(h.ptrs[1], [b.add(h.ptrs[2], const(at))]), ir.IntType(16).as_pointer()),
                          align=1)
            return b.load(b.gep(h.ptrs[11], [b.zext(bits, _I64)]))

        o_start = h.ptrs[2]
        with cgutils.for_range(b, h.ptrs[10]) as loop:
            k = loop.index
            h.ptrs[2] = b.add(o_start, b.mul(k, const(size)))  # the block the W32 readers see
            qo, so = b.add(h.ptrs[4], b.mul(k, const(ROWS * 32))), b.add(h.ptrs[6], b.mul(k, const(ROWS * 8)))
            dto = b.add(h.ptrs[8], b.mul(k, h.ptrs[9]))
            u = w_of_block(h)
            scales = b.fmul(b.load(vptr(7, dto, vr), align=4), h.splat(half(d_at), vr))
            if WIDE:
                u2 = b.bitcast(b.shuffle_vector(u, u, ir.Constant(ir.VectorType(_I32, 64), list(range(32)) * 2)), vi)
            else:
                w = b.sub(u, h.bytes_const(offset)) if offset else u
            for a in range(ROWS // per):
                if WIDE:
                    x = b.bitcast(h.vload(3, qo, _V64B, 64 * a), vi)
                    start = (b.shl(h.vload(5, so, vi, 16 * a), ir.Constant(vi, [shift] * 16)) if offset
                             else ir.Constant(vi, [0] * 16))
                    lanes = _x86(h, "llvm.x86.avx512.vpdpbusd.512", vi, start, u2, x)
                    scale = _pick(h, scales, [2 * a] * 8 + [2 * a + 1] * 8)
                else:
                    lanes = _b32_lanes(h, w, h.vload(3, qo, _VB, 32 * a), offset == 0)
                    scale = h.splat(b.extract_element(scales, ir.Constant(_I32, a)), vf)
                b.store(b.call(fma, [scale, b.sitofp(lanes, vf), b.load(accs[a])]), accs[a])
            if m_at >= 0:  # Q8_1's mins: summs = fma(m, s_x, summs), ROWS rows at once
                b.store(b.call(fma_r, [h.splat(half(m_at), vr), b.load(vptr(13, dto, vr), align=4), b.load(mins)]),
                        mins)
            h.ptrs[2] = o_start
        for a in range(ROWS // per):
            b.store(b.load(accs[a]), vptr(0, const(width * a), vf), align=4)
        b.store(b.load(mins), vptr(12, const(0), vr), align=4)
        return context.get_dummy_value()
    return codegen


def _b32_intrinsic(kind):
    @intrinsic
    def row_group(typingctx, acc, b, o, qg, qo, ns, so, dt, dto, dt_stride, nb, lut, accm, st):
        return (types.void(acc, b, o, qg, qo, ns, so, dt, dto, dt_stride, nb, lut, accm, st),
                _b32_row_group(kind))
    return row_group


rows_q8_0, rows_q4_0, rows_q5_0, rows_q4_1, rows_q5_1 = map(_b32_intrinsic, W32)


def _add_picked(h, u, v, first, second):
    """shuffle(u, v, first) + shuffle(u, v, second) for two <8 x f32> (lane-wise adds: any lane order, exact)."""
    pick = lambda idx: h.b.shuffle_vector(u, v, ir.Constant(_V8I, list(idx)))
    return h.b.fadd(pick(first), pick(second))


def _row_sums(h, quads):
    """<8 x f32>: lane r = (v.0 + v.2) + (v.1 + v.3) of row r's 4 lanes v, from 4 <8 x f32> vectors of two rows'
    4 lanes each (rows 2k, 2k + 1 in vector k): the scalar code's adds, eight rows at a time."""
    pairs = [_add_picked(h, quads[k], quads[k + 1], [0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15])
             for k in (0, 2)]  # lanes (r.0 + r.2, r.1 + r.3), four rows per vector
    return _add_picked(h, pairs[0], pairs[1], range(0, 16, 2), range(1, 16, 2))


def _finish(kind):
    """codegen: out[oo + k * o_stride] = hsum_float_8(acc[8k:8k + 8]) + the mins term of row k, for the ROWS
    rows, vectorised eight rows at a time (what the row kernels compute one row at a time: the same adds)."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        vf = ir.VectorType(_F32, 8)
        load = lambda arg, at: h.b.load(h.b.bitcast(h.b.gep(h.ptrs[arg], [ir.Constant(_I64, at)]), vf.as_pointer()),
                                        align=4)
        zero = ir.Constant(vf, [0.0] * 8)  # the lanes of rows past ROWS (4-row layout): computed, not stored
        rows = [load(0, 8 * r) for r in range(ROWS)] + [zero] * (8 - ROWS)
        halves = [_add_picked(h, rows[r], rows[r + 1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
                  for r in range(0, 8, 2)]  # lanes l + (l + 4), two rows per vector
        total = _row_sums(h, halves)
        if kind == Q4_K:
            total = h.b.fadd(total, _row_sums(h, [load(1, 8 * k) if 2 * k < ROWS else zero for k in range(4)]))
        elif kind == Q5_K:
            mins = h.b.load(h.b.bitcast(h.ptrs[1], ir.VectorType(_F32, ROWS).as_pointer()), align=4)
            total = h.b.fadd(total, _pick(h, mins, list(range(ROWS)) + [0] * (8 - ROWS)))
        for r in range(ROWS):
            at = h.b.add(h.ptrs[3], h.b.mul(h.ptrs[4], ir.Constant(_I64, r)))
            h.b.store(h.b.extract_element(total, ir.Constant(_I32, r)), h.b.gep(h.ptrs[2], [at]))
        return context.get_dummy_value()
    return codegen


def _finish_intrinsic(kind):
    @intrinsic
    def finish(typingctx, acc, accm, out, oo, o_stride):
        return types.void(acc, accm, out, oo, o_stride), _finish(kind)
    return finish


finish_q4_k, finish_q5_k, finish_q6_k = (_finish_intrinsic(k) for k in (Q4_K, Q5_K, Q6_K))


# The kernels take the activations' Q8_K scales twice: d [m, nb] for the tail's row kernel and dt [nb, m] (a
# block's rows side by side) for the blocked one; the block sums as int32 for the row kernel and int16 here.
@njit(inline="always")
def _gemm_k(block_rows, finish, row_kernel, raw, q, qp, d, dt, sums, sums16, out, lut, r0, r1, geometry, accm_size):
    """out[:, r0:r1] for Q4_K/Q5_K raw against Q8_K activations q/d/sums: groups of ROWS rows through
    block_rows (idot_q4_k_rows / idot_q5_k_rows), the tail through qint's row kernel; each element as
    that row kernel computes it."""
    block, size, d_at, m_at = geometry
    m, n = q.shape
    nb, groups = n // block, m // ROWS * ROWS
    acc, accm = np.empty(ROWS * 8, np.float32), np.empty(accm_size, np.float32)
    for i in range(0, groups, ROWS):
        for r in range(r0, r1):
            b = raw[r]
            acc[:] = 0.0
            accm[:] = 0.0
            for blk in range(nb):
                o = blk * size
                block_rows(acc, b, o, qp, i * n + blk * block, n, dt, blk * m + i, _half(lut, b, o + d_at), accm,
                           sums16, i * (n // 32) + blk * 8, n // 32, _half(lut, b, o + m_at))
            finish(acc, accm, out, i * out.shape[1] + r, out.shape[1])
    if groups < m:
        row_kernel(raw, q[groups:], d[groups:], sums[groups:], out[groups:], lut, r0, r1)


@njit(cache=True, nogil=True)
def _gemm_q4_k(raw, q, qp, d, dt, sums, sums16, bsums, out, lut, r0, r1):
    """Q4_K: the mins in 4 lanes per row (each element as qint._mm_q4_k)."""
    _gemm_k(idot_q4_k_rows, finish_q4_k, _mm_q4_k, raw, q, qp, d, dt, sums, sums16, out, lut, r0, r1,
            GEOMETRY[Q4_K], ROWS * 4)


@njit(cache=True, nogil=True)
def _gemm_q5_k(raw, q, qp, d, dt, sums, sums16, bsums, out, lut, r0, r1):
    """Q5_K: the mins in one f32 per row (each element as qint._mm_q5_k)."""
    _gemm_k(idot_q5_k_rows, finish_q5_k, _mm_q5_k, raw, q, qp, d, dt, sums, sums16, out, lut, r0, r1,
            GEOMETRY[Q5_K], ROWS)


@njit(cache=True, nogil=True)
def _gemm_q6_k(raw, q, qp, d, dt, sums, sums16, bsums, out, lut, r0, r1):
    """As _gemm_q4_k for Q6_K (each element as qint._mm_q6_k)."""
    block, size, d_at, _ = GEOMETRY[Q6_K]
    m, n = q.shape
    nb, groups = n // block, m // ROWS * ROWS
    acc = np.empty(ROWS * 8, np.float32)
    for i in range(0, groups, ROWS):
        for r in range(r0, r1):
            b = raw[r]
            acc[:] = 0.0
            for blk in range(nb):
                o = blk * size
                idot_q6_k_rows(acc, b, o, q, i * n + blk * block, n, dt, blk * m + i, _half(lut, b, o + d_at), bsums,
                               i * (n // 16) + blk * 16, n // 16)
            finish_q6_k(acc, acc, out, i * out.shape[1] + r, out.shape[1])
    if groups < m:
        _mm_q6_k(raw, q[groups:], d[groups:], bsums[groups:], out[groups:], lut, r0, r1)


@njit(inline="always")
def _gemm_32(row_group, finish, row_kernel, raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1, geometry):
    """out[:, r0:r1] for a 32-element block format against Q8_0/Q8_1 activations q/d (qg, ns: group_layout's;
    s, st: Q8_1's block sums, st transposed): groups of ROWS rows through row_group, the tail through qint's
    row kernel."""
    m, n = q.shape
    nb, groups = n // geometry[0], m // ROWS * ROWS
    acc, accm = np.empty(ROWS * 8, np.float32), np.empty(ROWS, np.float32)
    for i in range(0, groups, ROWS):
        for r in range(r0, r1):
            acc[:] = 0.0
            accm[:] = 0.0
            row_group(acc, raw[r], 0, qg, i * n, ns, i * (n // 4), dt, i, m, nb, lut, accm, st)
            finish(acc, accm, out, i * out.shape[1] + r, out.shape[1])
    if groups < m:
        row_kernel(raw, q[groups:], d[groups:], s[groups:], out[groups:], lut, r0, r1)


# finish_q6_k adds nothing to the lanes' hsum (Q8_0, Q4_0, Q5_0); finish_q5_k adds one f32 per row (the summs)
@njit(cache=True, nogil=True)
def _gemm_q8_0(raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1):
    _gemm_32(rows_q8_0, finish_q6_k, _mm_q8_0, raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1, GEOMETRY[Q8_0])


@njit(cache=True, nogil=True)
def _gemm_q4_0(raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1):
    _gemm_32(rows_q4_0, finish_q6_k, _mm_q4_0, raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1, GEOMETRY[Q4_0])


@njit(cache=True, nogil=True)
def _gemm_q5_0(raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1):
    _gemm_32(rows_q5_0, finish_q6_k, _mm_q5_0, raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1, GEOMETRY[Q5_0])


@njit(cache=True, nogil=True)
def _gemm_q4_1(raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1):
    _gemm_32(rows_q4_1, finish_q5_k, _mm_q4_1, raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1, GEOMETRY[Q4_1])


@njit(cache=True, nogil=True)
def _gemm_q5_1(raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1):
    _gemm_32(rows_q5_1, finish_q5_k, _mm_q5_1, raw, q, d, qg, ns, dt, s, st, out, lut, r0, r1, GEOMETRY[Q5_1])


KERNELS = kernels("gemm", globals())  # qtype -> its blocked GEMM, by the pipeline/kernels/formats.py row


def supports(qtype: int) -> bool:
    return int(qtype) in KERNELS


def matmul_t_many(weights, x: np.ndarray) -> list:
    """[x @ W.T for (qtype, raw) in weights] (the formats of KERNELS), x f32 [m, n] quantized once per partner
    (Q8_0, Q8_1, Q8_K); the same bits as pipeline/kernels/qint.matmul_t_many. Every weight's rows are cut into
    pieces of PIECE_ROWS (a grid fixed by its shape) that the threads take dynamically."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"qint_gemm: x must be [m, n_cols], got shape {x.shape}")
    for qtype, raw in weights:
        if int(qtype) not in KERNELS:
            raise ValueError(f"qint_gemm: no blocked integer kernel for ggml type {qtype}")
        _check(qtype, raw, x.shape[1])
    acts = {}  # partner -> the activation arrays its kernels take after raw
    for partner in sorted({PARTNER[int(qtype)] for qtype, _ in weights}):
        q, d, extra = quantize_activations(partner, x)
        dt = np.ascontiguousarray(d.T)  # a block's rows side by side
        if partner != Q8_K_PARTNER:
            s = extra if extra is not None else np.zeros((x.shape[0], 1), np.float32)
            acts[partner] = (q, d, *group_layout(q), dt, s, np.ascontiguousarray(s.T) if extra is not None else s)
            continue
        sums16 = extra.astype(np.int16)  # |a 32-element sum| <= 32 * 128: exact
        bsums = np.empty((x.shape[0], x.shape[1] // 16), np.int32)  # Q6_K's offset reads the 16-element sums
        if any(int(qtype) == Q6_K for qtype, _ in weights):
            _bsums(q, bsums)
        acts[partner] = (q, pair_order(q) if VNNI else q, d, dt, extra, sums16, bsums)
    outs, pieces = [], []
    for qtype, raw in weights:
        raw = np.ascontiguousarray(raw)
        out = np.empty((x.shape[0], raw.shape[0]), np.float32)
        pieces += [(KERNELS[int(qtype)], raw, acts[PARTNER[int(qtype)]], out, r0, min(raw.shape[0], r0 + PIECE_ROWS))
                   for r0 in range(0, raw.shape[0], PIECE_ROWS)]
        outs.append(out)

    def piece(i):
        kernel, raw, args, out, r0, r1 = pieces[i]
        kernel(raw, *args, out, HALF_TO_FLOAT, r0, r1)

    run_dynamic(len(pieces), piece)
    return outs
