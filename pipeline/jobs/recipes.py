"""Optimizer recipes and gradient clipping for pipeline jobs.

The pipeline needs three things from an optimizer: `step(lr)` over parameters
whose `.grad` is set, `state_dict()` -> {name: array} + JSON-able scalars, and
`load_state_dict()`. `pipeline.optim` (the optimizer issue) is the real home of
AdamW/Muon; until its API is wired in here, `AdamWLite` is a small,
deterministic AdamW with torch semantics (bias corrections computed once per
step in float64, cast to float32; element-independent update).

Trade-off: a job-local optimizer keeps the pipeline testable on its own, at the
cost of a second AdamW implementation in the tree; swap to pipeline.optim when
its state layout is settled (the checkpoint names below are ours).
"""
from __future__ import annotations

import math

import numpy as np


class AdamWLite:
    """AdamW (torch.optim.AdamW semantics, decoupled weight decay) over named Tensors."""

    kind = "adamw"

    def __init__(self, named, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, no_decay=lambda name, p: p.ndim < 2):
        self.named = list(named)
        self.b1, self.b2 = betas
        self.eps, self.wd = eps, weight_decay
        self.decay = {n: (weight_decay if not no_decay(n, p.data) else 0.0) for n, p in self.named}
        self.m = {n: np.zeros_like(p.data, dtype=np.float32) for n, p in self.named}
        self.v = {n: np.zeros_like(p.data, dtype=np.float32) for n, p in self.named}
        self.t = 0

    def step(self, lr: float):
        self.t += 1
        bc1 = 1.0 - self.b1 ** self.t
        bc2 = 1.0 - self.b2 ** self.t
        step_size = np.float32(lr / bc1)
        bc2_sqrt = np.float32(math.sqrt(bc2))
        b1, b2 = np.float32(self.b1), np.float32(self.b2)
        for n, p in self.named:
            g = p.grad
            if g is None:
                continue
            if self.decay[n]:
                p.data *= np.float32(1.0 - lr * self.decay[n])
            m, v = self.m[n], self.v[n]
            m *= b1
            m += (np.float32(1) - b1) * g
            v *= b2
            v += (np.float32(1) - b2) * (g * g)
            denom = np.sqrt(v) / bc2_sqrt + np.float32(self.eps)
            p.data -= step_size * (m / denom)

    def state_dict(self):
        tensors = {}
        for n, _ in self.named:
            tensors[f"{n}.exp_avg"] = self.m[n]
            tensors[f"{n}.exp_avg_sq"] = self.v[n]
        return tensors, {"kind": self.kind, "t": self.t, "betas": [self.b1, self.b2], "eps": self.eps,
                         "weight_decay": self.wd}

    def load_state_dict(self, tensors, meta):
        from ..errors import ConfigMismatchError
        if meta.get("kind") != self.kind:
            raise ConfigMismatchError(f"optimizer state: kind {meta.get('kind')!r} in the checkpoint, {self.kind!r} configured")
        for n, p in self.named:
            for key, dst in ((f"{n}.exp_avg", self.m[n]), (f"{n}.exp_avg_sq", self.v[n])):
                if key not in tensors:
                    raise ConfigMismatchError(f"optimizer state: tensor {key!r} missing from the checkpoint")
                if tensors[key].shape != dst.shape:
                    raise ConfigMismatchError(f"optimizer state: {key!r} has shape {tensors[key].shape}, parameter needs {dst.shape}")
                dst[...] = tensors[key]
        self.t = int(meta["t"])


def clip_grad_norm(named, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ semantics; the norm is a float64 sum in name order."""
    total = 0.0
    for _, p in named:
        if p.grad is not None:
            g = p.grad.astype(np.float64).ravel()
            total += float(g @ g)
    norm = math.sqrt(total)
    if max_norm and max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            c = np.float32(coef)
            for _, p in named:
                if p.grad is not None:
                    p.grad *= c
    return norm


def warmup_hold_cooldown(step: int, total: int, warmup: int, cooldown: int, peak: float, floor: float = 0.0) -> float:
    """LR at a (0-based) step: linear warm-up, hold at peak, linear cool-down to floor; pure in step."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    start = total - cooldown
    if cooldown > 0 and step >= start:
        frac = (step - start + 1) / cooldown
        return peak + (floor - peak) * frac
    return peak
