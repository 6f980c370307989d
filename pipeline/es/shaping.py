"""Fitness shaping: raw member rewards -> update coefficients C_n.

Trade-off: `z_score` (default, the es-at-scale reference) keeps reward
magnitudes, converges on smooth bounded rewards and self-stops when all
rewards are equal, but one catastrophic outlier can dominate an iteration;
`centered_ranks` (Salimans et al. 2017) is immune to outliers and to any
monotone reward transform, at the price of discarding magnitudes (and taking
a mean-zero phantom step when every reward ties).

    z_score:        C_n = (R_n - mean R) / (std R + 1e-8)     float64, ddof 0
    centered_ranks: C_n = rank_n / (N - 1) - 0.5              ties: lower member index ranks lower

Non-finite rule: a NaN or +-inf reward says the member broke (or the reward
function did), never that it was infinitely good. Each non-finite reward is
replaced by the WORST finite reward of the iteration before shaping, and the
count is reported in the stats, so one broken member cannot poison the
iteration with NaN coefficients. If no reward is finite the iteration is
refused with an error and nothing is updated.
"""
from __future__ import annotations

import numpy as np

from ..errors import FucinaError

SHAPINGS = ("z_score", "centered_ranks")
Z_EPS = 1e-8


class RewardError(FucinaError):
    """The rewards of an iteration cannot be used (wrong count, none finite)."""


def sanitize(rewards, population: int) -> tuple[np.ndarray, int]:
    """float64 copy with non-finite rewards set to the worst finite one; (rewards, n_replaced)."""
    r = np.array(rewards, dtype=np.float64).reshape(-1)
    if r.size != population:
        raise RewardError(f"expected {population} rewards (one per member), got {r.size}")
    finite = np.isfinite(r)
    if not finite.any():
        raise RewardError(f"all {population} rewards are non-finite (e.g. {r[0]}); "
                          "iteration refused, parameters unchanged")
    n_bad = int(r.size - finite.sum())
    if n_bad:
        r[~finite] = r[finite].min()
    return r, n_bad


def z_score(r: np.ndarray) -> np.ndarray:
    r = np.asarray(r, dtype=np.float64)
    return (r - r.mean()) / (r.std() + Z_EPS)


def centered_ranks(r: np.ndarray) -> np.ndarray:
    r = np.asarray(r, dtype=np.float64)
    if r.size < 2:
        raise RewardError("centered_ranks needs a population of at least 2")
    order = np.lexsort((np.arange(r.size), r))  # by reward, then member index: pinned tie order
    ranks = np.empty(r.size, dtype=np.float64)
    ranks[order] = np.arange(r.size, dtype=np.float64)
    return ranks / (r.size - 1) - 0.5


def shape(rewards, population: int, method: str = "z_score") -> tuple[np.ndarray, dict]:
    """(float64 coefficients, stats) for one iteration's rewards in member order."""
    if method not in SHAPINGS:
        raise ValueError(f"shaping must be one of {SHAPINGS}, got {method!r}")
    r, n_bad = sanitize(rewards, population)
    coeffs = z_score(r) if method == "z_score" else centered_ranks(r)
    stats = {"reward_mean": float(r.mean()), "reward_std": float(r.std()), "reward_min": float(r.min()),
             "reward_max": float(r.max()), "nonfinite": n_bad}
    return coeffs, stats
