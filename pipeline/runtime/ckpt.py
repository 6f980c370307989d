"""Checkpoint directories for pipeline runs (the DESIGN.md section 5 protocol).

    checkpoint-step-N/
      model.safetensors       parameters (names from named_parameters)
      optimizer.safetensors   optimizer state tensors; its config/step in metadata
      trainer_state.json      written LAST: the commit sentinel

Every file goes to a temp name, is fsynced, then renamed; a directory without a
parseable sentinel is not a checkpoint, so a writer killed mid-way leaves the
previous checkpoint the latest committed one, and a retry simply rewrites.

Trade-off: this is the pipeline's own small writer so the runtime does not wait
on pipeline/train/checkpoint.py; the layout is the shared protocol, so either
side can read the other's directories.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np
from safetensors.numpy import load_file, save_file

from ..errors import CheckpointError

SENTINEL = "trainer_state.json"
_STEP_DIR = re.compile(r"^checkpoint-step-(\d+)$")


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path, write):
    tmp = f"{path}.tmp-{os.getpid()}"
    write(tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_checkpoint(ckpt_dir, params: dict, optim: dict, optim_meta: dict, state: dict, on_file=None):
    """Write one checkpoint directory; `on_file(name)` is called after each file (fault tests)."""
    os.makedirs(ckpt_dir, exist_ok=True)
    sentinel = os.path.join(ckpt_dir, SENTINEL)
    if os.path.exists(sentinel):  # re-writing a committed step: un-commit first
        os.unlink(sentinel)
    contiguous = lambda d: {k: np.ascontiguousarray(v) for k, v in d.items()}  # noqa: E731
    _atomic(os.path.join(ckpt_dir, "model.safetensors"),
            lambda p: save_file(contiguous(params), p, metadata={"format": "fucina-pipeline"}))
    on_file and on_file("model.safetensors")
    _atomic(os.path.join(ckpt_dir, "optimizer.safetensors"),
            lambda p: save_file(contiguous(optim), p, metadata={"optimizer": json.dumps(optim_meta)}))
    on_file and on_file("optimizer.safetensors")

    def write_json(p):
        with open(p, "w") as fh:
            json.dump(state, fh, indent=1, sort_keys=True)
    _atomic(sentinel, write_json)
    _fsync_dir(ckpt_dir)
    on_file and on_file(SENTINEL)
    return ckpt_dir


def is_committed(ckpt_dir) -> bool:
    try:
        with open(os.path.join(ckpt_dir, SENTINEL)) as fh:
            return isinstance(json.load(fh).get("step"), int)
    except (OSError, ValueError, AttributeError):
        return False


def latest_checkpoint(run_dir) -> str | None:
    """The committed checkpoint-step-N with the largest N (uncommitted ones ignored)."""
    best = None
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return None
    for name in names:
        m = _STEP_DIR.match(name)
        path = os.path.join(run_dir, name)
        if m and is_committed(path) and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), path)
    return best[1] if best else None


def resolve(path) -> str:
    """A checkpoint dir, or a run dir (-> its latest committed checkpoint)."""
    if is_committed(path):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: neither a committed checkpoint (no parseable {SENTINEL}) "
                              f"nor a run directory holding one")
    return latest


def read_checkpoint(ckpt_dir):
    """-> (params, optim tensors, optim meta, trainer state); errors name the file."""
    try:
        with open(os.path.join(ckpt_dir, SENTINEL)) as fh:
            state = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt_dir}/{SENTINEL}: not a committed checkpoint ({e})") from None
    out = []
    for name in ("model.safetensors", "optimizer.safetensors"):
        path = os.path.join(ckpt_dir, name)
        try:
            out.append(load_file(path))
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            raise CheckpointError(f"{path}: cannot read ({e})") from None
    from safetensors import safe_open
    with safe_open(os.path.join(ckpt_dir, "optimizer.safetensors"), "np") as f:
        meta = json.loads((f.metadata() or {}).get("optimizer", "{}"))
    return out[0], out[1], meta, state


def params_sha256(params: dict) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        a = np.ascontiguousarray(params[name])
        h.update(f"{name}|{a.dtype.str}|{list(a.shape)}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()
