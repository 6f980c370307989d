"""The one learning-rate schedule of fine-tuning: linear warm-up, then constant, linear or cosine decay.

Every fine-tune loop reads it (the `finetune` job's lr_factor, Session's lr_at): a pure function of the
optimizer step, so a resumed run, N trainers and the in-process run see the same lr at every step.
"""
from __future__ import annotations

from ..errors import UserError
from ..optim.schedules import warmup_cosine_factor

DECAYS = ("constant", "linear", "cosine")


def lr_factor(step: int, warmup: int, total: int = 0, decay: str = "constant") -> float:
    """The multiplier of the peak lr at optimizer step `step` (0-based): (step + 1) / warmup over the first
    `warmup` steps, then 1 (constant), or falling to 0 at `total` steps linearly or along a half cosine."""
    if decay not in DECAYS:
        raise UserError(f"lr decay must be one of {', '.join(DECAYS)}, got {decay!r}")
    if warmup > 0 and step < warmup:
        return min(1.0, (step + 1) / warmup)
    if decay == "constant":
        return 1.0
    if decay == "cosine":
        return warmup_cosine_factor(step, total, warmup)
    if total <= warmup:
        return 0.0
    return max(0.0, 1.0 - (step - warmup) / (total - warmup))
