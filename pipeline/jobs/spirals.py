"""`spirals`: mini-batch two-spirals classification (pipeline.models.spirals).

The smallest real job: ~4k parameters, so a 300-step run takes about a second
in-process and the multiprocess overhead dominates - which is exactly what the
determinism and fault tests want to exercise.

Data order: the points are re-shuffled every epoch by a permutation that is a
pure function of (seed, epoch); global row i of the run is point
perm(seed, i // n)[i % n]. Trade-off: the whole data set is regenerated in
every process that needs it (cheap here) instead of being shipped.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from pipeline.kernels import rng

from ..autograd.losses import cross_entropy
from ..models.spirals import SpiralsMLP, accuracy, make_spirals
from ..optim import warmup_hold_linear_cooldown
from .base import Job, bind_module, zero_copy_grads
from .recipes import adamw
from .spec import field, on_nonfinite_field, tensorboard_field


@dataclasses.dataclass
class SpiralsSpec:
    steps: int = field(300, "optimizer steps")
    batch: int = field(64, "rows per optimizer step (split into micro-batches)")
    micro_batches: int = field(4, "micro-batches per step (tasks handed to trainers)")
    points: int = field(200, "points per spiral arm (two arms)")
    noise: float = field(0.05, "gaussian noise on the point coordinates")
    hidden: int = field(64, "hidden width of the 2-hidden-layer tanh MLP")
    lr: float = field(0.03, "peak learning rate (AdamW)")
    warmup: int = field(20, "warm-up steps")
    cooldown: float = field(0.2, "share of the run spent cooling the LR linearly to 0")
    weight_decay: float = field(0.0, "AdamW decoupled weight decay on matrices")
    clip: float = field(1.0, "clip the global gradient norm to this (0: off)")
    checkpoint_every: int = field(100, "checkpoint cadence in steps (the final step is always saved)")
    eval_every: int = field(100, "accuracy on the full set every N steps (0: off)")
    seed: int = field(0, "seed for init, data and shuffles")
    on_nonfinite: str = on_nonfinite_field()
    tensorboard: str = tensorboard_field()

    def validate(self):
        from ..errors import UserError
        if min(self.steps, self.batch, self.micro_batches, self.points, self.hidden) < 1:
            raise UserError("spirals: steps, batch, micro_batches, points and hidden must be >= 1")
        if self.batch % self.micro_batches:
            raise UserError(f"spirals: batch {self.batch} is not divisible by micro_batches {self.micro_batches}")


def epoch_permutation(seed: int, epoch: int, n: int):
    """The data order of one epoch: a pure function of (seed, epoch)."""
    keys = rng.uniform(rng.derive_seed(rng.derive_seed(seed, 3), epoch), (n,), dtype=np.float64)
    return np.argsort(keys, kind="stable")


class Spirals(Job):
    name = "spirals"
    Spec = SpiralsSpec
    eval_name = "accuracy"

    def __init__(self, spec):
        super().__init__(spec)
        self.x, self.y = make_spirals(spec.points, noise=spec.noise, seed=spec.seed)
        self._perm = (None, None)

    def init_params(self):
        model = SpiralsMLP(seed=self.spec.seed, hidden=self.spec.hidden)
        return [(n, t.data) for n, t in model.named_parameters()]

    def batch_layout(self):
        m = self.rows_per_micro()
        return [("x", (m, 2), np.float32), ("y", (m,), np.int64)]

    def _permutation(self, epoch):
        if self._perm[0] != epoch:
            self._perm = (epoch, epoch_permutation(self.spec.seed, epoch, len(self.y)))
        return self._perm[1]

    def fill_batch(self, step, k, out):
        m, n = self.rows_per_micro(), len(self.y)
        start = step * self.spec.batch + k * m
        idx = np.array([self._permutation(i // n)[i % n] for i in range(start, start + m)], dtype=np.int64)
        out["x"][...] = self.x[idx]
        out["y"][...] = self.y[idx]

    def bind(self, params):
        return bind_module(SpiralsMLP(seed=self.spec.seed, hidden=self.spec.hidden), params)

    def micro_grad(self, model, batch, grads):
        loss = cross_entropy(model(batch["x"]), batch["y"], reduction="sum") * np.float32(1.0 / self.spec.batch)
        loss.backward()
        zero_copy_grads(model, grads)
        return float(loss.data), len(batch["y"])

    def make_optimizer(self, named):
        return adamw(named, lr=self.spec.lr, weight_decay=self.spec.weight_decay, betas=(0.9, 0.99))

    def lr_factor(self, step):
        s = self.spec
        return warmup_hold_linear_cooldown(step, s.steps, s.warmup, s.cooldown)

    def schedule_fields(self):
        return {"name": "warmup_hold_linear_cooldown", "warmup": self.spec.warmup, "cooldown": self.spec.cooldown}

    def validate(self, model):
        return accuracy(model, self.x, self.y)

    def finish(self, run_dir, params, log=print):
        acc = accuracy(self.bind(list(params.items())), self.x, self.y)
        log(f"spirals: accuracy on all {len(self.y)} points: {acc:.3f}")
        return {"accuracy": acc}


JOB = Spirals
