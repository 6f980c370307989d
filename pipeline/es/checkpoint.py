"""ES checkpoints: the parameters plus trainer_state.json, and no optimizer file.

Trade-off: ES has no optimizer state: (seed, iteration) regenerate the whole
noise stream, so a checkpoint is the weights (model.safetensors, every
registered slot including frozen and f16/bf16 ones, dtypes kept) and the
es_* fields. They live in the one checkpoint protocol (pipeline/runtime/ckpt.py:
atomic files, the sentinel written last): TrainerState.step is the ES
iteration and TrainerState.config holds the es_* fields (plus any run config
the caller adds). On load every structural es_* field must match the running
trainer: a different sigma, seed, scheme, ... would silently change the
stream, so it is an error naming the field. The anchor of anchored weight
decay is never stored: capture it from the initial weights before loading.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ConfigMismatchError, DTypeMismatchError
from ..runtime.ckpt import SENTINEL, WEIGHT_FILES, read_state, save_checkpoint, tensors_of
from ..train.state_dict import dtype_tag, load_state_dict
from ..train.trainer_state import TrainerState
from .trainer import ESStateError, ESTrainer

WEIGHTS = WEIGHT_FILES[0]  # model.safetensors
STRUCTURAL = ("es_sigma", "es_alpha", "es_population", "es_seed", "es_noise", "es_antithetic", "es_shaping",
              "es_restore_mode", "es_anchor_decay", "es_anchor_lambda")


def save_es_checkpoint(ckpt_dir, trainer: ESTrainer, run_config: dict | None = None) -> Path:
    """Write ckpt_dir/{model.safetensors, trainer_state.json}; the sentinel last."""
    if trainer.active_member is not None:
        raise ESStateError(f"save: member {trainer.active_member} is applied; restore it first")
    state = TrainerState(step=trainer.iteration, seeds={"es": trainer.config.seed},
                         config={**(run_config or {}), **trainer.state_fields()})
    return save_checkpoint(ckpt_dir, state, model=tensors_of(trainer.named_arrays()))


def load_es_checkpoint(ckpt_dir, trainer: ESTrainer) -> TrainerState:
    """Validate everything, then load the weights and the iteration into trainer."""
    if trainer.active_member is not None:
        raise ESStateError(f"load: member {trainer.active_member} is applied; restore it first")
    ckpt_dir = Path(ckpt_dir)
    state = read_state(ckpt_dir)
    source = ckpt_dir / SENTINEL
    stored_cfg = state.config
    ours = trainer.state_fields()
    for name in STRUCTURAL + ("es_iteration",):
        if name not in stored_cfg:
            raise CheckpointError(f"{source}: config field {name!r} missing (not an ES checkpoint?)")
    for name in STRUCTURAL:
        if stored_cfg[name] != ours[name]:
            raise ConfigMismatchError(f"{source}: field {name!r} is {stored_cfg[name]!r} in the checkpoint, "
                                      f"{ours[name]!r} in this run")
    if stored_cfg["es_iteration"] != state.step:
        raise CheckpointError(f"{source}: es_iteration {stored_cfg['es_iteration']} != step {state.step}")
    path = ckpt_dir / WEIGHTS
    stored = load_state_dict(path)
    targets = dict(trainer.named_arrays())
    missing, unexpected = sorted(set(targets) - set(stored)), sorted(set(stored) - set(targets))
    if missing or unexpected:
        raise CheckpointError(f"{path}: names do not match (missing from the file: {missing[:8]}; "
                              f"not registered: {unexpected[:8]})")
    for name, arr in targets.items():
        if stored[name].shape != arr.shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {list(stored[name].shape)} in the file, "
                                  f"{list(arr.shape)} registered")
        if stored[name].dtype != arr.dtype:
            raise DTypeMismatchError(f"{path}: tensor {name!r} is {dtype_tag(stored[name].dtype)} in the file, "
                                     f"{dtype_tag(arr.dtype)} registered (no implicit conversion)")
    for name, arr in targets.items():
        np.copyto(arr, stored[name])
    trainer.iteration = state.step
    return state
