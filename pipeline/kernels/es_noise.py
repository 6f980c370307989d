"""ES noise: a fast gaussian fill, and the three ES noise passes built on it.

Trade-off: evolution strategies regenerate every member's noise on every
perturb, restore and update instead of storing it, so the gaussian draw is the
hot loop. This module keeps the splitmix64 pair stream and the 53-bit uniforms
of pipeline.kernels.rng but replaces libm's log/cos/sin with short polynomials written
in plain IEEE float64 arithmetic (no libm, no FMA contraction). That makes it
a few times cheaper than the exact scalar kernel AND makes its values the same
bits on every platform. It is therefore its OWN (key -> values) mapping, a
checkpoint contract pinned by tests/goldens/es/: never change a formula or a
constant here. Values agree with pipeline.kernels.rng.gaussian_at to ~1e-10.

    pair p of stream `key` (elements 2p and 2p+1):
        u1 = 1 - (at(key, 2p)     >> 11) * 2**-53      in (0, 1]
        u2 =     (at(key, 2p + 1) >> 11) * 2**-53      in [0, 1)
        r  = sqrt(-2 * log_poly(u1))
        element 2p   = r * cos_poly(2 pi u2)
        element 2p+1 = r * sin_poly(2 pi u2)
    log_poly:  u1 = m * 2**e (frexp), m folded into [sqrt(1/2), sqrt(2));
               log m = 2 s (1 + s^2/3 + ... + s^12/13), s = (m-1)/(m+1)
    sincos:    y = 4 u2, q = floor(y + 1/2), x = (y - q) * pi/2 in [-pi/4, pi/4],
               Taylor sin to x^11 and cos to x^12, rotated by quadrant q mod 4

The ES passes (materialize, materialize_pairs for antithetic members, weighted_sum)
work on a flat float32 parameter vector split into slots
(offsets/sizes); one noise stream key per (member, slot). The parallel loops
run over a fixed task grid (each slot cut into CHUNK-element pieces), never
over a thread-dependent split, so results are bitwise identical for any
thread count. All ES arithmetic is float32:
    materialize: out[b, j] = theta[j] + scale[b] * f32(eps_b[j])
    weighted_sum: out[j]   = sum_n (in member order) coeff[n] * f32(eps_n[j])
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .rng import at

CHUNK = 1 << 14  # fixed task grid: elements per parallel task (even: tasks start on pair boundaries)

_INV53 = 1.0 / 9007199254740992.0  # 2**-53
_S11 = np.uint64(11)
_ONE = np.uint64(1)
SQRT_HALF = 0.7071067811865476
LN2 = 0.6931471805599453
HALF_PI = 1.5707963267948966
# log series 2 s (1 + s^2 L1 + s^4 L2 + ...), L_k = 1 / (2k + 1)
L1, L2, L3, L4, L5, L6 = 1.0 / 3.0, 1.0 / 5.0, 1.0 / 7.0, 1.0 / 9.0, 1.0 / 11.0, 1.0 / 13.0
# Taylor: sin x = x (1 + x^2 S1 + ...), cos x = 1 + x^2 K1 + ...
S1, S2, S3, S4, S5 = -1.0 / 6.0, 1.0 / 120.0, -1.0 / 5040.0, 1.0 / 362880.0, -1.0 / 39916800.0
K1, K2, K3, K4, K5, K6 = -0.5, 1.0 / 24.0, -1.0 / 720.0, 1.0 / 40320.0, -1.0 / 3628800.0, 1.0 / 479001600.0


@intrinsic
def _f64_bits(typingctx, x):
    """The IEEE bits of a float64 (lets frexp become branch-free, vectorizable integer ops)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.uint64(types.float64), codegen


@intrinsic
def _bits_f64(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.uint64), codegen


_MANTISSA = np.uint64((1 << 52) - 1)
_HALF_EXPONENT = np.uint64(1022 << 52)  # exponent field of [0.5, 1)
_S52 = np.uint64(52)
_TWO = np.uint64(2)
BLOCK = 256  # pairs per stage: the stages are separate simple loops so LLVM vectorizes them


