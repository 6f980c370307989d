"""Learning-rate schedules as pure functions of the (macro) step, plus a tiny applier.

A schedule is a factor f(step) in float64; `LrSchedule` captures each
optimizer's base lr once and sets lr = base * f. Because the factor is a pure
function of the step, resuming from a checkpoint just re-applies it; this is
why lr is not a validated field of optimizer checkpoints.

Trade-off: no scheduler objects with hidden state (nothing to save), at the
price of passing the step explicitly.
"""
from __future__ import annotations

import math

from .base import OptimizerConfigError


def warmup_cosine_factor(step, total_steps, warmup_steps, min_factor=0.0):
    """Linear warm-up (step+1)/warmup, then a half cosine from 1 down to min_factor at total_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return float(min_factor)
    progress = min((step - warmup_steps) / (total_steps - warmup_steps), 1.0)
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_hold_linear_cooldown(step, total, warmup, cooldown):
    """Warm up linearly over `warmup` steps, hold 1.0, then fall linearly to 0 over the last `cooldown` share."""
    if step < warmup:
        return (step + 1) / warmup
    decay_start = total * (1 - cooldown)
    if step < decay_start:
        return 1.0
    return max(0.0, (total - step) / (total - decay_start))


def context_at(step, total, context, warm):
    """Sequence-length warm-up: context//4 (at least 64) for the first 10%, context//2 until 30%, then context."""
    if not warm:
        return context
    if step < 0.1 * total:
        return max(64, context // 4)
    if step < 0.3 * total:
        return context // 2
    return context


class LrSchedule:
    """Rescales optimizers' lr from their captured base: `sched.apply(factor)`.

    Attach optimizers, an OptimizerSet, or anything with a settable `.lr`;
    Muon/APOLLO fallbacks are captured too (their own base lr).
    """

    def __init__(self, *targets):
        self.holders = []
        self.bases = []
        for t in targets:
            self.attach(t)

    def attach(self, target):
        holders = target.lr_holders() if hasattr(target, "lr_holders") else [target]
        for h in holders:
            if any(h is known for known in self.holders):
                raise OptimizerConfigError(f"LrSchedule.attach: {type(h).__name__} is already attached")
            self.holders.append(h)
            self.bases.append(float(h.lr))
        return self

    def apply(self, factor):
        """Set every attached lr to base * factor (factor >= 0)."""
        factor = float(factor)
        if not factor >= 0:
            raise OptimizerConfigError(f"LrSchedule.apply: factor must be >= 0, got {factor}")
        for h, base in zip(self.holders, self.bases):
            h.lr = base * factor
        return factor
