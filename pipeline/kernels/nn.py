"""Row kernels for the autograd engine: RMSNorm, dropout, embedding scatter-add, erf,
sigmoid/SiLU/SwiGLU, RoPE; and the tiled big GEMMs that run on our own threads.

Trade-off: numba loops instead of composed numpy so each op is one pass over
memory with no temporaries; in exchange every kernel has a numpy reference in
tests/kernels/test_nn.py. Parallel loops run over a FIXED chunk grid (rows or
columns per chunk are constants, never derived from the thread count), and any
cross-chunk reduction combines per-chunk partials serially in chunk order, so
the output bits do not depend on how many threads run.
"""
import contextlib
import math

import numba
import numpy as np
from numba import njit, prange

from pipeline.kernels.blas import gemm
from pipeline.kernels.fastexp import ONE, ZERO, exp64, expf
from pipeline.kernels.rng import _u64, uniform_at
from pipeline.kernels.workpool import run_tiles, single_thread_blas, split_range

ROW_CHUNK = 32      # rows per parallel task (RMSNorm)
COL_CHUNK = 64      # columns per parallel task (embedding scatter-add)
ELEM_CHUNK = 1 << 15  # elements per parallel task (dropout)
# Below this many elements the kernels run on the calling thread. A numba parallel
# launch is cheap by itself, but its worker then spin-waits for milliseconds and
# steals the core from the next tiled GEMM (measured on 2 cores: a 0.07 ms
# RMSNorm launched in parallel made the following 5.5 ms Q4_K GEMM take 9.3 ms),
# and on a busy machine each launch can wait a scheduler slice (~8 ms) for its
# worker. Training-size rows ([128, 3072]) take < 1 ms serially.
PARALLEL_MIN = 1 << 22


@contextlib.contextmanager
def threads_for(size):
    """Run small kernels on the calling thread only. The chunk grid does not
    change, so the bits do not either; only the launch overhead goes away."""
    if size >= PARALLEL_MIN:
        yield
        return
    prev = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(prev)


# Between SPLIT_MIN and PARALLEL_MIN elements the serial row functions run on our
# own threads (the GEMM tile pool: blocked workers, no spinning), cut at chunk
# boundaries of the same fixed grid. Every row/element is computed by the same
# serial code whatever the cut, so the bits equal the one-thread run. A hand-off
# costs ~30-40 us, so the smallest inputs stay on the calling thread.
SPLIT_MIN = 1 << 16


def _split_chunks(n_chunks, size, span):
    """span(c0, c1) over chunks [0, n_chunks): contiguous pieces, one per thread, when
    the input (size elements) is worth the hand-off; the caller runs the first piece."""
    split_range(n_chunks, n_chunks if size >= SPLIT_MIN else 1, span)


# --- RMSNorm -------------------------------------------------------------------
# No fastmath here: "reassoc" let LLVM pick a reduction order that differed
# between a fresh compile and the cached code (see pipeline/kernels/fastexp.py).


@njit(cache=True, nogil=True)
def _rms_norm_fwd_rows(x, w, eps, out, rstd, i0, i1):
    d = x.shape[1]
    for i in range(i0, i1):
        acc = 0.0
        for j in range(d):
            v = np.float64(x[i, j])
            acc += v * v
        r = 1.0 / np.sqrt(acc / d + eps)
        rstd[i] = r
        rr = x.dtype.type(r)
        for j in range(d):
            out[i, j] = x[i, j] * rr * w[j]


