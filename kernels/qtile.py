"""Tiled integer GEMM for prefill through Q4_K weights: 16 weight rows per vector lane set, x quantized to Q8_K.

Trade-off: kernels/qint_gemm.py keeps llama.cpp's vec_dot arithmetic (eight f32 lanes per output, each a sum
over sub-blocks of 4-element dot products scaled by the sub-block's scale), which costs two scaling
instructions per 32 weights and activation row whatever the layout. Here the weights are repacked once, at
first use, into tiles of 16 rows (TILE_ROWS) so that one 512-bit vpdpbusd multiplies 4 weights of each of the
16 rows by 4 broadcast activation bytes; a sub-block's 8 such steps leave the 16 rows' exact 32-element dot
products, scaled once per sub-block (vpmulld), and each block adds one f32 fused multiply-add per output: about
half the instructions per multiply-add (docs/models.md has the measured figures). The price is a different
f32 rounding from vec_dot (llama.cpp's own tiled prefill GEMM differs from its vec_dot the same way), so this
arithmetic is its own, defined below and pinned bitwise by a float64 model in tests/kernels/test_qtile.py:

    for each output (activation row i, weight row r), over the row's Q4_K blocks b:
        T = sum_j s_j * (w_j . q_j)      exact integers: sub-block j's 6-bit scale, 32 weights, 32 Q8_K values
        M = sum_j m_j * bsum_j           exact: sub-block j's 6-bit min, the sum of its 32 Q8_K values
        acc  = fma(f32(d_i * d_r),    f32(T), acc)     d_i the activation block's scale, d_r the weight's d
        accm = fma(f32(d_i * dmin_r), f32(M), accm)    from 0, block by block
    out = acc - accm

Every output is computed by the same code whatever rows or tiles sit beside it (groups of ROWS activation rows,
the rest one at a time), so the bits do not depend on grouping, the cut into pieces or the thread count. The
same arithmetic compiles on every ISA (portable IR where VNNI / AVX512-BW are missing): the same bits on any
x86 or other CPU. The tiles are 2560 bytes per 16 rows and block (Q4_K's 2304 plus the unpacked scales and
the mins as i16 pairs), kept beside the original rows (the decode kernels read those).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .dequant import HALF_TO_FLOAT, Q4_K, _check
from .qblocks import AVX2, _F32, _I8, _I32, _I64, _IR, _V8I, _V16S, _target_has, _x86
from .qint import PARTNER, quantize_activations
from .workpool import run_dynamic, split_range, threads as pool_threads

TILE_ROWS = 16  # weight rows per tile: the 16 i32 lanes of a 512-bit vector
VNNI512 = _target_has("avx512vnni", "avx512bw")
_BW = _target_has("avx512bw")
# activation rows per kernel call: 4 with 32 vector registers (a C prototype on a Xeon with AVX512-VNNI: 2, 4,
# 6, 8 rows gave 135, 173, 162, 141 G multiply-adds per second), 2 where a 512-bit value takes two of 16
ROWS = 4 if _target_has("avx512f") else 2
PIECE_TILES = 8  # tiles per piece (128 weight rows: ~320 KB of tiles per 1024 inputs, an L2's share)
# byte offsets inside one tile block (16 rows x 256 weights)
_QS, _SC, _MN, _D, _DMIN, TILE_BLOCK = 0, 2048, 2176, 2432, 2496, 2560
_V64B, _V16I, _V16F = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
_V32S, _V64I = ir.VectorType(ir.IntType(16), 32), ir.VectorType(_I32, 64)


@njit(cache=True, nogil=True)
def _pack_rows(raw, lut, out, t0, t1):
    """Tiles t0..t1 of pack_q4_k (raw rows past its end pack as zeros)."""
    n_out, nb = raw.shape[0], raw.shape[1] // 144
    for t in range(t0, t1):
        for lane in range(TILE_ROWS):
            r = t * TILE_ROWS + lane
            for blk in range(nb):
                tb = out[t, blk]
                if r >= n_out:
                    for c in range(4):
                        for g in range(8):
                            for k in range(4):
                                tb[_QS + 64 * (8 * c + g) + 4 * lane + k] = 0
                    for j in range(8):
                        tb[_SC + 16 * j + lane] = 0
                    for k in range(4 * lane, 4 * lane + 4):
                        for c in range(4):
                            tb[_MN + 64 * c + k] = 0
                        tb[_D + k], tb[_DMIN + k] = 0, 0
                    continue
                o = blk * 144
                b = raw[r]
                for c in range(4):
                    for g in range(8):
                        for k in range(4):
                            tb[_QS + 64 * (8 * c + g) + 4 * lane + k] = b[o + 16 + 32 * c + 4 * g + k]
                for j in range(8):  # ggml's get_scale_min_k4
                    if j < 4:
                        sc, mn = b[o + 4 + j] & 63, b[o + 8 + j] & 63
                    else:
                        sc = (b[o + 8 + j] & 0xF) | ((b[o + j] >> 6) << 4)
                        mn = (b[o + 8 + j] >> 4) | ((b[o + 4 + j] >> 6) << 4)
                    tb[_SC + 16 * j + lane] = sc
                    at = _MN + 64 * (j // 2) + 4 * lane + 2 * (j % 2)  # i16 little-endian, < 64: high byte 0
                    tb[at], tb[at + 1] = mn, 0
                for field, base in ((0, _D), (2, _DMIN)):
                    bits = np.float32(lut[np.int64(b[o + field]) | (np.int64(b[o + field + 1]) << 8)])
                    word = np.array([bits]).view(np.uint8)
                    for k in range(4):
                        tb[base + 4 * lane + k] = word[k]


def pack_q4_k(raw) -> np.ndarray:
    """Q4_K rows uint8 [n_out, nb * 144] -> tiles uint8 [ceil(n_out / 16), nb, TILE_BLOCK]. Rows past n_out are
    zero (d = 0: their outputs are never stored). Per tile block: the 128 quant bytes of the 16 rows as
    [chunk c][group g][row][4 bytes] (low nibbles: sub-block 2c's weights 4g..4g+3, high: 2c+1's), the scales
    as uint8 [sub-block][row], the mins as i16 pairs [pair c][row](m_2c, m_2c+1), then d and dmin as f32 [row].
    A numba pass over the rows, tiles split over the threads (each tile written by one)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    _check(Q4_K, raw, raw.shape[1] // 144 * 256)
    tiles = -(-raw.shape[0] // TILE_ROWS)
    out = np.empty((tiles, raw.shape[1] // 144, TILE_BLOCK), np.uint8)
    split_range(tiles, pool_threads(), lambda t0, t1: _pack_rows(raw, HALF_TO_FLOAT, out, t0, t1))
    return out


def _splat_i32(h, arg, element_offset):
    """<16 x i32>: the 4 bytes of array argument `arg` at element offset, in every lane."""
    v = h.vload(arg, element_offset, _I32)
    return h.splat(v, _V16I)


def _dpbusd(h, acc, w, x):
    """acc + the 16 lanes' dot products of 4 unsigned weight bytes (w <64 x i8>, values < 16) with 4 signed
    activation bytes (x <16 x i32>): vpdpbusd with AVX512-VNNI; vpmaddubsw + vpmaddwd by ones with AVX512-BW
    or AVX2 (on 256-bit halves; a pair's sum 2 * 15 * 128 never saturates i16); else portable IR. The same
    exact sums on every path."""
    if VNNI512:
        return _x86(h, "llvm.x86.avx512.vpdpbusd.512", _V16I, acc, h.b.bitcast(w, _V16I), x)
    xb = h.b.bitcast(x, _V64B)
    if _BW:
        pairs = _x86(h, "llvm.x86.avx512.pmaddubs.w.512", _V32S, w, xb)
        return h.b.add(acc, _x86(h, "llvm.x86.avx512.pmaddw.d.512", _V16I, pairs, ir.Constant(_V32S, [1] * 32)))
    if AVX2:
        half = lambda v, k: h.b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                               ir.Constant(ir.VectorType(_I32, 32), list(range(32 * k, 32 * k + 32))))
        quads = [_x86(h, "llvm.x86.avx2.pmadd.wd", _V8I, _x86(h, "llvm.x86.avx2.pmadd.ub.sw", _V16S, half(w, k),
                                                               half(xb, k)), ir.Constant(_V16S, [1] * 16))
                 for k in range(2)]
        return h.b.add(acc, h.b.shuffle_vector(quads[0], quads[1], ir.Constant(_V16I, list(range(16)))))
    prod = h.b.mul(h.b.zext(w, _V64I), h.b.sext(xb, _V64I))
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


# Argument layout of the tile intrinsics (one tile block: 16 weight rows x 256 weights, R activation rows):
#   0 acc f32 [R * 16]   1 accm f32 [R * 16]   2 tiles uint8 (any shape: flat offsets)   3 to (the block's byte)
#   4 q int8 (activations, flat)   5 qo (row 0's block start)   6 q_stride
#   7 sums16 int16 (the Q8_K 32-element sums, flat)   8 so (row 0's block start)   9 s_stride
#   10 d f32 (the activations' block scales, flat)   11 do (row 0's)   12 d_stride
def _tile_block(rows):
    def codegen(context, builder, signature, args):
        h = _IR(context, builder, signature, args)
        at = lambda extra: h.b.add(h.ptrs[3], ir.Constant(_I64, extra))
        row = lambda base, stride, i: h.b.add(h.ptrs[base], h.b.mul(h.ptrs[stride], ir.Constant(_I64, i)))
        zero = ir.Constant(_V16I, [0] * 16)
        totals, mins = [None] * rows, [None] * rows
        for c in range(4):
            lo_dots, hi_dots = [zero] * rows, [zero] * rows
            for g in range(8):
                v = h.vload(2, at(_QS + 64 * (8 * c + g)), _V64B)
                lo, hi = h.bits(v, 0, 0xF), h.bits(v, 4, 0xF)
                for i in range(rows):
                    x0 = h.b.add(row(5, 6, i), ir.Constant(_I64, 64 * c + 4 * g))
                    lo_dots[i] = _dpbusd(h, lo_dots[i], lo, _splat_i32(h, 4, x0))
                    hi_dots[i] = _dpbusd(h, hi_dots[i], hi, _splat_i32(h, 4, h.b.add(x0, ir.Constant(_I64, 32))))
            s_lo, s_hi = (h.b.zext(h.vload(2, at(_SC + 16 * (2 * c + k)), ir.VectorType(_I8, 16)), _V16I)
                          for k in range(2))
            min_pairs = h.b.bitcast(h.vload(2, at(_MN + 64 * c), _V64B), _V32S)
            for i in range(rows):
                part = h.b.add(h.b.mul(lo_dots[i], s_lo), h.b.mul(hi_dots[i], s_hi))
                totals[i] = part if totals[i] is None else h.b.add(totals[i], part)
                sums = h.b.bitcast(_splat_i32(h, 7, h.b.add(row(8, 9, i), ir.Constant(_I64, 2 * c))), _V32S)
                m = _madd_pairs(h, min_pairs, sums)
                mins[i] = m if mins[i] is None else h.b.add(mins[i], m)
        d, dmin = (h.b.bitcast(h.vload(2, at(off), _V64B), _V16F) for off in (_D, _DMIN))
        for i in range(rows):
            di = h.splat(h.b.load(h.b.gep(h.ptrs[10], [row(11, 12, i)])), _V16F)
            _fma_row(h, 0, 16 * i, h.b.fmul(di, d), totals[i])
            _fma_row(h, 1, 16 * i, h.b.fmul(di, dmin), mins[i])
        return context.get_dummy_value()
    return codegen


def _tile_intrinsic(rows):
    @intrinsic
    def tile_block(typingctx, acc, accm, tiles, to, q, qo, q_stride, sums16, so, s_stride, d, do, d_stride):
        sig = types.void(acc, accm, tiles, to, q, qo, q_stride, sums16, so, s_stride, d, do, d_stride)
        return sig, _tile_block(rows)
    return tile_block


tile_block_rows, tile_block_one = _tile_intrinsic(ROWS), _tile_intrinsic(1)


@njit(cache=True, nogil=True, inline="always")
def _store_tile(out, acc, accm, i, k, t):
    """out[i + k, 16 t: 16 t + 16] = acc - accm of row k (rows past out's width dropped)."""
    n_out = out.shape[1]
    for lane in range(min(TILE_ROWS, n_out - t * TILE_ROWS)):
        out[i + k, t * TILE_ROWS + lane] = acc[TILE_ROWS * k + lane] - accm[TILE_ROWS * k + lane]


@njit(cache=True, nogil=True)
def _gemm_tiles(tiles, q, d, sums16, out, t0, t1):
    """out[:, 16 t0: 16 t1] for the tiles t0..t1 against Q8_K activations q/d/sums16: ROWS rows per call, the
    rest one by one, each output the module docstring's arithmetic."""
    m, n = q.shape
    nb = n // 256
    acc, accm = np.empty(ROWS * TILE_ROWS, np.float32), np.empty(ROWS * TILE_ROWS, np.float32)
    i = 0
    while i < m:
        rows = ROWS if i + ROWS <= m else 1
        for t in range(t0, t1):
            acc[:] = 0.0
            accm[:] = 0.0
            for blk in range(nb):
                to, qo, so, do = (t * nb + blk) * TILE_BLOCK, i * n + blk * 256, i * (n // 32) + blk * 8, i * nb + blk
                if rows == ROWS:
                    tile_block_rows(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
                else:
                    tile_block_one(acc, accm, tiles, to, q, qo, n, sums16, so, n // 32, d, do, nb)
            for k in range(rows):
                _store_tile(out, acc, accm, i, k, t)
        i += rows


def supports(qtype: int) -> bool:
    return int(qtype) == Q4_K


def matmul_t_many(weights, x: np.ndarray) -> list:
    """[x @ W.T for (raw, tiles) in weights] (Q4_K rows and their pack_q4_k tiles), x f32 [m, n] quantized to
    Q8_K once; each weight's tiles cut into pieces of PIECE_TILES that the threads take dynamically."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"qtile: x must be [m, n_cols], got shape {x.shape}")
    for raw, tiles in weights:
        _check(Q4_K, raw, x.shape[1])
        if tiles.shape != (-(-raw.shape[0] // TILE_ROWS), x.shape[1] // 256, TILE_BLOCK):
            raise ValueError(f"qtile: tiles of shape {tiles.shape} do not belong to Q4_K rows {raw.shape}")
    q, d, sums = quantize_activations(PARTNER[Q4_K], x)
    sums16 = sums.astype(np.int16)  # |a 32-element sum| <= 32 * 127: exact
    outs, pieces = [], []
    for raw, tiles in weights:
        out = np.empty((x.shape[0], raw.shape[0]), np.float32)
        pieces += [(tiles, out, t0, min(tiles.shape[0], t0 + PIECE_TILES))
                   for t0 in range(0, tiles.shape[0], PIECE_TILES)]
        outs.append(out)

    def piece(i):
        tiles, out, t0, t1 = pieces[i]
        _gemm_tiles(tiles, q, d, sums16, out, t0, t1)

    run_dynamic(len(pieces), piece)
    return outs
