"""Integer dot products for no-grad forwards: x @ W.T with x quantized the way llama.cpp quantizes it.

Trade-off: llama.cpp's CPU matmul never multiplies floats by dequantized
weights; it quantizes each activation row to its weight format's partner
(PARTNER: Q8_0 blocks of 32 for Q8_0/Q4_0/Q5_0/IQ4_NL, Q8_1 - the same plus fp16 block sums - for
Q4_1/Q5_1, Q8_K blocks of 256 for the K-quants and IQ4_XS) and
takes exact integer dot products per block, scaled in f32 afterwards. Doing the
same here costs accuracy (activations rounded to 8 bits, as llama.cpp does) and
buys speed (int8 operands, no f32 weight) and llama.cpp's own bits: the
quantizers below are quantize_row_q8_0's AVX2 path (d = max/127 stored as fp16,
x * (127/max) rounded half to even; quantize_row_q8_1's sums) and quantize_row_q8_K_ref (the first
largest-magnitude element m, iscale = -127/m, nearest_int, d = 1/iscale); the
block intrinsics (pipeline/kernels/qblocks.py `idot_*`) keep llama.cpp's AVX2 lane
layout and fused multiply-adds, and the lanes are summed in hsum_float_8's
order. Used only where no gradient flows (pipeline/llm/quants.py,
FrozenWeight.integer_dot); training keeps f32 activations.
Each output element is computed by the same serial code whatever thread takes
its rows, so results are bitwise independent of the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit

from .dequant import HALF_TO_FLOAT, MATVEC_PIECES_PER_THREAD, ROW_CHUNK, _check, _half
from .formats import (FORMATS, GEOMETRY, IQ4_NL, IQ4_XS, PARTNER_BLOCK, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K,  # noqa: F401
                      Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, Q8_0_PARTNER, Q8_1_PARTNER, Q8_K_PARTNER, kernels)
from .optim import fma
from .quantize import _f16_bits_to_f32, _f32_to_f16_bits
from .qblocks import (IQ4_VALUES, idot_iq4_nl, idot_iq4_xs, idot_q2_k, idot_q3_k, idot_q4_0, idot_q4_1, idot_q4_k,
                      idot_q5_0, idot_q5_1, idot_q5_k, idot_q6_k, idot_q8_0)
from .handoff import NativeJob, atomic_add, f32_pointer, i8_pointer, i32_pointer, i64_pointer, u8_pointer
from .workpool import run_native, split_range, threads as pool_threads

# weight format -> the activation blocks llama.cpp pairs it with (its vec_dot_type), from pipeline.kernels/formats.py
PARTNER = {f.qtype: f.partner for f in FORMATS if f.partner}
# What a product quantizes x into, as bits of one mask: Q8_0 blocks (Q8_1's q and d are Q8_0's), Q8_1's fp16
# block sums on top, Q8_K blocks with their 32-element sums, and Q8_K's 16-element sums (bsums: Q2_K, Q6_K)
USE_Q8_0, USE_Q8_1_SUMS, USE_Q8_K, USE_Q8_K_BSUMS = 1, 2, 4, 8
NEEDS = {f.qtype: {Q8_0_PARTNER: USE_Q8_0, Q8_1_PARTNER: USE_Q8_0 | USE_Q8_1_SUMS, Q8_K_PARTNER: USE_Q8_K}[f.partner]
         | (USE_Q8_K_BSUMS if f.bsums else 0) for f in FORMATS if f.partner}
QUANTIZE_SPLIT = 1 << 16  # activations below this many elements are quantized on the calling thread


@njit(cache=True, inline="always")
def _round_even(v):
    """np.rint of an f32 |v| < 2^22 without a libm call: adding 1.5 * 2^23 leaves the integer part in the
    mantissa, rounded half to even by the f32 addition itself (ggml's nearest_int)."""
    magic = np.float32(12582912.0)
    return np.int32(np.float32(v + magic) - magic)


_MAGNITUDE, _INF_BITS = np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)


@njit(cache=True, inline="always")
def _top_magnitude_bits(bits, k0, k1):
    """The largest |x[k0:k1]| as its bit pattern (the f32 bits with the sign cleared): magnitudes order as those
    integers, and an integer max vectorises where a float max does not (LLVM may not reorder it). Above
    _INF_BITS: a NaN is there."""
    top = np.uint32(0)
    for k in range(k0, k1):
        top = max(top, bits[k] & _MAGNITUDE)
    return top


