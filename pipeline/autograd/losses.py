"""Losses: cross-entropy and fused linear + cross-entropy, PyTorch semantics.

Classes are on the LAST axis: logits [..., C] with integer labels [...]
(the LLM convention; torch's F.cross_entropy puts classes on axis 1).

Trade-off: one row-kernel pass for the forward, saving only 16 bytes per row
(max and sum of exp), and one pass for the backward from those stats. The fused
linear variant keeps its logits buffer outside the graph and overwrites it in
place with the logit gradient (or, with `chunk_rows`, never holds more than one
chunk of logits and recomputes them in backward: one extra GEMM for
O(chunk x classes) memory).

Determinism: per-row losses are float64; 'mean' and 'sum' are ONE serial sum in
row order (np.sum is pairwise, so the sum is np.cumsum's left-to-right scan).
Divergence from torch, as in the spec: if every row is ignored the loss is 0
with zero gradients (torch returns NaN for 'mean').
"""
from __future__ import annotations

import numpy as np

from pipeline.kernels.headce import RowSource, head_ce
from pipeline.kernels.losses import ce_backward, ce_forward
from pipeline.kernels.nn import matmul_nn, matmul_nt

from .ops import _compute, as_tensor
from .tensor import OpError, Tensor, grad_enabled

REDUCTIONS = ("mean", "sum", "none")


def _serial_sum(v):
    """Sum a float64 vector strictly left to right (np.sum is pairwise)."""
    return float(np.cumsum(v)[-1]) if v.size else 0.0


def _labels(op, labels, lead_shape, classes, ignore_index):
    lab = np.asarray(labels.data if isinstance(labels, Tensor) else labels)
    if lab.dtype.kind not in "iu":
        raise OpError(f"{op}: labels must be integers, got dtype {lab.dtype}")
    if lab.shape != tuple(lead_shape):
        raise OpError(f"{op}: labels shape {lab.shape} must equal the leading shape {tuple(lead_shape)} of the logits")
    flat = lab.reshape(-1).astype(np.int64)
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= classes))
    if bad.any():
        i = int(np.argmax(bad))
        raise OpError(f"{op}: label {int(flat[i])} at position {i} is out of range [0, {classes}) "
                      f"and is not ignore_index={ignore_index}")
    return lab, flat


def _check_options(op, reduction, label_smoothing):
    if reduction not in REDUCTIONS:
        raise OpError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise OpError(f"{op}: label_smoothing must be in [0, 1), got {label_smoothing}")


def _reduce(loss_rows, valid, reduction, lead_shape, dtype):
    """Loss value (float32, or float64 for float64 inputs) and the per-row
    gradient scale as a function of the upstream gradient g."""
    n_valid = int(valid.sum())
    if reduction == "none":
        return loss_rows.astype(dtype).reshape(lead_shape), lambda g: np.asarray(g, np.float64).reshape(-1) * valid
    total = _serial_sum(loss_rows)
    if reduction == "sum":
        return np.asarray(total, dtype), lambda g: np.full(valid.shape, float(g), np.float64) * valid
    if n_valid == 0:
        return np.asarray(0.0, dtype), lambda g: np.zeros(valid.shape, np.float64)
    return np.asarray(total / n_valid, dtype), lambda g: np.full(valid.shape, float(g) / n_valid, np.float64) * valid


