"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

update = sign(beta1*m + (1-beta1)*g); p = p*(1 - lr*wd) - lr*update;
m = beta2*m + (1-beta2)*g. One state buffer (bf16-able), decoupled decay,
the arithmetic order of the lion-pytorch reference.

Trade-off: half AdamW's state and a cheaper step, but every element moves by
exactly lr per step, so lr must be ~3-10x smaller than AdamW's.
"""
from __future__ import annotations

from pipeline.kernels import optim as K

from .base import Optimizer, check_betas, check_range, f32, new_state, state_dtype_name


class Lion(Optimizer):
    TYPE = "lion"
    STRUCTURAL = ("state_dtype",)

    def __init__(self, params=(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, state_dtype="f32"):
        self.betas = check_betas(betas, "Lion: betas")
        self.weight_decay = check_range("Lion: weight_decay", weight_decay, 0.0)
        self.state_dtype = state_dtype_name(state_dtype, "Lion: state_dtype")
        super().__init__(params, lr)

    def config(self):
        return {"lr": self.lr, "betas": list(self.betas), "weight_decay": self.weight_decay,
                "state_dtype": self.state_dtype}

    def _expected_state(self, slot):
        return {"exp_avg": (slot.tensor.data.shape, self.state_dtype)}

    def _update(self, slot, w, g):
        if "exp_avg" not in slot.state:
            slot.state["exp_avg"] = new_state(slot.tensor.data.shape, self.state_dtype)
        b1, b2 = self.betas
        K.lion_step(w, g, slot.state["exp_avg"].reshape(-1), f32(1.0 - self.lr * self.weight_decay),
                      f32(-self.lr), f32(b1), f32(1.0 - b1), f32(b2), f32(1.0 - b2))
