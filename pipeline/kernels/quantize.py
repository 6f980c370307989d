"""ggml block quantizers (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and F16/BF16 rounding, byte-exact.

Trade-off: these encoders follow llama.cpp's *reference* quantizers (the path
`llama_model_quantize` takes when no importance matrix is given) operation for
operation, in float32, in the same order — not the fastest or the most accurate
encoders one could write, but the only way to get the SAME BYTES as llama.cpp,
so a file exported here is indistinguishable from one llama-quantize wrote.
Every arithmetic step is therefore pinned to float32 explicitly (numba would
otherwise widen `int * float32` to float64 and change the last bits).

Block layouts, sizes and scale offsets: the rows of pipeline/kernels/formats.py (their `layout` field).

Blocks are independent, so the parallel loop (a fixed grid of CHUNK blocks)
gives identical bytes for any thread count.
"""
import math

import numpy as np
from numba import njit, prange

from .formats import FORMATS, GEOMETRY, Q6_K, Q8_0

QK8_0 = 32
QK_K = 256
CHUNK = 64  # blocks per parallel work item (fixed: independent of thread count)

# encoder key -> (values per block, bytes per block), from pipeline.kernels/formats.py
BLOCK = {f.quantize: (f.block, f.block_bytes) for f in FORMATS if f.quantize}

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it rounds a float32 to an integer
_TWO23 = np.float32(8388608.0)
_TWO24 = np.float32(16777216.0)
_GROUP_MAX_EPS = np.float32(1e-15)
_FLT_MAX = np.float32(3.4028234663852886e38)


# ---------------------------------------------------------------- scalar helpers

@njit(cache=True, inline="always")
def _nearest_int(f):
    """ggml's nearest_int: float32 add of 1.5*2**23 (round half to even), read the mantissa.

    While the sum lies in [2**23, 2**24) its mantissa field is sum - 2**23, so the
    result is sum - 1.5*2**23 (round-half-even of f for |f| <= 4194303). Beyond,
    we reproduce the mantissa read-out exactly (llama.cpp only asserts in debug builds).
    """
    val = np.float32(f + _MAGIC)
    if val >= _TWO23 and val < _TWO24:
        return np.int64(val) - 12582912
    if math.isnan(val):
        return np.int64(0)
    if math.isinf(val):
        return np.int64(-0x400000)
    m, e = math.frexp(abs(np.float64(val)))
    mantissa = np.int64((2.0 * m - 1.0) * 8388608.0)
    return (mantissa & 0x7FFFFF) - 0x400000


@njit(cache=True, inline="always")
def _roundf(x):
    """C roundf: half away from zero (float32 in, float32 out)."""
    t = np.float32(np.trunc(x))
    if abs(np.float32(x - t)) >= np.float32(0.5):
        t = np.float32(t + (_F1 if x > 0 else -_F1))
    return t


@njit(cache=True, inline="always")
def _c_int8(v):
    """C's (int8_t)(float) as x86 compilers emit it: truncate toward zero to int32 (cvttss2si; NaN,
    infinities and values beyond int32 give 0x80000000), keep the low byte. ggml's legacy quantizers
    convert this way; only an infinite or NaN scaled value (a block of magnitudes below ~2e-38,
    whose 1/d overflows) ever leaves the int8 range."""
    if v > -2147483649.0 and v < 2147483648.0:
        low = np.int64(np.trunc(np.float64(v))) & 0xFF
    else:
        low = 0
    return low - 256 if low > 127 else low


@njit(cache=True, inline="always")
def _f32_to_f16_bits(f):
    """IEEE round-to-nearest-even float32 -> half, as bits (NaN -> 0x7E00)."""
    x = np.float64(f)
    sign = 0x8000 if (x < 0 or (x == 0 and math.copysign(1.0, x) < 0)) else 0
    if math.isnan(x):
        return np.uint16(sign | 0x7E00)
    a = abs(x)
    if a >= 65520.0:  # half-way between 65504 and 2**16 rounds (to even) to infinity
        return np.uint16(sign | 0x7C00)
    if a < 6.103515625e-05:  # below 2**-14: subnormal (or the first normal after rounding)
        return np.uint16(sign | np.int64(np.rint(a * 16777216.0)))
    m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    exponent = e - 1 + 15
    mant = np.int64(np.rint((2.0 * m - 1.0) * 1024.0))
    if mant == 1024:
        mant = 0
        exponent += 1
    if exponent >= 31:
        return np.uint16(sign | 0x7C00)
    return np.uint16(sign | (exponent << 10) | mant)


