"""Muon: momentum orthogonalized by Newton-Schulz (Keller Jordan's reference).

For each weight matrix: buf = lerp(buf, g, 1-momentum); the update is the
Nesterov look-ahead lerp(g, buf, momentum) (or buf), flattened to
[d0, prod(rest)], orthogonalized by 5 steps of the quintic Newton-Schulz
iteration (a, b, c) = (3.4445, -4.7750, 2.0315) in float32 (tall matrices
transposed so the Gram matrix is the small side; X / (||X||_F + 1e-7) first),
scaled, then p *= 1 - lr*wd; p += -lr * update.

Scale: 'spectral' = sqrt(max(1, rows/cols)) (Keller) or 'match_rms_adamw' =
0.2*sqrt(max(rows, cols)) (Moonlight), rows/cols of the flattened matrix.

0-D/1-D params route automatically to an embedded AdamW (`self.fallback`, its
own config: lr 3e-4, betas (0.9, 0.95), eps 1e-10, wd 0 by default);
embeddings and output heads are 2-D but must not be orthogonalized: register
them with `add_fallback_param`.

Trade-off: the reference runs Newton-Schulz in bf16 on GPU; we run it in
float32 through the tiled GEMMs of pipeline/kernels/nn (single-threaded BLAS per tile on
a grid fixed by the shape, so the bits do not depend on the thread count:
multi-threaded OpenBLAS does not promise that, and on AMD EPYC it measurably
differs), exact enough to pin goldens to 1e-6 but ~5 GEMMs of the matrix size
per step.
"""
from __future__ import annotations

import math

import numpy as np

from pipeline.kernels import optim as K
from pipeline.kernels.nn import matmul_nn, matmul_nt

from .adamw import AdamW
from .base import Optimizer, OptimizerConfigError, check_range, f32, new_state, state_dtype_name

NS_COEFFS = (3.4445, -4.7750, 2.0315)
SCALES = ("spectral", "match_rms_adamw")
FALLBACK_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def newton_schulz5(G, steps=5):
    """Approximately orthogonalize a float32 [rows, cols] matrix (singular values ~(0.5, 1.5))."""
    a, b, c = (np.float32(x) for x in NS_COEFFS)
    tall = G.shape[0] > G.shape[1]
    X = np.ascontiguousarray(G.T if tall else G, dtype=np.float32)
    norm = np.float32(math.sqrt(K.sum_squares(X)))
    X = X / (norm + np.float32(1e-7))
    for _ in range(steps):
        A = matmul_nt(X, X)
        B = b * A + matmul_nn(c * A, A)  # the reference's operator order: c * A @ A == (c*A) @ A
        X = a * X + matmul_nn(B, X)
    return X.T if tall else X


def matrix_shape(shape):
    """[d0, prod(rest)]: how Muon/APOLLO see a >=2-D parameter."""
    return (shape[0], int(np.prod(shape[1:])))


class Muon(Optimizer):
    TYPE = "muon"
    STRUCTURAL = ("state_dtype", "nesterov", "ns_steps", "scale")

    def __init__(self, params=(), lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 scale="spectral", state_dtype="f32", fallback=None, fallback_params=()):
        self.momentum = check_range("Muon: momentum", momentum, 0.0, 1.0, high_open=True)
        self.nesterov = bool(nesterov)
        self.ns_steps = int(ns_steps)
        if self.ns_steps < 1:
            raise OptimizerConfigError(f"Muon: ns_steps must be >= 1, got {ns_steps}")
        self.weight_decay = check_range("Muon: weight_decay", weight_decay, 0.0)
        if scale not in SCALES:
            raise OptimizerConfigError(f"Muon: scale must be one of {SCALES}, got {scale!r}")
        self.scale = scale
        self.state_dtype = state_dtype_name(state_dtype, "Muon: state_dtype")
        fb = dict(FALLBACK_DEFAULTS)
        fb.update(fallback or {})
        try:
            self.fallback = AdamW((), **fb)
        except TypeError as e:
            raise OptimizerConfigError(f"Muon: bad fallback config {fallback!r}: {e}") from None
        super().__init__(params, lr)
        for item in fallback_params:
            if isinstance(item, tuple):
                self.add_fallback_param(item[1], name=item[0])
            else:
                self.add_fallback_param(item)

    def config(self):
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov, "ns_steps": self.ns_steps,
                "weight_decay": self.weight_decay, "scale": self.scale, "state_dtype": self.state_dtype,
                "fallback": self.fallback.config()}

    # --- routing ---------------------------------------------------------------
    def add_param(self, tensor, name=None):
        """Matrices (>= 2-D) go to Muon; 0-D/1-D params route to the AdamW fallback."""
        if getattr(tensor, "ndim", 2) < 2:
            return self.add_fallback_param(tensor, name)
        return self._register(tensor, name, self.slots)

    def add_fallback_param(self, tensor, name=None):
        """Step this param with the embedded AdamW (embeddings, output heads, biases, norms)."""
        return self._register(tensor, name, self.fallback.slots)

    def all_slots(self):
        return self.slots + self.fallback.slots

    def lr_holders(self):
        return [self, self.fallback]

    def step(self):
        super().step()
        self.fallback.step()

    # --- the update ---------------------------------------------------------------
    def _expected_state(self, slot):
        return {"momentum_buffer": (slot.tensor.data.shape, self.state_dtype)}

    def update_scale(self, rows, cols):
        if self.scale == "spectral":
            return max(1.0, rows / cols) ** 0.5
        return 0.2 * math.sqrt(max(rows, cols))

    def _update(self, slot, w, g):
        if "momentum_buffer" not in slot.state:
            slot.state["momentum_buffer"] = new_state(slot.tensor.data.shape, self.state_dtype)
        update = K.muon_momentum(g, slot.state["momentum_buffer"].reshape(-1), f32(1.0 - self.momentum),
                                 f32(self.momentum), self.nesterov)
        rows, cols = matrix_shape(slot.tensor.data.shape)
        ortho = newton_schulz5(update.reshape(rows, cols), self.ns_steps)
        ortho = ortho * f32(self.update_scale(rows, cols))
        if self.weight_decay != 0:
            w *= f32(1.0 - self.lr * self.weight_decay)
        K.axpby_(w, 1.0, ortho.reshape(-1), -self.lr)

    # --- persistence: Muon slots, then the fallback's under "fallback." ------------
    def state_dict(self):
        sd = super().state_dict()
        fb = self.fallback.state_dict()
        sd["tensors"].update({f"fallback.{k}": v for k, v in fb["tensors"].items()})
        sd["scalars"].update({f"fallback.{k}": v for k, v in fb["scalars"].items()})
        return sd

    def load_state_dict(self, sd, source="optimizer state"):
        def split(entries, inside):
            return {(k[len("fallback."):] if inside else k): v for k, v in (entries or {}).items()
                    if k.startswith("fallback.") == inside}
        config = (sd.get("config") or {}) if isinstance(sd, dict) else {}
        if isinstance(sd, dict) and sd.get("type") == self.TYPE:
            self.fallback.load_state_dict({"type": "adamw", "config": config.get("fallback") or {},
                                           "tensors": split(sd.get("tensors"), True),
                                           "scalars": split(sd.get("scalars"), True)},
                                          source=f"{source} (Muon fallback)")
            sd = dict(sd, tensors=split(sd.get("tensors"), False), scalars=split(sd.get("scalars"), False))
        super().load_state_dict(sd, source)
