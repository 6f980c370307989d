"""Integer block dot products (pipeline/kernels/qint.py): bitwise equal to a numpy model of llama.cpp's arithmetic.

The model, written from ggml-cpu's x86 quants.c independently of the kernels: activations
quantized as quantize_row_q8_0 (AVX2) / quantize_row_q8_K_ref; per block, exact integer sums
in 8 lanes (lane k = elements 4k..4k+3 of each 32-chunk, times the sub-block scale), converted
to f32 and fused-multiply-added into 8 f32 accumulators (Q4_K's mins into 4 more), then
hsum_float_8's order. The FMA is emulated in long double (64-bit mantissa: the f32 product is
exact there, and a second rounding to f32 could only differ on a long-double midpoint, ~2^-40).
"""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, quants

from pipeline.kernels import qint
from pipeline.threads import numba_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "llm"))
from test_gguf_dequant import random_blocks  # noqa: E402

FORMATS = [QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q4_1, QT.Q5_1, QT.IQ4_NL, QT.IQ4_XS, QT.Q2_K,
           QT.Q3_K]
Q8_0_WEIGHTS = (QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.IQ4_NL)  # quantize x as Q8_0; Q4_1/Q5_1 as Q8_1; the rest as Q8_K
Q8_1_WEIGHTS = (QT.Q4_1, QT.Q5_1)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)
LD = np.longdouble


def f16(b, off):
    return np.ascontiguousarray(b[..., off:off + 2]).view(np.float16)[..., 0].astype(np.float32)


def ref_quantize_q8_0(x):
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int64)
    return q.reshape(x.shape), (amax / np.float32(127)).astype(np.float16).astype(np.float32)


def ref_quantize_q8_1(x):
    """quantize_row_q8_1 (AVX2): Q8_0's q and fp16 d, and s = fp16(d * sum q) with the unrounded f32 d."""
    q, d = ref_quantize_q8_0(x)
    unrounded = (np.abs(x.reshape(x.shape[0], -1, 32)).max(axis=-1) / np.float32(127)).astype(np.float32)
    total = q.reshape(x.shape[0], -1, 32).sum(axis=-1).astype(np.float32)
    return q, d, (unrounded * total).astype(np.float16).astype(np.float32)


