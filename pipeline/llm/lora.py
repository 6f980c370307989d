"""LoRA adapters: y = base(x) + (alpha / rank) * B (A dropout(x)) beside a frozen linear.

A: [rank, in] kaiming-uniform from the counter RNG (seeded, reproducible);
B: [out, rank] exact zeros, so at step 0 the adapted model IS the base model,
bit for bit. The scale alpha/rank keeps a learning rate tuned at one rank sane
at another.

Trade-off: the delta is one fused differentiable op (`lora_delta`) rather than
a chain of generic ops. It never forms the [out, in] product B·A (two thin
matmuls, O(rank * (in + out)) per row), regenerates the dropout mask from its
seed in backward instead of storing it, and computes the A, B and input
gradients side by side. The merged weight exists only at `merge_into` time.

Dropout follows the engine's contract: element i of the (flattened) input keeps
x[i] / (1 - p) iff the 53-bit uniform of at(seed, i) is below 1 - p. A `None`
seed is eval mode (no dropout).
"""
from __future__ import annotations

import numpy as np

from kernels.workpool import single_thread_blas
from kernels.rng import kaiming_uniform, uniform
from pipeline.autograd.module import Module
from pipeline.autograd.tensor import Tensor, parameter
from pipeline.errors import UserError

QUANTIZED_MERGE_REFUSAL = (
    "refusing to merge a LoRA adapter into a quantized base weight: dequantize -> merge -> re-encode "
    "compounds the quantization error. Merge into a dense f32/f16 base instead and quantize the RESULT "
    "(or dequantize to an f32 copy for in-memory use)")


def dropout_keep_mask(seed, shape, p):
    """The inverted-dropout multiplier: 1/(1-p) where kept, 0 where dropped (float32)."""
    u = uniform(seed, shape, dtype=np.float64)
    return np.where(u < 1.0 - p, np.float32(1.0 / (1.0 - p)), np.float32(0.0)).astype(np.float32)


def lora_delta(x, a, b, scale, dropout_p=0.0, dropout_seed=None):
    """scale * dropout(x) @ A.T @ B.T as one differentiable op.

    x: [..., in] float32 Tensor; a: [rank, in]; b: [out, rank]. Returns [..., out].
    """
    if x.shape[-1] != a.shape[1] or a.shape[0] != b.shape[1]:
        raise ValueError(f"lora_delta: x {x.shape}, A {a.shape}, B {b.shape} do not chain (x[..., in] @ A[r, in].T @ B[out, r].T)")
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x.data, dtype=np.float32).reshape(-1, a.shape[1])
    use_dropout = dropout_seed is not None and dropout_p > 0.0
    xd = x2 * dropout_keep_mask(dropout_seed, x2.shape, dropout_p) if use_dropout else x2
    with single_thread_blas():  # rank-thin products: BLAS threads only spin-wait here
        h = xd @ a.data.T                      # [N, r]: the only intermediate kept
        y = (h @ b.data.T) * np.float32(scale)  # [N, out]

    def backward(g):
        g2 = g.reshape(-1, b.shape[0])
        with single_thread_blas():
            gh = (g2 @ b.data) * np.float32(scale)          # [N, r]
            gb = (g2.T @ h) * np.float32(scale) if b.requires_grad else None
            ga = None
            if a.requires_grad:
                xd_ = x2 * dropout_keep_mask(dropout_seed, x2.shape, dropout_p) if use_dropout else x2
                ga = gh.T @ xd_
            gx = None
            if x.requires_grad:
                gx = gh @ a.data
                if use_dropout:
                    gx *= dropout_keep_mask(dropout_seed, x2.shape, dropout_p)
                gx = gx.reshape(x.shape)
        return gx, ga, gb

    return Tensor.make(y.reshape(*lead, b.shape[0]), (x, a, b), backward, "lora_delta")