@njit(cache=True, inline="always")
def _f16_bits_to_f32(h):
    h = np.int64(h)
    sign = -1.0 if h & 0x8000 else 1.0
    exponent = (h >> 10) & 0x1F
    mant = h & 0x3FF
    if exponent == 0:
        return np.float32(sign * mant * 5.960464477539063e-08)  # mant * 2**-24
    if exponent == 31:
        return np.float32(sign * np.inf) if mant == 0 else np.float32(np.nan)
    return np.float32(sign * (1.0 + mant / 1024.0) * math.ldexp(1.0, exponent - 15))


@njit(cache=True, inline="always")
def _put_f16(out, pos, f):
    h = _f32_to_f16_bits(f)
    out[pos] = np.uint8(h & 0xFF)
    out[pos + 1] = np.uint8(h >> 8)
    return _f16_bits_to_f32(h)


# ---------------------------------------------------------------- scale searches

@njit(cache=True)
def _make_qx_quants(n, nmax, x, off, L, loff):
    """Symmetric scale search with weights x**2 (ggml make_qx_quants, rmse_type 1).

    x[off:off+n] float32 -> L[loff:loff+n] in [0, 2*nmax); returns the scale."""
    fmax = _F0
    amax = _F0
    for i in range(n):
        ax = abs(x[off + i])
        if ax > amax:
            amax = ax
            fmax = x[off + i]
    if amax < _GROUP_MAX_EPS:
        for i in range(n):
            L[loff + i] = 0
        return _F0
    fn = np.float32(nmax)
    iscale = np.float32(-fn / fmax)
    sumlx = _F0
    suml2 = _F0
    for i in range(n):
        xi = x[off + i]
        l = _nearest_int(np.float32(iscale * xi))
        l = max(-nmax, min(nmax - 1, l))
        L[loff + i] = l + nmax
        w = np.float32(xi * xi)
        fl = np.float32(l)
        sumlx = np.float32(sumlx + np.float32(np.float32(w * xi) * fl))
        suml2 = np.float32(suml2 + np.float32(np.float32(w * fl) * fl))
    scale = np.float32(sumlx / suml2) if suml2 != 0 else _F0
    best = np.float32(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = np.float32(-np.float32(fn + np.float32(np.float32(0.1) * np.float32(step))) / fmax)
        sumlx = _F0
        suml2 = _F0
        for i in range(n):
            xi = x[off + i]
            l = _nearest_int(np.float32(iscale * xi))
            l = max(-nmax, min(nmax - 1, l))
            w = np.float32(xi * xi)
            fl = np.float32(l)
            sumlx = np.float32(sumlx + np.float32(np.float32(w * xi) * fl))
            suml2 = np.float32(suml2 + np.float32(np.float32(w * fl) * fl))
        if suml2 > 0 and np.float32(sumlx * sumlx) > np.float32(best * suml2):
            for i in range(n):
                l = _nearest_int(np.float32(iscale * x[off + i]))
                L[loff + i] = nmax + max(-nmax, min(nmax - 1, l))
            scale = np.float32(sumlx / suml2)
            best = np.float32(scale * sumlx)
    return scale


@njit(cache=True)
def _make_qkx2_quants(nmax, x, off, weights, L, loff, Laux, rmin, rdelta, nstep):
    """Asymmetric (scale, min) search over 32 values (ggml make_qkx2_quants, squared error).

    Returns (scale, -min); L[loff:loff+32] gets the levels in [0, nmax]."""
    n = 32
    fmin = x[off]
    fmax = x[off]
    sum_w = weights[0]
    sum_x = np.float32(sum_w * x[off])
    for i in range(1, n):
        xi = x[off + i]
        if xi < fmin:
            fmin = xi
        if xi > fmax:
            fmax = xi
        w = weights[i]
        sum_w = np.float32(sum_w + w)
        sum_x = np.float32(sum_x + np.float32(w * xi))
    if fmin > 0:
        fmin = _F0
    if fmax == fmin:
        for i in range(n):
            L[loff + i] = 0
        return _F0, np.float32(-fmin)
    fn = np.float32(nmax)
    iscale = np.float32(fn / np.float32(fmax - fmin))
    scale = np.float32(_F1 / iscale)
    best_error = _F0
    for i in range(n):
        l = _nearest_int(np.float32(iscale * np.float32(x[off + i] - fmin)))
        l = max(0, min(nmax, l))
        L[loff + i] = l
        diff = np.float32(np.float32(np.float32(scale * np.float32(l)) + fmin) - x[off + i])
        best_error = np.float32(best_error + np.float32(weights[i] * np.float32(diff * diff)))
    for step in range(nstep + 1):
        iscale = np.float32(np.float32(np.float32(rmin + np.float32(rdelta * np.float32(step))) + fn)
                            / np.float32(fmax - fmin))
        sum_l = _F0
        sum_l2 = _F0
        sum_xl = _F0
        for i in range(n):
            xi = x[off + i]
            l = _nearest_int(np.float32(iscale * np.float32(xi - fmin)))
            l = max(0, min(nmax, l))
            Laux[i] = l
            w = weights[i]
            fl = np.float32(l)
            wl = np.float32(w * fl)
            sum_l = np.float32(sum_l + wl)
            sum_l2 = np.float32(sum_l2 + np.float32(wl * fl))
            sum_xl = np.float32(sum_xl + np.float32(wl * xi))
        D = np.float32(np.float32(sum_w * sum_l2) - np.float32(sum_l * sum_l))
        if D > 0:
            this_scale = np.float32(np.float32(np.float32(sum_w * sum_xl) - np.float32(sum_x * sum_l)) / D)
            this_min = np.float32(np.float32(np.float32(sum_l2 * sum_x) - np.float32(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = _F0
                this_scale = np.float32(sum_xl / sum_l2)
            cur_error = _F0
            for i in range(n):
                diff = np.float32(np.float32(np.float32(this_scale * np.float32(Laux[i])) + this_min) - x[off + i])
                cur_error = np.float32(cur_error + np.float32(weights[i] * np.float32(diff * diff)))
            if cur_error < best_error:
                for i in range(n):
                    L[loff + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                fmin = this_min
    return scale, np.float32(-fmin)


# ---------------------------------------------------------------- block encoders

@njit(cache=True, parallel=True)
def _q8_0(x, out):
    """x: float32[nb*32] -> out: uint8[nb * block bytes]."""
    size = GEOMETRY[Q8_0][1]
    nb = x.size // QK8_0
    nchunks = (nb + CHUNK - 1) // CHUNK
    for c in prange(nchunks):
        for b in range(c * CHUNK, min(nb, (c + 1) * CHUNK)):
            off = b * QK8_0
            amax = _F0
            for j in range(QK8_0):
                amax = max(amax, abs(x[off + j]))
            d = np.float32(amax / np.float32(127.0))
            inv_d = np.float32(_F1 / d) if d != 0 else _F0
            pos = b * size
            _put_f16(out, pos, d)
            for j in range(QK8_0):
                q = np.int64(_roundf(np.float32(x[off + j] * inv_d)))
                out[pos + 2 + j] = np.uint8(q & 0xFF)


@njit(cache=True)
def _legacy_block(x, off, out, pos, nbits, affine):
    """One 32-value Q4_0/Q5_0 block (affine False) or Q4_1/Q5_1 block (affine True) of x[off:] into
    out[pos:], operation for operation as ggml's quantize_row_q{4,5}_{0,1}_ref.

    Symmetric: d = max / -2**(nbits-1) with max the value of largest magnitude, q = (int8)(x/d + 2**(nbits-1)
    + 0.5) capped at 2**nbits - 1. Affine: d = (max - min) / (2**nbits - 1), m = min, q = (int8)((x - min)/d
    + 0.5), capped at 15 for Q4_1 only (Q5_1's reference has no cap)."""
    top = (1 << nbits) - 1
    head = pos + 2  # past d
    if affine:
        lo = _FLT_MAX
        hi = -_FLT_MAX
        for j in range(32):
            v = x[off + j]
            if v < lo:
                lo = v
            if v > hi:
                hi = v
        d = np.float32(np.float32(hi - lo) / np.float32(top))
        shift = lo
        bias = np.float32(0.5)
        _put_f16(out, head, lo)
        head += 2
    else:
        amax = _F0
        hi = _F0
        for j in range(32):
            v = x[off + j]
            if amax < abs(v):
                amax = abs(v)
                hi = v
        d = np.float32(hi / np.float32(-(1 << (nbits - 1))))
        shift = _F0
        bias = np.float32((1 << (nbits - 1)) + 0.5)
    inv = np.float32(_F1 / d) if d != 0 else _F0
    _put_f16(out, pos, d)
    capped = not (affine and nbits == 5)
    qs = head + (4 if nbits == 5 else 0)
    qh = 0
    for j in range(16):
        q0 = _legacy_level(x[off + j], shift, inv, bias, affine, capped, top)
        q1 = _legacy_level(x[off + j + 16], shift, inv, bias, affine, capped, top)
        if nbits == 4:
            out[qs + j] = (q0 | (q1 << 4)) & 0xFF
        else:
            out[qs + j] = (q0 & 0xF) | ((q1 & 0xF) << 4)
            qh |= ((q0 & 0x10) >> 4) << j
            qh |= ((q1 & 0x10) >> 4) << (j + 16)
    if nbits == 5:
        for k in range(4):
            out[head + k] = (qh >> (8 * k)) & 0xFF


@njit(cache=True, inline="always")
def _legacy_level(v, shift, inv, bias, affine, capped, top):
    """The stored byte of one value: (uint8) MIN(top, (int8)(scaled + bias)) (Q5_1: no MIN)."""
    scaled = np.float32(np.float32(v - shift) * inv) if affine else np.float32(v * inv)
    q = _c_int8(np.float32(scaled + bias))
    if capped:
        q = min(top, q)
    return q & 0xFF


@njit(cache=True, parallel=True)
def _legacy(x, out, size, nbits, affine):
    """x: float32[nb*32] -> out: uint8[nb*size] in Q4_0 (nbits 4, affine False), Q4_1 (4, True), Q5_0 (5,
    False) or Q5_1 (5, True) blocks."""
    nb = x.size // QK8_0
    for c in prange((nb + CHUNK - 1) // CHUNK):
        for b in range(c * CHUNK, min(nb, (c + 1) * CHUNK)):
            _legacy_block(x, b * QK8_0, out, b * size, nbits, affine)


_LEGACY = {"q4_0": (4, False), "q4_1": (4, True), "q5_0": (5, False), "q5_1": (5, True)}  # (nbits, affine)


@njit(cache=True)
def _pack_k_scales(scales, mins, max_scale, max_min, out, pos):
    """Shared by Q4_K/Q5_K: 6-bit (scale, min) pairs into 12 bytes after d, dmin.

    Returns the float32 values of d and dmin as stored (fp16-rounded)."""
    inv_scale = np.float32(np.float32(63.0) / max_scale) if max_scale > 0 else _F0
    inv_min = np.float32(np.float32(63.0) / max_min) if max_min > 0 else _F0
    sc = pos + 4
    for j in range(8):
        ls = min(63, _nearest_int(np.float32(inv_scale * scales[j])) & 0xFF)  # uint8 cast, then MIN
        lm = min(63, _nearest_int(np.float32(inv_min * mins[j])) & 0xFF)
        if j < 4:
            out[sc + j] = ls
            out[sc + j + 4] = lm
        else:
            out[sc + j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            out[sc + j - 4] |= (ls >> 4) << 6
            out[sc + j] |= (lm >> 4) << 6
    d = _put_f16(out, pos, np.float32(max_scale / np.float32(63.0)))
    dmin = _put_f16(out, pos + 2, np.float32(max_min / np.float32(63.0)))
    return d, dmin


@njit(cache=True, inline="always")
def _k_scale_min(out, sc, j):
    """Read back sub-block j's 6-bit (scale, min) from the 12 packed bytes at out[sc:]."""
    if j < 4:
        return out[sc + j] & 63, out[sc + j + 4] & 63
    return ((out[sc + j + 4] & 0xF) | ((out[sc + j - 4] >> 6) << 4),
            (out[sc + j + 4] >> 4) | ((out[sc + j] >> 6) << 4))


@njit(cache=True)
def _qk_levels(x, off, nmax, rmin, nstep, L, Laux, weights, scales, mins, out, pos):
    """Q4_K/Q5_K common part: per-sub-block search, packed scales, final levels in L[0:256]."""
    max_scale = _F0
    max_min = _F0
    for j in range(8):
        sub = off + 32 * j
        sum_x2 = _F0
        for l in range(32):
            sum_x2 = np.float32(sum_x2 + np.float32(x[sub + l] * x[sub + l]))
        av_x = np.float32(np.sqrt(np.float32(sum_x2 / np.float32(32.0))))
        for l in range(32):
            weights[l] = np.float32(av_x + abs(x[sub + l]))
        s, m = _make_qkx2_quants(nmax, x, sub, weights, L, 32 * j, Laux, rmin, np.float32(0.1), nstep)
        scales[j] = s
        mins[j] = m
        if s > max_scale:
            max_scale = s
        if m > max_min:
            max_min = m
    d_all, dmin_all = _pack_k_scales(scales, mins, max_scale, max_min, out, pos)
    for j in range(8):
        sc, m = _k_scale_min(out, pos + 4, j)
        d = np.float32(d_all * np.float32(sc))
        if d == 0:
            continue  # keep the search's levels, as ggml does
        dm = np.float32(dmin_all * np.float32(m))
        for i in range(32):
            l = _nearest_int(np.float32(np.float32(x[off + 32 * j + i] + dm) / d))
            L[32 * j + i] = max(0, min(nmax, l))


@njit(cache=True)
def _pack_q4_k(L, out, pos):
    """Q4_K's qs: the levels of values j and j + 32 of each 64 as the low and high nibble."""
    q = pos + 16
    for j in range(0, QK_K, 64):
        for l in range(32):
            out[q + l] = L[j + l] | (L[j + l + 32] << 4)
        q += 32


@njit(cache=True)
def _pack_q5_k(L, out, pos):
    """Q5_K's qh (bit 4 of each level) and qs (the low nibbles, as Q4_K's)."""
    qh = pos + 16
    ql = pos + 48
    for j in range(32):
        out[qh + j] = 0
    m1 = 1
    m2 = 2
    for n in range(0, QK_K, 64):
        for j in range(32):
            l1 = L[n + j]
            if l1 > 15:
                l1 -= 16
                out[qh + j] |= m1
            l2 = L[n + j + 32]
            if l2 > 15:
                l2 -= 16
                out[qh + j] |= m2
            out[ql + j] = l1 | (l2 << 4)
        m1 <<= 2
        m2 <<= 2
        ql += 32


@njit(cache=True, parallel=True)
def _qk(x, out, size, high_bit):
    """x: float32[nb*256] -> out: uint8[nb * size] in Q4_K (high_bit False: levels 0..15, ggml's rmin -1 and
    20 steps) or Q5_K (True: 0..31, rmin -0.5, 15 steps) blocks."""
    nmax, rmin, nstep = (31, np.float32(-0.5), 15) if high_bit else (15, np.float32(-1.0), 20)
    nb = x.size // QK_K
    nchunks = (nb + CHUNK - 1) // CHUNK
    for c in prange(nchunks):
        L = np.zeros(QK_K, np.int64)
        Laux = np.zeros(32, np.int64)
        weights = np.zeros(32, np.float32)
        scales = np.zeros(8, np.float32)
        mins = np.zeros(8, np.float32)
        for b in range(c * CHUNK, min(nb, (c + 1) * CHUNK)):
            pos = b * size
            _qk_levels(x, b * QK_K, nmax, rmin, nstep, L, Laux, weights, scales, mins, out, pos)
            if high_bit:
                _pack_q5_k(L, out, pos)
            else:
                _pack_q4_k(L, out, pos)


@njit(cache=True, parallel=True)
def _q6_k(x, out):
    """x: float32[nb*256] -> out: uint8[nb * block bytes]."""
    size = GEOMETRY[Q6_K][1]
    nb = x.size // QK_K
    nchunks = (nb + CHUNK - 1) // CHUNK
    for c in prange(nchunks):
        L = np.zeros(QK_K, np.int64)
        scales = np.zeros(16, np.float32)
        for b in range(c * CHUNK, min(nb, (c + 1) * CHUNK)):
            off = b * QK_K
            pos = b * size
            max_scale = _F0
            max_abs_scale = _F0
            for ib in range(16):
                s = _make_qx_quants(16, 32, x, off + 16 * ib, L, 16 * ib)
                scales[ib] = s
                if abs(s) > max_abs_scale:
                    max_abs_scale = abs(s)
                    max_scale = s
            if max_abs_scale < _GROUP_MAX_EPS:
                for i in range(size):
                    out[pos + i] = 0
                continue
            iscale = np.float32(np.float32(-128.0) / max_scale)
            d_all = _put_f16(out, pos + GEOMETRY[Q6_K][2], np.float32(_F1 / iscale))
            for ib in range(16):
                q = min(127, _nearest_int(np.float32(iscale * scales[ib])))
                out[pos + 192 + ib] = np.uint8(q & 0xFF)
            for j in range(16):
                sq = np.int64(out[pos + 192 + j])
                if sq > 127:
                    sq -= 256  # int8
                d = np.float32(d_all * np.float32(sq))
                if d == 0:
                    continue
                for i in range(16):
                    l = _nearest_int(np.float32(x[off + 16 * j + i] / d))
                    L[16 * j + i] = max(-32, min(31, l)) + 32
            ql = pos
            qh = pos + 128
            for j in range(0, QK_K, 128):
                for l in range(32):
                    q1 = L[j + l] & 0xF
                    q2 = L[j + l + 32] & 0xF
                    q3 = L[j + l + 64] & 0xF
                    q4 = L[j + l + 96] & 0xF
                    out[ql + l] = q1 | (q3 << 4)
                    out[ql + l + 32] = q2 | (q4 << 4)
                    out[qh + l] = ((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2)
                                   | ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6))
                ql += 64
                qh += 32


def _legacy_kernel(size, nbits, affine):
    return lambda x, out: _legacy(x, out, size, nbits, affine)


def _k_kernel(size, high_bit):
    return lambda x, out: _qk(x, out, size, high_bit)


_KERNELS = {"q8_0": _q8_0, "q6_k": _q6_k, "q4_k": _k_kernel(BLOCK["q4_k"][1], False),
            "q5_k": _k_kernel(BLOCK["q5_k"][1], True),
            **{key: _legacy_kernel(BLOCK[key][1], *spec) for key, spec in _LEGACY.items()}}
if set(_KERNELS) != set(BLOCK):
    raise RuntimeError("pipeline/kernels/formats.py's quantize keys and kernels/quantize.py's encoders disagree")


# ---------------------------------------------------------------- public API

def quantize(x, qtype):
    """Encode float32 `x` (..., n) row by row into ggml blocks of `qtype`.

    Returns uint8 (..., n // block_values * block_bytes) — the layout gguf-py's
    writer takes for a quantized tensor. n must be a multiple of the block size
    (32 for q4_0/q4_1/q5_0/q5_1/q8_0, 256 for the K-quants); values must be finite.
    """
    qtype = qtype.lower()
    if qtype not in _KERNELS:
        raise ValueError(f"quantize: unknown type {qtype!r} (known: {', '.join(_KERNELS)})")
    values, nbytes = BLOCK[qtype]
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"quantize({qtype}): input must be float32, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % values != 0:
        raise ValueError(f"quantize({qtype}): row length {x.shape[-1] if x.ndim else 0} "
                         f"is not a multiple of {values} (shape {x.shape})")
    if not np.isfinite(x).all():
        raise ValueError(f"quantize({qtype}): input has NaN or infinite values (shape {x.shape})")
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.zeros(flat.size // values * nbytes, np.uint8)
    _KERNELS[qtype](flat, out)
    return out.reshape(*x.shape[:-1], x.shape[-1] // values * nbytes)


def to_f16(x):
    """float32 -> float16, round to nearest even (ggml's fp32->fp16; NaN -> quiet NaN)."""
    with np.errstate(over="ignore"):  # beyond 65504 rounds to infinity, as in ggml
        return np.asarray(x, np.float32).astype(np.float16)


def to_bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN -> quiet NaN as ggml does."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (bits >> np.uint32(16)) | np.uint32(64)
    return np.where(nan, quiet, rounded).astype(np.uint16)
