"""Adam and AdamW: ports of torch.optim.Adam / torch.optim.AdamW (single-tensor path).

Adam couples L2 decay into the gradient (g += wd*p); AdamW decays the
parameter before the step (p *= 1 - lr*wd) and keeps eps outside the bias
correction: p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps). The bias
corrections are computed once per step in float64 and cast to float32, as
torch does with its Python-float scalars. m and v can each be stored in bf16
(`state_dtype`, `second_moment_dtype`); the math stays float32.

Trade-off: v in bf16 is opt-in because with beta2 = 0.999 its ~0.1%/step
change is below bf16's ~0.4% resolution, so the average can stall.
"""
from __future__ import annotations

import math

from pipeline.kernels import optim as K

from .base import Optimizer, check_betas, check_range, f32, new_state, state_dtype_name


class AdamW(Optimizer):
    TYPE = "adamw"
    STRUCTURAL = ("state_dtype", "second_moment_dtype")
    DECOUPLED = True

    def __init__(self, params=(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 state_dtype="f32", second_moment_dtype="f32"):
        name = type(self).__name__
        self.betas = check_betas(betas, f"{name}: betas")
        self.eps = check_range(f"{name}: eps", eps, 0.0)
        self.weight_decay = check_range(f"{name}: weight_decay", weight_decay, 0.0)
        self.state_dtype = state_dtype_name(state_dtype, f"{name}: state_dtype")
        self.second_moment_dtype = state_dtype_name(second_moment_dtype, f"{name}: second_moment_dtype")
        super().__init__(params, lr)

    def config(self):
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
                "state_dtype": self.state_dtype, "second_moment_dtype": self.second_moment_dtype}

    def _expected_state(self, slot):
        shape = slot.tensor.data.shape
        return {"exp_avg": (shape, self.state_dtype), "exp_avg_sq": (shape, self.second_moment_dtype)}

    def _update(self, slot, w, g):
        if "exp_avg" not in slot.state:
            shape = slot.tensor.data.shape
            slot.state["exp_avg"] = new_state(shape, self.state_dtype)
            slot.state["exp_avg_sq"] = new_state(shape, self.second_moment_dtype)
        beta1, beta2 = self.betas
        t = slot.step
        bc1 = 1.0 - beta1 ** t
        bc2_sqrt = math.sqrt(1.0 - beta2 ** t)
        lr, wd = self.lr, self.weight_decay
        keep = 1.0 - lr * wd if (self.DECOUPLED and wd != 0) else 1.0
        l2 = 0.0 if self.DECOUPLED else wd
        K.adam_step(w, g, slot.state["exp_avg"].reshape(-1), slot.state["exp_avg_sq"].reshape(-1),
                      f32(keep), f32(l2), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2),
                      f32(-(lr / bc1)), f32(bc2_sqrt), f32(self.eps))


class Adam(AdamW):
    """torch.optim.Adam: coupled L2 decay (default weight_decay 0)."""

    TYPE = "adam"
    DECOUPLED = False

    def __init__(self, params=(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 state_dtype="f32", second_moment_dtype="f32"):
        super().__init__(params, lr, betas, eps, weight_decay, state_dtype, second_moment_dtype)
