"""Differentiable ops: each builds its output and its backward side by side.

A backward closure receives the float32 gradient of the output and returns one
gradient per parent (None where a parent needs none). Broadcasting is undone by
the engine (`_reduce_to_shape`), so elementwise ops may return full-shape grads.

Trade-off: plain numpy first (legible, BLAS for contractions); the few row
kernels that dominate training time (cross-entropy, RMSNorm, dropout, and for
float32 sigmoid/SiLU/RoPE) call numba kernels in `pipeline/kernels/`; attention runs its
(batch, kv head) GEMMs and `linear` its float32 products in tiles on our threads.
Forward values keep the input dtype (float64 inputs stay float64, which the
finite-difference tests rely on); 16-bit inputs to contractions are widened to
float32 for the compute. Gradients are float32.

Anything that is not a Tensor (a numpy array, a Python number, a frozen
bf16 weight) is a constant: it takes part in the forward and gets no gradient.
"""
from __future__ import annotations

import builtins
import math

import ml_dtypes
import numpy as np

from pipeline.kernels.nn import matmul_nn

from .tensor import OpError, OpIndexError, Tensor, enable_grad, grad_enabled

__all__ = [
    "as_tensor", "add", "sub", "mul", "div", "neg", "pow", "exp", "log", "tanh", "sigmoid", "silu", "gelu",
    "relu", "sqrt", "abs", "clamp", "where", "stack", "matmul", "linear", "sum", "mean", "max", "reshape",
    "transpose", "permute", "index", "gather",
    "embedding", "concat", "split", "softmax", "log_softmax", "rms_norm", "layer_norm", "rope", "rope_tables",
    "attention", "dropout", "to", "checkpoint",
]

_SIXTEEN_BIT = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_DTYPES = {
    "float32": np.dtype(np.float32), "f32": np.dtype(np.float32),
    "float16": np.dtype(np.float16), "f16": np.dtype(np.float16), "half": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16), "bf16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64), "f64": np.dtype(np.float64),
}


def as_tensor(x) -> Tensor:
    if isinstance(x, Tensor):
        return x
    arr = np.asarray(x)
    if arr.dtype.kind in "iub" or arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    return Tensor(arr)


def _f32(a):
    return a if a.dtype == np.float32 else a.astype(np.float32)


def _compute(a):
    """The array an op computes with: 16-bit floats are widened to float32."""
    return a.astype(np.float32) if a.dtype in _SIXTEEN_BIT else a


def _binary(op, a, b, fn):
    a, b = as_tensor(a), as_tensor(b)
    try:
        np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise OpError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast") from None
    return a, b, fn(a.data, b.data)


# --- elementwise arithmetic -------------------------------------------------
def add(a, b):
    a, b, out = _binary("add", a, b, np.add)
    return Tensor.make(out, (a, b), lambda g: (g, g), "add")


def sub(a, b):
    a, b, out = _binary("sub", a, b, np.subtract)
    return Tensor.make(out, (a, b), lambda g: (g, -g), "sub")


def mul(a, b):
    a, b, out = _binary("mul", a, b, np.multiply)

    def backward(g):
        return (g * b.data if a.requires_grad else None, g * a.data if b.requires_grad else None)

    return Tensor.make(out, (a, b), backward, "mul")


def div(a, b):
    a, b, out = _binary("div", a, b, np.divide)

    def backward(g):
        ga = g / b.data if a.requires_grad else None
        gb = -g * out / b.data if b.requires_grad else None
        return ga, gb

    return Tensor.make(out, (a, b), backward, "div")


def neg(a):
    a = as_tensor(a)
    return Tensor.make(-a.data, (a,), lambda g: (-g,), "neg")


def pow(a, p: float):
    """a ** p for a constant exponent p."""
    a = as_tensor(a)
    if isinstance(p, Tensor):
        raise OpError("pow: the exponent must be a constant number, got a Tensor")
    out = a.data ** p
    return Tensor.make(out, (a,), lambda g: (g * p * a.data ** (p - 1),), "pow")


def exp(a):
    a = as_tensor(a)
    out = np.exp(a.data)
    return Tensor.make(out, (a,), lambda g: (g * out,), "exp")


def log(a):
    a = as_tensor(a)
    return Tensor.make(np.log(a.data), (a,), lambda g: (g / a.data,), "log")


def tanh(a):
    a = as_tensor(a)
    out = np.tanh(a.data)
    return Tensor.make(out, (a,), lambda g: (g * (1.0 - out * out),), "tanh")


def _sigmoid(x):
    # split by sign so exp never overflows
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


def sigmoid(a):
    a = as_tensor(a)
    if a.dtype == np.float32:  # SIMD exp kernel; float64 (finite differences) stays numpy
        from pipeline.kernels.nn import sigmoid as sigmoid_f32
        out = sigmoid_f32(a.data)
    else:
        out = _sigmoid(a.data)
    return Tensor.make(out, (a,), lambda g: (g * out * (1.0 - out),), "sigmoid")