@njit(cache=True, nogil=True)
def _quantize_q8_0(x, q, d, s, with_sums):
    """x f32 [m, n] -> q int8 [m, n], d f32 [m, n/32] = max|x| / 127 per block, rounded to its fp16 value
    (the scale the dot product reads); with_sums: s f32 [m, n/32] = Q8_1's fp16(d * sum q) with the unrounded d
    (quantize_row_q8_1's AVX2 path: its q and d are Q8_0's)."""
    bits = x.view(np.uint32)
    for i in range(x.shape[0]):
        bi = bits[i]
        for blk in range(x.shape[1] // 32):
            top = _top_magnitude_bits(bi, blk * 32, blk * 32 + 32)
            if top > _INF_BITS:  # a NaN: the float max as before
                amax = np.float32(0.0)
                for k in range(blk * 32, blk * 32 + 32):
                    amax = max(amax, abs(x[i, k]))
            else:
                amax = np.uint32(top).view(np.float32)
            unrounded = amax / np.float32(127.0)
            d[i, blk] = _f16_bits_to_f32(_f32_to_f16_bits(unrounded))
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)  # the AVX2 path's 127/max, not 1/d
            total = np.int32(0)
            for k in range(blk * 32, blk * 32 + 32):
                v = _round_even(x[i, k] * inv)
                q[i, k] = np.int8(v)
                total += v
            if with_sums:
                s[i, blk] = _f16_bits_to_f32(_f32_to_f16_bits(unrounded * np.float32(total)))