@njit(cache=True, parallel=True)
def _rms_norm_fwd(x, w, eps, out, rstd):
    """x [N, D], w [D], out [N, D] (x's dtype), rstd [N] float64.
    out = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps), sum of squares in float64.
    The row loops live in a serial function: compiled outside the parfor pass they vectorize."""
    n = x.shape[0]
    for c in prange((n + ROW_CHUNK - 1) // ROW_CHUNK):
        _rms_norm_fwd_rows(x, w, eps, out, rstd, c * ROW_CHUNK, min(n, (c + 1) * ROW_CHUNK))


@njit(cache=True, nogil=True)
def _rms_norm_bwd_rows(g, x, w, rstd, gx, gw_row, i0, i1):
    d = x.shape[1]
    for j in range(d):
        gw_row[j] = 0.0
    for i in range(i0, i1):
        r = rstd[i]
        rr = x.dtype.type(r)
        dot = 0.0
        for j in range(d):
            dot += np.float64(g[i, j] * w[j] * x[i, j])
        k = x.dtype.type(dot * r * r * r / d)
        for j in range(d):
            gx[i, j] = rr * (g[i, j] * w[j]) - x[i, j] * k
            gw_row[j] += np.float64(g[i, j] * x[i, j] * rr)


@njit(cache=True, parallel=True)
def _rms_norm_bwd(g, x, w, rstd, gx, gw_partial):
    """g, x [N, D]; w [D]; rstd [N]; gx [N, D] out; gw_partial [nchunks, D] out
    (per-chunk sums of g * xhat, combined serially by the caller).
    gx = rstd * (g w - xhat * mean(g w xhat)), xhat = x * rstd."""
    n = x.shape[0]
    for c in prange((n + ROW_CHUNK - 1) // ROW_CHUNK):
        _rms_norm_bwd_rows(g, x, w, rstd, gx, gw_partial[c], c * ROW_CHUNK, min(n, (c + 1) * ROW_CHUNK))


@njit(cache=True, nogil=True)
def _rms_norm_bwd_span(g, x, w, rstd, gx, gw_partial, c0, c1):
    """_rms_norm_bwd's chunks c0..c1-1, serially (for our threads)."""
    n = x.shape[0]
    for c in range(c0, c1):
        _rms_norm_bwd_rows(g, x, w, rstd, gx, gw_partial[c], c * ROW_CHUNK, min(n, (c + 1) * ROW_CHUNK))


def _check_rows(op, x):
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.dtype not in (np.float32, np.float64):
        raise ValueError(f"{op}: expected a 2-D float32/float64 array, "
                         f"got {getattr(x, 'dtype', type(x))} {getattr(x, 'shape', '')}")
    return np.ascontiguousarray(x)


def rms_norm_forward(x, w, eps):
    """x [N, D] float32/64, w [D] or None -> (out [N, D] x.dtype, rstd [N] float64)."""
    x = _check_rows("rms_norm", x)
    w = np.ones(x.shape[1], x.dtype) if w is None else np.ascontiguousarray(w, dtype=x.dtype)
    out = np.empty_like(x)
    rstd = np.empty(x.shape[0], np.float64)
    n, eps = x.shape[0], float(eps)
    if x.size >= PARALLEL_MIN:
        _rms_norm_fwd(x, w, eps, out, rstd)
    else:
        _split_chunks(-(-n // ROW_CHUNK), x.size, lambda c0, c1: _rms_norm_fwd_rows(
            x, w, eps, out, rstd, c0 * ROW_CHUNK, min(n, c1 * ROW_CHUNK)))
    return out, rstd


def rms_norm_backward(g, x, w, rstd, need_weight_grad=True):
    """-> (gx [N, D] float32, gw [D] float32 or None); gw summed chunk by chunk in order."""
    x = _check_rows("rms_norm backward", x)
    g = np.ascontiguousarray(g, dtype=x.dtype)
    w = np.ones(x.shape[1], x.dtype) if w is None else np.ascontiguousarray(w, dtype=x.dtype)
    gx = np.empty_like(x)
    nchunks = (x.shape[0] + ROW_CHUNK - 1) // ROW_CHUNK
    partial = np.empty((nchunks, x.shape[1]), np.float64)
    if x.size >= PARALLEL_MIN:
        _rms_norm_bwd(g, x, w, rstd, gx, partial)
    else:
        _split_chunks(nchunks, x.size, lambda c0, c1: _rms_norm_bwd_span(g, x, w, rstd, gx, partial, c0, c1))
    gw = _sum_chunks(partial).astype(np.float32) if need_weight_grad else None
    return gx.astype(np.float32, copy=False), gw


@njit(cache=True, nogil=True)
def _sum_chunks(partial):
    """partial [nchunks, D] float64 summed over the chunks serially in chunk order: the bits of a Python loop
    `gw += partial[c]`, without its ~1.5 us per chunk (64 chunks for the lm shape's q/k norms)."""
    gw = np.zeros(partial.shape[1], np.float64)
    for c in range(partial.shape[0]):
        for j in range(partial.shape[1]):
            gw[j] += partial[c, j]
    return gw


# --- dropout -------------------------------------------------------------------------
@njit(cache=True, parallel=True)
def _dropout(seed, x, out, keep, scale):
    """x, out flat [n]: out[i] = x[i] * scale if uniform(seed, i) < keep else 0."""
    n = x.size
    nchunks = (n + ELEM_CHUNK - 1) // ELEM_CHUNK
    for c in prange(nchunks):
        for i in range(c * ELEM_CHUNK, min(n, (c + 1) * ELEM_CHUNK)):
            if uniform_at(seed, np.uint64(i)) < keep:
                out[i] = x[i] * scale
            else:
                out[i] = 0


def dropout_apply(seed, x, p):
    """Inverted dropout of x (any shape, float32/float64) with the mask of (seed, flat index)."""
    if x.dtype not in (np.float32, np.float64):
        raise ValueError(f"dropout: expected float32/float64, got {x.dtype}")
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty_like(flat)
    with threads_for(flat.size):
        _dropout(_u64(seed), flat, out, 1.0 - float(p), x.dtype.type(1.0 / (1.0 - float(p))))
    return out.reshape(x.shape)


def dropout_mask(seed, shape, p):
    """The boolean keep-mask dropout(seed, p) uses for an array of `shape`."""
    return dropout_apply(seed, np.ones(shape, np.float32), p) != 0


# --- embedding backward --------------------------------------------------------------
@njit(cache=True, parallel=True)
def _embedding_bwd(ids, g, out):
    """ids [R] int64, g [R, D], out [V, D] zeroed: out[ids[r]] += g[r], rows in order.
    Parallel over fixed column chunks, so each output element sums in row order."""
    rows, d = g.shape
    nchunks = (d + COL_CHUNK - 1) // COL_CHUNK
    for c in prange(nchunks):
        j0 = c * COL_CHUNK
        j1 = min(d, j0 + COL_CHUNK)
        for r in range(rows):
            t = ids[r]
            for j in range(j0, j1):
                out[t, j] += g[r, j]


def embedding_backward(ids, g, vocab):
    """Scatter-add g [R, D] into a [vocab, D] float32 gradient at rows ids [R]."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    g = np.ascontiguousarray(g, dtype=np.float32)
    if g.ndim != 2 or g.shape[0] != ids.shape[0]:
        raise ValueError(f"embedding backward: g {g.shape} must be [len(ids)={ids.shape[0]}, dim]")
    out = np.zeros((vocab, g.shape[1]), np.float32)
    with threads_for(g.size):
        _embedding_bwd(ids, g, out)
    return out


# --- erf (exact GELU) ---------------------------------------------------------------
@njit(cache=True, parallel=True)
def _erf(x, out):
    """x, out flat float64 [n]: out = erf(x) (libm), elementwise over a fixed chunk grid."""
    n = x.size
    for c in prange((n + ELEM_CHUNK - 1) // ELEM_CHUNK):
        for i in range(c * ELEM_CHUNK, min(n, (c + 1) * ELEM_CHUNK)):
            out[i] = math.erf(x[i])


def erf(x):
    """float64 erf of any-shape array (numpy has no erf ufunc)."""
    flat = np.ascontiguousarray(x, dtype=np.float64).reshape(-1)
    out = np.empty_like(flat)
    with threads_for(flat.size):
        _erf(flat, out)
    return out.reshape(np.shape(x))


# --- tanh GELU (float64, rounded to float32) --------------------------------------------
# 0.5 x (1 + tanh(y)) = x sigmoid(2y), y = sqrt(2/pi) (x + 0.044715 x^3): one exp64 of -2|y| (never overflows)
# instead of libm's pow and tanh, scalar calls that took ~25 ns per element (57 of a 123 ms Gemma 3 prompt);
# every caller (ops.gelu, the prefill and decode layers) takes these bits.
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@njit(cache=True, inline="always", error_model="numpy")
def _gelu_tanh_sig(x):
    """float64 x -> (sigmoid(2y), 1 - sigmoid(2y), y'), each side computed without cancellation."""
    y = SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))
    e = exp64(-2.0 * abs(y))
    inv = 1.0 / (1.0 + e)
    s, c = (inv, e * inv) if y >= 0.0 else (e * inv, inv)
    return s, c, SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * (x * x))


