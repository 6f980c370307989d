"""Optimizer update kernels: fused, single-pass, element-independent maps.

Each step of an elementwise optimizer reads the parameter, the gradient and
its state once and writes the parameter and the state once, so the step is
memory-bound; fusing the whole update into one loop is what lets it run near
memory bandwidth (a numpy expression chain would stream the arrays several
times). The trade-off is one hand-written loop per optimizer instead of
composed array ops.

Determinism: every update is an element-independent map, split over a FIXED
grid of CHUNK elements that does not depend on the thread count, so the bits
are identical for any number of numba threads. The one reduction (sum of
squares, used by gradient clipping and Muon/APOLLO norms) sums each chunk in
float64 in element order and then combines the chunk partials serially in
chunk order: also thread-count invariant.

State buffers are float32 or bf16. bf16 buffers are carried as uint16 arrays
(the raw bits); `_load`/`_store` widen on read and narrow on write with
round-to-nearest-even, NaN kept NaN (quieted, sign preserved). Which arm is
used is decided at compile time from the array type, so each (state dtype)
combination is its own compiled loop. All step math is float32; per-step
scalars arrive precomputed (in float64 by the caller, then cast to float32).

Shapes: every kernel takes 1-D C-contiguous arrays of one length n (callers
pass `.reshape(-1)` views); `p` float32 (the parameter or its f32 master), `g`
float32, state float32 or uint16 (bf16 bits).
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

CHUNK = 1 << 14  # fixed parallel grid (elements per task), independent of threads

_U16 = np.uint32(16)
_ONE = np.uint32(1)
_ROUND = np.uint32(0x7FFF)
_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_QUIET = np.uint32(0x0040)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """Reinterpret a uint32 as float32 (no conversion)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_from_f32(typingctx, x):
    """Reinterpret a float32 as uint32 (no conversion)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def fma(typingctx, x, y, z):
    """x*y + z with one rounding (llvm.fma.f32), as torch's vectorized CPU kernels compute
    add(alpha=), lerp and addcmul: matching it is what pins goldens to an ulp or two."""
    def codegen(context, builder, sig, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@njit(cache=True, inline="always", error_model="numpy")
def _lerp(a, b, w):
    """torch.lerp(a, b, w) on CPU: fma(w, b-a, a) for |w| < 0.5, else fma(w-1, b-a, b)."""
    if abs(w) < 0.5:
        return fma(w, b - a, a)
    return fma(w - np.float32(1), b - a, b)


@njit(cache=True, inline="always", error_model="numpy")
def bf16_bits(x):
    """float32 -> bf16 bits, round-to-nearest-even; NaN stays NaN (quiet bit set)."""
    u = _bits_from_f32(x)
    if (u & _ABS) > _INF:
        return np.uint16((u >> _U16) | _QUIET)
    return np.uint16((u + _ROUND + ((u >> _U16) & _ONE)) >> _U16)


@njit(cache=True, inline="always", error_model="numpy")
def _load(a, i):
    if isinstance(a[0], np.uint16):
        return _f32_from_bits(np.uint32(a[i]) << _U16)
    return a[i]


@njit(cache=True, inline="always", error_model="numpy")
def _store(a, i, x):
    if isinstance(a[0], np.uint16):
        a[i] = bf16_bits(x)
    else:
        a[i] = x


# Each update is a body `_x(arrays...)` (inlined) behind two entry points:
# `x_par` runs it on each CHUNK-sized slice of the fixed grid with prange,
# `x_ser` runs it over the whole arrays on the calling thread. (Bodies loop
# over `range(a.size)` of a slice, not `range(lo, hi)`: with a possibly
# negative `lo` numba keeps index wraparound checks that stop LLVM from
# vectorizing; error_model="numpy" likewise drops the division-by-zero check.) Per element the arithmetic is
# the same, so both give the same bits; `launch` picks the serial one for small
# tensors, where waking the thread pool costs more than the work.

# --- SGD ------------------------------------------------------------------

@njit(cache=True, inline="always", error_model="numpy")
def _sgd(p, g, buf, lr, momentum, one_minus_dampening, weight_decay, use_momentum, first, nesterov):
    """torch.optim.SGD single-tensor step.

    d = g + wd*p;  buf = d (first step) or buf*momentum + (1-dampening)*d;
    d = d + momentum*buf (nesterov) or buf;  p = p + (-lr)*d   (each "+ x*a" an fma).
    buf: [n] (or [1] unused when use_momentum is False).
    """
    neg_lr = -lr
    for i in range(p.size):
        d = g[i]
        if weight_decay != 0:
            d = fma(p[i], weight_decay, d)
        if use_momentum:
            if first:
                b = d
            else:
                b = fma(d, one_minus_dampening, _load(buf, i) * momentum)
            _store(buf, i, b)
            if nesterov:
                d = fma(b, momentum, d)
            else:
                d = b
        p[i] = fma(d, neg_lr, p[i])


@njit(cache=True, parallel=True, error_model="numpy")
def sgd_par(p, g, buf, lr, momentum, one_minus_dampening, weight_decay, use_momentum, first, nesterov):
    n = p.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = c * CHUNK, min(n, c * CHUNK + CHUNK)
        _sgd(p[lo:hi], g[lo:hi], buf[lo:hi] if use_momentum else buf, lr, momentum, one_minus_dampening,
             weight_decay, use_momentum, first, nesterov)


@njit(cache=True, error_model="numpy")
def sgd_ser(p, g, buf, lr, momentum, one_minus_dampening, weight_decay, use_momentum, first, nesterov):
    _sgd(p, g, buf, lr, momentum, one_minus_dampening, weight_decay, use_momentum, first, nesterov)


# --- Adam / AdamW (torch single-tensor path) --------------------------------

@njit(cache=True, inline="always", error_model="numpy")
def _adam(p, g, m, v, keep, l2, w1, beta2, one_minus_b2, neg_step_size, bc2_sqrt, eps):
    """One Adam/AdamW step (torch single-tensor formulas).

    AdamW: keep = 1 - lr*wd (decoupled decay before the step), l2 = 0.
    Adam:  keep = 1, l2 = wd (coupled: g += wd*p before the moments).
    m = lerp(m, g, w1 = 1-b1);  v = v*b2 + ((1-b2)*g)*g  (fma);
    p = p*keep + ((-lr/bc1)*m) / (sqrt(v)/sqrt(bc2) + eps).
    """
    for i in range(p.size):
        pi = p[i]
        gi = g[i]
        if l2 != 0:
            gi = fma(pi, l2, gi)
        if keep != 1:
            pi = pi * keep
        m0 = _load(m, i)
        v0 = _load(v, i)
        m1 = _lerp(m0, gi, w1)
        v1 = fma(one_minus_b2 * gi, gi, v0 * beta2)
        _store(m, i, m1)
        _store(v, i, v1)
        p[i] = pi + (neg_step_size * m1) / (np.sqrt(v1) / bc2_sqrt + eps)


@njit(cache=True, parallel=True, error_model="numpy")
def adam_par(p, g, m, v, keep, l2, w1, beta2, one_minus_b2, neg_step_size, bc2_sqrt, eps):
    n = p.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = c * CHUNK, min(n, c * CHUNK + CHUNK)
        _adam(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], keep, l2, w1, beta2, one_minus_b2, neg_step_size, bc2_sqrt, eps)


@njit(cache=True, error_model="numpy")
def adam_ser(p, g, m, v, keep, l2, w1, beta2, one_minus_b2, neg_step_size, bc2_sqrt, eps):
    _adam(p, g, m, v, keep, l2, w1, beta2, one_minus_b2, neg_step_size, bc2_sqrt, eps)


# --- legacy HuggingFace AdamW (APOLLO's fallback) ----------------------------------

@njit(cache=True, inline="always", error_model="numpy")
def _hf_adamw(p, g, m, v, beta1, one_minus_b1, beta2, one_minus_b2, eps, neg_step_size, neg_lr_wd):
    """apollo_torch's AdamW step for unprojected params (eps on the uncorrected sqrt(v),
    decay AFTER the step):  m = m*b1 + (1-b1)*g;  v = v*b2 + ((1-b2)*g)*g;
    p = p + (-step_size) * (m / (sqrt(v) + eps));  p = p + (-lr*wd)*p   (each "+ x*a" an fma).
    """
    for i in range(p.size):
        gi = g[i]
        m1 = fma(gi, one_minus_b1, m[i] * beta1)
        v1 = fma(one_minus_b2 * gi, gi, v[i] * beta2)
        m[i] = m1
        v[i] = v1
        pi = fma(m1 / (np.sqrt(v1) + eps), neg_step_size, p[i])
        if neg_lr_wd != 0:
            pi = fma(pi, neg_lr_wd, pi)
        p[i] = pi


@njit(cache=True, parallel=True, error_model="numpy")
def hf_adamw_par(p, g, m, v, beta1, one_minus_b1, beta2, one_minus_b2, eps, neg_step_size, neg_lr_wd):
    n = p.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = c * CHUNK, min(n, c * CHUNK + CHUNK)
        _hf_adamw(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], beta1, one_minus_b1, beta2, one_minus_b2, eps,
                  neg_step_size, neg_lr_wd)


@njit(cache=True, error_model="numpy")
def hf_adamw_ser(p, g, m, v, beta1, one_minus_b1, beta2, one_minus_b2, eps, neg_step_size, neg_lr_wd):
    _hf_adamw(p, g, m, v, beta1, one_minus_b1, beta2, one_minus_b2, eps, neg_step_size, neg_lr_wd)


# --- Lion -------------------------------------------------------------------

@njit(cache=True, inline="always", error_model="numpy")
def _lion(p, g, m, keep, neg_lr, beta1, one_minus_b1, beta2, one_minus_b2):
    """Lion (Chen et al. 2023): p = p*keep + (-lr)*sign(m*b1 + (1-b1)*g); m = m*b2 + (1-b2)*g."""
    for i in range(p.size):
        gi = g[i]
        m0 = _load(m, i)
        u = fma(gi, one_minus_b1, m0 * beta1)
        s = np.float32(0)
        if u > 0:
            s = np.float32(1)
        elif u < 0:
            s = np.float32(-1)
        elif u != u:
            s = u  # NaN propagates, like torch.sign
        pi = p[i]
        if keep != 1:
            pi = pi * keep
        p[i] = fma(s, neg_lr, pi)
        _store(m, i, fma(gi, one_minus_b2, m0 * beta2))


@njit(cache=True, parallel=True, error_model="numpy")
def lion_par(p, g, m, keep, neg_lr, beta1, one_minus_b1, beta2, one_minus_b2):
    n = p.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = c * CHUNK, min(n, c * CHUNK + CHUNK)
        _lion(p[lo:hi], g[lo:hi], m[lo:hi], keep, neg_lr, beta1, one_minus_b1, beta2, one_minus_b2)


@njit(cache=True, error_model="numpy")
def lion_ser(p, g, m, keep, neg_lr, beta1, one_minus_b1, beta2, one_minus_b2):
    _lion(p, g, m, keep, neg_lr, beta1, one_minus_b1, beta2, one_minus_b2)


# --- Muon momentum ------------------------------------------------------------

@njit(cache=True, inline="always", error_model="numpy")
def _muon_momentum(g, buf, out, w_buf, momentum, nesterov):
    """buf = lerp(buf, g, 1-momentum); out = lerp(g, buf, momentum) (nesterov) or buf.

    w_buf = 1 - momentum (float64-computed then cast), out: [n] float32.
    """
    for i in range(g.size):
        gi = g[i]
        b1 = _lerp(_load(buf, i), gi, w_buf)
        _store(buf, i, b1)
        if nesterov:
            out[i] = _lerp(gi, b1, momentum)
        else:
            out[i] = b1


@njit(cache=True, parallel=True, error_model="numpy")
def muon_momentum_par(g, buf, out, w_buf, momentum, nesterov):
    n = g.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = c * CHUNK, min(n, c * CHUNK + CHUNK)
        _muon_momentum(g[lo:hi], buf[lo:hi], out[lo:hi], w_buf, momentum, nesterov)


@njit(cache=True, error_model="numpy")
def muon_momentum_ser(g, buf, out, w_buf, momentum, nesterov):
    _muon_momentum(g, buf, out, w_buf, momentum, nesterov)


# --- small fused maps (APOLLO, Muon's apply, scaling) ---------------------------

@njit(cache=True, inline="always", error_model="numpy")
def _axpby(y, beta, x, alpha):
    """y = fma(x, alpha, y*beta) (torch: y.mul_(beta).add_(x, alpha=alpha))."""
    for i in range(y.size):
        yi = y[i]
        if beta != 1:
            yi = yi * beta
        y[i] = fma(x[i], alpha, yi)


@njit(cache=True, parallel=True, error_model="numpy")
def axpby_par(y, beta, x, alpha):
    n = y.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = c * CHUNK, min(n, c * CHUNK + CHUNK)
        _axpby(y[lo:hi], beta, x[lo:hi], alpha)


@njit(cache=True, error_model="numpy")
def axpby_ser(y, beta, x, alpha):
    _axpby(y, beta, x, alpha)


@njit(cache=True, error_model="numpy")
def ema_sq_ser(v, beta, x, alpha):
    """v = fma(alpha*x, x, v*beta) (torch: v.mul_(beta).addcmul_(x, x, value=alpha)); compressed
    APOLLO moments only, so serial."""
    for i in range(v.size):
        xi = x[i]
        v[i] = fma(alpha * xi, xi, v[i] * beta)


@njit(cache=True, inline="always", error_model="numpy")
def _scale(x, f):
    for i in range(x.size):
        x[i] = x[i] * f


@njit(cache=True, parallel=True, error_model="numpy")
def scale_par(x, f):
    n = x.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = c * CHUNK, min(n, c * CHUNK + CHUNK)
        _scale(x[lo:hi], f)


@njit(cache=True, error_model="numpy")
def scale_ser(x, f):
    _scale(x, f)


# --- the one reduction: fixed chunks, float64, serial combine --------------------

@njit(cache=True, inline="always", error_model="numpy")
def _chunk_sq(x, c):
    """Sum of squares of chunk c in float64: four interleaved accumulators (element i goes
    to accumulator i % 4), combined as (a0 + a1) + (a2 + a3): a fixed order, and four
    independent dependency chains instead of one."""
    lo, hi = c * CHUNK, min(x.size, c * CHUNK + CHUNK)
    y = x[lo:hi]
    a0 = a1 = a2 = a3 = 0.0
    n4 = y.size - y.size % 4
    for i in range(0, n4, 4):
        x0, x1, x2, x3 = np.float64(y[i]), np.float64(y[i + 1]), np.float64(y[i + 2]), np.float64(y[i + 3])
        a0 += x0 * x0
        a1 += x1 * x1
        a2 += x2 * x2
        a3 += x3 * x3
    for i in range(n4, y.size):
        xi = np.float64(y[i])
        a0 += xi * xi
    return (a0 + a1) + (a2 + a3)


@njit(cache=True, parallel=True, error_model="numpy")
def sum_squares_par(x):
    partial = np.empty((x.size + CHUNK - 1) // CHUNK, dtype=np.float64)
    for c in prange(partial.size):
        partial[c] = _chunk_sq(x, c)
    total = 0.0
    for c in range(partial.size):
        total += partial[c]
    return total


@njit(cache=True, error_model="numpy")
def sum_squares_ser(x):
    total = 0.0
    for c in range((x.size + CHUNK - 1) // CHUNK):
        total += _chunk_sq(x, c)
    return total


@njit(cache=True, error_model="numpy")
def bf16_narrow_ser(x, out):
    """out[i] = bf16 bits of x[i] (RNE, NaN preserved); x float32 [n], out uint16 [n]."""
    for i in range(x.size):
        out[i] = bf16_bits(x[i])


@njit(cache=True, inline="always", error_model="numpy")
def _triad(a, b, s):
    for i in range(a.size):
        a[i] = a[i] + s * b[i]


@njit(cache=True, parallel=True, error_model="numpy")
def triad_par(a, b, s):
    """In-place STREAM-style triad a = a + s*b over the fixed chunk grid: the bandwidth
    yardstick of `fucina bench optim`. 12 bytes per element, all of them real traffic:
    like the optimizer loops it reads every array it writes, so it pays no write-allocate."""
    n = a.size
    for k in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = k * CHUNK, min(n, k * CHUNK + CHUNK)
        _triad(a[lo:hi], b[lo:hi], s)


PARALLEL_MIN = 1 << 17  # below this many elements the thread pool costs more than it saves


def launch(par, ser, n, *args):
    """Run the parallel entry point for large n, the serial one otherwise (same bits)."""
    return (par if n >= PARALLEL_MIN else ser)(*args)


# --- public wrappers (validate, then call the kernels) -----------------------

def _flat_f32(a, what):
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        raise TypeError(f"{what}: expected a float32 numpy array, got {getattr(a, 'dtype', type(a).__name__)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous (shape {a.shape})")
    return a.reshape(-1)


def _state(a, n, what):
    if not isinstance(a, np.ndarray) or a.dtype not in (np.float32, np.uint16):
        raise TypeError(f"{what}: state must be float32 or uint16 (bf16 bits), "
                        f"got {getattr(a, 'dtype', type(a).__name__)}")
    if a.ndim != 1 or a.size != n or not a.flags.c_contiguous:
        raise ValueError(f"{what}: state must be a contiguous [{n}] array, got shape {a.shape}")
    return a


def _pg(p, g, what):
    p = _flat_f32(p, f"{what} p")
    g = _flat_f32(g, f"{what} g")
    if p.size != g.size:
        raise ValueError(f"{what}: param has {p.size} elements, grad {g.size}")
    return p, g


def sgd_step(p, g, buf, lr, momentum, one_minus_dampening, weight_decay, use_momentum, first, nesterov):
    """In-place SGD step on flat float32 p with grad g; buf [n] state (or a [1] placeholder)."""
    p, g = _pg(p, g, "sgd_step")
    if use_momentum:
        _state(buf, p.size, "sgd_step momentum_buffer")
    f = np.float32
    launch(sgd_par, sgd_ser, p.size, p, g, buf, f(lr), f(momentum), f(one_minus_dampening), f(weight_decay),
           bool(use_momentum), bool(first), bool(nesterov))


def adam_step(p, g, m, v, keep, l2, w1, beta2, one_minus_b2, neg_step_size, bc2_sqrt, eps):
    """In-place Adam/AdamW step (see _adam); m, v float32 or bf16-bits state."""
    p, g = _pg(p, g, "adam_step")
    _state(m, p.size, "adam_step exp_avg")
    _state(v, p.size, "adam_step exp_avg_sq")
    f = np.float32
    launch(adam_par, adam_ser, p.size, p, g, m, v, f(keep), f(l2), f(w1), f(beta2), f(one_minus_b2),
           f(neg_step_size), f(bc2_sqrt), f(eps))


def hf_adamw_step(p, g, m, v, beta1, one_minus_b1, beta2, one_minus_b2, eps, neg_step_size, neg_lr_wd):
    """In-place legacy-HF AdamW step (APOLLO's unprojected params); m, v float32 [n]."""
    p, g = _pg(p, g, "hf_adamw_step")
    for buf, what in ((m, "exp_avg"), (v, "exp_avg_sq")):
        if _state(buf, p.size, f"hf_adamw_step {what}").dtype != np.float32:
            raise TypeError(f"hf_adamw_step: {what} must be float32 (APOLLO state is float32 only)")
    f = np.float32
    launch(hf_adamw_par, hf_adamw_ser, p.size, p, g, m, v, f(beta1), f(one_minus_b1), f(beta2), f(one_minus_b2),
           f(eps), f(neg_step_size), f(neg_lr_wd))


def lion_step(p, g, m, keep, neg_lr, beta1, one_minus_b1, beta2, one_minus_b2):
    """In-place Lion step; m float32 or bf16-bits state."""
    p, g = _pg(p, g, "lion_step")
    _state(m, p.size, "lion_step exp_avg")
    f = np.float32
    launch(lion_par, lion_ser, p.size, p, g, m,
           f(keep), f(neg_lr), f(beta1), f(one_minus_b1), f(beta2), f(one_minus_b2))


def muon_momentum(g, buf, w_buf, momentum, nesterov):
    """Update Muon's momentum buffer in place; return the (Nesterov) update as a new float32 [n] array."""
    g = _flat_f32(g, "muon_momentum g")
    _state(buf, g.size, "muon_momentum momentum_buffer")
    out = np.empty_like(g)
    launch(muon_momentum_par, muon_momentum_ser, g.size, g, buf, out,
           np.float32(w_buf), np.float32(momentum), bool(nesterov))
    return out


def sum_squares(x):
    """Sum of squares of a float32 array in float64, thread-count invariant."""
    flat = _flat_f32(np.ascontiguousarray(x), "sum_squares")
    return float(launch(sum_squares_par, sum_squares_ser, flat.size, flat))


def scale_(x, factor):
    """In-place x *= float32(factor) over a C-contiguous float32 array."""
    flat = _flat_f32(x, "scale_")
    launch(scale_par, scale_ser, flat.size, flat, np.float32(factor))
    return x


def axpby_(y, beta, x, alpha):
    """In place y = y*beta + x*alpha with torch's fma rounding (C-contiguous float32, same size)."""
    yf, xf = _flat_f32(y, "axpby_ y"), _flat_f32(np.ascontiguousarray(x), "axpby_ x")
    if yf.size != xf.size:
        raise ValueError(f"axpby_: sizes differ ({y.shape} vs {np.shape(x)})")
    launch(axpby_par, axpby_ser, yf.size, yf, np.float32(beta), xf, np.float32(alpha))
    return y


def ema_sq_(v, beta, x, alpha):
    """In place v = v*beta + (alpha*x)*x with torch's fma rounding."""
    vf, xf = _flat_f32(v, "ema_sq_ v"), _flat_f32(np.ascontiguousarray(x), "ema_sq_ x")
    if vf.size != xf.size:
        raise ValueError(f"ema_sq_: sizes differ ({v.shape} vs {np.shape(x)})")
    ema_sq_ser(vf, np.float32(beta), xf, np.float32(alpha))
    return v


def f32_to_bf16_bits(x):
    """float32 array -> uint16 array of bf16 bits (RNE, NaN preserved), same shape."""
    flat = _flat_f32(np.ascontiguousarray(x, dtype=np.float32), "f32_to_bf16_bits")
    out = np.empty(flat.size, dtype=np.uint16)
    bf16_narrow_ser(flat, out)
    return out.reshape(np.shape(x))


def bf16_bits_to_f32(bits):
    """uint16 bf16 bits -> float32 (exact widening)."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)
