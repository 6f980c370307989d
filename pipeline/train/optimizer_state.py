"""Optimizer state files: the optimizer's state_dict() as one safetensors file.

The optimizer contract (pipeline/optim) is
    opt.state_dict() -> {"type": str, "config": {...}, "tensors": {"<slot>.<buffer>": ndarray},
                         "scalars": {"<slot>.step": int}, ...}
    opt.load_state_dict(sd)  validates type, structural config and dtypes.
Every ndarray anywhere in that structure becomes a named safetensors tensor:
entries of the top-level "tensors" map keep their names ("w1.exp_avg",
"0.b1.exp_avg_sq" in a set), arrays elsewhere are named by their key path
joined with "/"; the rest of the
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

from ..errors import CheckpointError, ConfigMismatchError, DTypeMismatchError
from ..untrusted import brief, parse_json
from .state_dict import read_safetensors, save_state_dict

FORMAT = "fucina.optimizer_state/1"
_MAX_STATE_DEPTH = 64  # an OptimizerSet of Muons with fallbacks nests a handful of levels
_TENSOR_REF = "__tensor__"


def _split(value, path, tensors):
    """Replace arrays in a nested structure by references; collect them by name."""
    if isinstance(value, np.ndarray):
        # the contract's flat "tensors" map keeps its own names; anything else is named by path
        name = path[1] if len(path) == 2 and path[0] == "tensors" else "/".join(path)
        if name in tensors:
            raise CheckpointError(f"optimizer state: two tensors would both be stored as {name!r}")
        tensors[name] = value
        return {_TENSOR_REF: name}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise CheckpointError(f"optimizer state: key {key!r} at {'/'.join(path) or 'top level'} "
                                      "is not a string")
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
            if not isinstance(name, str) or name not in tensors:
                raise CheckpointError(f"{source}: state refers to tensor {brief(name)}, which is not in the file "
                                      "(or is referred to twice)")
            return tensors.pop(name)
        return {key: _join(v, tensors, source) for key, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors, source) for v in value]
    return value


def _dtype_fields(stored, mine, path=("config",)):
    """Yield (field path, stored, configured) for every differing '*dtype' config field."""
    if isinstance(stored, dict) and isinstance(mine, dict):
        for key in stored.keys() & mine.keys():
            if key.endswith("dtype") and stored[key] != mine[key]:
                yield ".".join(path + (key,)), stored[key], mine[key]
            else:
                yield from _dtype_fields(stored[key], mine[key], path + (key,))
    elif isinstance(stored, list) and isinstance(mine, list):
        for i, (a, b) in enumerate(zip(stored, mine)):
            yield from _dtype_fields(a, b, path + (str(i),))


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
        raise CheckpointError(f"{path}: not a Fucina optimizer state file "
                              f"(metadata 'format' is {meta.get('format')!r})")
    # bounded nesting: _join recurses once per level, as the decoder does
    skeleton = parse_json(meta["state"], f"{path}: corrupt optimizer state metadata", CheckpointError,
                          max_depth=_MAX_STATE_DEPTH)
    state = _join(skeleton, tensors, str(path))
    if tensors:
        raise CheckpointError(f"{path}: tensors not referenced by the optimizer state: {', '.join(sorted(tensors))}")
    if not isinstance(state, dict) or not isinstance(state.get("type"), str):
        raise CheckpointError(f"{path}: corrupt optimizer state metadata (field 'type' is not a string)")
    return state


def load_optimizer(path, opt) -> None:
    """Restore `opt` from a file written by save_optimizer.

    The optimizer type and the '*dtype' config fields are checked here (a
    dtype difference raises DTypeMismatchError); the optimizer's
    load_state_dict then validates the other structural config, slot names,
    shapes and tensor dtypes. Its errors are
    re-raised (same class) with the file named. As in the seeds' contract a
    failed load may leave `opt` partly restored: treat it as fatal for `opt`.
    """
    state = read_optimizer(path)
    mine = opt.state_dict()
    if state["type"] != mine["type"]:
        raise ConfigMismatchError(
            f"{path}: field 'type': the checkpoint holds {state['type']!r} optimizer state, "
            f"this optimizer is {mine['type']!r}")
    # A state-dtype difference is reported as what it is, before any other structural check.
    for field, stored, configured in _dtype_fields(state.get("config"), mine.get("config")):
        raise DTypeMismatchError(
            f"{path}: field {field!r} is {stored!r} in the checkpoint, configured {configured!r} "
            "(no implicit f32<->bf16 conversion: it would break bit-exact resume)")
    try:
        opt.load_state_dict(state)
    except CheckpointError as e:
        raise type(e)(f"{path}: {e}") from None
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:  # a state it could not even parse
        raise CheckpointError(f"{path}: optimizer state does not fit {type(opt).__name__} "
                              f"({type(e).__name__}: {e})") from None
