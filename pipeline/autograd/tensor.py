"""Tensor: a numpy array, an optional gradient, and the node that made it.

Reverse mode in the micrograd style: every op builds its output and attaches
a backward closure right beside the forward. `backward()` topologically sorts
the graph, walks it in reverse, and ADDS into the `.grad` of leaves that
require grad (accumulation is the default; `zero_grad()` is the only clear).
Intermediate gradients live in a dict for the duration of one backward and are
never stored on tensors. A graph can be walked once: its closures are released
afterwards and a second backward raises.

Trade-off: closures keep forward intermediates alive until backward; use
`checkpoint()` (ops.py) to trade that memory for recompute.

Gradients are always float32 numpy arrays, whatever the data dtype.
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from ..errors import UserError

_state = threading.local()


def grad_enabled() -> bool:
    return getattr(_state, "enabled", True)


@contextlib.contextmanager
def no_grad():
    """Inference context: ops build no graph."""
    prev = grad_enabled()
    _state.enabled = False
    try:
        yield
    finally:
        _state.enabled = prev


@contextlib.contextmanager
def enable_grad():
    prev = grad_enabled()
    _state.enabled = True
    try:
        yield
    finally:
        _state.enabled = prev


class GraphError(RuntimeError):
    pass


class OpError(UserError, ValueError):
    """Bad input to an op (shapes, dtypes, label ranges); the message names the op."""


class OpIndexError(OpError, IndexError):
    """Out-of-range indexing (an IndexError, so iteration over a Tensor stops)."""


class Tensor:
    """A numpy array that can take part in reverse-mode differentiation.

    data: the numpy array (float32 by default; f16/bf16 via `to`; ints for ids)
    grad: float32 numpy array of data's shape, or None until a backward adds to it
    requires_grad: leaf flag (trainable parameter); results of ops inherit it
    """

    __slots__ = ("data", "grad", "requires_grad", "name", "_parents", "_backward", "_op", "_consumed", "__weakref__")
    __array_priority__ = 1000  # so ndarray + Tensor defers to Tensor.__radd__

    def __init__(self, data, requires_grad=False, name=None, dtype=None):
        arr = np.asarray(data.data if isinstance(data, Tensor) else data)
        if dtype is not None:
            arr = arr.astype(dtype, copy=False)
        elif arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        if requires_grad and arr.dtype.kind not in "fV":
            raise TypeError(f"Tensor: only floating tensors can require grad, got dtype {arr.dtype}")
        self.data = arr
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self.name = name
        self._parents = ()
        self._backward = None
        self._op = None
        self._consumed = False

    # --- construction of graph nodes -------------------------------------
    @staticmethod
    def make(data, parents, backward, op):
        """Result of an op. `backward(g)` returns one gradient (or None) per parent:
        fresh arrays or views of g (see `_adoptable` for why)."""
        out = Tensor.__new__(Tensor)
        out.data = data if isinstance(data, np.ndarray) else np.asarray(data)
        out.grad = None
        out.name = None
        out._consumed = False
        out._op = op
        if grad_enabled() and any(p.requires_grad for p in parents):
            out.requires_grad = True
            out._parents = tuple(parents)
            out._backward = backward
        else:
            out.requires_grad = False
            out._parents = ()
            out._backward = None
        return out

    @property
    def is_leaf(self):
        return not self._parents

    # --- numpy-like facade ------------------------------------------------
    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return self.data.size

    def __len__(self):
        return len(self.data)

    def numpy(self):
        return self.data

    def item(self):
        return self.data.item()

    def detach(self):
        return Tensor(self.data)

    def __repr__(self):
        flag = ", requires_grad=True" if self.requires_grad else ""
        nm = f", name={self.name!r}" if self.name else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}{flag}{nm})"

    def zero_grad(self):
        self.grad = None

    # --- reverse mode -----------------------------------------------------
    def backward(self, grad=None):
        """Differentiate this tensor; ADD the result into leaf `.grad`s.

        `grad` defaults to 1 for a scalar. The graph is consumed: a second
        backward over it raises GraphError.
        """
        if not self.requires_grad:
            raise GraphError("backward: this tensor does not require grad "
                             "(no parameter with requires_grad=True reached it, or it was built under no_grad())")
        if self._consumed:
            raise GraphError("backward: this graph was already differentiated; "
                             "run the forward again (a graph can be walked once)")

        if grad is None:
            if self.data.size != 1:
                raise GraphError(f"backward: grad can be implied only for a scalar output, got shape {self.shape}")
            grad = np.ones(self.shape, dtype=np.float32)
        else:
            grad = np.asarray(grad.data if isinstance(grad, Tensor) else grad, dtype=np.float32)
            if grad.shape != self.shape:
                raise GraphError(f"backward: grad shape {grad.shape} does not match tensor shape {self.shape}")

        order = _topo_order(self)
        for node in order:
            if node._consumed:
                raise GraphError("backward: part of this graph was already differentiated; run the forward again")
        grads = {id(self): grad}
        shared = {id(_owner(grad))}  # memory a leaf may not adopt: the caller's grad, memory already adopted
        sums = {}  # id -> gradient sums this walk allocated: later contributions add into them in place
        for node in reversed(order):
            g = grads.pop(id(node), None)
            sums.pop(id(g), None)
            if node._backward is None:
                # a leaf: accumulate
                if g is not None and node.requires_grad:
                    g = _reduce_to_shape(g, node.data.shape)
                    if node.grad is not None:
                        node.grad += g
                    elif _adoptable(g) and id(_owner(g)) not in shared:
                        node.grad = g  # a fresh array from a backward: skip the copy
                        shared.add(id(_owner(g)))
                    else:
                        node.grad = np.array(g, dtype=np.float32, copy=True)
                continue
            if g is not None:
                parent_grads = node._backward(g)
                for p, pg in zip(node._parents, parent_grads):
                    if pg is None or not p.requires_grad:
                        continue
                    pg = _reduce_to_shape(np.asarray(pg, dtype=np.float32), p.data.shape)
                    key = id(p)
                    prev = grads.get(key)
                    if prev is None:
                        grads[key] = pg
                    elif id(prev) in sums:
                        prev += pg  # the same bits as prev + pg, without a new array
                    else:
                        total = prev + pg
                        sums[id(total)] = total
                        grads[key] = total
            # release the graph: closures hold forward intermediates
            node._backward = None
            node._consumed = True
            node._parents = ()

    # operators are attached in ops.py (Tensor.__add__ = ops.add, ...)


def _topo_order(root):
    order, seen = [], set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for p in node._parents:
            if id(p) not in seen and p.requires_grad:
                stack.append((p, False))
    return order


def _owner(g):
    """The array that owns g's memory (g itself, or the base of a view)."""
    return g if g.base is None else g.base


def _adoptable(g):
    """A float32 array whose memory is exactly one fresh buffer (an array that
    owns its data, or a full-size reshape of one) can become a leaf's .grad
    without a copy. Contract for backward closures: return fresh arrays or
    views of the gradient they received, never a buffer they reuse later, and
    never write into received or returned gradients."""
    if not (isinstance(g, np.ndarray) and g.dtype == np.float32 and g.flags.c_contiguous and g.flags.writeable):
        return False
    owner = _owner(g)
    return isinstance(owner, np.ndarray) and owner.flags.owndata and owner.nbytes == g.nbytes


def _reduce_to_shape(g, shape):
    """Sum a broadcast gradient back down to `shape`."""
    if g.shape == shape:
        return g
    nd = g.ndim - len(shape)
    if nd > 0:
        g = g.sum(axis=tuple(range(nd)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def tensor(data, requires_grad=False, name=None, dtype=None):
    return Tensor(data, requires_grad=requires_grad, name=name, dtype=dtype)


def parameter(data, name=None):
    """A trainable float32 leaf."""
    return Tensor(np.array(data, dtype=np.float32), requires_grad=True, name=name)
