"""The autograd engine: Tensor, no_grad, and the differentiable ops."""
from .tensor import GraphError, OpError, OpIndexError, Tensor, enable_grad, grad_enabled, no_grad, parameter, tensor
from . import ops
from .module import Module, named_parameters
from .ops import *  # noqa: F401,F403  (the op functions: add, matmul, tanh, ...)
from .losses import cross_entropy, linear_cross_entropy
