"""Optimizers and the training-step machinery.

    opt = AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    loss.backward(); opt.clip_grad_norm(1.0); opt.step(); opt.zero_grad()

Each optimizer is a faithful port of its reference (torch.optim SGD/Adam/AdamW,
Keller Jordan's Muon, apollo_torch's APOLLOAdamW, Lion) pinned by goldens in
tests/optim. See docs/optimizers.md and docs/training.md.
"""
from .adamw import Adam, AdamW
from .apollo import Apollo
from .base import Optimizer, OptimizerConfigError
from .clip import clip_grad_norm, grad_norm, scale_gradients
from .lion import Lion
from .muon import Muon
from .schedules import LrSchedule, context_at, warmup_cosine_factor, warmup_hold_linear_cooldown
from .set import OptimizerSet
from .sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Muon", "Apollo", "Lion", "OptimizerSet", "Optimizer", "OptimizerConfigError",
           "clip_grad_norm", "grad_norm", "scale_gradients", "LrSchedule", "warmup_cosine_factor",
           "warmup_hold_linear_cooldown", "context_at"]
