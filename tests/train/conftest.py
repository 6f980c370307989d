"""A stand-in optimizer that follows pipeline/optim's persistence contract.

It lets the checkpoint tests run without depending on a particular optimizer:
heavy-ball momentum with optional bf16 state, slots named explicitly or
"param<i>" by registration index, and a load_state_dict that validates type,
structural config and dtypes the way the real optimizers promise to.
"""
import ml_dtypes
import numpy as np
import pytest

from pipeline.errors import ConfigMismatchError, DTypeMismatchError


class FakeMomentum:
    type_name = "fake_momentum"

    def __init__(self, params=(), lr=0.1, momentum=0.9, state_dtype="f32"):
        self.config = {"lr": lr, "momentum": momentum, "state_dtype": state_dtype}
        self.slots = []  # [name, tensor, buffer | None, step]
        for i, p in enumerate(params):
            name, t = p if isinstance(p, tuple) else (None, p)
            self.add_param(t, name)

    def add_param(self, t, name=None):
        self.slots.append([name or f"param{len(self.slots)}", t, None, 0])

    def _dtype(self):
        return np.dtype(ml_dtypes.bfloat16) if self.config["state_dtype"] == "bf16" else np.dtype(np.float32)

    def step(self):
        for slot in self.slots:
            _, t, buf, _ = slot
            if t.grad is None:
                continue
            prev = np.zeros_like(t.grad) if buf is None else buf.astype(np.float32)
            new = np.float32(self.config["momentum"]) * prev + t.grad
            slot[2] = new.astype(self._dtype())
            slot[3] += 1
            t.data -= np.float32(self.config["lr"]) * new

    def zero_grad(self):
        for _, t, _, _ in self.slots:
            t.grad = None

    def state_dict(self):
        return {
            "type": self.type_name,
            "config": dict(self.config),
            "tensors": {f"{n}.momentum": b for n, _, b, _ in self.slots if b is not None},
            "scalars": {f"{n}.step": s for n, _, _, s in self.slots},
        }

    def load_state_dict(self, sd):
        if sd["type"] != self.type_name:
            raise ConfigMismatchError(f"type {sd['type']!r} is not {self.type_name!r}")
        for key in ("momentum", "state_dtype"):  # lr is deliberately not structural
            if sd["config"][key] != self.config[key]:
                raise ConfigMismatchError(f"config field {key!r}: {sd['config'][key]!r} != {self.config[key]!r}")
        for slot in self.slots:
            name = slot[0]
            buf = sd["tensors"].get(f"{name}.momentum")
            if buf is not None and buf.dtype != self._dtype():
                raise DTypeMismatchError(f"{name}.momentum is {buf.dtype}, optimizer state is {self._dtype()}")
            slot[2] = None if buf is None else buf.copy()
            slot[3] = sd["scalars"][f"{name}.step"]
        self.config["lr"] = sd["config"]["lr"]


@pytest.fixture
def fake_momentum():
    return FakeMomentum