def cross_entropy(logits, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """Cross-entropy of logits [..., C] against integer labels [...].

    ignore_index rows contribute zero loss and zero gradient and are excluded
    from the 'mean' denominator; label_smoothing eps uses the target
    (1 - eps) onehot + eps / C. Returns a scalar ('mean', 'sum') or [...] ('none').
    """
    op = "cross_entropy"
    _check_options(op, reduction, label_smoothing)
    logits = as_tensor(logits)
    if logits.ndim < 1 or logits.dtype.kind not in "fV":
        raise OpError(f"{op}: logits must be a float array [..., classes], got {logits.dtype} {logits.shape}")
    C = logits.shape[-1]
    lead = logits.shape[:-1]
    _, flat = _labels(op, labels, lead, C, ignore_index)
    X = np.ascontiguousarray(_compute(logits.data)).reshape(-1, C)
    loss_rows, stats = ce_forward(X, flat, ignore_index, label_smoothing)
    valid = flat != ignore_index
    value, row_scale = _reduce(loss_rows, valid, reduction, lead, X.dtype)

    def backward(g):
        grad = ce_backward(X, flat, stats, row_scale(g), ignore_index, label_smoothing)
        return (grad.reshape(logits.shape),)

    return Tensor.make(value, (logits,), backward, op)


def linear_cross_entropy(x, w, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0, chunk_rows=None):
    """cross_entropy(x @ w.T, labels) as ONE op; x [..., H], w [C, H].

    The [rows, C] logits never enter the graph. Default: they are kept in the
    backward closure and overwritten in place with their gradient before the
    two gradient GEMMs. With chunk_rows=R, at most [R, C] logits exist at a
    time (recomputed per chunk in backward; dw accumulates in chunk order).

    w may be a pipeline/kernels/headce.RowSource (a frozen head kept in its file format, dequantized a chunk of
    rows at a time): always the one-pass frozen-head path, whose bits equal those with w's dense f32 values.
    """
    op = "linear_cross_entropy"
    _check_options(op, reduction, label_smoothing)
    source = isinstance(w, RowSource)
    x, w = as_tensor(x), (w if source else as_tensor(w))
    if len(w.shape) != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise OpError(f"{op}: x {x.shape} and weight {w.shape} do not fit "
                      "(weight is [classes, hidden]; x's last dim must equal hidden)")
    C, H = w.shape
    lead = x.shape[:-1]
    _, flat = _labels(op, labels, lead, C, ignore_index)
    X_all = np.ascontiguousarray(_compute(x.data)).reshape(-1, H)
    W = w if source else _compute(w.data)
    valid = flat != ignore_index
    # Ignored rows add nothing to the loss or to any gradient, so only the
    # supervised rows enter the GEMMs (a prompt-masked SFT sample skips its prompt).
    rows = np.flatnonzero(valid)
    X, kept = (X_all, flat) if rows.size == valid.size else (np.ascontiguousarray(X_all[rows]), flat[rows])
    N = X.shape[0]
    step = N if chunk_rows is None else max(1, int(chunk_rows))
    starts = range(0, N, step) if N else []

    if source:
        if X.dtype != np.float32:
            raise OpError(f"{op}: a row-source head needs float32 x, got {X.dtype}")
        return _frozen_head(x, w, X, W, kept, rows, valid, starts, step, reduction, label_smoothing, lead)
    if (grad_enabled() and x.requires_grad and not w.requires_grad
            and X.dtype == W.dtype == np.float32):
        return _frozen_head(x, w, X, W, kept, rows, valid, starts, step, reduction, label_smoothing, lead)

    f32 = X.dtype == W.dtype == np.float32  # the big float32 products run tiled on our threads
    gemm_nt = matmul_nt if f32 else (lambda a, b: a @ b.T)
    gemm_nn = matmul_nn if f32 else (lambda a, b: a @ b)

    kept_loss = np.empty(N, np.float64)
    stats = np.empty((N, 2), np.float64)
    saved = None
    for s in starts:
        logits = gemm_nt(X[s:s + step], W)
        kept_loss[s:s + step], stats[s:s + step] = ce_forward(logits, kept[s:s + step], ignore_index, label_smoothing)
        if chunk_rows is None:
            saved = logits
    value, row_scale = _reduce(_scatter_rows(kept_loss, rows, valid.size), valid, reduction, lead, X.dtype)

    def backward(g):
        nonlocal saved
        scale = row_scale(g) if X is X_all else row_scale(g)[rows]
        gx = np.empty((N, H), np.float32) if x.requires_grad else None
        gw = np.zeros((C, H), np.float32) if w.requires_grad else None
        for s in starts:
            logits = saved if chunk_rows is None else gemm_nt(X[s:s + step], W)
            dl = ce_backward(logits, kept[s:s + step], stats[s:s + step], scale[s:s + step],
                             ignore_index, label_smoothing, out=logits)  # in place: no second buffer
            if gx is not None:
                gx[s:s + step] = gemm_nn(dl, W)
            if gw is not None:
                gw += dl.T @ X[s:s + step]
        saved = None  # release the logits with the graph
        return (None if gx is None else _scatter_rows(gx, rows, valid.size).reshape(x.shape), gw)

    return Tensor.make(value, (x, w), backward, op)


def _scatter_rows(values, rows, n):
    """Per-row values of the supervised rows -> all n rows, zeros at ignored rows
    (the array itself when every row is supervised)."""
    if values.shape[0] == n:
        return values
    full = np.zeros((n,) + values.shape[1:], values.dtype)
    full[rows] = values
    return full


def _frozen_head(x, w, X, W, kept, rows, valid, starts, step, reduction, label_smoothing, lead):
    """linear_cross_entropy when only x needs a gradient: one pass over W per
    block of `step` rows computes each row's loss and the gradient of its own loss
    (pipeline/kernels/headce.py); the backward multiplies rows by the reduction's scale. w: a constant Tensor or
    a RowSource (never a parent then)."""
    N, H = X.shape
    kept_loss = np.empty(N, np.float64)
    gx_unit = np.empty((N, H), np.float32)
    for s in starts:
        kept_loss[s:s + step], gx_unit[s:s + step] = head_ce(X[s:s + step], W, kept[s:s + step], label_smoothing)
    value, row_scale = _reduce(_scatter_rows(kept_loss, rows, valid.size), valid, reduction, lead, X.dtype)

    def backward(g):
        nonlocal gx_unit
        scale = row_scale(g) if N == valid.size else row_scale(g)[rows]
        gx = gx_unit * scale.astype(np.float32)[:, None]
        gx_unit = None  # release with the graph
        gx = _scatter_rows(gx, rows, valid.size).reshape(x.shape)
        return (gx,) if source else (gx, None)

    source = isinstance(w, RowSource)
    return Tensor.make(value, (x,) if source else (x, w), backward, "linear_cross_entropy")
