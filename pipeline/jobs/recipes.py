"""Optimizer recipes for pipeline jobs, built from pipeline.optim.

A recipe turns [(name, Tensor)] into one optimizer object with the
pipeline.optim surface (step, zero_grad, clip_grad_norm, lr_holders,
state_dict/load_state_dict); the optimizer role drives it and an LrSchedule
applies the job's schedule factor, a pure function of the step.

Trade-off: weight decay follows the common GPT recipe (matrices decay,
vectors and norms do not) by splitting AdamW into two param groups inside an
OptimizerSet, which keeps each group a plain torch-parity AdamW.
"""
from __future__ import annotations

from ..optim import AdamW, Muon, OptimizerSet


def adamw(named, lr, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8):
    decay = [(n, t) for n, t in named if t.data.ndim >= 2]
    flat = [(n, t) for n, t in named if t.data.ndim < 2]
    if not weight_decay or not flat or not decay:
        return AdamW(named, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return OptimizerSet(AdamW(decay, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                        AdamW(flat, lr=lr, betas=betas, eps=eps, weight_decay=0.0))


FALLBACK_NAMES = ("embed", "output.weight")  # matrices that are not hidden: the embedding and the head


def is_hidden_matrix(name, array) -> bool:
    """A block matrix: what Muon trains (and pretrain's --bf16 stores in bf16)."""
    return array.ndim >= 2 and name not in FALLBACK_NAMES


def muon_adamw(named, lr, adamw_lr, weight_decay=0.0):
    """Muon on hidden matrices; AdamW (Muon's embedded fallback) on embeddings, head and vectors."""
    hidden = [(n, t) for n, t in named if is_hidden_matrix(n, t.data)]
    fallback = [(n, t) for n, t in named if not is_hidden_matrix(n, t.data)]
    return Muon(hidden, lr=lr, weight_decay=weight_decay,
                fallback={"lr": adamw_lr, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0},
                fallback_params=fallback)