class LoraAdapter(Module):
    """One adapter beside one frozen [out, in] linear (a Module: its tensors are lora_a, lora_b)."""

    def __init__(self, in_dim, out_dim, rank=8, alpha=16.0, dropout=0.0, seed=0, prefix="adapter"):
        if not (isinstance(rank, (int, np.integer)) and 1 <= rank <= min(in_dim, out_dim)):
            raise UserError(f"{prefix}: LoRA rank must be an integer in [1, min(in, out)] = [1, {min(in_dim, out_dim)}], got {rank}")
        if not (0.0 <= dropout < 1.0):
            raise UserError(f"{prefix}: LoRA dropout must be in [0, 1), got {dropout}")
        self.in_dim, self.out_dim, self.rank = int(in_dim), int(out_dim), int(rank)
        self.alpha, self.dropout = float(alpha), float(dropout)
        self.scale = np.float32(self.alpha / self.rank)
        self.prefix = prefix
        self.lora_a = parameter(kaiming_uniform(seed, (self.rank, self.in_dim), fan_in=self.in_dim), name=f"{prefix}.lora_a")
        self.lora_b = parameter(np.zeros((self.out_dim, self.rank), dtype=np.float32), name=f"{prefix}.lora_b")

    def named_parameters(self, prefix=None, trainable_only=True):
        """[("<prefix>.lora_a", A), ("<prefix>.lora_b", B)]: the registration and persistence names."""
        prefix = self.prefix if prefix is None else prefix
        return [(f"{prefix}.lora_a", self.lora_a), (f"{prefix}.lora_b", self.lora_b)]

    def delta(self, x, dropout_seed=None):
        """(alpha/rank) * B (A dropout(x)); dropout_seed None = eval (no dropout)."""
        return lora_delta(x, self.lora_a, self.lora_b, self.scale, self.dropout, dropout_seed)

    def apply(self, x, base_out, dropout_seed=None):
        """base_out + delta(x): the adapted projection's output."""
        return base_out + self.delta(x, dropout_seed)

    # --- merging ----------------------------------------------------------
    def _delta_weight(self):
        """scale * B @ A as a dense [out, in] float32 matrix (merge time only)."""
        return (self.lora_b.data @ self.lora_a.data) * self.scale

    def _check_weight(self, w, where):
        if tuple(w.shape) != (self.out_dim, self.in_dim):
            raise UserError(f"{where}: {self.prefix}: base weight shape {tuple(w.shape)} != adapter [out, in] = {(self.out_dim, self.in_dim)}")

    def merge_into(self, weight):
        """Fold the adapter into a dense float32 base weight IN PLACE.

        weight: a float32 numpy array or a Tensor that does not require grad
        (the frozen-base case). Quantized or 16-bit weights are refused.
        """
        if isinstance(weight, Tensor):
            if weight.requires_grad:
                raise UserError(f"merge_into: {self.prefix}: the base weight requires grad; merge only into a frozen (no-grad) weight")
        if _looks_quantized(weight):
            raise UserError(f"merge_into: {self.prefix}: {QUANTIZED_MERGE_REFUSAL}")
        weight = _dense(weight)
        if not isinstance(weight, np.ndarray) or weight.dtype != np.float32:
            dtype = getattr(weight, "dtype", type(weight).__name__)
            raise UserError(f"merge_into: {self.prefix}: in-place merge needs a float32 weight, got {dtype}; use merged_f16 for float16 bases")
        self._check_weight(weight, "merge_into")
        if not weight.flags.writeable:
            raise UserError(f"merge_into: {self.prefix}: the base weight is read-only (memory-mapped?); merge into a copy")
        weight += self._delta_weight()
        return weight

    def merged_f16(self, weight):
        """A NEW float16 array: f16 base widened to f32, merged, cast back."""
        if _looks_quantized(weight):
            raise UserError(f"merged_f16: {self.prefix}: {QUANTIZED_MERGE_REFUSAL}")
        w = _dense(weight)
        if not isinstance(w, np.ndarray) or w.dtype != np.float16:
            raise UserError(f"merged_f16: {self.prefix}: expected a float16 base weight, got {getattr(w, 'dtype', type(w).__name__)}")
        self._check_weight(w, "merged_f16")
        return (w.astype(np.float32) + self._delta_weight()).astype(np.float16)


def _looks_quantized(weight):
    """True for block-quantized weights: raw uint8 blocks, or a frozen weight whose format is quantized."""
    if isinstance(weight, Tensor):
        weight = weight.data
    if isinstance(weight, np.ndarray):
        return weight.dtype == np.uint8
    return bool(getattr(getattr(weight, "format", None), "quantized", False))


def _dense(weight):
    """The numpy array behind a Tensor or a non-quantized frozen weight (its `.raw`)."""
    if isinstance(weight, Tensor):
        return weight.data
    return getattr(weight, "raw", weight)