def ref_quantize_q8_k(x):
    blocks = x.reshape(x.shape[0], -1, 256)
    first = np.abs(blocks).argmax(axis=-1)
    mx = np.take_along_axis(blocks, first[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = (np.float32(-127) / mx).astype(np.float32)
    q = np.minimum(127, np.rint(blocks * iscale[..., None])).astype(np.int64)
    d = (np.float32(1) / iscale).astype(np.float32)
    q[mx == 0], d[mx == 0] = 0, 0
    return q.reshape(x.shape), d


def _nibble_pairs(qs):
    """[..., 16] bytes -> [..., 32] nibbles: the low ones, then the high ones (every 32-weight block's order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def block_integers(qt, raw, n):
    """(w int64 [rows, n] the integer weights, scale int64 [rows, n] each weight's sub-block scale,
    d f32 [rows, blocks], extra): the bytes as ggml's reference dequantization reads them."""
    rows = raw.shape[0]
    ones = np.ones((rows, n), np.int64)
    if qt == QT.Q8_0:
        b = raw.reshape(rows, -1, 34)
        w = b[:, :, 2:].view(np.int8).astype(np.int64).reshape(rows, n)
        return w, ones, f16(b, 0), None
    if qt in (QT.Q4_0, QT.IQ4_NL):
        b = raw.reshape(rows, -1, 18)
        nib = _nibble_pairs(b[:, :, 2:].astype(np.int64))
        w = nib - 8 if qt == QT.Q4_0 else IQ4_VALUES[nib]
        return w.reshape(rows, n), ones, f16(b, 0), None
    if qt in (QT.Q5_0, QT.Q5_1):
        at = 2 if qt == QT.Q5_0 else 4  # qh's offset; the nibbles follow it
        b = raw.reshape(rows, -1, 22 if qt == QT.Q5_0 else 24)
        qs = b[:, :, at + 4:].astype(np.int64)
        bits = (np.ascontiguousarray(b[:, :, at:at + 4]).view("<u4").astype(np.int64) >> np.arange(32)) & 1  # qh
        w = _nibble_pairs(qs) | (bits << 4)
        if qt == QT.Q5_0:
            return (w - 16).reshape(rows, n), ones, f16(b, 0), None
        return w.reshape(rows, n), ones, f16(b, 0), f16(b, 2)
    if qt == QT.Q4_1:
        b = raw.reshape(rows, -1, 20)
        return _nibble_pairs(b[:, :, 4:].astype(np.int64)).reshape(rows, n), ones, f16(b, 0), f16(b, 2)
    if qt == QT.IQ4_XS:
        b = raw.reshape(rows, -1, 136)
        sh = np.ascontiguousarray(b[:, :, 2:4]).view("<u2")[..., 0].astype(np.int64)
        sl = b[:, :, 4:8].astype(np.int64)
        j = np.arange(8)
        s = (((sl[..., j // 2] >> (4 * (j % 2))) & 15) | (((sh[..., None] >> (2 * j)) & 3) << 4)) - 32
        w = IQ4_VALUES[_nibble_pairs(b[:, :, 8:].astype(np.int64).reshape(rows, -1, 8, 16))]
        return w.reshape(rows, n), np.repeat(s, 32, axis=-1).reshape(rows, n), f16(b, 0), None
    if qt in (QT.Q2_K, QT.Q3_K):  # the 2-bit fields: vector 4 * half + t holds bits 2t of the 32 bytes of half
        at = 16 if qt == QT.Q2_K else 32
        b = raw.reshape(rows, -1, 84 if qt == QT.Q2_K else 110)
        qs = b[:, :, at:at + 64].astype(np.int64).reshape(rows, -1, 2, 1, 32)
        low = ((qs >> (2 * np.arange(4))[:, None]) & 3).reshape(rows, -1, 256)
        if qt == QT.Q2_K:
            sc = b[:, :, :16].astype(np.int64)
            return (low.reshape(rows, n), np.repeat(sc & 15, 16, axis=-1).reshape(rows, n), f16(b, 80),
                    (f16(b, 82), sc >> 4))
        hmask = b[:, :, :32].astype(np.int64)
        hbit = ((hmask[:, :, None, :] >> np.arange(8)[:, None]) & 1).reshape(rows, -1, 256)
        sc = b[:, :, 96:108].astype(np.int64)
        g = np.arange(16)
        s = (((sc[..., g % 8] >> (4 * (g // 8))) & 15) | (((sc[..., 8 + g % 4] >> (2 * (g // 4))) & 3) << 4)) - 32
        return ((low - 4 * (1 - hbit)).reshape(rows, n), np.repeat(s, 16, axis=-1).reshape(rows, n), f16(b, 108),
                None)
    if qt in (QT.Q4_K, QT.Q5_K):
        b = raw.reshape(rows, -1, 144 if qt == QT.Q4_K else 176)
        sc = b[:, :, 4:16].astype(np.int64)
        s, m = np.empty(sc.shape[:2] + (8,), np.int64), np.empty(sc.shape[:2] + (8,), np.int64)
        s[..., :4], m[..., :4] = sc[..., 0:4] & 63, sc[..., 4:8] & 63
        s[..., 4:] = (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)
        m[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
        qs = b[:, :, 16 if qt == QT.Q4_K else 48:].astype(np.int64).reshape(rows, -1, 4, 32)
        w = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 8, 32)  # chunk c: low nibbles, then high
        if qt == QT.Q5_K:  # bit j of the 32 qh bytes is the fifth bit of sub-block j
            qh = b[:, :, 16:48].astype(np.int64)
            w = w | (((qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1) << 4)
        w = w.reshape(rows, n)
        return w, np.repeat(s, 32, axis=-1).reshape(rows, n), f16(b, 0), (f16(b, 2), m)
    b = raw.reshape(rows, -1, 210)  # Q6_K
    ql, qh = b[:, :, :128].astype(np.int64), b[:, :, 128:192].astype(np.int64)
    w = np.empty((rows, b.shape[1], 256), np.int64)
    for half in range(2):
        lo, hi = ql[..., 64 * half:64 * half + 64], qh[..., 32 * half:32 * half + 32]
        for t in range(4):
            w[..., 128 * half + 32 * t:128 * half + 32 * t + 32] = (
                ((lo[..., (t & 1) * 32:(t & 1) * 32 + 32] >> (4 * (t >> 1))) & 15) | (((hi >> (2 * t)) & 3) << 4))
    scales = b[:, :, 192:208].view(np.int8).astype(np.int64)
    return (w - 32).reshape(rows, n), np.repeat(scales, 16, axis=-1).reshape(rows, n), f16(b, 208), None


def fma32(a, b, c):
    return (LD(a) * LD(b) + LD(c)).astype(np.float32)


def hsum8(acc):
    """hsum_float_8 over [rows, 8]: high half + low half, then (0 + 2) + (1 + 3)."""
    r = acc[:, 4:] + acc[:, :4]
    return (r[:, 0] + r[:, 2]) + (r[:, 1] + r[:, 3])


def reference(qt, raw, x):
    n = x.shape[1]
    ys = None
    if qt in Q8_1_WEIGHTS:
        q, yd, ys = ref_quantize_q8_1(x)
    else:
        q, yd = (ref_quantize_q8_0 if qt in Q8_0_WEIGHTS else ref_quantize_q8_k)(x)
    w, scale, wd, extra = block_integers(qt, raw, n)
    block = 32 if qt in Q8_0_WEIGHTS + Q8_1_WEIGHTS else 256
    rows, blocks = raw.shape[0], n // block
    out = np.empty((x.shape[0], rows), np.float32)
    for i in range(x.shape[0]):
        if qt == QT.Q6_K:  # unsigned weights, and the -32 offset from 16-element sums (lane k: groups 2k, 2k+1)
            prod = ((w + 32) * scale * q[i]).reshape(rows, blocks, block // 32, 8, 4)
            bsums = q[i].reshape(blocks, 16, 16).sum(axis=-1)
            offset = 32 * (scale[:, ::16].reshape(rows, blocks, 16) * bsums).reshape(rows, blocks, 8, 2).sum(axis=-1)
            lanes = (prod.sum(axis=(2, 4)) - offset).astype(np.float32)
        else:
            prod = (w * scale * q[i]).reshape(rows, blocks, block // 32, 8, 4)
            lanes = prod.sum(axis=(2, 4)).astype(np.float32)   # [rows, blocks, 8], exact then sitofp
        d = (yd[i] * wd).astype(np.float32)                     # [rows, blocks]
        acc = np.zeros((rows, 8), np.float32)
        if qt == QT.IQ4_NL:  # block pairs into two accumulators, an odd last block as the scalar tail
            acc2 = np.zeros((rows, 8), np.float32)
            for blk in range(0, blocks - 1, 2):
                acc = fma32(d[:, blk, None], lanes[:, blk], acc)
                acc2 = fma32(d[:, blk + 1, None], lanes[:, blk + 1], acc2)
            total = hsum8((acc + acc2).astype(np.float32))
            if blocks % 2:
                total = fma32(d[:, -1], lanes[:, -1].sum(axis=-1), total)
            out[i] = total
            continue
        for blk in range(blocks):
            if qt == QT.Q2_K:  # the mins first: dmin * (m_2k * bsum_2k + m_2k+1 * bsum_2k+1) into lane k
                dmin, mins = extra
                bsums = q[i].reshape(-1, 16, 16).sum(axis=-1)     # [blocks, 16]
                pairs = (mins[:, blk] * bsums[blk]).reshape(rows, 8, 2).sum(axis=-1).astype(np.float32)
                acc = fma32((-yd[i, blk] * dmin[:, blk, None]).astype(np.float32), pairs, acc)
            acc = fma32(d[:, blk, None], lanes[:, blk], acc)
        total = hsum8(acc)
        if qt in Q8_1_WEIGHTS:  # summs = fma(m, s, summs) per block, added after the lanes' sum
            summs = np.zeros(rows, np.float32)
            for blk in range(blocks):
                summs = fma32(extra[:, blk], ys[i, blk], summs)
            total = total + summs
        elif qt == QT.Q5_K:  # Q5_K: dmin * (min . 32-sums) into one f32
            dmin, mins = extra
            sums = q[i].reshape(-1, 8, 32).sum(axis=-1)
            whole = (mins * sums).sum(axis=-1).astype(np.float32)  # [rows, blocks]
            dm = (-yd[i] * dmin).astype(np.float32)
            accm = np.zeros(rows, np.float32)
            for blk in range(blocks):
                accm = fma32(dm[:, blk], whole[:, blk], accm)
            total = total + accm
        elif qt == QT.Q4_K:  # Q4_K: dmin * (min . 32-sums) in 4 lanes of pairs of sub-blocks
            dmin, mins = extra
            sums = q[i].reshape(-1, 8, 32).sum(axis=-1)          # [blocks, 8]
            pairs = (mins * sums).reshape(rows, -1, 4, 2).sum(axis=-1).astype(np.float32)
            dm = (-yd[i] * dmin).astype(np.float32)
            accm = np.zeros((rows, 4), np.float32)
            for blk in range(blocks):
                accm = fma32(dm[:, blk, None], pairs[:, blk], accm)
            total = total + ((accm[:, 0] + accm[:, 2]) + (accm[:, 1] + accm[:, 3]))
        out[i] = total
    return out


@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_integer_dot_bitwise_equals_llama_model(qt):
    n = 800 if qt == QT.IQ4_NL else 768  # IQ4_NL: 25 blocks, an odd last one (its scalar tail)
    raw = random_blocks(qt, 37, n, seed=3)
    x = np.random.default_rng(4).standard_normal((3, n)).astype(np.float32)
    x[1, :256] *= 1e-3  # a quiet block (tiny Q8_0 scales, some subnormal in fp16)
    got = qint.matmul_t_many([(int(qt), raw)], x)[0]
    np.testing.assert_array_equal(got.view(np.uint32), reference(qt, raw, x).view(np.uint32))
    # and it is x @ W.T up to the activations' 8-bit rounding: |error| <= sum_k |w_k| * d_k / 2 (Q8_1's fp16
    # block sums add |m| * |s| * 2^-11 per block)
    w = quants.dequantize(raw, qt).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    block = 32 if qt in Q8_0_WEIGHTS + Q8_1_WEIGHTS else 256
    half_step = np.abs(x).reshape(3, -1, block).max(axis=-1) / 127 / 2 * 1.01  # per activation block
    bound = np.abs(w).reshape(37, -1, block).sum(axis=-1) @ half_step.T
    if qt in Q8_1_WEIGHTS:
        _, _, s = ref_quantize_q8_1(x)
        bound = bound + np.abs(block_integers(qt, raw, n)[3]) @ np.abs(s).T * 2.0 ** -10
    assert (np.abs(got - exact) <= bound.T + 1e-4 * np.abs(exact).max()).all()


def test_quantizers_match_the_parity_roundtrip():
    """Q8_K: q * d is what FrozenWeight.llama_numerics has fed the f32 path so far."""
    from pipeline.llm.quants import llama_activation_roundtrip
    x = np.random.default_rng(1).standard_normal((2, 512)).astype(np.float32)
    q, d, sums = qint.quantize_activations(qint.Q8_K_PARTNER, x)
    back = (q.reshape(2, -1, 256) * d[..., None]).astype(np.float32).reshape(2, 512)
    np.testing.assert_array_equal(back, llama_activation_roundtrip(QT.Q4_K, x))
    np.testing.assert_array_equal(sums, q.reshape(2, -1, 32).sum(axis=-1, dtype=np.int64))
    q0, d0, _ = qint.quantize_activations(qint.Q8_0_PARTNER, x)
    rq, rd = ref_quantize_q8_0(x)
    np.testing.assert_array_equal(q0, rq)
    np.testing.assert_array_equal(d0, rd)


def test_q8_k_keeps_the_first_largest_magnitude_and_skips_nans():
    """The Q8_K quantizer finds a block's largest magnitude as an integer max over the sign-cleared bits, then the
    first x of it: as ggml's scan, whose sign decides the scale. Blocks: a magnitude tie (-3 before +3 and +3
    before -3), -0.0 with zeros, all zeros, an infinity, and NaNs (ggml's scan never takes one, so those blocks
    keep the scan)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 7 * 256)).astype(np.float32)
    blocks = x.reshape(2, 7, 256)
    blocks[0, 0, 10], blocks[0, 0, 200] = -3.0, 3.0
    blocks[0, 1, 10], blocks[0, 1, 200] = 3.0, -3.0
    blocks[0, 2] = 0.0
    blocks[0, 2, 5] = -0.0
    blocks[0, 3, :] = 0.0
    blocks[1, 0, 7] = np.inf
    blocks[1, 1, 9] = np.nan
    blocks[1, 2, 255] = np.nan
    q, d, sums = qint.quantize_activations(qint.Q8_K_PARTNER, x)
    finite = np.isfinite(blocks).all(axis=-1)
    with np.errstate(all="ignore"):  # numpy's argmax would take the NaN: the reference sees it as 0
        rq, rd = ref_quantize_q8_k(np.where(np.isnan(x), np.float32(0), x))
    np.testing.assert_array_equal(d[finite], rd[finite])
    np.testing.assert_array_equal(q.reshape(2, 7, 256)[finite], rq.reshape(2, 7, 256)[finite])
    assert d[0, 0] < 0 < d[0, 1]  # the first of the tied magnitudes set the sign
    assert (q.reshape(2, 7, 256)[0, 2:4] == 0).all() and (d[0, 2:4] == 0).all()
    for blk in (1, 2):  # a NaN block: scaled by its largest finite magnitude, as ggml's scan does
        nan_free = np.where(np.isnan(blocks[1, blk]), np.float32(0), blocks[1, blk])
        assert d[1, blk] == rd[1, blk] and abs(d[1, blk]) == np.float32(1) / (np.float32(127) / np.abs(nan_free).max())
    assert d[1, 0] == -np.inf  # +inf: iscale -0, d = 1 / -0 (the q of a non-finite block are ggml's garbage too)
    np.testing.assert_array_equal(sums.reshape(2, 7, 8)[finite], q.reshape(2, 7, 8, 32)[finite].sum(-1, dtype=np.int64))


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q8_0, QT.Q4_1, QT.Q2_K, QT.IQ4_NL], ids=lambda q: q.name)
def test_thread_count_does_not_change_bits(qt):
    """Also the formats reading Q8_1's block sums (Q4_1), Q8_K's bsums (Q2_K) and IQ4_NL's two accumulators."""
    raw = random_blocks(qt, 100, 512, seed=5)
    x = np.random.default_rng(6).standard_normal((5, 512)).astype(np.float32)
    outs = []
    for n in (1, 2):
        with numba_threads(n):
            outs.append(qint.matmul_t_many([(int(qt), raw), (int(qt), raw[:40])], x))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    np.testing.assert_array_equal(outs[0][1], outs[0][0][:, :40])  # a row's bits do not depend on the cut


def test_bad_shapes_are_refused():
    raw = random_blocks(QT.Q4_K, 4, 512)
    with pytest.raises(ValueError, match="row of 256 elements"):
        qint.matmul_t_many([(int(QT.Q4_K), raw)], np.zeros((1, 256), np.float32))
    with pytest.raises(ValueError, match="no integer kernel"):  # F16: no integer dot (llama.cpp's is f16 too)
        qint.matmul_t_many([(int(QT.F16), np.zeros((4, 512), np.float16))], np.zeros((1, 512), np.float32))


def test_frozen_weight_takes_the_integer_path_only_without_gradients():
    from pipeline.kernels import dequant, qgemm
    from pipeline.autograd import no_grad
    from pipeline.llm.quants import FORMATS, FrozenWeight, matmul_t_many
    raw = random_blocks(QT.Q4_K, 48, 256, seed=9)
    fw = FrozenWeight(FORMATS[QT.Q4_K], raw, (48, 256), "w")
    assert fw.integer_dot  # the default
    x = np.random.default_rng(10).standard_normal((3, 256)).astype(np.float32)  # decode-sized
    integer = qint.matmul_t_many([(int(QT.Q4_K), raw)], x)[0]
    f32 = dequant.matvec_rows(int(QT.Q4_K), raw, x)  # the fused f32 decode kernel
    assert not np.array_equal(integer, f32)  # the two paths are distinguishable
    np.testing.assert_array_equal(fw.matmul_t(x), f32)  # gradients on (training): f32 activations
    with no_grad():
        np.testing.assert_array_equal(fw.matmul_t(x), integer)
        np.testing.assert_array_equal(matmul_t_many([fw, fw], x)[1], integer)
        many = np.repeat(x, 3, axis=0)  # prefill-sized: a K-quant takes the blocked integer GEMM, same bits
        np.testing.assert_array_equal(fw.matmul_t(many), np.repeat(integer, 3, axis=0))
        np.testing.assert_array_equal(matmul_t_many([fw, fw], many)[0], np.repeat(integer, 3, axis=0))
        q8 = FrozenWeight(FORMATS[QT.Q8_0], random_blocks(QT.Q8_0, 48, 256, seed=9), (48, 256), "q8")
        assert q8.uses_integer_dot(4) and not q8.uses_integer_dot(9)  # f32_prompt: the f32 GEMM for a prompt
        fw.integer_dot = False
        np.testing.assert_array_equal(fw.matmul_t(many), qgemm.matmul_t(int(QT.Q4_K), raw, many, (48, 256)))
        fw.llama_numerics = True  # vec_dot's bits below 8 rows, llama.cpp's tiled AVX2 GEMM's from 8 (9 here)
        np.testing.assert_array_equal(fw.matmul_t(many[:7]), np.repeat(integer, 3, axis=0)[:7])
        from pipeline.kernels import qtile
        np.testing.assert_array_equal(fw.matmul_t(many), qtile.matmul_t_many([(int(QT.Q4_K), raw, fw.tiles())],
                                                                              many, ggml_avx2=True)[0])
        fw.llama_numerics = False
        np.testing.assert_array_equal(fw.matmul_t(x), f32)
    np.testing.assert_array_equal(FrozenWeight(FORMATS[QT.Q4_K], raw, (48, 256)).matmul_t(many),
                                  qgemm.matmul_t(int(QT.Q4_K), raw, many, (48, 256)))  # gradients on: f32


def _target_without(cpu, prefixes):
    """numba's target as CPU `cpu` with the host's features minus those named with `prefixes`, for a host that
    can run it."""
    import llvmlite.binding as llvm
    features = llvm.get_host_cpu_features()
    for name in list(features):
        if name.startswith(prefixes):
            features[name] = False
    return {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features.flatten()}


# isa -> (numba's target CPU, host features it leaves out, the host feature it needs)
_TARGETS = {"avxvnni": ("alderlake", ("avx512", "amx", "evex512"), "avxvnni"),  # AVX-VNNI without AVX-512
            "avx512bw": ("skylake-avx512", ("avx512vnni", "avx512bf16", "avx512fp16", "avx512vbmi", "avx512bitalg",
                                            "avx512vpopcntdq", "avx512ifma", "amx", "avxvnni", "gfni"), "avx512bw"),
            "haswell": ("haswell", ("avx512", "amx", "evex512", "avxvnni", "avxifma", "avxneconvert", "vpclmul",
                                    "gfni", "vaes", "sha", "avx10"), "avx2")}  # AVX2 alone: 16 vector registers


@pytest.mark.slow
@pytest.mark.parametrize("isa, probe, expected", [
    ("portable", "from pipeline.kernels import qblocks; print(qblocks.AVX2)", "False"),
    ("avx2", "from pipeline.kernels import qint_gemm; print(qint_gemm.ROWS, qint_gemm.VNNI)", "4 False"),
    ("avxvnni", "from pipeline.kernels import qint_gemm; print(qint_gemm.ROWS, qint_gemm.VNNI, qint_gemm._EVEX_VNNI)",
     "4 True False"),
    ("avx512bw", "from pipeline.kernels import qtile; print(qtile.ROWS, qtile.VNNI512, qtile._BW)", "4 False True"),
    ("haswell", "from pipeline.kernels import qtile, qint_gemm; print(qtile.ROWS, qtile.VNNI512, qint_gemm.ROWS)",
     "2 False 4")])
def test_portable_ir_and_the_4_row_gemm_give_the_same_bits(tmp_path, isa, probe, expected):
    """Every ISA path of the integer kernels against the same numpy models, in a fresh process with its own
    numba cache (no code compiled for the default target is reused): the portable IR (non-AVX2 targets; forced
    by FUCINA_INTEGER_ISA=portable); AVX2 alone (FUCINA_INTEGER_ISA=avx2: the blocked GEMM's 4-row layout, the
    tiled GEMM's vpmaddubsw path); AVX-VNNI without AVX-512 (the VEX vpdpwssd), AVX512-BW without VNNI (the
    tiled GEMM's 512-bit vpmaddubsw) and Haswell's AVX2 (16 vector registers: the tiled GEMM's 2-row calls),
    each by numba targeting such a CPU on a host that can run it. A path this host's default build already
    takes (the probe prints the same without a target) is the default suite's, not compiled again here."""
    import os
    import subprocess
    import llvmlite.binding as llvm
    from pipeline.kernels.qblocks import AVX2
    if isa != "portable" and not AVX2:
        pytest.skip("no AVX2 here")
    if isa in _TARGETS and not llvm.get_host_cpu_features().get(_TARGETS[isa][2], False):
        pytest.skip(f"no {_TARGETS[isa][2]} here")
    native = {k: v for k, v in os.environ.items() if k not in ("FUCINA_INTEGER_ISA", "NUMBA_CPU_NAME",
                                                                "NUMBA_CPU_FEATURES")}
    if subprocess.run([sys.executable, "-c", probe], env=native, capture_output=True, text=True,
                      check=True).stdout.strip() == expected:  # e.g. avx2 and haswell on an AVX2-only host
        pytest.skip(f"this host's own build takes the {isa} path: the default suite's bitwise tests run it")
    target = _target_without(*_TARGETS[isa][:2]) if isa in _TARGETS else {"FUCINA_INTEGER_ISA": isa}
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), **target)
    seen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert seen.stdout.strip() == expected
    blocked, tiled = (str(Path(__file__).with_name(f"test_{m}.py")) for m in ("qint_gemm", "qtile"))  # shared IR
    args = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, blocked, tiled,
            "-k", "bitwise_equals or thread_count"]  # one process: xdist's workers would each compile cold
    run = subprocess.run(args, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]  # every selected test ran and passed: none skipped, failed or erred
    ran = re.fullmatch(r"(\d+) passed(, \d+ deselected)? in .*", last)
    assert ran and int(ran.group(1)) >= 32, run.stdout[-500:]


def test_fp16_rounding_of_the_q8_0_scales_is_numpys():
    """The Q8_0 activation scales are rounded to fp16 inside numba (pipeline/kernels/quantize._f32_to_f16_bits;
    numba has no fp16): bit for bit numpy's float16 rounding over a sweep of f32 bit patterns (normal, fp16-subnormal,
    overflowing) and ties."""
    from numba import njit

    from pipeline.kernels.quantize import _f32_to_f16_bits

    @njit
    def rounded(values, out):
        for i in range(values.shape[0]):
            out[i] = _f32_to_f16_bits(values[i])

    sweep = np.arange(0x30000000, 0x48000000, 4093, dtype=np.uint32).view(np.float32)
    ties = (np.arange(1, 2048, dtype=np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)  # subnormal halves
    special = np.float32([0.0, 65504.0, 65519.0, 65520.0, 1e9, np.inf, 2.0 ** -25, 2.0 ** -24, 6.1e-5])
    values = np.concatenate([sweep, ties, special])
    got = np.empty(len(values), np.int64)
    rounded(values, got)
    with np.errstate(over="ignore"):
        want = values.astype(np.float16).view(np.uint16).astype(np.int64)
    np.testing.assert_array_equal(got, want)


def test_a_kept_product_gives_the_one_off_bits_and_follows_its_weights():
    """pipeline.llm.quants.integer_product keeps one qint.Product per weight group: it gives matmul_t_many's
    bits call after call (Q8_0 and Q8_K partners in one group), and a weight whose raw array is replaced gets a
    new product rather than the old addresses."""
    from pipeline.llm.quants import FORMATS, FrozenWeight, integer_product
    raws = [random_blocks(QT.Q4_K, 40, 512, seed=11), random_blocks(QT.Q8_0, 24, 512, seed=12)]
    weights = [FrozenWeight(FORMATS[qt], raw, (len(raw), 512)) for qt, raw in zip((QT.Q4_K, QT.Q8_0), raws)]
    x = np.random.default_rng(13).standard_normal((2, 512)).astype(np.float32)
    want = qint.matmul_t_many([(int(QT.Q4_K), raws[0]), (int(QT.Q8_0), raws[1])], x)
    product = integer_product(weights)
    for _ in range(2):
        for a, b in zip(product(x), want):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert integer_product(weights) is product
    weights[1].raw = random_blocks(QT.Q8_0, 24, 512, seed=14)
    renewed = integer_product(weights)
    assert renewed is not product
    np.testing.assert_array_equal(renewed(x)[1], qint.matmul_t_many([(int(QT.Q8_0), weights[1].raw)], x)[0])


@pytest.mark.parametrize("group", [(QT.Q4_K, QT.Q6_K), (QT.Q5_0, QT.Q8_0), (QT.Q4_1, QT.Q8_0, QT.IQ4_XS)],
                         ids=lambda g: "+".join(q.name for q in g))
def test_a_product_runs_on_its_formats_runner_with_each_weights_bits(group):
    """A product runs on the runner of its set of formats (one per set, whatever the order), and each weight's
    rows are the bits of that weight's product alone."""
    want = qint.runner_of(sorted(group, reverse=True))
    assert qint.runner_of(group) is want and qint.runner_of(group[:1]) is not want
    raws = [random_blocks(q, 33, 512, seed=7 + i) for i, q in enumerate(group)]
    x = np.random.default_rng(8).standard_normal((2, 512)).astype(np.float32)
    product = qint.Product([(int(q), r) for q, r in zip(group, raws)], 512)
    assert product.runner is want
    for (q, r), got in zip(zip(group, raws), product(x)):
        np.testing.assert_array_equal(got.view(np.uint32), qint.matmul_t_many([(int(q), r)], x)[0].view(np.uint32))


_COMPILED_KERNELS = """
import numpy as np
from numba.core import event
names = []
class Listen(event.Listener):
    def on_start(self, ev):
        names.append(ev.data["dispatcher"].py_func.__name__)
    def on_end(self, ev):
        pass
from pipeline.kernels import qint
from pipeline.kernels.formats import Q4_1, Q8_0
from gguf import GGMLQuantizationType as QT, quants
w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
raws = [quants.quantize(w, QT.Q4_1), quants.quantize(w, QT.Q8_0)]
event.register("numba:compile", Listen())
qint.matmul_t_many([(Q4_1, raws[0])], np.ones((1, 256), np.float32))
qint.matmul_t_many([(Q4_1, raws[0]), (Q8_0, raws[1])], np.ones((1, 256), np.float32))
print(" ".join(sorted({n for n in names if n.startswith("_mm_")})))
"""


def test_a_product_compiles_only_its_own_formats_kernels(tmp_path):
    """The first product of a Q4_1 weight, then of Q4_1 + Q8_0, compiles those two row kernels and no other of
    the twelve (an empty numba cache, in a fresh process: what a fresh clone's first `generate` pays)."""
    import os
    import subprocess
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _COMPILED_KERNELS], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["_mm_q4_1", "_mm_q8_0"]