@njit(cache=True, nogil=True)
def _bsums(q, bsums):
    """bsums[i, g] = sum of q[i, 16g:16g+16] (Q8_K's bsums: Q2_K's mins and Q6_K's offset read them)."""
    for i in range(q.shape[0]):
        for g in range(q.shape[1] // 16):
            total = np.int32(0)
            for k in range(16 * g, 16 * g + 16):
                total += np.int32(q[i, k])
            bsums[i, g] = total


@njit(cache=True, nogil=True)
def _quantize_q8_k(x, q, d, sums):
    """x f32 [m, n] -> q int8 [m, n], d f32 [m, n/256], sums int32 [m, n/32] (each 32 q's sum)."""
    bits = x.view(np.uint32)
    for i in range(x.shape[0]):
        xi, bi = x[i], bits[i]
        for blk in range(x.shape[1] // 256):
            o = blk * 256
            top = _top_magnitude_bits(bi, o, o + 256)  # ggml keeps the first x of the largest magnitude
            amax, mx = np.float32(0.0), np.float32(0.0)
            if top > _INF_BITS:  # a NaN: ggml's scan, which never takes one
                for k in range(o, o + 256):
                    if abs(xi[k]) > amax:
                        amax, mx = abs(xi[k]), xi[k]
            else:
                for k in range(o, o + 256):
                    if bi[k] & _MAGNITUDE == top:
                        amax, mx = abs(xi[k]), xi[k]
                        break
            if amax == 0:
                d[i, blk] = 0.0
                q[i, o:o + 256] = 0
                sums[i, blk * 8:blk * 8 + 8] = 0
                continue
            iscale = np.float32(-127.0) / mx
            qi = q[i]
            for g in range(8):
                total = np.int32(0)
                for k in range(o + 32 * g, o + 32 * g + 32):
                    v = min(np.int32(127), _round_even(iscale * xi[k]))
                    qi[k] = np.int8(v)
                    total += v
                sums[i, blk * 8 + g] = total
            # an infinite x leaves iscale -0 or +0: ggml's 1 / iscale is then -inf or +inf (numba would raise)
            d[i, blk] = np.float32(1.0) / iscale if iscale != 0 else np.float32(-np.inf if mx > 0 else np.inf)


def quantize_activations(partner: str, x: np.ndarray):
    """x f32 [m, n] in llama.cpp's activation blocks: (q int8 [m, n], d f32 [m, n/block], extra). Q8_0's and
    Q8_1's d is its fp16 value (what the dot product reads), Q8_K's stays f32; extra is None for Q8_0, Q8_1's
    fp16 block sums s f32 [m, n/32], Q8_K's 32-element sums int32 [m, n/32]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    block = PARTNER_BLOCK[partner]
    if x.ndim != 2 or x.shape[1] % block:
        raise ValueError(f"qint: activations must be [m, k * {block}] for {partner}, got shape {x.shape}")
    q = np.empty(x.shape, np.int8)
    d = np.empty((x.shape[0], x.shape[1] // block), np.float32)
    parts = pool_threads() if x.size >= QUANTIZE_SPLIT else 1  # rows are independent: any split, the same bits
    if partner in (Q8_0_PARTNER, Q8_1_PARTNER):
        with_sums = partner == Q8_1_PARTNER
        s = np.empty(d.shape if with_sums else (1, 1), np.float32)
        split_range(x.shape[0], parts, lambda r0, r1: _quantize_q8_0(x[r0:r1], q[r0:r1], d[r0:r1],
                                                                      s[r0:r1] if with_sums else s, with_sums))
        return q, d, (s if with_sums else None)
    sums = np.empty((x.shape[0], x.shape[1] // 32), np.int32)
    split_range(x.shape[0], parts, lambda r0, r1: _quantize_q8_k(x[r0:r1], q[r0:r1], d[r0:r1], sums[r0:r1]))
    return q, d, sums


@njit(cache=True, inline="always")
def _hsum8(a):
    """hsum_float_8: high half + low half, then (0 + 2) + (1 + 3)."""
    r0, r1, r2, r3 = a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]
    return (r0 + r2) + (r1 + r3)


# The row kernels: each format's driver is a module-level function (numba caches it by name); the formats whose
# block dot takes one f32 scale, or Q8_1's scale and min, share an inlined loop, at the offsets of the format's
# pipeline/kernels/formats.py row (GEOMETRY).
@njit(inline="always")
def _rows_scaled(idot, raw, q, d, out, lut, r0, r1, geometry, weight_first):
    """Rows r0..r1 of raw [n_rows, row_bytes] against activations q/d -> out f32 [m, n_rows]: per block one
    idot with the scale weight d * activation d (weight_first: in that operand order, else the other)."""
    block, size, d_at, _ = geometry
    acc = np.empty(8, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(q.shape[0]):
            qi, di = q[i], d[i]
            acc[:] = 0.0
            for blk in range(qi.shape[0] // block):
                o = blk * size
                if weight_first:
                    idot(acc, b, o, qi, blk * block, _half(lut, b, o + d_at) * di[blk])
                else:
                    idot(acc, b, o, qi, blk * block, di[blk] * _half(lut, b, o + d_at))
            out[i, r] = _hsum8(acc)


@njit(inline="always")
def _rows_q8_1(idot, raw, q, d, s, out, lut, r0, r1, geometry):
    """Rows r0..r1 of Q4_1/Q5_1 raw against Q8_1 activations q/d/s: the scaled sums in 8 lanes, the mins times
    the activations' fp16 sums in one f32 (summs, a fused multiply-add per block as llama.cpp's compiled code)."""
    block, size, d_at, m_at = geometry
    acc = np.empty(8, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(q.shape[0]):
            qi, di, si = q[i], d[i], s[i]
            acc[:] = 0.0
            summs = np.float32(0.0)
            for blk in range(qi.shape[0] // block):
                o = blk * size
                idot(acc, b, o, qi, blk * block, _half(lut, b, o + d_at) * di[blk])
                summs = fma(_half(lut, b, o + m_at), si[blk], summs)
            out[i, r] = _hsum8(acc) + summs


@njit(cache=True, nogil=True)
def _mm_q8_0(raw, q, d, sums, out, lut, r0, r1):
    """Rows r0..r1 of Q8_0 raw [n_rows, row_bytes] against Q8_0 activations q/d -> out f32 [m, n_rows]."""
    _rows_scaled(idot_q8_0, raw, q, d, out, lut, r0, r1, GEOMETRY[Q8_0], True)


@njit(cache=True, nogil=True)
def _mm_q4_0(raw, q, d, sums, out, lut, r0, r1):
    _rows_scaled(idot_q4_0, raw, q, d, out, lut, r0, r1, GEOMETRY[Q4_0], True)


@njit(cache=True, nogil=True)
def _mm_q5_0(raw, q, d, sums, out, lut, r0, r1):
    _rows_scaled(idot_q5_0, raw, q, d, out, lut, r0, r1, GEOMETRY[Q5_0], True)


@njit(cache=True, nogil=True)
def _mm_iq4_xs(raw, q, d, sums, out, lut, r0, r1):
    """Against Q8_K activations."""
    _rows_scaled(idot_iq4_xs, raw, q, d, out, lut, r0, r1, GEOMETRY[IQ4_XS], True)


@njit(cache=True, nogil=True)
def _mm_q3_k(raw, q, d, sums, out, lut, r0, r1):
    """Against Q8_K activations (the scale as activation d * weight d)."""
    _rows_scaled(idot_q3_k, raw, q, d, out, lut, r0, r1, GEOMETRY[Q3_K], False)


@njit(cache=True, nogil=True)
def _mm_q4_1(raw, q, d, s, out, lut, r0, r1):
    _rows_q8_1(idot_q4_1, raw, q, d, s, out, lut, r0, r1, GEOMETRY[Q4_1])


@njit(cache=True, nogil=True)
def _mm_q5_1(raw, q, d, s, out, lut, r0, r1):
    _rows_q8_1(idot_q5_1, raw, q, d, s, out, lut, r0, r1, GEOMETRY[Q5_1])


_Q6_K, _Q2_K, _IQ4_NL = (GEOMETRY[q] for q in (Q6_K, Q2_K, IQ4_NL))


@njit(inline="always")
def _mins4(accm):
    """Q4_K's mins: 4 lanes, added as llama.cpp does."""
    return (accm[0] + accm[2]) + (accm[1] + accm[3])


@njit(inline="always")
def _mins1(accm):
    """Q5_K's mins: one f32."""
    return accm[0]


@njit(inline="always")
def _rows_k(idot, mins, accm_size, raw, q, d, sums, out, lut, r0, r1, geometry):
    """Rows r0..r1 of Q4_K/Q5_K raw against Q8_K activations: the scaled sums in 8 lanes, the mins in accm_size
    f32 lanes, as llama.cpp (its mins(accm) added after the lanes' hsum_float_8)."""
    block, size, d_at, m_at = geometry
    acc = np.empty(8, np.float32)
    accm = np.empty(accm_size, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(q.shape[0]):
            qi, di, si = q[i], d[i], sums[i]
            acc[:] = 0.0
            accm[:] = 0.0
            for blk in range(qi.shape[0] // block):
                o = blk * size
                idot(acc, b, o, qi, blk * block, di[blk] * _half(lut, b, o + d_at), accm, si, blk * 8,
                     -di[blk] * _half(lut, b, o + m_at))
            out[i, r] = _hsum8(acc) + mins(accm)


@njit(cache=True, nogil=True)
def _mm_q4_k(raw, q, d, sums, out, lut, r0, r1):
    _rows_k(idot_q4_k, _mins4, 4, raw, q, d, sums, out, lut, r0, r1, GEOMETRY[Q4_K])


@njit(cache=True, nogil=True)
def _mm_q5_k(raw, q, d, sums, out, lut, r0, r1):
    _rows_k(idot_q5_k, _mins1, 1, raw, q, d, sums, out, lut, r0, r1, GEOMETRY[Q5_K])


@njit(cache=True, nogil=True)
def _mm_q6_k(raw, q, d, bsums, out, lut, r0, r1):
    """Rows r0..r1 of Q6_K raw against Q8_K activations and their 16-element sums (the -32 offset's)."""
    block, size, d_at, _ = _Q6_K
    acc = np.empty(8, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(q.shape[0]):
            qi, di, si = q[i], d[i], bsums[i]
            acc[:] = 0.0
            for blk in range(qi.shape[0] // block):
                o = blk * size
                idot_q6_k(acc, b, o, qi, blk * block, di[blk] * _half(lut, b, o + d_at), si, blk * 16)
            out[i, r] = _hsum8(acc)


_IQ4_TABLE = np.array(IQ4_VALUES, np.int32)


@njit(cache=True, nogil=True)
def _mm_iq4_nl(raw, q, d, sums, out, lut, r0, r1):
    """Rows r0..r1 of IQ4_NL raw against Q8_0 activations, as ggml_vec_dot_iq4_nl_q8_0 (AVX2): blocks taken in
    pairs into two accumulators, added lane-wise before hsum_float_8; an odd last block as its scalar tail,
    fma(d, sum, total)."""
    block, size, d_at, _ = _IQ4_NL
    acc, acc2 = np.empty(8, np.float32), np.empty(8, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(q.shape[0]):
            qi, di = q[i], d[i]
            nb = qi.shape[0] // block
            acc[:] = 0.0
            acc2[:] = 0.0
            for blk in range(0, nb - 1, 2):
                o = blk * size
                idot_iq4_nl(acc, b, o, qi, blk * block, _half(lut, b, o + d_at) * di[blk])
                idot_iq4_nl(acc2, b, o + size, qi, blk * block + block, _half(lut, b, o + size + d_at) * di[blk + 1])
            for k in range(8):
                acc[k] += acc2[k]
            total = _hsum8(acc)
            if nb % 2:
                o, qo = (nb - 1) * size, (nb - 1) * block
                sumi = np.int32(0)
                for k in range(block // 2):
                    sumi += (_IQ4_TABLE[b[o + 2 + k] & 15] * np.int32(qi[qo + k])
                             + _IQ4_TABLE[b[o + 2 + k] >> 4] * np.int32(qi[qo + block // 2 + k]))
                total = fma(_half(lut, b, o + d_at) * di[nb - 1], np.float32(sumi), total)
            out[i, r] = total


@njit(cache=True, nogil=True)
def _mm_q2_k(raw, q, d, bsums, out, lut, r0, r1):
    """Rows r0..r1 of Q2_K raw against Q8_K activations and their 16-element sums: per block the mins' fma,
    then the scales', into the same 8 lanes."""
    block, size, d_at, m_at = _Q2_K
    acc = np.empty(8, np.float32)
    for r in range(r0, r1):
        b = raw[r]
        for i in range(q.shape[0]):
            qi, di, si = q[i], d[i], bsums[i]
            acc[:] = 0.0
            for blk in range(qi.shape[0] // block):
                o = blk * size
                idot_q2_k(acc, b, o, qi, blk * block, di[blk] * _half(lut, b, o + d_at), si, blk * 16,
                          -di[blk] * _half(lut, b, o + m_at))
            out[i, r] = _hsum8(acc)


KERNELS = kernels("idot", globals())  # qtype -> its row kernel, by the pipeline/kernels/formats.py row


def supports(qtype: int) -> bool:
    return int(qtype) in KERNELS


# A product's job block (int64, read by every thread that runs it): the header, one entry per weight, one per
# piece. Arrays are passed by address (an activation array no weight uses is a 1x1 stand-in, never read); the
# caller keeps them alive until the job returns.
_LENGTH, _NEXT, _PIECES, _WEIGHTS, _M, _N, _LUT, _Q80, _D80, _Q8K, _D8K, _SUMS, _S81, _BSUMS = range(14)
_HEADER, _WEIGHT, _PIECE = 16, 5, 3  # slots: header, per weight (qtype, raw, rows, row bytes, out), per piece


@njit(cache=True, nogil=True, inline="always")
def _views(job):
    """The activation views of a job block: (m, lut, q80, d80, q8k, d8k, sums, s81, bsums)."""
    m, n = job[_M], job[_N]
    lut = carray(f32_pointer(job[_LUT]), 65536)
    q80, d80 = carray(i8_pointer(job[_Q80]), (m, n)), carray(f32_pointer(job[_D80]), (m, n // 32))
    q8k, d8k = carray(i8_pointer(job[_Q8K]), (m, n)), carray(f32_pointer(job[_D8K]), (m, n // 256))
    sums = carray(i32_pointer(job[_SUMS]), (m, n // 32))
    s81 = carray(f32_pointer(job[_S81]), (m, n // 32))
    bsums = carray(i32_pointer(job[_BSUMS]), (m, n // 16))
    return m, lut, q80, d80, q8k, d8k, sums, s81, bsums


@njit(cache=True, nogil=True, inline="always")
def _piece(job, i, m):
    """Piece i of the job: (qtype, the weight's raw rows, its output view, r0, r1)."""
    pieces = _HEADER + _WEIGHT * job[_WEIGHTS]
    w, r0, r1 = job[pieces + _PIECE * i], job[pieces + _PIECE * i + 1], job[pieces + _PIECE * i + 2]
    e = _HEADER + _WEIGHT * w
    qtype, rows = job[e], job[e + 2]
    raw = carray(u8_pointer(job[e + 1]), (rows, job[e + 3]))
    out = carray(f32_pointer(job[e + 4]), (m, rows))
    return qtype, raw, out, r0, r1


# The runners: each takes the job's pieces from its counter (job[_NEXT]) until none are left; a piece is rows
# r0..r1 of one weight, computed by that weight's kernel as a serial call would. A runner is made for the set of
# formats of one product (at most three: a group of weights sharing an input is q/k/v, gate/up or one weight),
# and its dispatch names them as closure constants a, b, c: numba prunes a branch whose condition is made of
# constants before it types the body, so a product's first call compiles only its own formats' kernels (a Q4_1
# model's layers 1 of the 12, its Q8_0 head another), and each set is its own cache entry (numba keys a cached
# closure by its cell values). One branch per format, written once.


def _runner(a, b, c):
    """The job runner `run(address)` of a product whose pieces are all of formats a, b or c."""
    def run(address):
        job = _job(address)
        m, lut, q80, d80, q8k, d8k, sums, s81, bsums = _views(job)
        while True:
            i = atomic_add(job, _NEXT, 1)
            if i >= job[_PIECES]:
                return
            qt, raw, out, r0, r1 = _piece(job, i, m)
            if (a == Q8_0 or b == Q8_0 or c == Q8_0) and qt == Q8_0:
                _mm_q8_0(raw, q80, d80, sums, out, lut, r0, r1)
            elif (a == Q4_0 or b == Q4_0 or c == Q4_0) and qt == Q4_0:
                _mm_q4_0(raw, q80, d80, sums, out, lut, r0, r1)
            elif (a == Q5_0 or b == Q5_0 or c == Q5_0) and qt == Q5_0:
                _mm_q5_0(raw, q80, d80, sums, out, lut, r0, r1)
            elif (a == IQ4_NL or b == IQ4_NL or c == IQ4_NL) and qt == IQ4_NL:
                _mm_iq4_nl(raw, q80, d80, sums, out, lut, r0, r1)
            elif (a == Q4_1 or b == Q4_1 or c == Q4_1) and qt == Q4_1:
                _mm_q4_1(raw, q80, d80, s81, out, lut, r0, r1)
            elif (a == Q5_1 or b == Q5_1 or c == Q5_1) and qt == Q5_1:
                _mm_q5_1(raw, q80, d80, s81, out, lut, r0, r1)
            elif (a == Q4_K or b == Q4_K or c == Q4_K) and qt == Q4_K:
                _mm_q4_k(raw, q8k, d8k, sums, out, lut, r0, r1)
            elif (a == Q5_K or b == Q5_K or c == Q5_K) and qt == Q5_K:
                _mm_q5_k(raw, q8k, d8k, sums, out, lut, r0, r1)
            elif (a == Q6_K or b == Q6_K or c == Q6_K) and qt == Q6_K:
                _mm_q6_k(raw, q8k, d8k, bsums, out, lut, r0, r1)
            elif (a == Q3_K or b == Q3_K or c == Q3_K) and qt == Q3_K:
                _mm_q3_k(raw, q8k, d8k, sums, out, lut, r0, r1)
            elif (a == Q2_K or b == Q2_K or c == Q2_K) and qt == Q2_K:
                _mm_q2_k(raw, q8k, d8k, bsums, out, lut, r0, r1)
            elif (a == IQ4_XS or b == IQ4_XS or c == IQ4_XS) and qt == IQ4_XS:
                _mm_iq4_xs(raw, q8k, d8k, sums, out, lut, r0, r1)
    return run


@njit(cache=True)
def _template(qtypes, addresses, rows, row_bytes, offsets, parts):
    """The job block of a product of the weights (ggml types, raw data addresses, rows, row bytes; int64 arrays,
    not a tuple of raw arrays: one compiled signature for groups of 1, 2 or 3 weights) with its per-call slots
    empty: each weight's rows cut into at most `parts` pieces of whole ROW_CHUNKs; an entry's out slot holds the
    weight's first row in the flat output until `_fill` turns it into an address."""
    n_weights = len(qtypes)
    steps = np.empty(n_weights, np.int64)
    n_pieces = 0
    for w in range(n_weights):
        steps[w] = -(-rows[w] // max(1, min(parts, rows[w] // ROW_CHUNK)))
        n_pieces += -(-rows[w] // steps[w])
    job = np.zeros(_HEADER + _WEIGHT * n_weights + _PIECE * n_pieces, np.int64)
    job[_LENGTH], job[_PIECES], job[_WEIGHTS] = len(job), n_pieces, n_weights
    p = _HEADER + _WEIGHT * n_weights
    for w in range(n_weights):
        e = _HEADER + _WEIGHT * w
        job[e], job[e + 1], job[e + 2], job[e + 3], job[e + 4] = qtypes[w], addresses[w], rows[w], row_bytes[w], \
            offsets[w]
        for r0 in range(0, rows[w], steps[w]):
            job[p], job[p + 1], job[p + 2] = w, r0, min(rows[w], r0 + steps[w])
            p += _PIECE
    return job


@njit(cache=True, nogil=True)
def scratch(m, n, needs):
    """The activation arrays a product of x [m, n] quantizes into, for the USE_* bits of `needs` (1x1 stand-ins
    for the rest): (q80, d80, s81, q8k, d8k, sums, bsums)."""
    q8_0, q8_k = needs & USE_Q8_0, needs & USE_Q8_K
    return (np.empty((m, n) if q8_0 else (1, 1), np.int8), np.empty((m, n // 32) if q8_0 else (1, 1), np.float32),
            np.empty((m, n // 32) if needs & USE_Q8_1_SUMS else (1, 1), np.float32),
            np.empty((m, n) if q8_k else (1, 1), np.int8), np.empty((m, n // 256) if q8_k else (1, 1), np.float32),
            np.empty((m, n // 32) if q8_k else (1, 1), np.int32),
            np.empty((m, n // 16) if needs & USE_Q8_K_BSUMS else (1, 1), np.int32))


@njit(cache=True, nogil=True)
def _fill(template, x, arrays, lut, flat, needs):
    """This call's job block: x quantized into the activation `arrays` (`scratch(m, n, needs)`) each weight
    reads, and their addresses and the outputs' (flat f32 [m * total rows], weight w's rows from its offset)
    written into a copy of the template. -> (job, its address)."""
    q80, d80, s81, q8k, d8k, sums, bsums = arrays
    job = template.copy()
    m = x.shape[0]
    if needs & USE_Q8_0:
        _quantize_q8_0(x, q80, d80, s81, needs & USE_Q8_1_SUMS != 0)
    if needs & USE_Q8_K:
        _quantize_q8_k(x, q8k, d8k, sums)
    if needs & USE_Q8_K_BSUMS:
        _bsums(q8k, bsums)
    job[_M], job[_N], job[_LUT] = m, x.shape[1], lut.ctypes.data
    job[_Q80], job[_D80], job[_Q8K], job[_D8K], job[_SUMS] = (q80.ctypes.data, d80.ctypes.data, q8k.ctypes.data,
                                                               d8k.ctypes.data, sums.ctypes.data)
    job[_S81], job[_BSUMS] = s81.ctypes.data, bsums.ctypes.data
    for w in range(job[_WEIGHTS]):
        e = _HEADER + _WEIGHT * w
        job[e + 4] = flat.ctypes.data + 4 * m * template[e + 4]
    return job, job.ctypes.data


@njit(inline="always")
def _job(address):
    return carray(i64_pointer(address), carray(i64_pointer(address), _HEADER)[_LENGTH])


_CALLED = {name for code in _runner.__code__.co_consts if hasattr(code, "co_names") for name in code.co_names}
if {kernel.__name__ for kernel in KERNELS.values()} - _CALLED:  # a format added without its runner branch
    raise RuntimeError("qint: the runner must have a branch for every integer kernel's format")
_RUNNERS = {}  # sorted formats, padded to three -> its NativeJob (what the pool's threads call with a job block)


def runner_of(qtypes) -> NativeJob:
    """The runner of a product of these formats (compiled, or loaded from the cache, on first use)."""
    formats = sorted({int(q) for q in qtypes})
    if not 1 <= len(formats) <= 3:
        raise ValueError(f"qint: a product runs one to three formats, got {formats}")
    key = tuple(formats + formats[-1:] * (3 - len(formats)))
    runner = _RUNNERS.get(key)
    if runner is None:
        runner = _RUNNERS[key] = NativeJob(_runner(*key))
    return runner


_EMPTY_JOB = np.zeros(_HEADER, np.int64)
_EMPTY_JOB[_LENGTH] = _HEADER
_EMPTY_JOB_ADDRESS = _EMPTY_JOB.ctypes.data


def empty_dispatch(threads: int):
    """A product with no pieces on `threads` threads: the fixed cost of a decode product's hand-off
    (`fucina bench llm`'s machine/dispatch row)."""
    run_native(runner_of([Q4_1]).address, _EMPTY_JOB_ADDRESS, threads)


class Product:
    """x @ W.T for a fixed group of weights that share their input (q/k/v, gate/up, one weight), through the
    integer row kernels: the job block's weight entries and piece grid are laid out once per thread count, and
    a call quantizes x once per partner format and fills in its addresses in one numba call (the per-call
    Python of a decode product: ~15 us instead of ~70). Rows are cut into a fixed number of pieces per weight
    (ROW_CHUNK multiples) that the threads take from one counter, in one native job (workpool.run_native:
    no Python and no GIL on the workers); every element is the same serial code whichever thread runs it."""

    def __init__(self, weights, n_cols: int):
        for qtype, raw in weights:
            if int(qtype) not in KERNELS:
                raise ValueError(f"qint: no integer kernel for ggml type {qtype}")
            _check(int(qtype), raw, n_cols)
        self.n_cols = n_cols
        self.qtypes = tuple(int(qtype) for qtype, _ in weights)
        self.raws = tuple(np.ascontiguousarray(raw) for _, raw in weights)  # kept alive: the job holds addresses
        self.rows = [raw.shape[0] for raw in self.raws]
        self.offsets = np.cumsum([0] + self.rows)
        self.needs = 0  # the USE_* bits: which activation blocks x is quantized into
        for qtype in self.qtypes:
            self.needs |= NEEDS[qtype]
        self._templates = {}  # pieces per weight -> the job template
        self.runner = runner_of(self.qtypes)  # compiled (or loaded) on first use: its formats' kernels only

    def template(self, threads: int) -> np.ndarray:
        """The job block laid out for `threads` threads (pieces per weight: 1 on one thread, else
        MATVEC_PIECES_PER_THREAD per thread), without this call's activations and outputs (`_fill`)."""
        parts = 1 if threads == 1 else threads * MATVEC_PIECES_PER_THREAD
        template = self._templates.get(parts)
        if template is None:
            i64 = lambda values: np.array(values, np.int64)  # noqa: E731
            template = self._templates[parts] = _template(
                i64(self.qtypes), i64([raw.ctypes.data for raw in self.raws]), i64([raw.shape[0] for raw in self.raws]),
                i64([raw.shape[1] for raw in self.raws]), i64(self.offsets[:-1]), parts)
        return template

    def __call__(self, x: np.ndarray) -> list:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.n_cols:
            raise ValueError(f"qint: x must be [m, {self.n_cols}], got shape {x.shape}")
        threads = pool_threads()
        template = self.template(threads)
        flat = np.empty(x.shape[0] * int(self.offsets[-1]), np.float32)
        arrays = scratch(x.shape[0], x.shape[1], self.needs)
        job, address = _fill(template, x, arrays, HALF_TO_FLOAT, flat, self.needs)
        run_native(self.runner.address, address, min(threads, int(job[_PIECES])))
        m = x.shape[0]
        return [flat[m * o:m * (o + r)].reshape(m, r) for o, r in zip(self.offsets, self.rows)]


def matmul_t_many(weights, x: np.ndarray) -> list:
    """[x @ W.T for (qtype, raw) in weights] through integer block dots, x f32 [m, n] quantized once per
    partner format (a one-off `Product`; callers that repeat a group keep its Product)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"qint: x must be [m, n_cols], got shape {x.shape}")
    return Product(weights, x.shape[1])(x)
