"""Evolution strategies: gradient-free training from scalar rewards (see docs/es.md)."""
from .shaping import RewardError, SHAPINGS, centered_ranks, z_score
from .trainer import ESConfig, ESConfigError, ESStateError, ESTrainer

__all__ = ["ESConfig", "ESConfigError", "ESStateError", "ESTrainer", "RewardError", "SHAPINGS", "centered_ranks",
           "z_score"]
