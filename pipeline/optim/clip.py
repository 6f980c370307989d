"""Global gradient-norm clipping and gradient scaling (torch.nn.utils semantics).

clip_grad_norm: total = sqrt(sum over params of sum(g^2)), each tensor's sum
of squares from the fixed-chunk float64 reduction in pipeline/kernels/optim.py and the
tensors combined in registration order, so the norm is bitwise identical for
any thread count. If max_norm / (total + 1e-6) < 1 every gradient is scaled by
that factor (cast to float32). Returns the pre-clip norm.

Trade-off: float64 accumulation costs a little speed versus torch's float32
norm, and buys a norm that does not depend on summation order.
"""
from __future__ import annotations

import math

import numpy as np

from pipeline.kernels import optim as K

from .base import OptimizerConfigError


def _grad_arrays(target):
    """Gradients in a fixed order from an optimizer, an OptimizerSet, or an iterable of Tensors."""
    if hasattr(target, "grads"):
        return [g for _, g in target.grads()]
    return [t.grad for t in target if t.grad is not None]


def grad_norm(target):
    """Global L2 norm of the gradients (float), deterministic float64 reduction."""
    total = 0.0
    for g in _grad_arrays(target):
        total += K.sum_squares(g)
    return math.sqrt(total)


def clip_grad_norm(target, max_norm):
    """Scale gradients in place so their global norm is at most ~max_norm; return the pre-clip norm."""
    max_norm = float(max_norm)
    if not max_norm > 0:
        raise OptimizerConfigError(f"clip_grad_norm: max_norm must be > 0, got {max_norm}")
    total = grad_norm(target)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:  # a NaN norm compares False: grads are left alone and the NaN is returned to the caller
        for g in _grad_arrays(target):
            K.scale_(_writable(g), coef)
    return total


def scale_gradients(target, factor):
    """Multiply every gradient by float32(factor) in place (e.g. 1/N after N backwards).

    Deterministic, but NOT bitwise equal to scaling the loss before backward
    (a different floating-point order); pick one per run.
    """
    for g in _grad_arrays(target):
        K.scale_(_writable(g), float(factor))


def _writable(g):
    if not isinstance(g, np.ndarray) or g.dtype != np.float32 or not g.flags.c_contiguous or not g.flags.writeable:
        raise OptimizerConfigError("clip/scale: gradients are scaled in place and must be writeable C-contiguous "
                                   f"float32 arrays, got {getattr(g, 'dtype', type(g).__name__)} "
                                   f"{getattr(g, 'shape', '')}")

    return g
