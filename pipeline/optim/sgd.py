"""SGD: a port of torch.optim.SGD (single-tensor path), quirks included.

Coupled L2 weight decay (g += wd*p), momentum with dampening, Nesterov; the
momentum buffer starts as a clone of the first (decayed) gradient, not zeros
(stored narrowed when state_dtype='bf16'). Nesterov with momentum 0 or
dampening != 0 is rejected at construction, like torch.

Trade-off: faithful to torch's arithmetic order rather than the "textbook"
formula, so goldens can pin it to a couple of float32 ulps.
"""
from __future__ import annotations

from pipeline.kernels import optim as K

from .base import Optimizer, OptimizerConfigError, check_range, dummy_state, f32, new_state, state_dtype_name


class SGD(Optimizer):
    TYPE = "sgd"
    STRUCTURAL = ("state_dtype", "nesterov")

    def __init__(self, params=(), lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, state_dtype="f32"):
        self.momentum = check_range("SGD: momentum", momentum, 0.0)
        self.dampening = float(dampening)
        self.weight_decay = check_range("SGD: weight_decay", weight_decay, 0.0)
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise OptimizerConfigError("SGD: nesterov requires momentum > 0 and dampening == 0 "
                                       f"(got momentum={self.momentum}, dampening={self.dampening})")
        self.state_dtype = state_dtype_name(state_dtype, "SGD: state_dtype")
        super().__init__(params, lr)

    def config(self):
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov, "state_dtype": self.state_dtype}

    def _expected_state(self, slot):
        if self.momentum == 0:
            return {}
        return {"momentum_buffer": (slot.tensor.data.shape, self.state_dtype)}

    def _update(self, slot, w, g):
        use_momentum = self.momentum != 0
        first = use_momentum and "momentum_buffer" not in slot.state
        if first:
            slot.state["momentum_buffer"] = new_state(slot.tensor.data.shape, self.state_dtype)
        buf = slot.state["momentum_buffer"].reshape(-1) if use_momentum else dummy_state()
        K.sgd_step(w, g, buf, f32(self.lr), f32(self.momentum), f32(1.0 - self.dampening),
                     f32(self.weight_decay), use_momentum, first, self.nesterov)
