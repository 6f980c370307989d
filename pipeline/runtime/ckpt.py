"""The checkpoint directory - one module for every writer and reader: the runtime's roles, the in-process
runs, the spirals gauntlet, ES and the LoRA fine-tunes.

    checkpoint-step-N/
      model.safetensors      # or adapters.safetensors (a LoRA run saves only its adapters)
      optimizer.safetensors  # the optimizer's state_dict (pipeline/train/optimizer_state.py); ES has none
      trainer_state.json     # written LAST: the commit sentinel

Every file is written atomically (temp + fsync + rename + directory fsync),
and the sentinel goes last, so a directory with a valid trainer_state.json is
a complete checkpoint and a crash at any point before it leaves a directory
that `latest_checkpoint` skips. Re-saving into a committed directory first
removes its sentinel, so a crash mid-overwrite never passes for committed.
Loading reads and validates everything it can (sentinel, names, shapes,
dtypes) before touching the model; the model is written only after the
optimizer accepted its state.

The checkpointer role holds no model and no optimizer - only a snapshot of
arrays - so `write_checkpoint` adapts a snapshot to `save_checkpoint`'s
model/optimizer arguments. A pipeline sentinel's `step` counts micro-batches
and `accum_steps` is the job's micro-batches per step, so `macro_step` is the
optimizer step. `params_sha256` is a run's identity: the digest of every final
parameter in name order, what the determinism tests compare.

Trade-off: a directory of plain files instead of one archive: each piece
opens in ordinary tools (safetensors, a text editor) and the adapters can be
shipped alone, at the price of a commit protocol over several files. A retry
re-saves into the same directory - after removing the temp files
(`.NAME.tmp-PID`) a killed writer left there, so a committed directory holds
only its own files.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import numpy as np

from ..autograd import named_parameters
from ..autograd.tensor import Tensor
from ..errors import CheckpointError
from ..train.optimizer_state import load_optimizer, save_optimizer
from ..train.state_dict import assign_state, atomic_write_bytes, fsync_dir, load_state_dict, save_state_dict
from ..train.trainer_state import TrainerState
from .transport import process_exited

SENTINEL = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
WEIGHT_FILES = ("model.safetensors", "adapters.safetensors")
_STEP_DIR = re.compile(r"^checkpoint-step-(\d+)$")
_TEMP_FILE = re.compile(r"^\..+\.tmp-(\d+)$")  # state_dict.atomic_write's temp name


def checkpoint_dir(run_dir, step) -> str:
    """run_dir/checkpoint-step-<step>."""
    return os.path.join(run_dir, f"checkpoint-step-{step}")


def read_state(ckpt_dir) -> TrainerState:
    """The checkpoint's TrainerState; CheckpointError if it is not committed."""
    path = Path(ckpt_dir) / SENTINEL
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir}: not a committed checkpoint (no {SENTINEL})")
    return TrainerState.read(path)


def is_committed(ckpt_dir) -> bool:
    try:
        read_state(ckpt_dir)
    except CheckpointError:
        return False
    return True


def latest_checkpoint(run_dir) -> str | None:
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
            return str(child)
    return None


