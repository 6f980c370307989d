"""Checkpoints of pipeline runs, on the shared directory protocol (pipeline.train).

    checkpoint-step-N/  model.safetensors, optimizer.safetensors, trainer_state.json (last)

The checkpointer holds no model and no optimizer - only a snapshot of arrays -
so this module adapts a snapshot to `save_checkpoint`'s model/optimizer
arguments. The sentinel's `step` counts micro-batches and `accum_steps` is
the job's micro-batches per step, so `macro_step` is the optimizer step (the
pipeline.train convention). `params_sha256` is the run's identity: the digest
of every final parameter in name order, what the determinism tests compare.

Trade-off: a thin adapter, not a second writer; a crash mid-save is handled by
the protocol (sentinel last), a retry simply re-saves into the same directory
- after removing the temp files (`.NAME.tmp-PID`) a killed writer left there,
so a committed directory holds only its own files.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import numpy as np

from ..autograd.tensor import Tensor
from ..errors import CheckpointError
from ..train import checkpoint as protocol
from ..train.state_dict import load_state_dict
from ..train.trainer_state import TrainerState
from .transport import process_exited

is_committed = protocol.is_committed
_TEMP_FILE = re.compile(r"^\..+\.tmp-(\d+)$")  # state_dict.atomic_write's temp name


def latest_checkpoint(run_dir) -> str | None:
    path = protocol.latest_checkpoint(run_dir)
    return str(path) if path else None


def resolve(path) -> str:
    """A checkpoint dir, or a run dir (-> its latest committed checkpoint)."""
    if is_committed(path):
        return str(path)
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: neither a committed checkpoint (no valid {protocol.SENTINEL}) "
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
    model = {n: Tensor(a, requires_grad=True) for n, a in params.items()}
    ckpt_dir = Path(ckpt_dir)
    remove_dead_writers_temp_files(ckpt_dir)
    if on_file is None:
        protocol.save_checkpoint(ckpt_dir, state, model=model, optimizer=_FrozenState(optim_skeleton, optim_tensors),
                                 adapters=adapters)
        return str(ckpt_dir)
    # the same protocol in two calls, so a fault can strike between the files (sentinel still last)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    sentinel = ckpt_dir / protocol.SENTINEL
    if sentinel.exists():
        sentinel.unlink()
    from ..train.state_dict import save_state_dict
    weights = protocol.WEIGHT_FILES[1 if adapters else 0]
    save_state_dict(ckpt_dir / weights, list(model.items()), metadata={"format": "fucina.weights/1"})
    on_file(weights)
    protocol.save_checkpoint(ckpt_dir, state, model=model, optimizer=_FrozenState(optim_skeleton, optim_tensors),
                             adapters=adapters)
    return str(ckpt_dir)


def publish(ckpt_dir, dest) -> str:
    """Commit a copy of the committed checkpoint `ckpt_dir` at `dest` (its files, the sentinel last), so a run
    dir is itself its final checkpoint (what `fucina finetune --save DIR` always wrote)."""
    from ..train.state_dict import atomic_write_bytes
    src, dest = Path(ckpt_dir), Path(dest)
    protocol.read_sentinel(src)  # only a committed checkpoint is published
    dest.mkdir(parents=True, exist_ok=True)
    (dest / protocol.SENTINEL).unlink(missing_ok=True)  # uncommit before overwriting anything
    names = [protocol.weights_file(src).name, protocol.OPTIMIZER_FILE]
    for name in {*protocol.WEIGHT_FILES, protocol.OPTIMIZER_FILE} - set(names):
        (dest / name).unlink(missing_ok=True)  # nothing stale from an earlier publish
    for name in [*names, protocol.SENTINEL]:
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
    state = protocol.load_checkpoint(ckpt_dir, model=dict(named_tensors), optimizer=optimizer)
    return state.macro_step


def read_params(ckpt_dir, order=None) -> dict:
    stored = load_state_dict(protocol.weights_file(ckpt_dir))
    return {n: stored[n] for n in (order or sorted(stored))}


def read_state(ckpt_dir) -> TrainerState:
    return protocol.read_sentinel(ckpt_dir)


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


def checkpoint_dir(run_dir, step) -> str:
    return os.path.join(run_dir, f"checkpoint-step-{step}")