def silu(a):
    """x * sigmoid(x) (a.k.a. swish), as in SwiGLU MLPs."""
    a = as_tensor(a)
    if a.dtype == np.float32:  # one fused pass each way; backward recomputes sigmoid instead of storing it
        from pipeline.kernels.nn import silu as silu_f32, silu_backward
        return Tensor.make(silu_f32(a.data), (a,), lambda g: (silu_backward(_f32(g), a.data),), "silu")
    s = _sigmoid(a.data)
    out = a.data * s
    return Tensor.make(out, (a,), lambda g: (g * s * (1.0 + a.data * (1.0 - s)),), "silu")


def relu(a):
    a = as_tensor(a)
    out = np.maximum(a.data, 0)
    return Tensor.make(out, (a,), lambda g: (g * (a.data > 0),), "relu")


def sqrt(a):
    a = as_tensor(a)
    out = np.sqrt(a.data)
    return Tensor.make(out, (a,), lambda g: (g * 0.5 / out,), "sqrt")


def abs(a):
    """|a|; the gradient at 0 is 0 (torch's sign convention)."""
    a = as_tensor(a)
    return Tensor.make(np.abs(a.data), (a,), lambda g: (g * np.sign(a.data),), "abs")


def clamp(a, low=None, high=None):
    """min(max(a, low), high); the gradient passes only where a is inside [low, high]."""
    a = as_tensor(a)
    if low is None and high is None:
        raise OpError("clamp: give low, high or both")
    out = np.clip(a.data, low, high)
    inside = np.ones(a.shape, bool)
    if low is not None:
        inside &= a.data >= low
    if high is not None:
        inside &= a.data <= high
    return Tensor.make(out, (a,), lambda g: (g * inside,), "clamp")


def where(cond, a, b):
    """cond ? a : b elementwise (cond a boolean array, broadcast with a and b)."""
    cond = np.asarray(cond.data if isinstance(cond, Tensor) else cond)
    if cond.dtype != np.bool_:
        raise OpError(f"where: cond must be a boolean array, got dtype {cond.dtype}")
    a, b = as_tensor(a), as_tensor(b)
    try:
        out = np.where(cond, a.data, b.data)
    except ValueError:
        raise OpError(f"where: shapes {cond.shape}, {a.shape} and {b.shape} do not broadcast") from None
    return Tensor.make(out, (a, b), lambda g: (np.where(cond, g, 0), np.where(cond, 0, g)), "where")


