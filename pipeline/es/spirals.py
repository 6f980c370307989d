"""ES-spirals: the spirals MLP trained from random init by pure ES (no backward).

Trade-off: the parameter set is tiny (4482 floats) and a forward pass over 400
points is cheap, so members are evaluated as a batch: materialize B replicas
theta + sigma*eps_m as rows of one (B, dim) buffer, then run the 2-64-64-2
tanh MLP for all of them with stacked matmuls. That beats B separate
autograd forwards by a wide margin but means this module re-states the model's
forward in numpy (tests pin it against pipeline.models.spirals).

Rewards (`reward=`): "nll" (default): R = -mean CE. On this smooth landscape
from a random init it is the best learning signal we measured (z-score ES
then tracks normalized gradient descent closely), and a tanh MLP's logits
stay moderate, so no catastrophic outliers appear. "acc": R = accuracy +
0.1 * exp(-mean CE), bounded in [0, 1.1] (the seed's recommendation for
fine-tuning with unbounded losses); here its quantized accuracy term makes
z-scores noisy and it converges several times slower. Per-member statistics are
reduced in float64 along each member's own row, so a member's reward is the
same bits whichever batch (or worker) evaluated it: BLAS is pinned to one
thread (pipeline.threads / threadpoolctl) wherever this runs.

The "center" (theta itself, unperturbed) is scored every iteration too: the
run stops at the first iteration whose center reaches 100% training accuracy.
"""
from __future__ import annotations


import numpy as np

from ..models.spirals import SpiralsMLP, make_spirals
from .trainer import ESConfig, ESTrainer

BATCH = 32  # members per stacked forward: bounds activation memory at 32*400*64 floats


SIGMA, ALPHA = 0.02, 0.25  # tuned for this task (docs/es.md); the library defaults are 1e-3 and sigma/2


def spirals_config(population=128, sigma=None, alpha=None, seed=0, antithetic=True, shaping="z_score",
                   noise="iid") -> ESConfig:
    """The tuned ES-spirals defaults (see docs/es.md for how they were chosen)."""
    return ESConfig(sigma=SIGMA if sigma is None else sigma, alpha=ALPHA if alpha is None else alpha,
                    population=population, seed=seed, noise=noise, antithetic=antithetic, shaping=shaping)


class SpiralsTask:
    """A parameter replica (ESTrainer over SpiralsMLP(model_seed)) plus the batched member scorer."""

    REWARDS = ("acc", "nll")

    def __init__(self, es: ESConfig, model_seed: int = 0, data_seed: int = 0, reward: str = "nll"):
        if reward not in self.REWARDS:
            raise ValueError(f"spirals reward must be one of {self.REWARDS}, got {reward!r}")
        self.reward_kind = reward
        self.X, self.y = make_spirals(seed=data_seed)
        self.sign = np.where(self.y == 1, 1.0, -1.0)
        self.model = SpiralsMLP(model_seed)
        self.trainer = ESTrainer(es)
        self.trainer.add_registry(self.model)
        self.trainer.cache_noise = True  # 4482 floats per draw: keep this iteration's eps for the update
        self.run_config = {"task": "spirals", "model_seed": model_seed, "data_seed": data_seed, "reward": reward,
                           "es": es.to_dict()}

    @classmethod
    def from_run_config(cls, run: dict) -> "SpiralsTask":
        return cls(ESConfig(**run["es"]), model_seed=run["model_seed"], data_seed=run["data_seed"],
                   reward=run["reward"])

    def score_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mean CE float64 (B,), accuracy float64 (B,)) for parameter rows (B, dim)."""
        P = self.trainer.split(rows)
        h = np.matmul(self.X, P["w1"].transpose(0, 2, 1))  # weights are [out, in] like nn.Linear
        h += P["b1"][:, None, :]
        np.tanh(h, out=h)
        h = np.matmul(h, P["w2"].transpose(0, 2, 1))
        h += P["b2"][:, None, :]
        np.tanh(h, out=h)
        z = np.matmul(h, P["w3"].transpose(0, 2, 1)) + P["b3"][:, None, :]
        margin = (z[..., 1] - z[..., 0]).astype(np.float64) * self.sign  # >0 means correct
        ce = np.logaddexp(0.0, -margin).mean(axis=-1)  # 2-class CE = softplus(-margin)
        acc = (margin > 0).mean(axis=-1)
        return ce, acc

    def reward(self, ce, acc):
        return acc + 0.1 * np.exp(-ce) if self.reward_kind == "acc" else -ce

    def rewards(self, members, theta=None) -> np.ndarray:
        """float64 rewards of the given members at the trainer's current iteration."""
        theta = self.trainer.flat_params() if theta is None else theta
        members = list(members)
        out = np.empty(len(members))
        for i in range(0, len(members), BATCH):
            rows = self.trainer.materialize_members(members[i:i + BATCH], theta=theta)
            out[i:i + BATCH] = self.reward(*self.score_rows(rows))
        return out

    def center(self) -> tuple[float, float]:
        """(mean CE, accuracy) of theta itself."""
        ce, acc = self.score_rows(self.trainer.flat_params()[None, :])
        return float(ce[0]), float(acc[0])
