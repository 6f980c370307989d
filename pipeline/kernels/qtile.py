"""Tiled integer GEMM for prefill through K-quant, IQ4_XS and Q8_0/Q4_0/Q5_0 weights: 16 weight rows per vector lane
set, x as Q8_K (Q8_0 for the 32-element formats).

Trade-off: pipeline/kernels/qint_gemm.py keeps llama.cpp's vec_dot arithmetic (eight f32 lanes per output, each a sum
over sub-blocks of 4-element dot products scaled by the sub-block's scale), which costs two scaling
instructions per 32 weights and activation row whatever the layout. Here the weights are repacked once, at
first use, into tiles of 16 rows (TILE_ROWS) so that one 512-bit vpdpbusd multiplies 4 weights of each of the
16 rows by 4 broadcast activation bytes; a sub-block's dot products for the 16 rows are then exact, scaled once
per sub-block (vpmulld), and each block adds one f32 fused multiply-add per output: about half the
instructions per multiply-add (docs/models.md has the measured figures). The price is a different f32
rounding from vec_dot (llama.cpp's own tiled prefill GEMM differs from its vec_dot the same way), so this
arithmetic is its own, defined below and pinned bitwise by a numpy model in tests/kernels/test_qtile.py:

    for each output (activation row i, weight row r), over the row's blocks b:
        T = sum_j s_j * (w_j . q_j)      exact integers: sub-block j's scale and weights, the Q8_K values
        M = sum_j m_j * bsum_j           exact (Q4_K, Q5_K): sub-block j's min, the sum of its 32 Q8_K values
        acc  = fma(f32(d_i * d_r),    f32(T), acc)     d_i the activation block's scale, d_r the weight's d
        accm = fma(f32(d_i * dmin_r), f32(M), accm)    (Q4_K, Q5_K; Q6_K has no mins: accm stays 0)
    out = acc - accm

Q4_K/Q5_K's sub-blocks are 32 weights (unsigned 4/5-bit) with 6-bit scales and mins; Q6_K's are 16 signed
weights (q - 32) with int8 scales: vpdpbusd multiplies unsigned by signed bytes, so for Q6_K the activations
go in as x + 128 (unsigned) and the weights signed, and T takes off 128 * sum_j s_j * sum(w_j), a constant of
the weight row and block stored in its tile. Q3_K is packed into Q6_K's tiles (its weights ql - 4 * !hbit in
-4..3 and scales s - 32 fit Q6_K's int8 fields), so it runs Q6_K's kernel with the same arithmetic; IQ4_XS into
Q6_K's layout too (its table values as the weights, each 32-weight scale for both 16-weight halves), with the
dots taken without vpmaddubsw where there is no VNNI (its pair sums would saturate i16). Q2_K keeps its 2-bit
weights four to a byte (bits 2s: four 16-weight sub-blocks per vector), one scale per 16 weights, and its mins
against the activations' 16-element sums: M = sum_j m_j * bsum16_j over 16 sub-blocks.
The 32-element formats Q8_0, Q4_0, Q5_0 (kinds 6, 5, 5) take Q6_K's scheme with one block of 32 signed weights
(q, q - 8, q - 16) and llama.cpp's Q8_0 activations (fp16 scales): per block T = sum((x + 128) * w) - 128 *
sum(w) = sum(x * w), exact, and acc = fma(f32(d_x * d_w), f32(T), acc), no mins; all of a row's blocks in one
call (the block loop inside, the accumulators in registers). Q8_0's weights reach -128, whose pairs would
saturate vpmaddubsw's i16, so its kind takes the wide dots where there is no VNNI, as IQ4_XS's. Q4_1 and Q5_1
(kind 7) keep their unsigned weights q (0..31) as the unsigned operand against llama.cpp's Q8_1 activations
(signed; fp16 d and block sums s = d * sum(q)): T = sum(x * w) exact, acc = fma(f32(d_x * d_w), f32(T), acc),
then acc = fma(m_w, s_x, acc), per block.
Every output is computed by the same code whatever rows or tiles sit beside it (groups of ROWS activation rows,
the rest one at a time), so the bits do not depend on grouping, the cut into pieces or the thread count. The
same arithmetic compiles on every ISA (vpdpbusd with AVX512-VNNI; vpmaddubsw + vpmaddwd by ones with AVX512-BW
or AVX2; portable IR elsewhere): the same bits on any CPU. The tiles are kept beside the original rows (the
decode kernels read those): per 16 rows and block 2560 bytes for Q4_K (the file's 2304), 4608 for Q5_K (2816;
its 5-bit weights unpacked to bytes), 4480 for Q6_K (3360), Q3_K (1760) and IQ4_XS (2176), 1920 for Q2_K (1344);
per 16 rows and 32 weights 640 bytes for Q8_0 (544), Q4_0 (288), Q5_0 (352), Q4_1 (320) and Q5_1 (384).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .dequant import HALF_TO_FLOAT, _check, _half
from .formats import FORMATS, Q4_1, Q4_K, Q8_0, QK_K
from .qblocks import AVX2, _F32, _I8, _I32, _I64, _IR, _V8I, _V16S, _target_has, _x86
from .qint import _IQ4_TABLE, PARTNER, _bsums, quantize_activations
from .workpool import run_dynamic, split_range, threads as pool_threads

TILE_ROWS = 16  # weight rows per tile: the 16 i32 lanes of a 512-bit vector
VNNI512 = _target_has("avx512vnni", "avx512bw")
_BW = _target_has("avx512bw")
# activation rows per kernel call: 4 with 32 vector registers (a C prototype on a Xeon with AVX512-VNNI: 2, 4,
# 6, 8 rows gave 135, 173, 162, 141 G multiply-adds per second), 2 where a 512-bit value takes two of 16
ROWS = 4 if _target_has("avx512f") else 2
PIECE_TILES = 8  # tiles per piece (128 weight rows: ~320 KB of tiles per 1024 inputs, an L2's share)
# Tile block layouts (16 rows x 256 weights; byte offsets), by kind 0 Q4_K, 1 Q5_K, 2 Q6_K, 3 IQ4_XS, 4 Q2_K:
#   Q4_K: quants [chunk c][group g][row][4 bytes] (low nibbles: sub-block 2c's weights 4g..4g+3, high: 2c+1's),
#         scales u8 [sub-block][row], mins as i16 pairs [pair c][row](m_2c, m_2c+1), d f32 [row], dmin f32 [row]
#   Q5_K: the same with the 5-bit weights as bytes [c][g][sub-block 2c + k][row][4 bytes]
#   Q6_K: signed weights (q - 32) as int8 [16-weight sub-block j][group g][row][4 bytes], scales int8 [j][row],
#         the correction 128 * sum_j s_j * sum(w_j) as i32 [row], d f32 [row]
#   Q3_K: Q6_K's tiles (kind 2), its weights ql - 4 * !hbit (-4..3) and scales s - 32 in Q6_K's fields
#   IQ4_XS: Q6_K's layout (kind 3), its table values (-127..113) as the weights, each 32-weight scale s - 32
#         twice (two 16-weight sub-blocks); kind 3's dots take wider sums without VNNI (_dpbusd's `wide`)
#   Q2_K: the 2-bit weights four to a byte [chunk c][group g][row][4 bytes] (bits 2s: sub-block 4c + s's
#         weights 4g..4g+3), scales u8 [16-weight sub-block j][row], mins as i16 pairs [pair p][row](m_2p,
#         m_2p+1) against the activations' 16-element sums, d f32 [row], dmin f32 [row]
#   Q4_0, Q5_0 (kind 5), Q8_0 (kind 6), 16 rows x 32 weights: signed weights (q - 8, q - 16, q) as int8
#         [group g][row][4 bytes], the correction 128 * sum(w) as i32 [row], d f32 [row] (640 bytes)
#   Q4_1, Q5_1 (kind 7), 16 rows x 32 weights: unsigned weights q as u8 [group g][row][4 bytes], d f32 [row],
#         m f32 [row] (640 bytes)
# the file's block, as _pack_rows reads it (pipeline/kernels/formats.py's tile_source): Q4_K 0, Q5_K 1, Q6_K 2, Q3_K 3,
# IQ4_XS 4, Q2_K 5, Q8_0 6, Q4_0 7, Q5_0 8, Q4_1 9, Q5_1 10; by source: the block's bytes, its fp16 offsets, its
# tile layout and kernel (tile_kind)
SOURCES = {f.qtype: f.tile_source for f in FORMATS if f.tile_source >= 0}
_BY_SOURCE = sorted((f for f in FORMATS if f.tile_source >= 0), key=lambda f: f.tile_source)
_RAW_BLOCK = tuple(f.block_bytes for f in _BY_SOURCE)
_D_AT, _DMIN_AT = tuple(f.d_at for f in _BY_SOURCE), tuple(f.dmin_at for f in _BY_SOURCE)
_KIND_OF_SOURCE = tuple(f.tile_kind for f in _BY_SOURCE)
KINDS = {qtype: _KIND_OF_SOURCE[src] for qtype, src in SOURCES.items()}
_QS = 0
_SC = (2048, 4096, 4096, 4096, 1024, -1, -1, -1)
_MN = (2176, 4224, -1, -1, 1280, -1, -1, -1)      # Q6_K, IQ4_XS, the 32-element kinds: none
_CORR = (-1, -1, 4352, 4352, -1, 512, 512, -1)    # Q6_K, IQ4_XS, Q8_0/Q4_0/Q5_0
_D = (2432, 4480, 4416, 4416, 1792, 576, 576, 512)
_DMIN = (2496, 4544, -1, -1, 1856, -1, -1, 576)   # kind 7: Q4_1/Q5_1's m
TILE_BLOCK = (2560, 4608, 4480, 4480, 1920, 640, 640, 640)
BLOCK_ELEMS = (QK_K,) * 5 + (32, 32, 32)  # weights per tile block, by kind
_MIN_PAIRS = (4, 4, 0, 0, 8, 0, 0, 0)  # i16 min pairs per block: against 32-element sums (Q4_K/Q5_K), 16-element (Q2_K)
# the 32-element kinds: Q4_0/Q5_0 (5), Q8_0 (6: wide dots without VNNI) against Q8_0 activations; Q4_1/Q5_1 (7)
# against Q8_1's
B32_KINDS = (5, 6, 7)
_V64B, _V16I, _V16F = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
_V32S, _V64I = ir.VectorType(ir.IntType(16), 32), ir.VectorType(_I32, 64)


@njit(cache=True, nogil=True, inline="always")
def _k4_scale_min(b, o, j):
    """Sub-block j's 6-bit scale and min of the Q4_K/Q5_K block at b[o] (ggml's get_scale_min_k4)."""
    if j < 4:
        return b[o + 4 + j] & 63, b[o + 8 + j] & 63
    return (b[o + 8 + j] & 0xF) | ((b[o + j] >> 6) << 4), (b[o + 8 + j] >> 4) | ((b[o + 4 + j] >> 6) << 4)


@njit(cache=True, nogil=True, inline="always")
def _weight(b, o, src, element):
    """The integer weight `element` (0..255) of the Q5_K (source 1: unsigned), Q6_K (2: q - 32), Q3_K (3: ql -
    4 * !hbit) or IQ4_XS (4: the table value) block at b[o]. (Q4_K's tiles copy the file's nibble bytes.)"""
    if src == 5:  # Q2_K: vector 4 * half + t of 32 weights holds bits 2t of the 32 bytes at o + 16 + 32 * half
        half, t, lane = element // 128, (element % 128) // 32, element % 32
        return np.int32((b[o + 16 + 32 * half + lane] >> (2 * t)) & 3)
    if src == 4:  # IQ4_XS: sub-block j's 16 bytes at o + 8 + 16 j, low nibbles the first 16 weights
        j, lane = element // 32, element % 32
        return _IQ4_TABLE[(b[o + 8 + 16 * j + lane % 16] >> (4 * (lane // 16))) & 15]
    if src == 3:  # Q3_K: ggml's dequantize_row_q3_K element order (vector j = 4 * half + t of 32 weights)
        half, t, lane = element // 128, (element % 128) // 32, element % 32
        low = (b[o + 32 + 32 * half + lane] >> (2 * t)) & 3
        return np.int32(low) - 4 * (1 - np.int32((b[o + lane] >> (4 * half + t)) & 1))
    if src == 2:  # Q6_K: ggml's dequantize_row_q6_K element order
        half, t, lane = element // 128, (element % 128) // 32, element % 32
        low = (b[o + 64 * half + lane + 32 * (t & 1)] >> (4 * (t >> 1))) & 0xF
        return np.int32(low | (((b[o + 128 + 32 * half + lane] >> (2 * t)) & 3) << 4)) - 32
    j, lane = element // 32, element % 32
    low = (b[o + 48 + 32 * (j // 2) + lane] >> (4 * (j % 2))) & 0xF
    return np.int32(low | (((b[o + 16 + lane] >> j) & 1) << 4))


@njit(cache=True, nogil=True, inline="always")
def _weight_32(b, o, src, e):
    """The integer weight e (0..31) of the Q8_0 (source 6), Q4_0 (7: q - 8), Q5_0 (8: q - 16), Q4_1 (9: q) or
    Q5_1 (10: q) block at b[o] (ggml's dequantize_row order: low nibbles the first 16 weights, Q5's bit e of
    qh the fifth bit)."""
    if src == 6:
        return np.int32(np.int8(b[o + 2 + e]))
    at = (o + 2, o + 6, o + 4, o + 8)[src - 7]
    low = np.int32((b[at + e % 16] >> (4 * (e // 16))) & 0xF)
    if src == 7 or src == 9:
        return low - 8 * (src == 7)
    h = o + 2 if src == 8 else o + 4
    qh = np.int32(b[h]) | (np.int32(b[h + 1]) << 8) | (np.int32(b[h + 2]) << 16) | (np.int32(b[h + 3]) << 24)
    return (low | (((qh >> e) & 1) << 4)) - 16 * (src == 8)


@njit(cache=True, nogil=True, inline="always")
def _scale_16(b, o, src, j):
    """Sub-block j's (16 weights) signed scale of the Q6_K (source 2: int8), Q3_K (3: 6 bits - 32) or IQ4_XS
    (4: its 32-weight sub-block j // 2's 6 bits - 32) block."""
    if src == 2:
        return np.int32(np.int8(b[o + 192 + j]))
    if src == 4:
        high = ((np.int32(b[o + 2]) | (np.int32(b[o + 3]) << 8)) >> (2 * (j // 2))) & 3
        return np.int32(((b[o + 4 + j // 4] >> (4 * ((j // 2) % 2))) & 15) | (high << 4)) - 32
    low = (b[o + 96 + j % 8] >> (4 * (j // 8))) & 15
    return np.int32(low | (((b[o + 104 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32


@njit(cache=True, nogil=True)
def _pack_rows(raw, src, lut, out, out_i16, out_i32, out_f32, t0, t1):
    """Tiles t0..t1 of pack for rows of source format `src` (SOURCES; rows past raw's end are left as pack
    zeroed them: d = 0, never stored). out_i16/i32/f32 are views of out's bytes."""
    n_out, block = raw.shape[0], _RAW_BLOCK[src]
    kind = _KIND_OF_SOURCE[src]
    for t in range(t0, t1):
        for lane in range(min(TILE_ROWS, n_out - t * TILE_ROWS)):
            b = raw[t * TILE_ROWS + lane]
            for blk in range(raw.shape[1] // block):
                tb, o = out[t, blk], blk * block
                if kind >= 5:
                    total = 0
                    for e in range(32):
                        w = _weight_32(b, o, src, e)
                        tb[_QS + 64 * (e // 4) + 4 * lane + e % 4] = np.uint8(w & 0xFF)
                        total += w
                    if kind == 7:
                        out_f32[t, blk, _DMIN[kind] // 4 + lane] = _half(lut, b, o + _DMIN_AT[src])
                    else:
                        out_i32[t, blk, _CORR[kind] // 4 + lane] = 128 * total
                    out_f32[t, blk, _D[kind] // 4 + lane] = _half(lut, b, o + _D_AT[src])
                    continue
                if kind == 4:
                    for c in range(4):
                        for g in range(4):
                            for e in range(4):
                                packed = 0
                                for sub in range(4):
                                    packed |= _weight(b, o, 5, 16 * (4 * c + sub) + 4 * g + e) << (2 * sub)
                                tb[_QS + 64 * (4 * c + g) + 4 * lane + e] = np.uint8(packed)
                    for j in range(16):
                        tb[_SC[4] + 16 * j + lane] = b[o + j] & 15
                        out_i16[t, blk, _MN[4] // 2 + 32 * (j // 2) + 2 * lane + j % 2] = b[o + j] >> 4
                    out_f32[t, blk, _D[4] // 4 + lane] = _half(lut, b, o + _D_AT[5])
                    out_f32[t, blk, _DMIN[4] // 4 + lane] = _half(lut, b, o + _DMIN_AT[5])
                    continue
                if kind >= 2:
                    corr = 0
                    for j in range(16):
                        scale = _scale_16(b, o, src, j)
                        tb[_SC[kind] + 16 * j + lane] = np.uint8(scale & 0xFF)
                        total = 0
                        for g in range(4):
                            for e in range(4):
                                w = _weight(b, o, src, 16 * j + 4 * g + e)
                                tb[_QS + 64 * (4 * j + g) + 4 * lane + e] = np.uint8(w & 0xFF)
                                total += w
                        corr += scale * total
                    out_i32[t, blk, _CORR[kind] // 4 + lane] = 128 * corr
                    out_f32[t, blk, _D[kind] // 4 + lane] = _half(lut, b, o + _D_AT[src])
                    continue
                for c in range(4):
                    for g in range(8):
                        for e in range(4):
                            if kind == 0:  # the file's byte: sub-block 2c's weight low, 2c + 1's high
                                tb[_QS + 64 * (8 * c + g) + 4 * lane + e] = b[o + 16 + 32 * c + 4 * g + e]
                            else:
                                for k in range(2):
                                    tb[_QS + 64 * (2 * (8 * c + g) + k) + 4 * lane + e] = _weight(
                                        b, o, 1, 32 * (2 * c + k) + 4 * g + e)
                for j in range(8):
                    sc, mn = _k4_scale_min(b, o, j)
                    tb[_SC[kind] + 16 * j + lane] = sc
                    out_i16[t, blk, _MN[kind] // 2 + 32 * (j // 2) + 2 * lane + j % 2] = mn
                out_f32[t, blk, _D[kind] // 4 + lane] = _half(lut, b, o + _D_AT[src])
                out_f32[t, blk, _DMIN[kind] // 4 + lane] = _half(lut, b, o + _DMIN_AT[src])


def supports(qtype: int, ggml_avx2: bool = False) -> bool:
    """True when the format has tiles (ggml_avx2: and llama.cpp's tiled arithmetic, the K-quant kinds only)."""
    return int(qtype) in KINDS and not (ggml_avx2 and KINDS[int(qtype)] in B32_KINDS)


def pack(qtype: int, raw) -> np.ndarray:
    """K-quant rows uint8 [n_out, row bytes] -> tiles uint8 [ceil(n_out / 16), blocks, TILE_BLOCK[kind]] in the
    layout above: a numba pass over the rows, the tiles split over the threads (each written by one)."""
    kind, src = KINDS[int(qtype)], SOURCES[int(qtype)]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    nb = raw.shape[1] // _RAW_BLOCK[src]
    _check(int(qtype), raw, nb * BLOCK_ELEMS[kind])
    out = np.empty((-(-raw.shape[0] // TILE_ROWS), nb, TILE_BLOCK[kind]), np.uint8)
    if raw.shape[0] % TILE_ROWS:
        out[-1] = 0  # the rows past the end: all fields zero
    views = out.view(np.int16), out.view(np.int32), out.view(np.float32)
    split_range(out.shape[0], pool_threads(), lambda t0, t1: _pack_rows(raw, src, HALF_TO_FLOAT, out, *views, t0, t1))
    return out


def _splat_i32(h, arg, element_offset):
    """<64 x i8>: the 4 bytes of array argument `arg` at element offset, in every 32-bit lane."""
    return h.b.bitcast(h.splat(h.vload(arg, element_offset, _I32), _V16I), _V64B)


def _dpbusd(h, acc, u, s, wide=False):
    """acc + the 16 lanes' dot products of 4 unsigned bytes (u <64 x i8>) with 4 signed bytes (s <64 x i8>):
    vpdpbusd with AVX512-VNNI; vpmaddubsw + vpmaddwd by ones with AVX512-BW or AVX2 (on 256-bit halves; a pair's
    sum never saturates i16 here: 2 * 31 * 127 for Q4_K/Q5_K, 2 * 255 * 32 for Q6_K/Q3_K); else portable IR. The
    same exact sums on every path. wide (IQ4_XS: 2 * 255 * 127 would saturate vpmaddubsw's i16): the portable
    IR's i32 products wherever vpdpbusd is missing."""
    if VNNI512:
        return _x86(h, "llvm.x86.avx512.vpdpbusd.512", _V16I, acc, h.b.bitcast(u, _V16I), h.b.bitcast(s, _V16I))
    if _BW and not wide:
        pairs = _x86(h, "llvm.x86.avx512.pmaddubs.w.512", _V32S, u, s)
        return h.b.add(acc, _x86(h, "llvm.x86.avx512.pmaddw.d.512", _V16I, pairs, ir.Constant(_V32S, [1] * 32)))
    if AVX2 and not wide:
        half = lambda v, k: h.b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                               ir.Constant(ir.VectorType(_I32, 32), list(range(32 * k, 32 * k + 32))))
        quads = [_x86(h, "llvm.x86.avx2.pmadd.wd", _V8I, _x86(h, "llvm.x86.avx2.pmadd.ub.sw", _V16S, half(u, k),
                                                               half(s, k)), ir.Constant(_V16S, [1] * 16))
                 for k in range(2)]
        return h.b.add(acc, h.b.shuffle_vector(quads[0], quads[1], ir.Constant(_V16I, list(range(16)))))
    prod = h.b.mul(h.b.zext(u, _V64I), h.b.sext(s, _V64I))
    pick = lambda k: h.b.shuffle_vector(prod, ir.Constant(_V64I, ir.Undefined),
                                        ir.Constant(_V16I, list(range(k, 64, 4))))
    return h.b.add(acc, h.b.add(h.b.add(pick(0), pick(1)), h.b.add(pick(2), pick(3))))


def _madd_pairs(h, a, b):
    """<16 x i32> lane l = a[2l] * b[2l] + a[2l+1] * b[2l+1] for <32 x i16> a, b (vpmaddwd; exact)."""
    if _BW:
        return _x86(h, "llvm.x86.avx512.pmaddw.d.512", _V16I, a, b)
    prod = h.b.mul(h.b.sext(a, ir.VectorType(_I32, 32)), h.b.sext(b, ir.VectorType(_I32, 32)))
    pick = lambda k: h.b.shuffle_vector(prod, ir.Constant(prod.type, ir.Undefined),
                                        ir.Constant(_V16I, list(range(k, 32, 2))))
    return h.b.add(pick(0), pick(1))


def _fma_row(h, arg, at, scale, total):
    """acc[arg][at:at + 16] = fma(scale, f32(total), acc[at:at + 16]) for <16 x f32> scale and <16 x i32> total."""
    p = h.b.bitcast(h.b.gep(h.ptrs[arg], [ir.Constant(_I64, at)]), _V16F.as_pointer())
    fn = cgutils.get_or_insert_function(h.b.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    h.b.store(h.b.call(fn, [scale, h.b.sitofp(total, _V16F), h.b.load(p, align=4)]), p, align=4)


def _k_dots(h, kind, rows, at, x_at):
    """Q4_K/Q5_K: per activation row the <16 x i32> T of the module docstring (before the mins)."""
    totals = [None] * rows
    zero = ir.Constant(_V16I, [0] * 16)
    for c in range(4):
        dots = [[zero] * rows, [zero] * rows]  # sub-blocks 2c, 2c + 1
        for g in range(8):
            if kind == 0:
                v = h.vload(2, at(_QS + 64 * (8 * c + g)), _V64B)
                weights = h.bits(v, 0, 0xF), h.bits(v, 4, 0xF)
            else:
                weights = tuple(h.vload(2, at(_QS + 64 * (2 * (8 * c + g) + k)), _V64B) for k in range(2))
            for i in range(rows):
                for k in range(2):
                    x = _splat_i32(h, 4, x_at(i, 64 * c + 32 * k + 4 * g))
                    dots[k][i] = _dpbusd(h, dots[k][i], weights[k], x)
        scales = [h.b.zext(h.vload(2, at(_SC[kind] + 16 * (2 * c + k)), ir.VectorType(_I8, 16)), _V16I)
                  for k in range(2)]
        for i in range(rows):
            part = h.b.add(h.b.mul(dots[0][i], scales[0]), h.b.mul(dots[1][i], scales[1]))
            totals[i] = part if totals[i] is None else h.b.add(totals[i], part)
    return totals


def _q2_k_dots(h, rows, at, x_at):
    """Q2_K: per activation row T, the 2-bit weights (unsigned, four sub-blocks' to a vector) against the
    activations, one scale per 16 weights."""
    totals = [None] * rows
    zero = ir.Constant(_V16I, [0] * 16)
    for c in range(4):
        dots = [[zero] * rows for _ in range(4)]  # sub-blocks 4c .. 4c + 3
        for g in range(4):
            v = h.vload(2, at(_QS + 64 * (4 * c + g)), _V64B)
            for sub in range(4):
                w = h.bits(v, 2 * sub, 3)
                for i in range(rows):
                    dots[sub][i] = _dpbusd(h, dots[sub][i], w, _splat_i32(h, 4, x_at(i, 16 * (4 * c + sub) + 4 * g)))
        for sub in range(4):
            scale = h.b.zext(h.vload(2, at(_SC[4] + 16 * (4 * c + sub)), ir.VectorType(_I8, 16)), _V16I)
            for i in range(rows):
                part = h.b.mul(dots[sub][i], scale)
                totals[i] = part if totals[i] is None else h.b.add(totals[i], part)
    return totals


def _q6_k_dots(h, kind, rows, at, x_at):
    """Q6_K's layout (kinds 2, 3): per activation row T, from the activations + 128 (unsigned) and the signed
    weights."""
    totals = [None] * rows
    zero = ir.Constant(_V16I, [0] * 16)
    for j in range(16):
        dots = [zero] * rows
        for g in range(4):
            w = h.vload(2, at(_QS + 64 * (4 * j + g)), _V64B)
            for i in range(rows):
                dots[i] = _dpbusd(h, dots[i], _splat_i32(h, 4, x_at(i, 16 * j + 4 * g)), w, wide=kind == 3)
        scale = h.b.sext(h.vload(2, at(_SC[kind] + 16 * j), ir.VectorType(_I8, 16)), _V16I)
        for i in range(rows):
            part = h.b.mul(dots[i], scale)
            totals[i] = part if totals[i] is None else h.b.add(totals[i], part)
    corr = h.b.bitcast(h.vload(2, at(_CORR[kind]), _V64B), _V16I)
    return [h.b.sub(t, corr) for t in totals]


# Argument layout of the tile intrinsics (one tile block: 16 weight rows x 256 weights, R activation rows):
#   0 acc f32 [R * 16]   1 accm f32 [R * 16]   2 tiles uint8 (any shape: flat offsets)   3 to (the block's byte)
#   4 q (int8 activations; Q6_K: uint8, + 128; flat)   5 qo (row 0's block start)   6 q_stride
#   7 sums16 int16 (the Q8_K 32-element sums, flat)   8 so (row 0's block start)   9 s_stride
#   10 d f32 (the activations' block scales, flat)   11 do (row 0's)   12 d_stride
def _tile_block(kind, rows, ggml_avx2=False):
    """ggml_avx2: llama.cpp's own AVX2 tiled epilogue instead (ggml-cpu/tiled/tiled-kernel.cpp, what llama-numerics
    takes from 8 rows): per block r = d_r * f32(T), r = fma(-dmin_r, f32(M), r), acc = fma(r, d_i, acc); accm
    stays 0."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        at = lambda extra: h.b.add(h.ptrs[3], ir.Constant(_I64, extra))
        row = lambda base, stride, i: h.b.add(h.ptrs[base], h.b.mul(h.ptrs[stride], ir.Constant(_I64, i)))
        x_at = lambda i, extra: h.b.add(row(5, 6, i), ir.Constant(_I64, extra))
        if kind == 4:
            totals = _q2_k_dots(h, rows, at, x_at)
        elif kind >= 2:
            totals = _q6_k_dots(h, kind, rows, at, x_at)
        else:
            totals = _k_dots(h, kind, rows, at, x_at)
        d = h.b.bitcast(h.vload(2, at(_D[kind]), _V64B), _V16F)
        row_d = [h.splat(h.b.load(h.b.gep(h.ptrs[10], [row(11, 12, i)])), _V16F) for i in range(rows)]
        if ggml_avx2:
            _ggml_epilogue(h, kind, rows, at, row, d, row_d, totals)
            return context.get_dummy_value()
        for i in range(rows):
            _fma_row(h, 0, 16 * i, h.b.fmul(row_d[i], d), totals[i])
        if kind in (2, 3):
            return context.get_dummy_value()
        dmin = h.b.bitcast(h.vload(2, at(_DMIN[kind]), _V64B), _V16F)
        mins = _block_mins(h, kind, rows, at, row)
        for i in range(rows):
            _fma_row(h, 1, 16 * i, h.b.fmul(row_d[i], dmin), mins[i])
        return context.get_dummy_value()
    return codegen


def _block_mins(h, kind, rows, at, row):
    """Per activation row the <16 x i32> M of the module docstring (Q4_K, Q5_K, Q2_K)."""
    mins = [None] * rows
    for c in range(_MIN_PAIRS[kind]):  # arg 7: the 32-element sums (Q4_K/Q5_K), the 16-element ones (Q2_K)
        min_pairs = h.b.bitcast(h.vload(2, at(_MN[kind] + 64 * c), _V64B), _V32S)
        for i in range(rows):
            sums = h.b.bitcast(_splat_i32(h, 7, h.b.add(row(8, 9, i), ir.Constant(_I64, 2 * c))), _V32S)
            m = _madd_pairs(h, min_pairs, sums)
            mins[i] = m if mins[i] is None else h.b.add(mins[i], m)
    return mins


def _ggml_epilogue(h, kind, rows, at, row, d, row_d, totals):
    fn = cgutils.get_or_insert_function(h.b.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    mins = None
    if kind not in (2, 3):
        dmin = h.b.bitcast(h.vload(2, at(_DMIN[kind]), _V64B), _V16F)
        neg_dmin = h.b.fsub(ir.Constant(_V16F, [-0.0] * 16), dmin)
        mins = _block_mins(h, kind, rows, at, row)
    for i in range(rows):
        r = h.b.fmul(d, h.b.sitofp(totals[i], _V16F))
        if mins is not None:
            r = h.b.call(fn, [neg_dmin, h.b.sitofp(mins[i], _V16F), r])
        p = h.b.bitcast(h.b.gep(h.ptrs[0], [ir.Constant(_I64, 16 * i)]), _V16F.as_pointer())
        h.b.store(h.b.call(fn, [r, row_d[i], h.b.load(p, align=4)]), p, align=4)


def _tile_intrinsic(kind, rows, ggml_avx2=False):
    @intrinsic
    def tile_block(typingctx, acc, accm, tiles, to, q, qo, q_stride, sums16, so, s_stride, d, do, d_stride):
        sig = types.void(acc, accm, tiles, to, q, qo, q_stride, sums16, so, s_stride, d, do, d_stride)
        return sig, _tile_block(kind, rows, ggml_avx2)
    return tile_block


_q4_k_rows, _q4_k_one = _tile_intrinsic(0, ROWS), _tile_intrinsic(0, 1)
_q5_k_rows, _q5_k_one = _tile_intrinsic(1, ROWS), _tile_intrinsic(1, 1)
_q6_k_rows, _q6_k_one = _tile_intrinsic(2, ROWS), _tile_intrinsic(2, 1)
_iq4_xs_rows, _iq4_xs_one = _tile_intrinsic(3, ROWS), _tile_intrinsic(3, 1)
_q2_k_rows, _q2_k_one = _tile_intrinsic(4, ROWS), _tile_intrinsic(4, 1)


# The 32-element kinds' intrinsic (one tile x R activation rows, all of the row's blocks in one call, the block
# loop inside so the accumulators stay in registers; the Q6_K scheme with one implicit scale of 1 per block):
#   0 acc f32 [R * 16]   1 tiles uint8 (flat offsets)   2 to (block 0's byte)   3 u uint8 (Q8_0 activations + 128;
#   kind 7: Q8_1's, signed)   4 qo (row 0's start)   5 q_stride   6 d f32 (the activations' block scales, flat)
#   7 do (row 0's block 0)   8 d_stride   9 nb (blocks)   10 s f32 (kind 7: Q8_1's block sums d * sum(q), as d)
def _b32_tiles(kind, rows):
    """Per block: T = sum((x + 128) * w) - 128 * sum(w) = sum(x * w) exact, acc = fma(f32(d_x * d_w), f32(T), acc);
    kind 7 (unsigned weights, signed activations): T = sum(x * w), then acc = fma(m_w, s_x, acc) too."""
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        b = h.b
        const = lambda v: ir.Constant(_I64, v)
        fma = cgutils.get_or_insert_function(b.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
        acc_at = lambda i: b.bitcast(b.gep(h.ptrs[0], [const(16 * i)]), _V16F.as_pointer())
        accs = []
        for i in range(rows):
            slot = cgutils.alloca_once(b, _V16F)
            b.store(b.load(acc_at(i), align=4), slot)
            accs.append(slot)
        zero = ir.Constant(_V16I, [0] * 16)
        with cgutils.for_range(b, h.ptrs[9]) as loop:
            k = loop.index
            tb = b.add(h.ptrs[2], b.mul(k, const(TILE_BLOCK[kind])))
            xo = [b.add(b.add(h.ptrs[4], b.mul(h.ptrs[5], const(i))), b.mul(k, const(32))) for i in range(rows)]
            dots = [zero] * rows
            for g in range(8):
                w = h.vload(1, b.add(tb, const(_QS + 64 * g)), _V64B)
                for i in range(rows):
                    x = _splat_i32(h, 3, b.add(xo[i], const(4 * g)))
                    dots[i] = (_dpbusd(h, dots[i], w, x) if kind == 7 else
                               _dpbusd(h, dots[i], x, w, wide=kind == 6))
            dw = b.bitcast(h.vload(1, b.add(tb, const(_D[kind])), _V64B), _V16F)
            if kind == 7:
                mw = b.bitcast(h.vload(1, b.add(tb, const(_DMIN[kind])), _V64B), _V16F)
            else:
                corr = b.bitcast(h.vload(1, b.add(tb, const(_CORR[kind])), _V64B), _V16I)
                dots = [b.sub(dot, corr) for dot in dots]
            for i in range(rows):
                at = b.add(b.add(h.ptrs[7], b.mul(h.ptrs[8], const(i))), k)
                scale = b.fmul(h.splat(b.load(b.gep(h.ptrs[6], [at])), _V16F), dw)
                acc = b.call(fma, [scale, b.sitofp(dots[i], _V16F), b.load(accs[i])])
                if kind == 7:
                    acc = b.call(fma, [mw, h.splat(b.load(b.gep(h.ptrs[10], [at])), _V16F), acc])
                b.store(acc, accs[i])
        for i in range(rows):
            b.store(b.load(accs[i]), acc_at(i), align=4)
        return context.get_dummy_value()
    return codegen


def _b32_intrinsic(kind, rows):
    @intrinsic
    def b32_tile(typingctx, acc, tiles, to, u, qo, q_stride, d, do, d_stride, nb, s):
        return types.void(acc, tiles, to, u, qo, q_stride, d, do, d_stride, nb, s), _b32_tiles(kind, rows)
    return b32_tile


_b32_rows, _b32_one = _b32_intrinsic(5, ROWS), _b32_intrinsic(5, 1)
_q8_0_rows, _q8_0_one = _b32_intrinsic(6, ROWS), _b32_intrinsic(6, 1)
_b32m_rows, _b32m_one = _b32_intrinsic(7, ROWS), _b32_intrinsic(7, 1)


@njit(cache=True, nogil=True)
def _gemm_b32(kind, tiles, u, d, s, out, t0, t1):
    """out[:, 16 t0: 16 t1] for the tiles t0..t1 of a 32-element kind against Q8_0 activations u (+ 128,
    unsigned) / d, or (kind 7) Q8_1's signed ones / d / s: ROWS rows per call, the rest one by one, each output
    the same arithmetic."""
    m, n = u.shape
    nb, block = n // 32, TILE_BLOCK[kind]
    acc, accm = np.empty(ROWS * TILE_ROWS, np.float32), np.zeros(ROWS * TILE_ROWS, np.float32)
    i = 0
    while i < m:
        rows = ROWS if i + ROWS <= m else 1
        for t in range(t0, t1):
            acc[:] = 0.0
            to, qo, do = t * nb * block, i * n, i * nb
            if kind == 7 and rows == ROWS:
                _b32m_rows(acc, tiles, to, u, qo, n, d, do, nb, nb, s)
            elif kind == 7:
                _b32m_one(acc, tiles, to, u, qo, n, d, do, nb, nb, s)
            elif kind == 6 and rows == ROWS:
                _q8_0_rows(acc, tiles, to, u, qo, n, d, do, nb, nb, s)
            elif kind == 6:
                _q8_0_one(acc, tiles, to, u, qo, n, d, do, nb, nb, s)
            elif rows == ROWS:
                _b32_rows(acc, tiles, to, u, qo, n, d, do, nb, nb, s)
            else:
                _b32_one(acc, tiles, to, u, qo, n, d, do, nb, nb, s)
            for k in range(rows):
                _store_tile(out, acc, accm, i, k, t)
        i += rows


_ggml_kinds = tuple(_tile_intrinsic(kind, 1, ggml_avx2=True) for kind in range(5))
_g_q4_k, _g_q5_k, _g_q6_k, _g_iq4_xs, _g_q2_k = _ggml_kinds


@njit(cache=True, nogil=True)
def _gemm_tiles_ggml(kind, tiles, q, d, sums16, out, t0, t1):
    """_gemm_tiles with llama.cpp's AVX2 tiled epilogue (_tile_block's ggml_avx2), one activation row at a time."""
    m, n = q.shape
    nb, block = n // QK_K, TILE_BLOCK[kind]
    acc, accm = np.empty(TILE_ROWS, np.float32), np.zeros(TILE_ROWS, np.float32)
    for i in range(m):
        for t in range(t0, t1):
            acc[:] = 0.0
            for blk in range(nb):
                to, qo, so, do = (t * nb + blk) * block, i * n + blk * QK_K, i * (n // 32) + blk * 8, i * nb + blk
                if kind == 4:
                    _g_q2_k(acc, accm, tiles, to, q, qo, n, sums16, 2 * so, n // 16, d, do, nb)
                elif kind == 0:
                    _g_q4_k(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                elif kind == 1:
                    _g_q5_k(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                elif kind == 2:
                    _g_q6_k(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                else:
                    _g_iq4_xs(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
            _store_tile(out, acc, accm, i, 0, t)


@njit(cache=True, nogil=True, inline="always")
def _store_tile(out, acc, accm, i, k, t):
    """out[i + k, 16 t: 16 t + 16] = acc - accm of row k (rows past out's width dropped)."""
    n_out = out.shape[1]
    for lane in range(min(TILE_ROWS, n_out - t * TILE_ROWS)):
        out[i + k, t * TILE_ROWS + lane] = acc[TILE_ROWS * k + lane] - accm[TILE_ROWS * k + lane]


@njit(cache=True, nogil=True)
def _gemm_tiles(kind, tiles, q, d, sums16, out, t0, t1):
    """out[:, 16 t0: 16 t1] for the tiles t0..t1 of a kind-`kind` weight against Q8_K activations q (Q6_K: + 128,
    unsigned)/d/sums16 (i16 sums of 32 elements; Q2_K: of 16): ROWS rows per call, the rest one by one, each
    output the module docstring's arithmetic."""
    m, n = q.shape
    nb, block = n // QK_K, TILE_BLOCK[kind]
    acc, accm = np.empty(ROWS * TILE_ROWS, np.float32), np.empty(ROWS * TILE_ROWS, np.float32)
    i = 0
    while i < m:
        rows = ROWS if i + ROWS <= m else 1
        for t in range(t0, t1):
            acc[:] = 0.0
            accm[:] = 0.0
            for blk in range(nb):
                to, qo, so, do = (t * nb + blk) * block, i * n + blk * QK_K, i * (n // 32) + blk * 8, i * nb + blk
                if kind == 4 and rows == ROWS:
                    _q2_k_rows(acc, accm, tiles, to, q, qo, n, sums16, 2 * so, n // 16, d, do, nb)
                elif kind == 4:
                    _q2_k_one(acc, accm, tiles, to, q, qo, n, sums16, 2 * so, n // 16, d, do, nb)
                elif kind == 0 and rows == ROWS:
                    _q4_k_rows(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                elif kind == 0:
                    _q4_k_one(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                elif kind == 1 and rows == ROWS:
                    _q5_k_rows(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                elif kind == 1:
                    _q5_k_one(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                elif kind == 2 and rows == ROWS:
                    _q6_k_rows(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                elif kind == 2:
                    _q6_k_one(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                elif rows == ROWS:
                    _iq4_xs_rows(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                else:
                    _iq4_xs_one(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
            for k in range(rows):
                _store_tile(out, acc, accm, i, k, t)
        i += rows


def matmul_t_many(weights, x: np.ndarray, ggml_avx2: bool = False) -> list:
    """[x @ W.T for (qtype, raw, tiles) in weights] (K-quant rows and their `pack` tiles), x f32 [m, n] quantized
    to Q8_K once; each weight's tiles cut into pieces of PIECE_TILES that the threads take dynamically.
    ggml_avx2: llama.cpp's AVX2 tiled arithmetic (llama-numerics prompts of >= 8 rows) instead of this module's."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"qtile: x must be [m, n_cols], got shape {x.shape}")
    for qtype, raw, tiles in weights:
        if not supports(qtype, ggml_avx2):
            raise ValueError(f"qtile: no tiled kernel for ggml type {qtype}" + " (llama.cpp's)" * ggml_avx2)
        _check(int(qtype), raw, x.shape[1])
        kind = KINDS[int(qtype)]
        if tiles.shape != (-(-raw.shape[0] // TILE_ROWS), x.shape[1] // BLOCK_ELEMS[kind], TILE_BLOCK[kind]):
            raise ValueError(f"qtile: tiles of shape {tiles.shape} do not belong to rows {raw.shape} of type {qtype}")
    kinds = {KINDS[int(w[0])] for w in weights}
    q = d = sums16 = unsigned = bsums16 = u32 = d32 = q81 = d81 = s81 = None
    if kinds - set(B32_KINDS):  # the K-quants: Q8_K activations
        q, d, sums = quantize_activations(PARTNER[Q4_K], x)
        sums16 = sums.astype(np.int16)  # |a 32-element sum| <= 32 * 127: exact
    if kinds & {2, 3}:
        unsigned = q.view(np.uint8) ^ np.uint8(0x80)
    if 4 in kinds:  # Q2_K's mins read the 16-element sums
        bsums = np.empty((x.shape[0], x.shape[1] // 16), np.int32)
        _bsums(q, bsums)
        bsums16 = bsums.astype(np.int16)
    if kinds & {5, 6}:  # Q8_0/Q4_0/Q5_0: Q8_0 activations (llama.cpp's fp16 scales), + 128
        q32, d32, _ = quantize_activations(PARTNER[Q8_0], x)
        u32 = q32.view(np.uint8) ^ np.uint8(0x80)
    if 7 in kinds:  # Q4_1/Q5_1: Q8_1 activations (fp16 d and block sums s)
        q81, d81, s81 = quantize_activations(PARTNER[Q4_1], x)
        q81 = q81.view(np.uint8)
    outs, pieces = [], []
    for qtype, raw, tiles in weights:
        kind = KINDS[int(qtype)]
        out = np.empty((x.shape[0], raw.shape[0]), np.float32)
        pieces += [(kind, tiles, out, t0, min(tiles.shape[0], t0 + PIECE_TILES))
                   for t0 in range(0, tiles.shape[0], PIECE_TILES)]
        outs.append(out)

    def piece(i):
        kind, tiles, out, t0, t1 = pieces[i]
        if kind == 7:
            _gemm_b32(kind, tiles, q81, d81, s81, out, t0, t1)
            return
        if kind in B32_KINDS:
            _gemm_b32(kind, tiles, u32, d32, d32, out, t0, t1)
            return
        gemm = _gemm_tiles_ggml if ggml_avx2 else _gemm_tiles
        gemm(kind, tiles, unsigned if kind in (2, 3) else q, d, bsums16 if kind == 4 else sums16, out, t0, t1)

    run_dynamic(len(pieces), piece)
    return outs
