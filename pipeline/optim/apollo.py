"""APOLLO and APOLLO-Mini: apollo_torch's APOLLOAdamW semantics (arXiv 2412.05270).

For a matrix gradient G [rows, cols] a random projection P maps it to rank r:
rows >= cols -> R = G @ P.T with P [r, cols] (right); else R = P.T @ G with
P [rows, r] (left); P ~ N(0, 1)/sqrt(r). Adam moments live in that compressed
space (legacy HF form: denom = sqrt(v) + eps, step_size = lr*sqrt(bc2)/bc1).
The ratio ||m/denom|| / (||R|| + 1e-8), per channel (over the rank axis) or for
the whole tensor, scales the RAW gradient: u = G * s; the norm-growth limiter
keeps ||u|| from growing more than 1.01x per step; u *= sqrt(scale);
p -= step_size*u; then decoupled decay AFTER the step (p -= lr*wd*p).
Non-matrix params and `add_fallback_param` ones take the same HF AdamW step
without projection.

Where our RNG replaces theirs: apollo_torch draws P from torch.Generator seeded
by the param's index and re-seeds with a torch.randint chain every
update_proj_gap steps. We regenerate P (never store it) from pipeline.kernels.rng as a
pure function of (seed, slot name, step // update_proj_gap): gaussian with
seed derive_seed(derive_seed(seed, fnv1a64(name)), step // gap). Goldens are
made by injecting exactly this P into apollo_torch.

Trade-off: state is ~2*rank*max(dim) floats per matrix instead of 2*rows*cols,
paid with a projection GEMM per matrix per step. State is float32 only: the
moments are already compressed and the scaling norms read them directly.
"""
from __future__ import annotations

import math

import numpy as np

from pipeline.kernels import optim as K
from pipeline.kernels import rng

from .base import Optimizer, OptimizerConfigError, check_betas, check_range, f32, new_state, state_dtype_name

SCALE_TYPES = ("channel", "tensor")


def fnv1a64(text):
    h = 0xCBF29CE484222325
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def projection(seed, name, epoch, rows, cols, rank):
    """The float32 projection matrix of slot `name` for refresh epoch `epoch` (step // gap)."""
    shape = (rank, cols) if rows >= cols else (rows, rank)
    epoch_seed = rng.derive_seed(rng.derive_seed(seed, fnv1a64(name)), epoch)
    return rng.gaussian(epoch_seed, shape) / np.float32(math.sqrt(rank))


def _norm(x, axis=None):
    """float64-accumulated L2 norm, cast to float32 (deterministic, order fixed by numpy)."""
    x64 = x.astype(np.float64)
    return np.sqrt(np.sum(x64 * x64, axis=axis)).astype(np.float32)