@njit(cache=True, inline="always")
def _fill_range_at(key, buf, start, stop):
    """buf[0:stop-start] = stream values start..stop-1 (start even).

    Staged over blocks of pairs: uniforms, then r = sqrt(-2 log u1), then the
    quadrant-rotated sin/cos, then the products. Each stage is a branch-free
    loop (selects, no calls) that LLVM vectorizes; the arithmetic per element
    is exactly the module-docstring formula (frexp via the exponent bits, which
    is exact: u1 >= 2**-53 is a normal float64)."""
    n = stop - start
    n_pairs = (n + 1) // 2
    first = np.uint64(start // 2)
    u1 = np.empty(BLOCK)
    u2 = np.empty(BLOCK)
    r = np.empty(BLOCK)
    c = np.empty(BLOCK)
    sn = np.empty(BLOCK)
    for b0 in range(0, n_pairs, BLOCK):
        m = min(BLOCK, n_pairs - b0)
        for i in range(m):
            two_p = (first + np.uint64(b0 + i)) * _TWO
            u1[i] = 1.0 - np.float64(at(key, two_p) >> _S11) * _INV53
            u2[i] = np.float64(at(key, two_p + _ONE) >> _S11) * _INV53
        for i in range(m):
            bits = _f64_bits(u1[i])
            e = np.float64(np.int64(bits >> _S52) - 1022)
            f = _bits_f64((bits & _MANTISSA) | _HALF_EXPONENT)  # u1 = f * 2**e, f in [0.5, 1)
            small = f < SQRT_HALF
            f = f * 2.0 if small else f
            e = e - 1.0 if small else e
            s = (f - 1.0) / (f + 1.0)
            z = s * s
            poly = 1.0 + z * (L1 + z * (L2 + z * (L3 + z * (L4 + z * (L5 + z * L6)))))
            r[i] = math.sqrt(-2.0 * (e * LN2 + 2.0 * s * poly))
        for i in range(m):
            y = u2[i] * 4.0
            q = math.floor(y + 0.5)
            x = (y - q) * HALF_PI
            x2 = x * x
            sin_x = x * (1.0 + x2 * (S1 + x2 * (S2 + x2 * (S3 + x2 * (S4 + x2 * S5)))))
            cos_x = 1.0 + x2 * (K1 + x2 * (K2 + x2 * (K3 + x2 * (K4 + x2 * (K5 + x2 * K6)))))
            quadrant = np.int64(q) & 3  # rotate by quadrant * pi/2
            odd = (quadrant & 1) == 1
            c0 = sin_x if odd else cos_x
            s0 = cos_x if odd else sin_x
            c[i] = -c0 if (quadrant == 1 or quadrant == 2) else c0
            sn[i] = -s0 if quadrant >= 2 else s0
        for i in range(m):
            j = 2 * (b0 + i)
            buf[j] = r[i] * c[i]
            if j + 1 < n:
                buf[j + 1] = r[i] * sn[i]


def _gaussian_fill_py(key, out):
    """out: (n,) float32/float64; out[j] = value j of stream key."""
    n = out.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        start, stop = c * CHUNK, min(n, (c + 1) * CHUNK)
        _fill_range_at(key, out[start:stop], start, stop)


@njit(cache=True)
def _task_grid(offsets, sizes):
    """(slot, start, stop) triples cutting every slot into CHUNK pieces: the fixed grid."""
    count = 0
    for s in range(sizes.size):
        count += (sizes[s] + CHUNK - 1) // CHUNK
    tasks = np.empty((count, 3), dtype=np.int64)
    t = 0
    for s in range(sizes.size):
        for start in range(0, sizes[s], CHUNK):
            tasks[t, 0] = s
            tasks[t, 1] = start
            tasks[t, 2] = min(sizes[s], start + CHUNK)
            t += 1
    return tasks


def _materialize_py(keys, scales, theta, offsets, sizes, out, eps_out):
    """keys (B, S) uint64, scales (B,) f32, theta (D,) f32, offsets/sizes (S,) int64,
    out (B, D) f32: out[b, off_s + j] = theta[off_s + j] + scales[b] * f32(eps(keys[b, s], j));
    eps_out (B, D) f32 receives the eps rows, or is (0, 0) to skip."""
    tasks = _task_grid(offsets, sizes)
    n_tasks = tasks.shape[0]
    for flat in prange(keys.shape[0] * n_tasks):
        b = flat // n_tasks
        s, start, stop = tasks[flat % n_tasks, 0], tasks[flat % n_tasks, 1], tasks[flat % n_tasks, 2]
        base = offsets[s]
        key = keys[b, s]
        scale = scales[b]
        buf = np.empty(stop - start, dtype=np.float32)
        _fill_range_at(key, buf, start, stop)
        for j in range(start, stop):
            out[b, base + j] = theta[base + j] + scale * buf[j - start]
        if eps_out.shape[0]:
            eps_out[b, base + start:base + stop] = buf


def _materialize_pairs_py(keys, scales, theta, offsets, sizes, out, eps_out):
    """keys (P, S), scales (P,), out (2P, D): rows 2p and 2p+1 are theta +- scales[p] * eps(keys[p]),
    bitwise what _materialize gives for the two rows (one draw serves both); eps_out (P, D) or (0, 0)."""
    tasks = _task_grid(offsets, sizes)
    n_tasks = tasks.shape[0]
    for flat in prange(keys.shape[0] * n_tasks):
        p = flat // n_tasks
        s, start, stop = tasks[flat % n_tasks, 0], tasks[flat % n_tasks, 1], tasks[flat % n_tasks, 2]
        base = offsets[s]
        plus = scales[p]
        minus = -plus
        buf = np.empty(stop - start, dtype=np.float32)
        _fill_range_at(keys[p, s], buf, start, stop)
        for j in range(start, stop):
            out[2 * p, base + j] = theta[base + j] + plus * buf[j - start]
            out[2 * p + 1, base + j] = theta[base + j] + minus * buf[j - start]
        if eps_out.shape[0]:
            eps_out[p, base + start:base + stop] = buf


def _weighted_sum_py(keys, coeffs, offsets, sizes, out, cache, cache_row):
    """keys (N, S) uint64, coeffs (N,) f32, out (D,) f32:
    out[off_s + j] = sum over n in order of coeffs[n] * f32(eps(keys[n, s], j)), from 0.
    cache (R, D) f32 holds already-drawn eps rows: cache_row[n] >= 0 reads row cache_row[n]
    instead of regenerating draw n (the same f32 values, so the same bits)."""
    tasks = _task_grid(offsets, sizes)
    for t in prange(tasks.shape[0]):
        s, start, stop = tasks[t, 0], tasks[t, 1], tasks[t, 2]
        base = offsets[s]
        buf = np.empty(stop - start, dtype=np.float32)
        acc = np.zeros(stop - start, dtype=np.float32)
        for n in range(keys.shape[0]):
            c = coeffs[n]
            if cache_row[n] >= 0:
                row = cache_row[n]
                for j in range(stop - start):
                    acc[j] = acc[j] + c * cache[row, base + start + j]
            else:
                _fill_range_at(keys[n, s], buf, start, stop)
                for j in range(stop - start):
                    acc[j] = acc[j] + c * buf[j]
        for j in range(stop - start):
            out[base + start + j] = acc[j]


# Each kernel is compiled twice from the same source: a parallel build for big
# inputs and a serial one for small inputs, where waking a thread team costs more
# than the work (and stalls under oversubscription). Same task grid, same
# per-element arithmetic, so both builds give the same bits.
_gaussian_fill = (njit(cache=True)(_gaussian_fill_py), njit(cache=True, parallel=True)(_gaussian_fill_py))
_materialize = (njit(cache=True)(_materialize_py), njit(cache=True, parallel=True)(_materialize_py))
_weighted_sum = (njit(cache=True)(_weighted_sum_py), njit(cache=True, parallel=True)(_weighted_sum_py))
_materialize_pairs = (njit(cache=True)(_materialize_pairs_py), njit(cache=True, parallel=True)(_materialize_pairs_py))
PARALLEL_MIN = 1 << 20  # values drawn per call below which the serial build runs


def _build(kernels, work, parallel):
    """parallel: None = by size, True/False = force (tests pin both builds)."""
    return kernels[int(work >= PARALLEL_MIN if parallel is None else bool(parallel))]


# ----------------------------------------------------------------- wrappers

def _u64(x):
    return np.uint64(int(x) & 0xFFFFFFFFFFFFFFFF)


def gaussian_fill_fast(key, out, parallel=None):
    """out.flat[j] = value j of stream `key` (this module's mapping); in place, returns out."""
    if not isinstance(out, np.ndarray) or out.dtype not in (np.float32, np.float64):
        raise TypeError("gaussian_fill_fast: out must be a float32/float64 numpy array, "
                        f"got {getattr(out, 'dtype', type(out))}")
    if not out.flags.c_contiguous:
        raise ValueError("gaussian_fill_fast: out must be C-contiguous")
    _build(_gaussian_fill, out.size, parallel)(_u64(key), out.reshape(-1))
    return out


def _check_layout(op, keys, offsets, sizes, dim):
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    if offsets.ndim != 1 or offsets.shape != sizes.shape:
        raise ValueError(f"{op}: offsets {offsets.shape} and sizes {sizes.shape} must be equal 1-D shapes")
    if keys.ndim != 2 or keys.shape[1] != sizes.size:
        raise ValueError(f"{op}: keys must be (members, {sizes.size} slots), got {keys.shape}")
    if sizes.size and (sizes.min() < 0 or offsets.min() < 0 or (offsets + sizes).max() > dim):
        raise ValueError(f"{op}: slots (offsets, sizes) exceed the parameter vector of {dim} elements")
    return keys, offsets, sizes


def _check_f32(op, name, a, ndim):
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != ndim or not a.flags.c_contiguous:
        raise TypeError(f"{op}: {name} must be a C-contiguous {ndim}-D float32 array, "
                        f"got {getattr(a, 'dtype', type(a))} {getattr(a, 'shape', '')}")


_NO_ROWS = np.zeros((0, 0), dtype=np.float32)


def _check_eps_out(op, eps_out, rows, dim):
    if eps_out is None:
        return _NO_ROWS
    _check_f32(op, "eps_out", eps_out, 2)
    if eps_out.shape != (rows, dim):
        raise ValueError(f"{op}: eps_out {eps_out.shape} must be ({rows}, {dim})")
    return eps_out


def materialize(keys, scales, theta, offsets, sizes, out, parallel=None, eps_out=None):
    """out[b] = theta + scales[b] * eps_b (float32), eps_b's slot s drawn from keys[b, s];
    eps_out (B, D), if given, receives the eps rows (for weighted_sum's cache)."""
    _check_f32("materialize", "theta", theta, 1)
    _check_f32("materialize", "out", out, 2)
    keys, offsets, sizes = _check_layout("materialize", keys, offsets, sizes, theta.size)
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    if out.shape != (keys.shape[0], theta.size) or scales.shape != (keys.shape[0],):
        raise ValueError(f"materialize: out {out.shape} / scales {scales.shape} must be "
                         f"({keys.shape[0]}, {theta.size}) / ({keys.shape[0]},)")
    eps_out = _check_eps_out("materialize", eps_out, keys.shape[0], theta.size)
    _build(_materialize, keys.shape[0] * int(sizes.sum()), parallel)(keys, scales, theta, offsets, sizes, out, eps_out)
    return out


def materialize_pairs(keys, scales, theta, offsets, sizes, out, parallel=None, eps_out=None):
    """Antithetic rows: out[2p] = theta + scales[p] * eps_p, out[2p+1] = theta - scales[p] * eps_p;
    eps_out (P, D), if given, receives eps_p."""
    _check_f32("materialize_pairs", "theta", theta, 1)
    _check_f32("materialize_pairs", "out", out, 2)
    keys, offsets, sizes = _check_layout("materialize_pairs", keys, offsets, sizes, theta.size)
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    if out.shape != (2 * keys.shape[0], theta.size) or scales.shape != (keys.shape[0],):
        raise ValueError(f"materialize_pairs: out {out.shape} / scales {scales.shape} must be "
                         f"({2 * keys.shape[0]}, {theta.size}) / ({keys.shape[0]},)")
    eps_out = _check_eps_out("materialize_pairs", eps_out, keys.shape[0], theta.size)
    _build(_materialize_pairs, keys.shape[0] * int(sizes.sum()), parallel)(keys, scales, theta, offsets, sizes, out,
                                                                            eps_out)
    return out


def weighted_sum(keys, coeffs, offsets, sizes, out, parallel=None, cache=None, cache_row=None):
    """out = sum_n coeffs[n] * eps_n in member order (float32); slots not covered are left alone.

    cache (R, D) float32 + cache_row (N,) int64: draw n is read from cache[cache_row[n]] when
    cache_row[n] >= 0 (rows saved by materialize's eps_out) instead of being regenerated."""
    _check_f32("weighted_sum", "out", out, 1)
    keys, offsets, sizes = _check_layout("weighted_sum", keys, offsets, sizes, out.size)
    coeffs = np.ascontiguousarray(coeffs, dtype=np.float32)
    if coeffs.shape != (keys.shape[0],):
        raise ValueError(f"weighted_sum: coeffs {coeffs.shape} must be ({keys.shape[0]},)")
    if cache is None:
        cache, cache_row = _NO_ROWS, np.full(keys.shape[0], -1, dtype=np.int64)
    else:
        _check_f32("weighted_sum", "cache", cache, 2)
        cache_row = np.ascontiguousarray(cache_row, dtype=np.int64)
        if (cache.shape[1] != out.size or cache_row.shape != (keys.shape[0],)
                or cache_row.max(initial=-1) >= cache.shape[0]):
            raise ValueError(f"weighted_sum: cache {cache.shape} / cache_row {cache_row.shape} do not fit "
                             f"{keys.shape[0]} draws of {out.size} elements")
    work = int((cache_row < 0).sum()) * int(sizes.sum())
    _build(_weighted_sum, work, parallel)(keys, coeffs, offsets, sizes, out, cache, cache_row)
    return out
