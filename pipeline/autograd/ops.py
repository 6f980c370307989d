"""Differentiable ops: each builds its output and its backward side by side.

A backward closure receives the float32 gradient of the output and returns one
gradient per parent (None where a parent needs none). Broadcasting is undone by
the engine (`_reduce_to_shape`), so elementwise ops may return full-shape grads.
"""
from __future__ import annotations

import numpy as np

from .tensor import Tensor


def as_tensor(x) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(np.asarray(x, dtype=np.float32))


def _f32(a):
    return a if a.dtype == np.float32 else a.astype(np.float32)


# --- elementwise arithmetic -------------------------------------------------
def add(a, b):
    a, b = as_tensor(a), as_tensor(b)
    return Tensor.make(a.data + b.data, (a, b), lambda g: (g, g), "add")


def sub(a, b):
    a, b = as_tensor(a), as_tensor(b)
    return Tensor.make(a.data - b.data, (a, b), lambda g: (g, -g), "sub")


def mul(a, b):
    a, b = as_tensor(a), as_tensor(b)
    return Tensor.make(a.data * b.data, (a, b), lambda g: (g * _f32(b.data), g * _f32(a.data)), "mul")


def div(a, b):
    a, b = as_tensor(a), as_tensor(b)
    out = a.data / b.data
    return Tensor.make(out, (a, b), lambda g: (g / _f32(b.data), -g * _f32(out) / _f32(b.data)), "div")


def neg(a):
    return Tensor.make(-a.data, (a,), lambda g: (-g,), "neg")


def pow(a, p: float):
    a = as_tensor(a)
    return Tensor.make(a.data ** p, (a,), lambda g: (g * p * _f32(a.data) ** (p - 1),), "pow")


def tanh(a):
    out = np.tanh(a.data)
    return Tensor.make(out, (a,), lambda g: (g * (1.0 - _f32(out) ** 2),), "tanh")


# --- linear algebra ----------------------------------------------------------
def matmul(a, b):
    a, b = as_tensor(a), as_tensor(b)
    if a.ndim < 1 or b.ndim < 1 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} are not aligned (last dim of a must equal the second-to-last of b)")
    out = a.data @ b.data

    def backward(g):
        ga = g @ np.swapaxes(_f32(b.data), -1, -2) if a.requires_grad else None
        gb = np.swapaxes(_f32(a.data), -1, -2) @ g if b.requires_grad else None
        return ga, gb

    return Tensor.make(out, (a, b), backward, "matmul")


# --- reductions and shape ----------------------------------------------------
def sum(a, axis=None, keepdims=False):
    out = a.data.sum(axis=axis, keepdims=keepdims, dtype=np.float32)

    def backward(g):
        if axis is not None and not keepdims:
            g = np.expand_dims(g, axis)
        return (np.broadcast_to(g, a.shape),)

    return Tensor.make(np.asarray(out), (a,), backward, "sum")


def mean(a, axis=None, keepdims=False):
    n = a.data.size if axis is None else int(np.prod([a.shape[i] for i in np.atleast_1d(axis)]))
    return mul(sum(a, axis, keepdims), np.float32(1.0 / n))


def reshape(a, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return Tensor.make(a.data.reshape(shape), (a,), lambda g: (g.reshape(a.shape),), "reshape")


Tensor.__add__ = add
Tensor.__radd__ = lambda a, b: add(b, a)
Tensor.__sub__ = sub
Tensor.__rsub__ = lambda a, b: sub(b, a)
Tensor.__mul__ = mul
Tensor.__rmul__ = lambda a, b: mul(b, a)
Tensor.__truediv__ = div
Tensor.__rtruediv__ = lambda a, b: div(b, a)
Tensor.__neg__ = neg
Tensor.__pow__ = pow
Tensor.__matmul__ = matmul
Tensor.__rmatmul__ = lambda a, b: matmul(b, a)
Tensor.sum = sum
Tensor.mean = mean
Tensor.reshape = reshape
Tensor.tanh = tanh