class Apollo(Optimizer):
    TYPE = "apollo"
    STRUCTURAL = ("rank", "update_proj_gap", "scale_type", "seed", "norm_growth_limit", "scale_front",
                  "correct_bias", "state_dtype")

    def __init__(self, params=(), lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, rank=128,
                 update_proj_gap=200, scale=1.0, scale_type="channel", correct_bias=True,
                 norm_growth_limit=True, scale_front=False, seed=0, state_dtype="f32",
                 second_moment_dtype="f32", fallback_params=()):
        self.betas = check_betas(betas, "Apollo: betas")
        self.eps = check_range("Apollo: eps", eps, 0.0)
        self.weight_decay = check_range("Apollo: weight_decay", weight_decay, 0.0)
        self.rank = int(rank)
        if self.rank < 1:
            raise OptimizerConfigError(f"Apollo: rank must be >= 1, got {rank}")
        self.update_proj_gap = int(update_proj_gap)
        if self.update_proj_gap < 1:
            raise OptimizerConfigError(f"Apollo: update_proj_gap must be >= 1, got {update_proj_gap}")
        self.apollo_scale = check_range("Apollo: scale", scale, 0.0)
        if scale_type not in SCALE_TYPES:
            raise OptimizerConfigError(f"Apollo: scale_type must be one of {SCALE_TYPES}, got {scale_type!r}")
        self.scale_type = scale_type
        self.correct_bias = bool(correct_bias)
        self.norm_growth_limit = bool(norm_growth_limit)
        self.scale_front = bool(scale_front)
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        for field, value in (("state_dtype", state_dtype), ("second_moment_dtype", second_moment_dtype)):
            if state_dtype_name(value, f"Apollo: {field}") != "f32":
                raise OptimizerConfigError(f"Apollo: {field}={value!r} is not supported: APOLLO state stays float32 "
                                           "(its moments are rank-compressed already "
                                           "and its scaling norms read them directly)")
        self.state_dtype = "f32"
        self._fallback_ids = set()
        self._proj_cache = {}
        super().__init__(params, lr)
        for item in fallback_params:
            if isinstance(item, tuple):
                self.add_fallback_param(item[1], name=item[0])
            else:
                self.add_fallback_param(item)

    @classmethod
    def mini(cls, params=(), lr=0.01, **kwargs):
        """APOLLO-Mini: rank 1, tensor-wise scaling, scale 128 (the paper's recipe)."""
        kwargs.setdefault("rank", 1)
        kwargs.setdefault("scale_type", "tensor")
        kwargs.setdefault("scale", 128.0)
        return cls(params, lr=lr, **kwargs)

    def config(self):
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
                "rank": self.rank, "update_proj_gap": self.update_proj_gap, "scale": self.apollo_scale,
                "scale_type": self.scale_type, "correct_bias": self.correct_bias,
                "norm_growth_limit": self.norm_growth_limit, "scale_front": self.scale_front,
                "seed": self.seed, "state_dtype": self.state_dtype}

    def add_fallback_param(self, tensor, name=None):
        """Step this 2-D param with plain (HF-style) AdamW: embeddings, output heads."""
        slot_name = self.add_param(tensor, name)
        self._fallback_ids.add(id(tensor))
        return slot_name

    def projected(self, slot):
        return slot.tensor.data.ndim == 2 and id(slot.tensor) not in self._fallback_ids

    def _moment_shape(self, slot):
        shape = slot.tensor.data.shape
        if not self.projected(slot):
            return shape
        rows, cols = shape
        return (rows, self.rank) if rows >= cols else (self.rank, cols)

    def _expected_state(self, slot):
        shape = self._moment_shape(slot)
        return {"exp_avg": (shape, "f32"), "exp_avg_sq": (shape, "f32")}

    def _extra_keys(self, slot):
        return ("scaled_grad_norm",) if self.projected(slot) else ()

    def projection(self, slot, epoch):
        key = slot.name
        cached = self._proj_cache.get(key)
        if cached is None or cached[0] != epoch:
            rows, cols = slot.tensor.data.shape
            cached = (epoch, projection(self.seed, slot.name, epoch, rows, cols, self.rank))
            self._proj_cache[key] = cached
        return cached[1]

    def _update(self, slot, w, g):
        shape = slot.tensor.data.shape
        projected = self.projected(slot)
        if projected:
            G = g.reshape(shape)
            P = self.projection(slot, (slot.step - 1) // self.update_proj_gap)
            R = G @ P.T if shape[0] >= shape[1] else P.T @ G
        else:
            R = g
        if "exp_avg" not in slot.state:
            slot.state["exp_avg"] = new_state(self._moment_shape(slot), "f32")
            slot.state["exp_avg_sq"] = new_state(self._moment_shape(slot), "f32")
        m, v = slot.state["exp_avg"], slot.state["exp_avg_sq"]
        b1, b2 = self.betas
        step_size = self.lr
        if self.correct_bias:
            step_size = step_size * math.sqrt(1.0 - b2 ** slot.step) / (1.0 - b1 ** slot.step)
        neg_lr_wd = -self.lr * self.weight_decay if self.weight_decay > 0 else 0.0
        if not projected:  # the whole HF AdamW step in one fused pass
            K.hf_adamw_step(w, g, m.reshape(-1), v.reshape(-1), b1, 1.0 - b1, b2, 1.0 - b2, self.eps,
                            -step_size, neg_lr_wd)
            return
        K.axpby_(m, b1, R, 1.0 - b1)
        K.ema_sq_(v, b2, R, 1.0 - b2)
        direction = self._scaled_gradient(slot, G, R, m / (np.sqrt(v) + f32(self.eps)))
        K.axpby_(w, 1.0, direction, -step_size)
        if neg_lr_wd:
            K.axpby_(w, 1.0, w, neg_lr_wd)

    def _scaled_gradient(self, slot, G, R, normalized):
        rows, cols = G.shape
        if self.scale_type == "channel":
            axis = 0 if rows < cols else 1  # the rank axis
            factor = _norm(normalized, axis) / (_norm(R, axis) + f32(1e-8))
            if axis == 1:
                factor = factor[:, None]
        else:
            factor = _norm(normalized) / (_norm(R) + f32(1e-8))
        u = G * factor
        sqrt_scale = f32(np.sqrt(self.apollo_scale))
        if self.scale_front:
            u *= sqrt_scale
        if self.norm_growth_limit:
            norm = np.float32(math.sqrt(K.sum_squares(u)))  # full-size: the chunked float64 reduction
            prev = slot.extra.get("scaled_grad_norm")
            if prev is None:
                slot.extra["scaled_grad_norm"] = norm
            else:
                limiter = max(norm / (prev + f32(1e-8)), f32(1.01)) / f32(1.01)
                u = u / f32(limiter)
                slot.extra["scaled_grad_norm"] = f32(norm / f32(limiter))
        if not self.scale_front:
            u *= sqrt_scale
        return u
