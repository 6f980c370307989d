"""Optimizer state files: the optimizer's state_dict() as one safetensors file.

The optimizer contract (pipeline/optim) is
    opt.state_dict() -> {"type": str, "config": {...}, "tensors": {"<slot>.<buffer>": ndarray},
                         "scalars": {"<slot>.step": int}, ...}
    opt.load_state_dict(sd)  validates type, structural config and dtypes.
Every ndarray anywhere in that structure (an OptimizerSet nests its members'
dicts) becomes a named safetensors tensor, named by its key path joined with
"/" ("tensors/w1.exp_avg", "members/0/tensors/b1.exp_avg_sq"); the rest of the
structure, with each array replaced by {"__tensor__": name}, is JSON in the
header metadata. So the file opens in any safetensors tool, moments keep their
stored dtype bit for bit, and floats in the config round-trip exactly (JSON
writes Python floats with repr).

Trade-off: we persist whatever structure the optimizer returns instead of
a schema per optimizer type; the optimizer's own load_state_dict is the one
place that knows what is structural and validates it.
"""
from __future__ import annotations

import json

import numpy as np

from ..errors import CheckpointError, ConfigMismatchError
from .state_dict import read_safetensors, save_state_dict

FORMAT = "fucina.optimizer_state/1"
_TENSOR_REF = "__tensor__"


def _split(value, path, tensors):
    """Replace arrays in a nested structure by references; collect them by name."""
    if isinstance(value, np.ndarray):
        name = "/".join(path)
        tensors[name] = value
        return {_TENSOR_REF: name}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise CheckpointError(f"optimizer state: key {key!r} at {'/'.join(path) or 'top level'} is not a string")
        return {key: _split(v, path + [key], tensors) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split(v, path + [str(i)], tensors) for i, v in enumerate(value)]
    if isinstance(value, np.generic):  # numpy scalars (an np.int64 step count) -> Python
        return value.item()
    return value


def _join(value, tensors, source):
    """Inverse of _split: put the named arrays back in place of their references."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            name = value[_TENSOR_REF]
            if name not in tensors:
                raise CheckpointError(f"{source}: state refers to tensor {name!r}, which is not in the file")
            return tensors.pop(name)
        return {key: _join(v, tensors, source) for key, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors, source) for v in value]
    return value


def optimizer_state_type(opt) -> str:
    return opt.state_dict()["type"]


def save_optimizer(path, opt) -> None:
    """Atomically write opt.state_dict() to a safetensors file at `path`."""
    state = opt.state_dict()
    if not isinstance(state, dict) or "type" not in state:
        raise CheckpointError(f"{path}: {type(opt).__name__}.state_dict() must return a dict with a 'type'")
    tensors = {}
    skeleton = _split(state, [], tensors)
    try:
        meta = json.dumps(skeleton, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: optimizer state is not JSON-serialisable ({e})") from None
    save_state_dict(path, tensors, metadata={"format": FORMAT, "type": str(state["type"]), "state": meta})


def read_optimizer(path) -> dict:
    """Read an optimizer state file back into the state_dict() structure."""
    tensors, meta = read_safetensors(path)
    if meta.get("format") != FORMAT or "state" not in meta:
        raise CheckpointError(f"{path}: not a Fucina optimizer state file (metadata 'format' is {meta.get('format')!r})")
    try:
        skeleton = json.loads(meta["state"])
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt optimizer state metadata ({e})") from None
    state = _join(skeleton, tensors, str(path))
    if tensors:
        raise CheckpointError(f"{path}: tensors not referenced by the optimizer state: {', '.join(sorted(tensors))}")
    if not isinstance(state, dict) or "type" not in state:
        raise CheckpointError(f"{path}: corrupt optimizer state metadata (no 'type')")
    return state


def load_optimizer(path, opt) -> None:
    """Restore `opt` from a file written by save_optimizer.

    The optimizer type is checked here; the optimizer's load_state_dict then
    validates structural config, slot names, shapes and dtypes. Its errors are
    re-raised (same class) with the file named. As in the seeds' contract a
    failed load may leave `opt` partly restored: treat it as fatal for `opt`.
    """
    state = read_optimizer(path)
    expected = optimizer_state_type(opt)
    if state["type"] != expected:
        raise ConfigMismatchError(
            f"{path}: field 'type': the checkpoint holds {state['type']!r} optimizer state, "
            f"this optimizer is {expected!r}")
    try:
        opt.load_state_dict(state)
    except CheckpointError as e:
        raise type(e)(f"{path}: {e}") from None
    except (KeyError, ValueError, TypeError) as e:  # a state the optimizer could not even parse
        raise CheckpointError(f"{path}: optimizer state does not fit {type(opt).__name__} ({type(e).__name__}: {e})") from None