def save_checkpoint(ckpt_dir, state: TrainerState, model=None, optimizer=None, adapters=False) -> Path:
    """Write a checkpoint directory; the sentinel (state) is committed last.

    model: any object named_parameters() walks (its trainable tensors are
    saved); adapters=True names the weight file adapters.safetensors (for a
    LoRA model whose only trainable tensors are its adapters).
    optimizer: anything with state_dict() (an optimizer or an OptimizerSet);
    None writes no optimizer file (ES).
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
    _uncommit(ckpt_dir)
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
    atomic_write_bytes(ckpt_dir / SENTINEL, state.to_json().encode("utf-8"))
    return ckpt_dir


def _uncommit(ckpt_dir: Path):
    """Remove the sentinel before anything in the directory is overwritten."""
    sentinel = ckpt_dir / SENTINEL
    if sentinel.exists():
        sentinel.unlink()
        fsync_dir(ckpt_dir)


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
    state = read_state(ckpt_dir)
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


def tensors_of(named_arrays) -> dict:
    """{name: Tensor whose .data is the array} for save_checkpoint/load_checkpoint over plain arrays."""
    return {n: Tensor(a, requires_grad=True) for n, a in dict(named_arrays).items()}


def resolve(path) -> str:
    """A checkpoint dir, or a run dir (-> its latest committed checkpoint)."""
    if is_committed(path):
        return str(path)
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: neither a committed checkpoint (no valid {SENTINEL}) "
                              f"nor a run directory holding one")
    return latest


class _FrozenState:
    """An optimizer stand-in whose state_dict() is a stored snapshot."""

    def __init__(self, skeleton: dict, tensors: dict):
        self.sd = {**skeleton, "tensors": tensors}

    def state_dict(self):
        return self.sd


def trainer_state(job, step: int) -> TrainerState:
    """The sentinel: micro-batch counter, seeds, loader position, schedule, job config."""
    from ..jobs.spec import to_dict
    m = job.micro_batches
    return TrainerState(step=step * m, accum_steps=m, seeds={"init": job.spec.seed, "data": job.spec.seed},
                        loader={"seed": job.spec.seed, "rows_consumed": step * job.rows_per_step()},
                        schedule={"total": job.steps, **job.schedule_fields()},
                        config={"job": job.name, "spec": to_dict(job.spec), **job.checkpoint_config()})


def write_checkpoint(ckpt_dir, params: dict, optim_skeleton: dict, optim_tensors: dict, state: TrainerState,
                     on_file=None, adapters=False):
    """Write one checkpoint from arrays; `on_file(name)` after the weights (fault-injection hook);
    adapters=True names the weights adapters.safetensors (a LoRA job's)."""
    model = tensors_of(params)
    ckpt_dir = Path(ckpt_dir)
    remove_dead_writers_temp_files(ckpt_dir)
    if on_file is None:
        save_checkpoint(ckpt_dir, state, model=model, optimizer=_FrozenState(optim_skeleton, optim_tensors),
                        adapters=adapters)
        return str(ckpt_dir)
    # the same protocol in two calls, so a fault can strike between the files (sentinel still last)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    _uncommit(ckpt_dir)
    weights = WEIGHT_FILES[1 if adapters else 0]
    save_state_dict(ckpt_dir / weights, list(model.items()), metadata={"format": "fucina.weights/1"})
    on_file(weights)
    save_checkpoint(ckpt_dir, state, model=model, optimizer=_FrozenState(optim_skeleton, optim_tensors),
                    adapters=adapters)
    return str(ckpt_dir)


def publish(ckpt_dir, dest) -> str:
    """Commit a copy of the committed checkpoint `ckpt_dir` at `dest` (its files, the sentinel last), so a run
    dir is itself its final checkpoint (what `fucina finetune --save DIR` always wrote)."""
    src, dest = Path(ckpt_dir), Path(dest)
    read_state(src)  # only a committed checkpoint is published
    dest.mkdir(parents=True, exist_ok=True)
    (dest / SENTINEL).unlink(missing_ok=True)  # uncommit before overwriting anything
    names = [weights_file(src).name, OPTIMIZER_FILE]
    for name in {*WEIGHT_FILES, OPTIMIZER_FILE} - set(names):
        (dest / name).unlink(missing_ok=True)  # nothing stale from an earlier publish
    for name in [*names, SENTINEL]:
        atomic_write_bytes(dest / name, (src / name).read_bytes())
    return str(dest)


def remove_dead_writers_temp_files(ckpt_dir: Path) -> list[str]:
    """Unlink the temp files of writers that no longer run (a live writer's are left alone); -> names removed."""
    removed = []
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        match = _TEMP_FILE.match(name)
        if match and process_exited(int(match.group(1))):
            (ckpt_dir / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def restore(ckpt_dir, named_tensors, optimizer) -> int:
    """Load weights (in place) and optimizer state; -> the optimizer step."""
    state = load_checkpoint(ckpt_dir, model=dict(named_tensors), optimizer=optimizer)
    return state.macro_step


def read_params(ckpt_dir, order=None) -> dict:
    stored = load_state_dict(weights_file(ckpt_dir))
    return {n: stored[n] for n in (order or sorted(stored))}


def params_sha256(params) -> str:
    """The one digest of a run's tensors: sha256 over (name, dtype, shape, bytes) of every tensor in name order.

    `params` is {name: array} or [(name, array)]; the order they come in does not matter."""
    params = dict(params)
    h = hashlib.sha256()
    for name in sorted(params):
        a = np.ascontiguousarray(params[name])
        h.update(f"{name}|{a.dtype.str}|{list(a.shape)}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()
