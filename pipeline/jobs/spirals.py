"""`spirals`: mini-batch two-spirals classification with a tanh MLP.

The smallest real job: a few thousand parameters, so a 300-step run takes
seconds in-process and the multiprocess overhead dominates - which is exactly
what the determinism and fault tests want to exercise.

Data order: the points are re-shuffled every epoch by a permutation that is a
pure function of (seed, epoch); global row i of the run is point
perm(seed, i // n)[i % n]. Trade-off: the whole data set is regenerated in every
process that needs it (cheap here) instead of being shipped.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from kernels import rng

from ..autograd import ops  # noqa: F401 - attaches Tensor operators
from ..autograd.tensor import Tensor
from .base import Job, bind_tensors, zero_copy_grads
from .recipes import AdamWLite, warmup_hold_cooldown
from .spec import field


@dataclasses.dataclass
class SpiralsSpec:
    steps: int = field(300, "optimizer steps")
    batch: int = field(64, "rows per optimizer step (split into micro-batches)")
    micro_batches: int = field(4, "micro-batches per step (tasks handed to trainers)")
    points: int = field(200, "points per spiral (two spirals)")
    noise: float = field(0.05, "gaussian noise on the point coordinates")
    hidden: int = field(32, "hidden width of the MLP")
    layers: int = field(2, "hidden layers")
    lr: float = field(0.01, "peak learning rate (AdamW)")
    warmup: int = field(20, "warm-up steps")
    cooldown: int = field(60, "linear cool-down steps at the end")
    weight_decay: float = field(0.0, "AdamW decoupled weight decay")
    clip: float = field(1.0, "clip the global gradient norm to this (0: off)")
    checkpoint_every: int = field(100, "checkpoint cadence in steps (the final step is always saved)")
    eval_every: int = field(100, "accuracy on the full set every N steps (0: off)")
    seed: int = field(0, "seed for init, data and shuffles")

    def validate(self):
        from ..errors import UserError
        if self.steps < 1 or self.batch < 1 or self.micro_batches < 1:
            raise UserError("spirals: steps, batch and micro_batches must be >= 1")
        if self.batch % self.micro_batches:
            raise UserError(f"spirals: batch {self.batch} is not divisible by micro_batches {self.micro_batches}")


def make_spirals(points: int, noise: float, seed: int):
    """(x float32 [2n, 2], y int64 [2n]): two interleaved spirals, pure in seed."""
    t = np.sqrt(rng.uniform(rng.derive_seed(seed, 1), (points,), dtype=np.float64)) * 3 * math.pi
    jitter = rng.gaussian(rng.derive_seed(seed, 2), (2 * points, 2), std=noise, dtype=np.float64)
    r = t / (3 * math.pi)
    a = np.stack([r * np.cos(t), r * np.sin(t)], axis=1)
    x = np.concatenate([a, -a]) + jitter
    y = np.concatenate([np.zeros(points, np.int64), np.ones(points, np.int64)])
    return x.astype(np.float32), y


def epoch_permutation(seed: int, epoch: int, n: int):
    keys = rng.uniform(rng.derive_seed(rng.derive_seed(seed, 3), epoch), (n,), dtype=np.float64)
    return np.argsort(keys, kind="stable")


def cross_entropy_rows(logits: Tensor, targets: np.ndarray, scale: float) -> Tensor:
    """scale * sum_i CE(logits_i, t_i), the sum taken serially in row order.

    A private op until the engine's cross_entropy lands in pipeline.autograd.ops.
    """
    z = logits.data.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logsum = np.log(np.exp(z).sum(axis=1))
    rows = logsum - z[np.arange(len(targets)), targets]
    total = 0.0
    for v in rows:  # one serial sum in row order (DESIGN.md 3.2)
        total += v
    out = np.asarray(np.float32(total * scale))

    def backward(g):
        p = np.exp(z - logsum[:, None])
        p[np.arange(len(targets)), targets] -= 1.0
        return ((p * scale * float(g)).astype(np.float32),)

    return Tensor.make(out, (logits,), backward, "cross_entropy_rows")


class Spirals(Job):
    name = "spirals"
    Spec = SpiralsSpec

    def __init__(self, spec):
        super().__init__(spec)
        self.x, self.y = make_spirals(spec.points, spec.noise, spec.seed)
        self._perm_cache = {}

    def init_params(self):
        s, sizes = self.spec, [2] + [self.spec.hidden] * self.spec.layers + [2]
        out = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            w = rng.kaiming_uniform(rng.derive_seed(s.seed, 100 + i), (fan_in, fan_out), fan_in=fan_in)
            bound = 1.0 / math.sqrt(fan_in)
            b = rng.uniform(rng.derive_seed(s.seed, 200 + i), (fan_out,), -bound, bound)
            out += [(f"layers.{i}.weight", w), (f"layers.{i}.bias", b)]
        return out

    def batch_layout(self):
        m = self.rows_per_micro()
        return [("x", (m, 2), np.float32), ("y", (m,), np.int64)]

    def _perm(self, epoch):
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: epoch_permutation(self.spec.seed, epoch, len(self.y))}
        return self._perm_cache[epoch]

    def fill_batch(self, step, k, out):
        m, n = self.rows_per_micro(), len(self.y)
        start = step * self.spec.batch + k * m
        idx = np.empty(m, np.int64)
        for j in range(m):
            i = start + j
            idx[j] = self._perm(i // n)[i % n]
        out["x"][...] = self.x[idx]
        out["y"][...] = self.y[idx]

    def bind(self, params):
        return bind_tensors(params)

    def forward(self, named, x):
        h = Tensor(x)
        n_layers = len(named) // 2
        for i in range(n_layers):
            h = h @ named[2 * i][1] + named[2 * i + 1][1]
            if i < n_layers - 1:
                h = h.tanh()
        return h

    def micro_grad(self, model, batch, grads):
        logits = self.forward(model, batch["x"])
        loss = cross_entropy_rows(logits, batch["y"], 1.0 / self.spec.batch)
        loss.backward()
        zero_copy_grads(model, grads)
        return float(loss.data), len(batch["y"])

    def make_optimizer(self, named):
        return AdamWLite(named, betas=(0.9, 0.99), eps=1e-8, weight_decay=self.spec.weight_decay)

    def lr_at(self, step):
        s = self.spec
        return warmup_hold_cooldown(step, s.steps, s.warmup, s.cooldown, s.lr, floor=0.0)

    def validate(self, model):
        from ..autograd.tensor import no_grad
        with no_grad():
            logits = self.forward(model, self.x).data
        return float((logits.argmax(axis=1) == self.y).mean())

    def finish(self, run_dir, params, log=print):
        named = bind_tensors(list(params.items()))
        acc = self.validate(named)
        log(f"spirals: accuracy on all {len(self.y)} points: {acc:.3f}")
        return {"accuracy": acc}


JOB = Spirals