_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
def gelu(a, approximate="none"):
    """GELU. approximate='none' (torch default): x * Phi(x) with the exact erf;
    approximate='tanh': 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    a = as_tensor(a)
    x = a.data
    x64 = x.astype(np.float64)
    if approximate == "tanh":  # as x sigmoid(2 inner), one vectorized float64 pass (kernels.nn.gelu_tanh)
        from pipeline.kernels.nn import gelu_tanh
        out64, dydx = gelu_tanh(x64)
    elif approximate == "none":
        from pipeline.kernels.nn import erf
        cdf = 0.5 * (1.0 + erf(x64 * _INV_SQRT_2))
        out64 = x64 * cdf
        dydx = cdf + x64 * _INV_SQRT_2PI * np.exp(-0.5 * x64 * x64)
    else:
        raise OpError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    out = out64.astype(x.dtype if x.dtype.kind == "f" else np.float32)
    return Tensor.make(out, (a,), lambda g: (g * dydx,), "gelu")


# --- linear algebra ----------------------------------------------------------
def matmul(a, b):
    """a @ b with numpy semantics (batched, broadcast batch dims; 1-D operands promoted)."""
    a, b = as_tensor(a), as_tensor(b)
    if a.ndim < 1 or b.ndim < 1 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
        raise OpError(f"matmul: shapes {a.shape} and {b.shape} are not aligned "
                      "(last dim of a must equal the second-to-last of b)")
    try:
        out = _compute(a.data) @ _compute(b.data)
    except ValueError:
        raise OpError(f"matmul: batch dims of {a.shape} and {b.shape} do not broadcast") from None

    def backward(g):
        A = _compute(a.data)
        B = _compute(b.data)
        A2 = A[None, :] if A.ndim == 1 else A
        B2 = B[:, None] if B.ndim == 1 else B
        G = g
        if a.ndim == 1:
            G = np.expand_dims(G, -2)
        if b.ndim == 1:
            G = np.expand_dims(G, -1)
        ga = gb = None
        if a.requires_grad:
            ga = G @ np.swapaxes(B2, -1, -2)
            if a.ndim == 1:
                ga = ga.reshape(ga.shape[:-2] + (ga.shape[-1],)).reshape(-1, a.shape[0]).sum(0)
        if b.requires_grad:
            gb = np.swapaxes(A2, -1, -2) @ G
            if b.ndim == 1:
                gb = gb.reshape(-1, b.shape[0]).sum(0)
        return ga, gb

    return Tensor.make(out, (a, b), backward, "matmul")


def _gemm(a, b):
    """a @ b of 2-D arrays. float32 products go to pipeline.kernels.nn.matmul_nn: a big one is cut into tiles on a
    grid fixed by the shapes and run on our threads (the training step holds BLAS at one thread, so a
    plain `@` would use one core whatever --threads says); the bits never depend on the thread count."""
    if a.dtype == b.dtype == np.float32:
        return matmul_nn(a, b)
    return a @ b


def linear(x, w, b=None):
    """y = x @ w.T + b with w laid out [out, in] (torch nn.Linear). w may be a
    16-bit constant or leaf; the product is computed in float32."""
    x, w = as_tensor(x), as_tensor(w)
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise OpError(f"linear: x {x.shape} and weight {w.shape} do not fit "
                      "(weight is [out, in]; x's last dim must equal in)")
    if b is not None:
        b = as_tensor(b)
        if b.shape != (w.shape[0],):
            raise OpError(f"linear: bias shape {b.shape} must be ({w.shape[0]},) for weight {w.shape}")
    X = _compute(x.data)
    W = _compute(w.data)
    out = _gemm(X.reshape(-1, X.shape[-1]), W.T).reshape(X.shape[:-1] + (W.shape[0],))
    if b is not None:
        out = out + _compute(b.data)

    def backward(g):
        g2 = g.reshape(-1, g.shape[-1])
        gx = _gemm(g2, _compute(w.data)).reshape(x.shape) if x.requires_grad else None
        gw = _gemm(g2.T, _compute(x.data).reshape(-1, x.shape[-1])) if w.requires_grad else None
        gb = g2.sum(axis=0) if b is not None and b.requires_grad else None
        return gx, gw, gb

    parents = (x, w) if b is None else (x, w, b)
    return Tensor.make(out, parents, backward, "linear")


# --- reductions -----------------------------------------------------------------
def _axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(ax % ndim for ax in axes)


def _acc_dtype(a):
    return np.float32 if a.dtype in _SIXTEEN_BIT or a.dtype.kind != "f" else a.dtype


def sum(a, axis=None, keepdims=False):
    a = as_tensor(a)
    axes = _axes(axis, a.ndim)
    out = np.asarray(a.data.sum(axis=axes, keepdims=keepdims, dtype=_acc_dtype(a)))

    def backward(g):
        if not keepdims:
            g = np.expand_dims(g, axes)
        return (np.broadcast_to(g, a.shape),)

    return Tensor.make(out, (a,), backward, "sum")


def mean(a, axis=None, keepdims=False):
    a = as_tensor(a)
    axes = _axes(axis, a.ndim)
    n = int(np.prod([a.shape[i] for i in axes])) if axes else 1
    s = sum(a, axes, keepdims)
    return mul(s, np.asarray(1.0 / n, dtype=s.dtype))


def max(a, axis=None, keepdims=False):
    """Maximum over axes. Gradient is split evenly among tied maxima (torch amax)."""
    a = as_tensor(a)
    axes = _axes(axis, a.ndim)
    out_keep = a.data.max(axis=axes, keepdims=True)
    out = out_keep if keepdims else out_keep.reshape([s for i, s in enumerate(a.shape) if i not in axes])

    def backward(g):
        if not keepdims:
            g = np.expand_dims(g, axes)
        hit = (a.data == out_keep).astype(np.float32)
        return (g * hit / hit.sum(axis=axes, keepdims=True),)

    return Tensor.make(np.asarray(out), (a,), backward, "max")


# --- shape ------------------------------------------------------------------
def reshape(a, *shape):
    a = as_tensor(a)
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    try:
        out = a.data.reshape(shape)
    except ValueError:
        raise OpError(f"reshape: cannot reshape {a.shape} ({a.size} elements) into {tuple(shape)}") from None
    return Tensor.make(out, (a,), lambda g: (g.reshape(a.shape),), "reshape")


def transpose(a, axis0=-2, axis1=-1):
    """Swap two axes (defaults: the last two)."""
    a = as_tensor(a)
    return Tensor.make(np.swapaxes(a.data, axis0, axis1), (a,), lambda g: (np.swapaxes(g, axis0, axis1),), "transpose")


def permute(a, *axes):
    a = as_tensor(a)
    axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
    if sorted(ax % a.ndim for ax in axes) != list(range(a.ndim)):
        raise OpError(f"permute: axes {axes} are not a permutation of {a.ndim} dims (shape {a.shape})")
    inverse = np.argsort([ax % a.ndim for ax in axes])
    return Tensor.make(np.transpose(a.data, axes), (a,), lambda g: (np.transpose(g, inverse),), "permute")


def _is_basic_index(idx):
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(isinstance(i, (int, np.integer, slice, type(None), type(Ellipsis))) for i in items)


def index(a, idx):
    """a[idx] (basic or advanced numpy indexing). Backward scatters with a
    sequential add, so repeated indices accumulate in a fixed order."""
    a = as_tensor(a)
    if isinstance(idx, Tensor):
        idx = idx.data
    if isinstance(idx, tuple):
        idx = tuple(i.data if isinstance(i, Tensor) else i for i in idx)
    try:
        out = a.data[idx]
    except IndexError as e:
        raise OpIndexError(f"index: {e} (tensor shape {a.shape})") from None
    basic = _is_basic_index(idx)

    def backward(g):
        ga = np.zeros(a.shape, dtype=np.float32)
        if basic:
            ga[idx] = g
        else:
            np.add.at(ga, idx, g)
        return (ga,)

    return Tensor.make(np.array(out) if basic else out, (a,), backward, "index")


def gather(a, axis, idx):
    """torch.gather: out[..., i, ...] = a[..., idx[..., i, ...], ...] along `axis`."""
    a = as_tensor(a)
    ids = np.asarray(idx.data if isinstance(idx, Tensor) else idx)
    if ids.dtype.kind not in "iu":
        raise OpError(f"gather: index must be an integer array, got dtype {ids.dtype}")
    if ids.ndim != a.ndim:
        raise OpError(f"gather: index rank {ids.ndim} (shape {ids.shape}) "
                      f"must equal input rank {a.ndim} (shape {a.shape})")
    axis = axis % a.ndim
    if ids.size and (ids.min() < 0 or ids.max() >= a.shape[axis]):
        raise OpError(f"gather: index values must be in [0, {a.shape[axis]}) along axis {axis}, "
                      f"got [{ids.min()}, {ids.max()}]")
    out = np.take_along_axis(a.data, ids, axis)

    def backward(g):
        ga = np.zeros(a.shape, dtype=np.float32)
        full = list(np.indices(ids.shape, sparse=True))
        full[axis] = ids
        np.add.at(ga, tuple(full), g)
        return (ga,)

    return Tensor.make(out, (a,), backward, "gather")


def embedding(ids, table):
    """table[ids]: ids any-shape integer array, table [vocab, dim] -> [*ids.shape, dim].
    Backward is a deterministic scatter-add (rows summed in id order)."""
    from pipeline.kernels.nn import embedding_backward

    table = as_tensor(table)
    ids = np.asarray(ids.data if isinstance(ids, Tensor) else ids)
    if ids.dtype.kind not in "iu":
        raise OpError(f"embedding: ids must be integers, got dtype {ids.dtype}")
    if table.ndim != 2:
        raise OpError(f"embedding: table must be [vocab, dim], got shape {table.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise OpError(f"embedding: ids must be in [0, {table.shape[0]}), got range [{ids.min()}, {ids.max()}]")
    out = table.data[ids]

    def backward(g):
        return (embedding_backward(ids.reshape(-1), g.reshape(-1, table.shape[1]), table.shape[0]),)

    return Tensor.make(out, (table,), backward, "embedding")


def concat(tensors, axis=0):
    ts = [as_tensor(t) for t in tensors]
    if not ts:
        raise OpError("concat: needs at least one tensor")
    try:
        out = np.concatenate([t.data for t in ts], axis=axis)
    except ValueError:
        raise OpError(f"concat: shapes {[t.shape for t in ts]} do not match outside axis {axis}") from None
    cuts = np.cumsum([t.shape[axis] for t in ts])[:-1]
    return Tensor.make(out, tuple(ts), lambda g: tuple(np.split(g, cuts, axis=axis)), "concat")


def stack(tensors, axis=0):
    """Join same-shape tensors along a new axis."""
    ts = [as_tensor(t) for t in tensors]
    if not ts or any(t.shape != ts[0].shape for t in ts):
        raise OpError(f"stack: needs one or more tensors of one shape, got {[t.shape for t in ts]}")
    out = np.stack([t.data for t in ts], axis=axis)
    n = len(ts)
    return Tensor.make(out, tuple(ts), lambda g: tuple(np.take(g, i, axis=axis) for i in range(n)), "stack")


def split(a, sizes, axis=0):
    """torch.split: `sizes` an int (chunk length) or a list of lengths; returns a tuple."""
    a = as_tensor(a)
    n = a.shape[axis]
    if isinstance(sizes, (int, np.integer)):
        sizes = [builtins.min(int(sizes), n - s) for s in range(0, n, int(sizes))]
    if builtins.sum(sizes) != n:
        raise OpError(f"split: sizes {list(sizes)} do not add up to {n} (axis {axis} of shape {a.shape})")
    pieces, start = [], 0
    ax = axis % a.ndim
    for s in sizes:
        sl = (slice(None),) * ax + (slice(start, start + s),)
        pieces.append(index(a, sl))
        start += s
    return tuple(pieces)


# --- softmax family -------------------------------------------------------------
def softmax(a, axis=-1):
    a = as_tensor(a)
    x = _compute(a.data)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    out = e / e.sum(axis=axis, keepdims=True)
    return Tensor.make(out, (a,), lambda g: (out * (g - (g * out).sum(axis=axis, keepdims=True)),), "softmax")


def log_softmax(a, axis=-1):
    a = as_tensor(a)
    x = _compute(a.data)
    m = x.max(axis=axis, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))
    out = x - lse
    return Tensor.make(out, (a,), lambda g: (g - np.exp(out) * g.sum(axis=axis, keepdims=True),), "log_softmax")


# --- normalization --------------------------------------------------------------
def rms_norm(x, weight=None, eps=1e-6):
    """x / sqrt(mean(x^2, last axis) + eps) * weight (weight optional, shape [dim])."""
    from pipeline.kernels.nn import rms_norm_backward, rms_norm_forward

    x = as_tensor(x)
    parents = (x,)
    if weight is not None:
        weight = as_tensor(weight)
        if weight.shape != x.shape[-1:]:
            raise OpError(f"rms_norm: weight shape {weight.shape} must be ({x.shape[-1]},) for input {x.shape}")
        parents = (x, weight)
    X = _compute(x.data)
    W = None if weight is None else _compute(weight.data)
    out, rstd = rms_norm_forward(X.reshape(-1, X.shape[-1]), W, eps)

    def backward(g):
        gx, gw = rms_norm_backward(g.reshape(-1, x.shape[-1]), X.reshape(-1, x.shape[-1]), W, rstd,
                                   need_weight_grad=weight is not None and weight.requires_grad)
        return (gx.reshape(x.shape), gw)[: len(parents)]

    return Tensor.make(out.reshape(x.shape), parents, backward, "rms_norm")


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """torch.nn.LayerNorm over the last axis (biased variance); affine optional."""
    x = as_tensor(x)
    d = x.shape[-1]
    for nm, t in (("weight", weight), ("bias", bias)):
        if t is not None and as_tensor(t).shape != (d,):
            raise OpError(f"layer_norm: {nm} shape {as_tensor(t).shape} must be ({d},) for input {x.shape}")
    weight = None if weight is None else as_tensor(weight)
    bias = None if bias is None else as_tensor(bias)
    X = _compute(x.data)
    mu = X.mean(axis=-1, keepdims=True)
    xc = X - mu
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    xhat = xc * rstd
    out = xhat
    if weight is not None:
        out = out * _compute(weight.data)
    if bias is not None:
        out = out + _compute(bias.data)
    parents = (x,) + tuple(t for t in (weight, bias) if t is not None)

    def backward(g):
        gh = g * _compute(weight.data) if weight is not None else g
        gx = rstd * (gh - gh.mean(axis=-1, keepdims=True) - xhat * (gh * xhat).mean(axis=-1, keepdims=True))
        grads = [gx]
        if weight is not None:
            grads.append((g * xhat).reshape(-1, d).sum(axis=0))
        if bias is not None:
            grads.append(g.reshape(-1, d).sum(axis=0))
        return tuple(grads)

    return Tensor.make(out, parents, backward, "layer_norm")


# --- rotary embedding and attention ---------------------------------------------------
def rope_tables(positions, head_dim, theta=10000.0, dtype=np.float32, freq_factors=None):
    """(cos, sin) of shape [*positions.shape, head_dim // 2] in `dtype`, angles
    pos * theta^(-2j/head_dim) / freq_factors[j] computed in float64 and rounded once.
    freq_factors (llama3-style RoPE scaling, a GGUF's rope_freqs.weight) default to 1."""
    if head_dim % 2:
        raise OpError(f"rope: head_dim must be even, got {head_dim}")
    pos = np.asarray(positions, dtype=np.float64)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    ang = pos[..., None] * inv_freq
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


_ROPE_TABLES = {}  # (positions, head_dim, theta, dtype) -> (cos, sin): a training step asks for the same few


def _cached_rope_tables(pos, head_dim, theta, dtype, freq_factors=None):
    factors = None if freq_factors is None else np.asarray(freq_factors, dtype=np.float64)
    key = (pos.dtype.str, pos.shape, pos.tobytes(), head_dim, float(theta), np.dtype(dtype).str,
           None if factors is None else factors.tobytes())
    tables = _ROPE_TABLES.get(key)
    if tables is None:
        if len(_ROPE_TABLES) >= 32:
            _ROPE_TABLES.clear()
        tables = _ROPE_TABLES[key] = rope_tables(pos, head_dim, theta, dtype, factors)
        for t in tables:
            t.flags.writeable = False  # shared between calls
    return tables


def rope(x, positions, theta=10000.0, freq_factors=None, interleaved=False):
    """Rotary position embedding, NeoX half-rotation layout (or, interleaved=True,
    the adjacent-pair layout llama.cpp calls "normal": pairs (x[2j], x[2j+1])).

    x: [..., seq, heads, head_dim]; positions: an array broadcastable to
    x.shape[:-2] (usually [seq], or [batch, seq]; linear RoPE scaling passes
    scaled, non-integer positions). With h = head_dim // 2:
    out[:h] = x1 cos - x2 sin, out[h:] = x2 cos + x1 sin.
    freq_factors: see rope_tables.
    """
    if interleaved:  # gather the pairs into halves, rotate as NeoX, scatter back: same arithmetic per pair
        x = as_tensor(x)
        d = x.shape[-1]
        halves = reshape(transpose(reshape(x, *x.shape[:-1], d // 2, 2)), *x.shape)
        rotated = rope(halves, positions, theta, freq_factors)
        return reshape(transpose(reshape(rotated, *x.shape[:-1], 2, d // 2)), *x.shape)
    x = as_tensor(x)
    if x.ndim < 3:
        raise OpError(f"rope: x must be [..., seq, heads, head_dim], got shape {x.shape}")
    pos = np.asarray(positions)
    try:
        np.broadcast_shapes(pos.shape, x.shape[:-2])
    except ValueError:
        raise OpError(f"rope: positions shape {pos.shape} does not broadcast to {x.shape[:-2]} "
                      f"(x shape {x.shape})") from None
    X = _compute(x.data)
    cos, sin = _cached_rope_tables(pos, x.shape[-1], theta, X.dtype, freq_factors)
    if X.dtype == np.float32:  # one kernel pass each way; backward rotates by the negative angle
        from pipeline.kernels.nn import rope_rotate
        rows = x.shape[:-2]
        cos_r = np.broadcast_to(cos, rows + cos.shape[-1:]).reshape(-1, cos.shape[-1])
        sin_r = np.broadcast_to(sin, rows + sin.shape[-1:]).reshape(-1, sin.shape[-1])
        flat = (-1,) + x.shape[-2:]
        out = rope_rotate(X.reshape(flat), cos_r, sin_r).reshape(x.shape)
        return Tensor.make(out, (x,), lambda g: (rope_rotate(g.reshape(flat), cos_r, -sin_r).reshape(x.shape),), "rope")
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    h = x.shape[-1] // 2
    x1, x2 = X[..., :h], X[..., h:]
    out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def backward(g):  # rotate back by -angle
        g1, g2 = g[..., :h], g[..., h:]
        return (np.concatenate([g1 * cos + g2 * sin, g2 * cos - g1 * sin], axis=-1),)

    return Tensor.make(out, (x,), backward, "rope")


_ATTN_QBLOCK = 64  # query positions per block in causal attention
# From this many keys the backward recomputes each block's probabilities (its GEMM and softmax again, the same
# bits) instead of keeping them from the forward: heads x seq^2 / 2 floats per layer (SmolLM2 at seq 2048:
# 75 MB a layer, 2.3 GB for 30 layers) for one more of the six GEMMs. 0: always; None: never.
ATTN_RECOMPUTE_MIN_KEYS = 1024


def attention(q, k, v, causal=True, offset=None, scale=None, window=0, segments=None):
    """Scaled dot-product attention with grouped-query heads.

    q: [batch, seq_q, heads_q, head_dim]; k, v: [batch, seq_k, heads_kv, head_dim]
    with heads_q a multiple of heads_kv (query head h reads kv head h // group).
    Causal: query i sits at absolute position offset + i and sees keys j <= offset + i;
    offset defaults to seq_k - seq_q (the KV-cache decoding case). Returns
    [batch, seq_q, heads_q, head_dim]. scale defaults to 1/sqrt(head_dim).
    window > 0 (causal only; sliding-window layers): query p also stops seeing keys j <= p - window.
    segments (causal self-attention only; packed samples): non-decreasing ids [seq], one per position of every
    batch row; a query sees only the keys of its own segment (a block-diagonal causal mask), and a block of
    queries multiplies only against the keys from its first query's segment start on.
    Probabilities are kept for the backward below ATTN_RECOMPUTE_MIN_KEYS keys, recomputed from there on.
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise OpError(f"attention: q, k, v must be [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}")
    B, Sq, Hq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise OpError(f"attention: k {k.shape} and v {v.shape} must be equal "
                      f"and match q {q.shape} in batch and head_dim")
    Sk, Hkv = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise OpError(f"attention: query heads {Hq} must be a multiple of kv heads {Hkv}")
    G = Hq // Hkv
    offset = Sk - Sq if offset is None else int(offset)
    if causal and offset < 0:
        raise OpError(f"attention: causal offset must be >= 0 (seq_q {Sq}, seq_k {Sk}, offset {offset})")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if window and not causal:
        raise OpError("attention: a sliding window needs causal=True")
    if window < 0:
        raise OpError(f"attention: window must be >= 0, got {window}")
    if segments is not None:
        segments = np.asarray(segments)
        if not causal or Sq != Sk or offset != 0 or segments.shape != (Sq,):
            raise OpError(f"attention: segments [seq] need causal self-attention, got segments "
                          f"{segments.shape} for seq_q {Sq}, seq_k {Sk}, offset {offset}")
        if Sq > 1 and np.any(np.diff(segments) < 0):
            raise OpError("attention: segments must be non-decreasing (one contiguous run per packed sample)")
        starts = np.searchsorted(segments, segments, side="left")  # each position's segment start

    from pipeline.kernels.attention import softmax_backward_rows_serial, softmax_rows_serial
    from pipeline.kernels.workpool import run_tiles

    # Fold the query heads that share a kv head into the GEMM rows: one GEMM per
    # (batch, kv head) pair. Causal: split the queries into blocks of _ATTN_QBLOCK
    # positions; a block only multiplies against the keys it can see. The pairs
    # are independent and run on our threads (single-threaded BLAS each): at
    # training sizes the GEMMs are too small for BLAS threading to pay.
    Q5 = np.ascontiguousarray(_compute(q.data).reshape(B, Sq, Hkv, G, D).transpose(0, 2, 3, 1, 4))
    K = _compute(k.data).transpose(0, 2, 1, 3)  # [B, Hkv, Sk, D]
    V = _compute(v.data).transpose(0, 2, 1, 3)
    step = _ATTN_QBLOCK if causal else Sq
    blocks = []  # (q0, q1, first and end of the visible keys, additive mask [G*bq, kmax - kmin] or None)
    for q0 in range(0, Sq, step):
        q1 = builtins.min(Sq, q0 + step)
        kmax = builtins.min(Sk, offset + q1) if causal else Sk
        kmin = int(starts[q0]) if segments is not None else 0
        mask = None
        if causal:
            keys, queries = np.arange(kmin, kmax)[None, :], (offset + np.arange(q0, q1))[:, None]
            blocked = keys > queries
            if window:
                blocked |= queries - keys >= window
            if segments is not None:
                blocked |= segments[kmin:kmax][None, :] != segments[q0:q1][:, None]
            if blocked.any():
                mask = np.tile(np.where(blocked, -np.inf, 0.0).astype(Q5.dtype), (G, 1))
        blocks.append((q0, q1, kmin, kmax, mask))
    pairs = B * Hkv
    saved = [None] * pairs  # per pair: [(Q rows [G*bq, D], probabilities [G*bq, kmax]) per block]
    O5 = np.empty(Q5.shape, Q5.dtype)
    typed_scale = np.asarray(scale, dtype=Q5.dtype)

    recompute = ATTN_RECOMPUTE_MIN_KEYS is not None and Sk >= ATTN_RECOMPUTE_MIN_KEYS and grad_enabled()

    def probabilities(b, h, q0, q1, kmin, kmax, mask):
        """(the block's query rows [G*bq, D], its softmax [G*bq, kmax - kmin]): the same bits at every call."""
        Qb = Q5[b, h, :, q0:q1].reshape(G * (q1 - q0), D)
        pb = Qb @ K[b, h, kmin:kmax].T
        pb *= typed_scale
        if mask is not None:
            pb += mask
        softmax_rows_serial(pb)
        return Qb, pb

    def forward_pair(i):
        b, h = divmod(i, Hkv)
        mine = []
        for q0, q1, kmin, kmax, mask in blocks:
            Qb, pb = probabilities(b, h, q0, q1, kmin, kmax, mask)
            O5[b, h, :, q0:q1] = (pb @ V[b, h, kmin:kmax]).reshape(G, q1 - q0, D)
            mine.append(None if recompute else (Qb, pb))
        saved[i] = mine

    run_tiles(pairs, forward_pair)
    out = O5.transpose(0, 3, 1, 2, 4).reshape(B, Sq, Hq, D)

    def backward(g):
        dO5 = g.reshape(B, Sq, Hkv, G, D).transpose(0, 2, 3, 1, 4)
        dQ5 = np.empty(Q5.shape, np.float32)
        dK = np.zeros(K.shape, np.float32)
        dV = np.zeros(V.shape, np.float32)

        def backward_pair(i):
            b, h = divmod(i, Hkv)
            for (q0, q1, kmin, kmax, mask), kept in zip(blocks, saved[i]):  # fixed block order: deterministic
                Qb, pb = kept if kept is not None else probabilities(b, h, q0, q1, kmin, kmax, mask)
                dOb = dO5[b, h, :, q0:q1].reshape(G * (q1 - q0), D)
                if v.requires_grad:
                    dV[b, h, kmin:kmax] += pb.T @ dOb  # sums over the group inside the GEMM
                ds = softmax_backward_rows_serial(pb, dOb @ V[b, h, kmin:kmax].T, scale)
                if q.requires_grad:
                    dQ5[b, h, :, q0:q1] = (ds @ K[b, h, kmin:kmax]).reshape(G, q1 - q0, D)
                if k.requires_grad:
                    dK[b, h, kmin:kmax] += ds.T @ Qb

        run_tiles(pairs, backward_pair)
        dq = dQ5.transpose(0, 3, 1, 2, 4).reshape(B, Sq, Hq, D) if q.requires_grad else None
        return (dq,
                dK.transpose(0, 2, 1, 3) if k.requires_grad else None,
                dV.transpose(0, 2, 1, 3) if v.requires_grad else None)

    return Tensor.make(np.ascontiguousarray(out), (q, k, v), backward, "attention")


# --- dropout, casts, checkpointing ------------------------------------------------
def dropout(x, p, seed):
    """Inverted dropout: element i (flat C order) is kept as x[i] / (1 - p) iff
    uniform(seed, i) < 1 - p (pipeline.kernels.rng), else 0. The mask is never stored:
    backward regenerates it from (seed, i). p == 0 returns x unchanged."""
    from pipeline.kernels.nn import dropout_apply

    x = as_tensor(x)
    if not 0.0 <= p < 1.0:
        raise OpError(f"dropout: p must be in [0, 1), got {p}")
    if p == 0.0:
        return x
    out = dropout_apply(seed, _compute(x.data), p)
    return Tensor.make(out, (x,), lambda g: (dropout_apply(seed, g, p),), "dropout")


def _dtype(d):
    if isinstance(d, str):
        if d not in _DTYPES:
            raise OpError(f"to: unknown dtype {d!r} (use one of {sorted(_DTYPES)})")
        return _DTYPES[d]
    return np.dtype(d)


def to(a, dtype):
    """Cast between float32 / float16 / bfloat16 (and float64). The gradient
    passes back unchanged as float32."""
    a = as_tensor(a)
    dt = _dtype(dtype)
    if dt.kind != "f" and dt not in _SIXTEEN_BIT:
        raise OpError(f"to: only floating dtypes are differentiable casts, got {dt}")
    if a.dtype == dt:
        return a
    return Tensor.make(a.data.astype(dt), (a,), lambda g: (g,), "to")


def checkpoint(fn, *inputs):
    """Activation checkpointing: run fn(*inputs) keeping no intermediates; in
    backward, re-run it with grad enabled and backprop through the rebuilt graph.

    fn must be deterministic in its inputs (dropout replays from its seed).
    Tensors captured by fn (weights) that require grad also receive gradients,
    added into their .grad during the recompute. Returns one Tensor.

    The first forward runs with gradients on, on detached copies of the inputs, and
    its graph is dropped when fn returns (the memory of one call of fn at a time, as
    the recompute needs anyway): ops that pick their arithmetic by grad mode (a
    quantized product takes integer dots without gradients) then give the forward
    the bits the recompute gives, so the loss is the one without checkpointing.
    """
    if not grad_enabled():
        return fn(*inputs)
    tensors = [(i, t) for i, t in enumerate(inputs) if isinstance(t, Tensor)]
    args = list(inputs)
    for i, t in tensors:
        args[i] = Tensor(t.data, dtype=t.dtype)  # no gradient flows back through this forward
    out = fn(*args)
    if not isinstance(out, Tensor):
        raise OpError(f"checkpoint: fn must return one Tensor, got {type(out).__name__}")
    touched_trainable = out.requires_grad  # only captured tensors can make it require grad
    out = Tensor(out.data, dtype=out.dtype)  # the graph of the forward goes with the old node

    def backward(g):
        args = list(inputs)
        leaves = []
        for i, t in tensors:
            leaf = Tensor(t.data, requires_grad=t.requires_grad, dtype=t.dtype)
            args[i] = leaf
            leaves.append(leaf)
        with enable_grad():
            again = fn(*args)
        if again.requires_grad:
            again.backward(g)
        return tuple(leaf.grad for leaf in leaves)

    parents = tuple(t for _, t in tensors)
    node = Tensor.make(out.data, parents, backward, "checkpoint")
    if touched_trainable and not node.requires_grad:
        # only captured weights need grad: the node hangs off no input, so give it a dummy parent
        anchor = Tensor(np.zeros((), np.float32), requires_grad=True)
        node = Tensor.make(out.data, parents + (anchor,), lambda g: backward(g) + (None,), "checkpoint")
    return node


# --- Tensor methods and operators ---------------------------------------------------
Tensor.__add__ = add
Tensor.__radd__ = lambda a, b: add(b, a)
Tensor.__sub__ = sub
Tensor.__rsub__ = lambda a, b: sub(b, a)
Tensor.__mul__ = mul
Tensor.__rmul__ = lambda a, b: mul(b, a)
Tensor.__truediv__ = div
Tensor.__rtruediv__ = lambda a, b: div(b, a)
Tensor.__neg__ = neg
Tensor.__abs__ = abs
Tensor.__pow__ = pow
Tensor.__matmul__ = matmul
Tensor.__rmatmul__ = lambda a, b: matmul(b, a)
Tensor.__getitem__ = index
Tensor.sum = sum
Tensor.mean = mean
Tensor.max = max
Tensor.reshape = reshape
Tensor.transpose = transpose
Tensor.permute = permute
Tensor.T = property(lambda a: transpose(a, -2, -1))
Tensor.exp = exp
Tensor.log = log
Tensor.tanh = tanh
Tensor.sigmoid = sigmoid
Tensor.silu = silu
Tensor.relu = relu
Tensor.sqrt = sqrt
Tensor.abs = abs
Tensor.gelu = gelu
Tensor.softmax = softmax
Tensor.log_softmax = log_softmax
Tensor.to = to
