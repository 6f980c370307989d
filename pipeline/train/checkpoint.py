"""The checkpoint directory: a three-file commit protocol.

    checkpoint-step-N/
      model.safetensors      # or adapters.safetensors (a LoRA run saves only its adapters)
      optimizer.safetensors  # the optimizer's state_dict (optimizer_state.py)
      trainer_state.json     # written LAST: the commit sentinel

Every file is written atomically (temp + fsync + rename + directory fsync),
and the sentinel goes last, so a directory with a valid trainer_state.json is
a complete checkpoint and a crash at any point before it leaves a directory
that `latest_checkpoint` skips. Re-saving into a committed directory first
removes its sentinel, so a crash mid-overwrite never passes for committed.

Trade-off: a directory of plain files instead of one archive: each piece
opens in ordinary tools (safetensors, a text editor) and the adapters can be
shipped alone, at the price of a commit protocol over several files.

Loading reads and validates everything it can (sentinel, names, shapes,
dtypes) before touching the model; the model is written only after the
optimizer accepted its state.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..autograd import named_parameters
from ..errors import CheckpointError
from .optimizer_state import load_optimizer, save_optimizer
from .state_dict import assign_state, atomic_write_bytes, fsync_dir, load_state_dict, save_state_dict
from .trainer_state import TrainerState

SENTINEL = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
WEIGHT_FILES = ("model.safetensors", "adapters.safetensors")
_STEP_DIR = re.compile(r"^checkpoint-step-(\d+)$")


def step_dir(run_dir, step: int) -> Path:
    """run_dir/checkpoint-step-<step>."""
    return Path(run_dir) / f"checkpoint-step-{step}"


def read_sentinel(ckpt_dir) -> TrainerState:
    """The checkpoint's TrainerState; CheckpointError if it is not committed."""
    path = Path(ckpt_dir) / SENTINEL
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir}: not a committed checkpoint (no {SENTINEL})")
    return TrainerState.read(path)


def is_committed(ckpt_dir) -> bool:
    try:
        read_sentinel(ckpt_dir)
    except CheckpointError:
        return False
    return True


def latest_checkpoint(run_dir) -> Path | None:
    """The committed checkpoint-step-N/ with the largest N under run_dir, or None.

    Directories without a valid sentinel (a save that crashed) are ignored.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    candidates = []
    for child in run_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            candidates.append((int(match.group(1)), child))
    for _, child in sorted(candidates, reverse=True):
        if is_committed(child):
            return child
    return None


def save_checkpoint(ckpt_dir, state: TrainerState, model=None, optimizer=None, adapters=False) -> Path:
    """Write a checkpoint directory; the sentinel (state) is committed last.

    model: any object named_parameters() walks (its trainable tensors are
    saved); adapters=True names the weight file adapters.safetensors (for a
    LoRA model whose only trainable tensors are its adapters).
    optimizer: anything with state_dict() (an optimizer or an OptimizerSet).
    A state inside an accumulation window is refused: partial gradients are
    never saved, so it could not be resumed.
    """
    ckpt_dir = Path(ckpt_dir)
    state.validate(f"{ckpt_dir / SENTINEL}")
    state.require_boundary(f"save to {ckpt_dir}")
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        fsync_dir(ckpt_dir.parent)
    except OSError as e:
        raise CheckpointError(f"{ckpt_dir}: cannot create the checkpoint directory: {e.strerror or e}") from None
    sentinel = ckpt_dir / SENTINEL
    if sentinel.exists():  # uncommit before overwriting anything
        sentinel.unlink()
        fsync_dir(ckpt_dir)
    weights = WEIGHT_FILES[1] if adapters else WEIGHT_FILES[0]
    written = {weights} if model is not None else set()
    if optimizer is not None:
        written.add(OPTIMIZER_FILE)
    for name in {*WEIGHT_FILES, OPTIMIZER_FILE} - written:  # a re-save keeps nothing stale from an earlier one
        (ckpt_dir / name).unlink(missing_ok=True)
    if model is not None:
        save_state_dict(ckpt_dir / weights, named_parameters(model), metadata={"format": "fucina.weights/1"})
    if optimizer is not None:
        save_optimizer(ckpt_dir / OPTIMIZER_FILE, optimizer)
    atomic_write_bytes(sentinel, state.to_json().encode("utf-8"))
    return ckpt_dir


def weights_file(ckpt_dir) -> Path:
    """The checkpoint's model.safetensors or adapters.safetensors."""
    for name in WEIGHT_FILES:
        if (Path(ckpt_dir) / name).is_file():
            return Path(ckpt_dir) / name
    raise CheckpointError(f"{ckpt_dir}: no {' or '.join(WEIGHT_FILES)}")


def load_checkpoint(ckpt_dir, model=None, optimizer=None, strict=True, trainable_only=True,
                    accum_steps: int | None = None) -> TrainerState:
    """Restore model and/or optimizer from a committed checkpoint; return its TrainerState.

    strict: weight names must match one-to-one. trainable_only=False also
    fills tensors without requires_grad (a gradient-free inference model).
    accum_steps: the resuming run's window; the checkpoint step must be a
    multiple of it (and of the stored one), else the resume is refused.
    """
    ckpt_dir = Path(ckpt_dir)
    state = read_sentinel(ckpt_dir)
    state.require_boundary(str(ckpt_dir / SENTINEL))
    if accum_steps is not None and state.step % accum_steps != 0:
        raise CheckpointError(
            f"{ckpt_dir / SENTINEL}: step {state.step} is not a multiple of this run's accum_steps={accum_steps}; "
            "resume only on an accumulation-window boundary")
    if model is None:
        if optimizer is not None:
            load_optimizer(ckpt_dir / OPTIMIZER_FILE, optimizer)
        return state
    path = weights_file(ckpt_dir)
    stored = load_state_dict(path)
    targets = named_parameters(model, trainable_only=trainable_only)
    # Validate the weights first, write them only once the optimizer took its state.
    assign_state(targets, stored, source=str(path), strict=strict, dry_run=True)
    if optimizer is not None:
        load_optimizer(ckpt_dir / OPTIMIZER_FILE, optimizer)
    assign_state(targets, stored, source=str(path), strict=strict)
    return state
