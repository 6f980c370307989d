"""Module: a plain container of parameters, named by dotted attribute path.

A model is an ordinary object whose attributes hold Tensors, lists/tuples/dicts
of Tensors, or other objects (Modules). `named_parameters` walks that structure
in attribute-definition order and yields ("layers.0.attn.q.weight", tensor) for
every Tensor with requires_grad=True. One walk feeds optimizer registration and
persistence, so nothing is listed twice.
"""
from __future__ import annotations

from .tensor import Tensor


def _walk(obj, prefix, seen, out, trainable_only):
    if isinstance(obj, Tensor):
        if (obj.requires_grad or not trainable_only) and id(obj) not in seen:
            seen.add(id(obj))
            out.append((prefix, obj))
        return
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif isinstance(obj, Module):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        items = ((k, v) for k, v in vars(obj).items() if not k.startswith("_"))
    else:
        return
    for key, value in items:
        _walk(value, f"{prefix}.{key}" if prefix else str(key), seen, out, trainable_only)


def named_parameters(obj, prefix="", trainable_only=True):
    """[(dotted_name, Tensor)] for every trainable Tensor reachable from obj."""
    out = []
    _walk(obj, prefix, set(), out, trainable_only)
    return out


class Module:
    """Base class for models: attributes starting with '_' are not walked."""

    def named_parameters(self, prefix="", trainable_only=True):
        return named_parameters(self, prefix, trainable_only)

    def parameters(self):
        return [t for _, t in self.named_parameters()]

    def zero_grad(self):
        for t in self.parameters():
            t.grad = None

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