@njit(cache=True, nogil=True, error_model="numpy")
def gelu_tanh_mul_range(g, u, out):
    """out = float32(gelu_tanh(float64(g))) * u over flat float32 arrays (the inference layers' gate)."""
    for i in range(g.shape[0]):
        x = np.float64(g[i])
        s, c, d = _gelu_tanh_sig(x)
        out[i] = np.float32(x * s) * u[i]


@njit(cache=True, nogil=True, error_model="numpy")
def _gelu_tanh_fwd(x, out, dydx):
    for i in range(x.shape[0]):
        v = np.float64(x[i])
        s, c, d = _gelu_tanh_sig(v)
        out[i] = v * s
        dydx[i] = s + 2.0 * v * s * c * d


def gelu_tanh(x):
    """x float array -> (float64 gelu_tanh(x), float64 derivative), same shape (ops.gelu's forward)."""
    flat = np.ascontiguousarray(x).reshape(-1)
    out, dydx = np.empty(flat.size), np.empty(flat.size)
    _gelu_tanh_fwd(flat, out, dydx)
    return out.reshape(np.shape(x)), dydx.reshape(np.shape(x))


# --- sigmoid / SiLU / SwiGLU (float32) -----------------------------------------------
# Elementwise maps with the SIMD exp of pipeline/kernels/fastexp.py (numpy's exp runs
# ~10 ns per float32 element here; this ~1). sigmoid(x) = num / (1 + e) with
# e = exp(-|x|) and num = 1 (x >= 0) or e (x < 0): exp never overflows, and
# the selects vectorize. Expressions keep numpy's evaluation order, so the
# fused SwiGLU gives the bits of silu then multiply.
@njit(cache=True, inline="always", error_model="numpy")
def _sigmoid1(x):
    e = expf(-abs(x))
    num = ONE if x >= ZERO else e
    return num / (ONE + e)


