"""The two-spirals task (Lang & Witbrock) and its 2-64-64-2 tanh MLP.

Trade-off: a dataset small enough to train full-batch in seconds yet not
linearly separable, so it exercises every stage of a training step. All
randomness (data noise, init) comes from pipeline.kernels.rng, so a (seed) pins every
bit of the data and the initial weights.
"""
from __future__ import annotations

import math

import numpy as np

from pipeline.kernels import rng
from pipeline.autograd import Module, Tensor, linear, no_grad, tanh


def make_spirals(n_per_arm=200, turns=1.75, noise=0.05, seed=0, radius=3.0):
    """X float32 [2 * n_per_arm, 2], y int64 [2 * n_per_arm].

    Arm 0: radius r = radius * (0.05 + 0.95 t) growing with angle 2 pi turns t,
    t = i / n_per_arm; arm 1 is arm 0 rotated by pi. Gaussian noise (std `noise`)
    from rng.gaussian(seed). Rows are arm 0 then arm 1. The outer radius of 3
    puts the inputs in tanh's useful range, so plain SGD solves it in 2000 steps."""
    t = np.arange(n_per_arm, dtype=np.float64) / n_per_arm
    r = radius * (0.05 + 0.95 * t)
    angle = 2.0 * math.pi * turns * t
    arm = np.stack([r * np.cos(angle), r * np.sin(angle)], axis=1)
    X = np.concatenate([arm, -arm], axis=0)
    X += rng.gaussian(seed, X.shape, std=noise, dtype=np.float64)
    y = np.concatenate([np.zeros(n_per_arm, np.int64), np.ones(n_per_arm, np.int64)])
    return X.astype(np.float32), y


class SpiralsMLP(Module):
    """2 -> hidden -> hidden -> 2 with tanh; weights [out, in] like torch nn.Linear.

    Init as nn.Linear: weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    tensor k (w1, b1, w2, b2, w3, b3) drawn from rng.derive_seed(seed, k)."""

    def __init__(self, seed=0, hidden=64, n_in=2, n_classes=2):
        shapes = [("w1", (hidden, n_in)), ("b1", (hidden,)), ("w2", (hidden, hidden)), ("b2", (hidden,)),
                  ("w3", (n_classes, hidden)), ("b3", (n_classes,))]
        fan_in = {"w1": n_in, "b1": n_in, "w2": hidden, "b2": hidden, "w3": hidden, "b3": hidden}
        for k, (name, shape) in enumerate(shapes):
            data = rng.kaiming_uniform(rng.derive_seed(seed, k), shape, fan_in=fan_in[name])
            setattr(self, name, Tensor(data, requires_grad=True, name=name))

    def forward(self, x):
        h = tanh(linear(x, self.w1, self.b1))
        h = tanh(linear(h, self.w2, self.b2))
        return linear(h, self.w3, self.b3)


def accuracy(model, X, y):
    """Fraction of rows whose argmax logit equals the label."""
    with no_grad():
        logits = model(X).data
    return float((logits.argmax(axis=-1) == np.asarray(y)).mean())