# error_model='numpy': IEEE division (1 + e >= 1 never divides by zero) instead of
# numba's ZeroDivisionError branch, which kept the loops scalar.
# The row functions take slices and loop from 0: with range(i0, i1) numba's
# negative-index wraparound stays in the loop and blocks vectorization.
@njit(cache=True, nogil=True, error_model="numpy")
def _sigmoid_range(x, out):
    for i in range(x.shape[0]):
        out[i] = _sigmoid1(x[i])


@njit(cache=True, nogil=True, error_model="numpy")
def _silu_range(x, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * _sigmoid1(x[i])


@njit(cache=True, nogil=True, error_model="numpy")
def _silu_bwd_range(g, x, gx):
    for i in range(x.shape[0]):
        s = _sigmoid1(x[i])
        gx[i] = g[i] * s * (ONE + x[i] * (ONE - s))


@njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_range(a, b, out):
    for i in range(a.shape[0]):
        out[i] = a[i] * _sigmoid1(a[i]) * b[i]


@njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_bwd_range(g, a, b, ga, gb):
    for i in range(a.shape[0]):
        s = _sigmoid1(a[i])
        gb[i] = g[i] * (a[i] * s)
        ga[i] = g[i] * b[i] * s * (ONE + a[i] * (ONE - s))


@njit(cache=True, parallel=True)
def _sigmoid(x, out):
    """x, out flat float32 [n]: out = sigmoid(x), over a fixed chunk grid."""
    n = x.size
    for c in prange((n + ELEM_CHUNK - 1) // ELEM_CHUNK):
        i0, i1 = c * ELEM_CHUNK, min(n, (c + 1) * ELEM_CHUNK)
        _sigmoid_range(x[i0:i1], out[i0:i1])


@njit(cache=True, parallel=True)
def _silu(x, out):
    """x, out flat float32 [n]: out = x * sigmoid(x)."""
    n = x.size
    for c in prange((n + ELEM_CHUNK - 1) // ELEM_CHUNK):
        i0, i1 = c * ELEM_CHUNK, min(n, (c + 1) * ELEM_CHUNK)
        _silu_range(x[i0:i1], out[i0:i1])


@njit(cache=True, parallel=True)
def _silu_bwd(g, x, gx):
    """g, x, gx flat float32 [n]: gx = g * s * (1 + x (1 - s)), s = sigmoid(x)."""
    n = x.size
    for c in prange((n + ELEM_CHUNK - 1) // ELEM_CHUNK):
        i0, i1 = c * ELEM_CHUNK, min(n, (c + 1) * ELEM_CHUNK)
        _silu_bwd_range(g[i0:i1], x[i0:i1], gx[i0:i1])


@njit(cache=True, parallel=True)
def _swiglu(a, b, out):
    """a, b, out flat float32 [n]: out = (a * sigmoid(a)) * b."""
    n = a.size
    for c in prange((n + ELEM_CHUNK - 1) // ELEM_CHUNK):
        i0, i1 = c * ELEM_CHUNK, min(n, (c + 1) * ELEM_CHUNK)
        _swiglu_range(a[i0:i1], b[i0:i1], out[i0:i1])


@njit(cache=True, parallel=True)
def _swiglu_bwd(g, a, b, ga, gb):
    """g, a, b, ga, gb flat float32 [n]: gb = g * silu(a); ga = (g * b) * s * (1 + a (1 - s))."""
    n = a.size
    for c in prange((n + ELEM_CHUNK - 1) // ELEM_CHUNK):
        i0, i1 = c * ELEM_CHUNK, min(n, (c + 1) * ELEM_CHUNK)
        _swiglu_bwd_range(g[i0:i1], a[i0:i1], b[i0:i1], ga[i0:i1], gb[i0:i1])


def _flat_f32(op, *arrays):
    """Validate same-shape float32 arrays; return their contiguous flat views."""
    shape = arrays[0].shape
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape:
            raise ValueError(f"{op}: expected float32 arrays of one shape, got "
                             f"{[(getattr(b, 'dtype', type(b).__name__), getattr(b, 'shape', None)) for b in arrays]}")
    return [np.ascontiguousarray(a).reshape(-1) for a in arrays]


def _map(op, kernel, range_kernel, n_out, *arrays):
    """kernel (parallel, whole arrays) or range_kernel (serial, slices) over flat float32 arrays."""
    flat = _flat_f32(op, *arrays)
    outs = [np.empty_like(flat[0]) for _ in range(n_out)]
    n = flat[0].size
    if n >= PARALLEL_MIN:
        kernel(*flat, *outs)
    elif n < SPLIT_MIN:  # one piece on this thread: the range kernel directly (a decode's SwiGLU: 14 -> 4 us)
        range_kernel(*flat, *outs)
    else:
        _split_chunks(-(-n // ELEM_CHUNK), n, lambda c0, c1: range_kernel(
            *[a[c0 * ELEM_CHUNK:c1 * ELEM_CHUNK] for a in flat + outs]))
    shape = arrays[0].shape
    return tuple(o.reshape(shape) for o in outs) if n_out > 1 else outs[0].reshape(shape)


def sigmoid(x):
    """float32 sigmoid of any-shape x."""
    return _map("sigmoid", _sigmoid, _sigmoid_range, 1, x)


def silu(x):
    """float32 x * sigmoid(x)."""
    return _map("silu", _silu, _silu_range, 1, x)


def silu_backward(g, x):
    """Gradient of silu at x for upstream g (float32, same shape)."""
    return _map("silu backward", _silu_bwd, _silu_bwd_range, 1, g, x)


def swiglu(a, b):
    """silu(a) * b (float32, same shape): the SwiGLU gate in one pass."""
    return _map("swiglu", _swiglu, _swiglu_range, 1, a, b)


def swiglu_backward(g, a, b):
    """-> (ga, gb) of swiglu(a, b) for upstream g."""
    return _map("swiglu backward", _swiglu_bwd, _swiglu_bwd_range, 2, g, a, b)


# --- rotary embedding (NeoX half rotation) -------------------------------------------
@njit(cache=True, nogil=True)
def _rope_rows(x, cos, sin, out):
    """x, out [R, H, D]; cos, sin [R, D/2]: out[:h] = x1 cos - x2 sin, out[h:] = x2 cos + x1 sin."""
    h = cos.shape[1]
    for r in range(x.shape[0]):
        c = cos[r]
        s = sin[r]
        for k in range(x.shape[1]):
            x1, x2 = x[r, k, :h], x[r, k, h:]  # halves as views: an index h + j kept the loop scalar
            o1, o2 = out[r, k, :h], out[r, k, h:]
            for j in range(h):
                o1[j] = x1[j] * c[j] - x2[j] * s[j]
                o2[j] = x2[j] * c[j] + x1[j] * s[j]


@njit(cache=True, parallel=True)
def _rope(x, cos, sin, out):
    """x, out [R, H, D] float32; cos, sin [R, D/2] float32; rows over a fixed chunk grid."""
    n = x.shape[0]
    for c in prange((n + ROW_CHUNK - 1) // ROW_CHUNK):
        i0, i1 = c * ROW_CHUNK, min(n, (c + 1) * ROW_CHUNK)
        _rope_rows(x[i0:i1], cos[i0:i1], sin[i0:i1], out[i0:i1])


def rope_rotate(x, cos, sin):
    """Rotate x [R, H, D] float32 by per-row angles (cos, sin [R, D/2] float32).
    The backward is the same call with -sin (a rotation by the negative angle)."""
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 3 and x.shape[2] % 2 == 0
            and cos.shape == sin.shape == (x.shape[0], x.shape[2] // 2) and cos.dtype == sin.dtype == np.float32):
        raise ValueError(f"rope: expected x float32 [R, H, D] and cos/sin float32 [R, D/2], got x "
                         f"{getattr(x, 'dtype', None)}{getattr(x, 'shape', None)}, "
                         f"cos {cos.dtype}{cos.shape}, sin {sin.dtype}{sin.shape}")
    x = np.ascontiguousarray(x)
    out = np.empty_like(x)
    cos, sin = np.ascontiguousarray(cos), np.ascontiguousarray(sin)
    if x.size >= PARALLEL_MIN:
        _rope(x, cos, sin, out)
    else:
        _split_chunks(-(-x.shape[0] // ROW_CHUNK), x.size, lambda c0, c1: _rope_rows(
            x[c0 * ROW_CHUNK:c1 * ROW_CHUNK], cos[c0 * ROW_CHUNK:c1 * ROW_CHUNK],
            sin[c0 * ROW_CHUNK:c1 * ROW_CHUNK], out[c0 * ROW_CHUNK:c1 * ROW_CHUNK]))
    return out


# --- big dense GEMMs on our own threads ---------------------------------------------
# Two-thread OpenBLAS spin-waits: on a 2-core machine shared with anything else
# a small batched matmul was measured 6.9 ms single-threaded vs 23 ms (quiet) to
# 1.4 s (one busy neighbour) with 2 BLAS threads. So the training step runs BLAS
# single-threaded (`single_thread_blas`) and the few big products are cut into
# tiles on a grid fixed by the shapes alone; each tile is one single-threaded
# BLAS call writing its own output columns, taken by whichever of our threads is
# free. No output element sums across tiles, so the bits never depend on the
# thread count (the same scheme as pipeline/kernels/qgemm.py for quantized weights).
TILED_MIN_FLOPS = 1 << 27  # below ~0.1 GFLOP one call on the calling thread is cheaper
N_TILES = 16               # tiles per product: enough to balance 2-4 threads
NN_TILE = 512              # matmul_nn: tile width along the cut side (measured within ~5% of one BLAS call)


def _tile_width(n, unit=256):
    """Output columns per tile: n / N_TILES rounded up to a multiple of unit (from n alone);
    at least `unit` so each BLAS call stays thick enough to run near peak."""
    return max(unit, -(-n // (N_TILES * unit)) * unit)


def _check_gemm(op, a, b, a_dim, b_dim):
    ok = (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.ndim == 2 and b.ndim == 2
          and a.dtype == b.dtype == np.float32 and a.shape[1] == b.shape[b_dim])
    if not ok:
        raise ValueError(f"{op}: expected float32 a [M, K] and b with K on axis {b_dim}, got "
                         f"{getattr(a, 'dtype', None)}{getattr(a, 'shape', None)} and "
                         f"{getattr(b, 'dtype', None)}{getattr(b, 'shape', None)}")
    # a transposed view (g.T in a weight gradient) goes to BLAS as it is: copying it costs as much as the product
    return a if a.flags.f_contiguous else np.ascontiguousarray(a)


def matmul_nt(a, b):
    """a [M, K] @ b.T for b [N, K] (float32) -> [M, N]: tiles over b's rows."""
    a = _check_gemm("matmul_nt", a, b, 1, 1)
    m, n = a.shape[0], b.shape[0]
    if 2 * m * n * a.shape[1] < TILED_MIN_FLOPS:
        with single_thread_blas():
            return a @ b.T
    width = _tile_width(n)
    out = np.empty((m, n), np.float32)

    def tile(i):
        r0, r1 = i * width, min(n, (i + 1) * width)
        gemm(a, b[r0:r1].T, out[:, r0:r1])

    run_tiles(-(-n // width), tile)
    return out


def matmul_nt_each(xs: list, b):
    """[matmul_nt(x, b) for x in xs] with each x's bits, sharing b: a tile of b is streamed from memory once for
    all xs (the ES members' rows against the output head, the model's largest matrix). Where the probe
    (qgemm.shared_call, layout x_wt) shows BLAS gives each x's rows the bits of its own call inside one call
    over all of them, every tile is ONE call over the stacked rows (16 members x 25 rows against SmolLM2's
    49152 x 576 head: 274 vs 637 ms CPU); else matmul_nt's call per x and tile."""
    m_rows, n = xs[0].shape[0], b.shape[0]
    if any(x.shape != xs[0].shape for x in xs) or 2 * m_rows * n * b.shape[1] < TILED_MIN_FLOPS:
        return [matmul_nt(x, b) for x in xs]  # matmul_nt's one-call case: nothing to share
    xs = [_check_gemm("matmul_nt_each", x, b, 1, 1) for x in xs]
    width = _tile_width(n)
    from .qgemm import shared_call
    if all(shared_call(r, b.shape[1], m_rows, len(xs), "x_wt") for r in {width, n - (-(-n // width) - 1) * width}):
        stacked = matmul_nt(np.concatenate(xs), b)  # the same tile grid (from n alone), one call per tile
        return [stacked[j * m_rows:(j + 1) * m_rows] for j in range(len(xs))]
    outs = [np.empty((m_rows, n), np.float32) for _ in xs]

    def tile(i):
        r0, r1 = i * width, min(n, (i + 1) * width)
        for x, out in zip(xs, outs):
            gemm(x, b[r0:r1].T, out[:, r0:r1])

    run_tiles(-(-n // width), tile)
    return outs


def _even_width(side, unit=64):
    """Tile width along a product's longer output side: ~NN_TILE wide pieces, at least 2 (a second core takes
    one) and at most N_TILES, each a multiple of unit; from the side alone."""
    tiles = min(N_TILES, max(2, side // NN_TILE))
    return -(-side // (tiles * unit)) * unit


def matmul_nn(a, b):
    """a [M, K] @ b for b [K, N] (float32) -> [M, N]: tiles across the longer output side (a's rows when
    M >= N, b's columns otherwise), ~NN_TILE wide and even: a tile repacks the operand it does not cut, and a
    ragged 256 + 128 cut of a 384-wide side cost 5-12% on one core (docs/BENCHMARKS.md, 2026-12-07)."""
    a = _check_gemm("matmul_nn", a, b, 1, 0)
    m, n = a.shape[0], b.shape[1]
    if 2 * m * n * a.shape[1] < TILED_MIN_FLOPS:
        with single_thread_blas():
            return a @ b
    out = np.empty((m, n), np.float32)
    rows = m >= n
    side = m if rows else n
    width = _even_width(side)

    def tile(i):
        e0, e1 = i * width, min(side, (i + 1) * width)
        if rows:
            gemm(a[e0:e1], b, out[e0:e1])
        else:
            gemm(a, b[:, e0:e1], out[:, e0:e1])

    run_tiles(-(-side // width), tile)
    return out
