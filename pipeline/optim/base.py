"""The shared optimizer core: registration, the step loop, masters, persistence.

Every optimizer is a thin subclass that names its state buffers and supplies
one `_update(slot, weights, grad)`; everything else (registering parameters by
name, skipping params without a gradient, stepping 16-bit params through a
float32 master, zero_grad, clipping, state_dict/load_state_dict with strict
validation) lives here once. A "param group" is simply another optimizer
instance; OptimizerSet makes several feel like one.

Trade-off: one Python call per parameter per step (fine for hundreds of
tensors; the per-element work is in numba kernels), and optimizers never
change parameter storage identity: updates are in place, so shared-memory
or memory-mapped parameters stay valid.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from pipeline.kernels.workpool import single_thread_blas
from pipeline.autograd.tensor import Tensor
from pipeline.errors import ConfigMismatchError, DTypeMismatchError, UserError

BF16 = np.dtype(ml_dtypes.bfloat16)
_STATE_DTYPES = {"f32": "f32", "float32": "f32", "fp32": "f32",
                 "bf16": "bf16", "bfloat16": "bf16"}


class OptimizerConfigError(UserError, ValueError):
    """A hyperparameter or registration is invalid (raised at construction / add_param)."""


def state_dtype_name(value, field):
    """Normalise 'f32'/'bf16' (or numpy dtypes) to 'f32' | 'bf16'."""
    if isinstance(value, str):
        key = value.lower()
    else:
        try:
            key = {np.dtype(np.float32): "f32", BF16: "bf16"}[np.dtype(value)]
        except (TypeError, KeyError):
            key = str(value)
    if key not in _STATE_DTYPES:
        raise OptimizerConfigError(f"{field}: expected 'f32' or 'bf16', got {value!r}")
    return _STATE_DTYPES[key]


def check_range(name, value, low=None, high=None, low_open=False, high_open=False):
    """Raise OptimizerConfigError unless low <= value <= high (open ends optional)."""
    value = float(value)
    if math.isnan(value):
        raise OptimizerConfigError(f"{name} must be a number, got nan")
    if low is not None and (value < low or (low_open and value == low)):
        raise OptimizerConfigError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise OptimizerConfigError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def check_betas(betas, name="betas"):
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise OptimizerConfigError(f"{name} must be a pair of floats, got {betas!r}") from None
    check_range(f"{name}[0]", b1, 0.0, 1.0, high_open=True)
    check_range(f"{name}[1]", b2, 0.0, 1.0, high_open=True)
    return (b1, b2)


def new_state(shape, dtype_name):
    """A zeroed state buffer: float32, or uint16 bf16 bits (bf16 zero is bits 0)."""
    return np.zeros(shape, dtype=np.float32 if dtype_name == "f32" else np.uint16)


def export_state(buf):
    """Kernel buffer -> state_dict array (uint16 bits are exported as ml_dtypes.bfloat16)."""
    if buf.dtype == np.uint16:
        return buf.view(BF16).copy()
    return buf.copy()


class Slot:
    """One registered parameter: its name, the Tensor, an optional f32 master, its state."""

    __slots__ = ("name", "tensor", "master", "published", "state", "step", "extra")

    def __init__(self, name, tensor):
        self.name = name
        self.tensor = tensor
        self.master = None     # float32 copy for f16/bf16 params
        self.published = None  # the 16-bit array the master was last narrowed into
        self.state = {}        # buffer name -> kernel array (float32 or uint16 bf16 bits)
        self.step = 0          # number of updates applied to this slot
        self.extra = {}        # optimizer-specific per-slot values (persisted as tensors)

    @property
    def is_16bit(self):
        return self.tensor.data.dtype != np.float32

    def weights(self):
        """The float32 array the kernels step: the param itself, or its master."""
        data = self.tensor.data
        if data.dtype == np.float32:
            if not (data.flags.c_contiguous and data.flags.writeable):
                raise UserError(f"optimizer step: parameter {self.name!r} now holds a non-contiguous or read-only "
                                f"array (shape {data.shape}); updates are in place, "
                                "so assign a contiguous writeable array")
            return data
        if self.master is None or self.published is not data:
            # first step, or the user swapped the param's array: (re)take the master
            self.master = data.astype(np.float32)
            self.published = data
        return self.master

    def publish(self):
        """Narrow the stepped master back into the 16-bit param (no-op for f32)."""
        data = self.tensor.data
        if data.dtype == np.float32 or self.master is None:
            return
        data[...] = self.master.astype(data.dtype)  # numpy/ml_dtypes casts round to nearest even
        self.published = data


class ParamGroup:
    """A torch-familiar handle on one optimizer's lr and params (`g["lr"]`, `g["params"]`)."""

    __slots__ = ("optimizer",)

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __getitem__(self, key):
        if key == "lr":
            return self.optimizer.lr
        if key == "params":
            return [s.tensor for s in self.optimizer.slots]
        raise KeyError(f"param group: only 'lr' and 'params' are available, not {key!r} "
                       "(hyperparameters are optimizer attributes)")

    def __setitem__(self, key, value):
        if key != "lr":
            raise KeyError(f"param group: only 'lr' can be set, not {key!r}")
        self.optimizer.lr = value


class Optimizer:
    """Base class: subclasses set TYPE, STRUCTURAL and implement `_update`.

    params: an iterable of Tensors or (name, Tensor) pairs (e.g.
    `model.named_parameters()`); unnamed params get the positional name
    "param.<index>" (keep their relative registration order to resume).
    """

    TYPE = "optimizer"
    STRUCTURAL = ()  # config fields a checkpoint must match exactly

    def __init__(self, params=(), lr=1e-3):
        self.lr = lr
        self.slots = []
        self._by_name = {}
        self._ids = {}
        if isinstance(params, Tensor):
            params = [params]
        for item in params:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Tensor):
                self.add_param(item[1], name=item[0])
            else:
                self.add_param(item)

    # --- hyperparameters ----------------------------------------------------
    @property
    def lr(self):
        return self._lr

    @lr.setter
    def lr(self, value):
        self._lr = check_range(f"{type(self).__name__}: lr", value, 0.0)

    def config(self):
        """JSON-able config: structural fields + hyperparameters (incl. lr)."""
        raise NotImplementedError

    # --- registration ---------------------------------------------------------
    def add_param(self, tensor, name=None):
        """Register a parameter (once). Returns its slot name."""
        return self._register(tensor, name, self.slots)

    def _register(self, tensor, name, slot_list):
        where = type(self).__name__
        if not isinstance(tensor, Tensor):
            raise OptimizerConfigError(f"{where}.add_param: expected a Tensor, got {type(tensor).__name__}")
        data = tensor.data
        if data.dtype not in (np.float32, np.float16, BF16):
            raise OptimizerConfigError(f"{where}.add_param({name or ''}): parameter dtype must be float32, "
                                       f"float16 or bfloat16, got {data.dtype}")
        if not data.flags.c_contiguous or not data.flags.writeable:
            raise OptimizerConfigError(f"{where}.add_param({name or ''}): parameter array must be C-contiguous "
                                       f"and writeable (shape {data.shape})")
        if id(tensor) in self._ids:
            raise OptimizerConfigError(f"{where}.add_param: parameter {name or tensor.name or ''!s} is already "
                                       f"registered as {self._ids[id(tensor)]!r} "
                                       "(each parameter belongs to exactly one slot)")
        if name is None:
            name = f"param.{len(self._ids)}"
        name = str(name)
        if name in self._by_name:
            raise OptimizerConfigError(f"{where}.add_param: duplicate slot name {name!r}")
        slot = Slot(name, tensor)
        slot_list.append(slot)
        self._by_name[name] = slot
        self._ids[id(tensor)] = name
        return name

    def all_slots(self):
        """Every slot this optimizer steps (Muon/APOLLO add their fallback slots)."""
        return list(self.slots)

    def named_parameters(self):
        return [(s.name, s.tensor) for s in self.all_slots()]

    @property
    def params(self):
        return [s.tensor for s in self.all_slots()]

    def lr_holders(self):
        """Objects whose `.lr` a schedule rescales (self, plus embedded fallbacks)."""
        return [self]

    @property
    def param_groups(self):
        """torch-style view: one group per lr holder; `group["lr"] = x` sets that optimizer's lr."""
        return [ParamGroup(h) for h in self.lr_holders()]

    # --- the step -------------------------------------------------------------
    def _grad(self, slot):
        g = slot.tensor.grad
        if g is None:
            return None
        if not isinstance(g, np.ndarray) or g.dtype != np.float32 or g.shape != slot.tensor.data.shape:
            raise UserError(f"{type(self).__name__}.step: gradient of {slot.name!r} must be float32 "
                            f"with shape {slot.tensor.data.shape}, "
                            f"got {getattr(g, 'dtype', type(g).__name__)} {getattr(g, 'shape', '')}")
        if not g.flags.c_contiguous:
            g = np.ascontiguousarray(g)
        return g

    def step(self):
        """Update every registered parameter that has a gradient (others are skipped).

        BLAS is held at one thread for the step (the updates' products are tiled on our own threads where
        they are big): multi-threaded BLAS may sum in a thread-count-dependent order."""
        with single_thread_blas():
            for slot in self.slots:
                g = self._grad(slot)
                if g is None:
                    continue
                w = slot.weights()
                slot.step += 1
                self._update(slot, w.reshape(-1), g.reshape(-1))
                slot.publish()

    def _update(self, slot, w, g):
        """Apply one step to slot: w (float32 [n], in place), g (float32 [n])."""
        raise NotImplementedError

    def zero_grad(self):
        """Clear every registered parameter's gradient (sets .grad to None)."""
        for slot in self.all_slots():
            slot.tensor.grad = None

    # --- gradients as a whole -------------------------------------------------
    def grads(self):
        """[(slot name, float32 grad array)] of params that have a gradient, in slot order."""
        return [(s.name, s.tensor.grad) for s in self.all_slots() if s.tensor.grad is not None]

    def clip_grad_norm(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over this optimizer's params; returns the pre-clip norm."""
        from .clip import clip_grad_norm
        return clip_grad_norm(self, max_norm)

    def scale_gradients(self, factor):
        from .clip import scale_gradients
        scale_gradients(self, factor)

    # --- persistence ------------------------------------------------------------
    def state_dict(self):
        """{"type", "config", "tensors": {"<slot>.<buffer>": array}, "scalars": {"<slot>.step": int}}.

        bf16 state is exported as ml_dtypes.bfloat16 arrays; 16-bit params add
        their float32 master as "<slot>.master". Arrays are copies.
        """
        tensors, scalars = {}, {}
        for slot in self.slots:
            for key, buf in slot.state.items():
                tensors[f"{slot.name}.{key}"] = export_state(buf)
            for key, value in slot.extra.items():
                tensors[f"{slot.name}.{key}"] = np.array(value, dtype=np.float32).reshape(1)
            if slot.master is not None:
                tensors[f"{slot.name}.master"] = slot.master.copy()
            scalars[f"{slot.name}.step"] = int(slot.step)
        return {"type": self.TYPE, "config": self.config(), "tensors": tensors, "scalars": scalars}

    def _expected_state(self, slot):
        """{buffer name: (shape, dtype name)} this slot holds once it has stepped."""
        raise NotImplementedError

    def load_state_dict(self, sd, source="optimizer state"):
        """Restore state by slot name; validates type, structural config, shapes and dtypes.

        lr and the other hyperparameters are NOT taken from the file: the
        constructor's values stay (a schedule re-applies lr from the step).
        Everything is validated before anything is applied, so a failed load
        leaves this optimizer as it was (Muon/OptimizerSet load their parts in
        turn: a failure there may leave earlier parts restored).
        """
        if not isinstance(sd, dict) or "type" not in sd:
            raise ConfigMismatchError(f"{source}: not an optimizer state dict (field 'type' missing)")
        if sd["type"] != self.TYPE:
            raise ConfigMismatchError(f"{source}: field 'type' is {sd['type']!r}, this optimizer is {self.TYPE!r}")
        self._check_structural(sd.get("config") or {}, source)
        tensors, scalars = sd.get("tensors", {}), sd.get("scalars", {})
        known, staged = set(), []
        for slot in self.slots:
            prefix = f"{slot.name}."
            step_key = prefix + "step"
            if step_key not in scalars:
                raise CheckpointMissing(f"{source}: no entry for slot {slot.name!r} (field {step_key!r}); "
                                        "was it registered under another name?")
            step = int(scalars[step_key])
            known.add(step_key)
            new_state = {}
            if step > 0:
                for key, (shape, dtype_name) in self._expected_state(slot).items():
                    new_state[key] = _import_state(tensors, prefix + key, shape, dtype_name, source)
                    known.add(prefix + key)
            extra = {}
            for key in self._extra_keys(slot):
                if prefix + key in tensors:
                    extra[key] = np.float32(
                        _check_array(tensors[prefix + key], prefix + key, (1,), np.float32, source)[0])
                    known.add(prefix + key)
            master = None
            if prefix + "master" in tensors:
                if not slot.is_16bit:
                    raise DTypeMismatchError(f"{source}: {prefix}master is stored but parameter {slot.name!r} "
                                             "is float32 (a 16-bit run's state?)")
                master = _check_array(tensors[prefix + "master"], prefix + "master", slot.tensor.data.shape,
                                      np.float32, source).copy()
                known.add(prefix + "master")
            staged.append((slot, step, new_state, extra, master))
        unknown = sorted((set(tensors) | set(scalars)) - known)
        if unknown:
            raise CheckpointMissing(f"{source}: entries not matching any registered slot: "
                                    f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for slot, step, new_state, extra, master in staged:  # everything validated: now apply
            slot.step, slot.state, slot.extra = step, new_state, extra
            if master is not None:
                slot.master = master
                slot.published = slot.tensor.data

    def _extra_keys(self, slot):
        return ()

    def _check_structural(self, stored, source):
        """Every field in STRUCTURAL must match exactly (lr/betas/eps/wd are not checked)."""
        mine = self.config()
        for field in self.STRUCTURAL:
            if field not in stored:
                raise ConfigMismatchError(f"{source}: structural field 'config.{field}' missing "
                                          f"(configured {mine[field]!r})")
            if stored[field] != mine[field]:
                error = DTypeMismatchError if field.endswith("dtype") else ConfigMismatchError
                raise error(f"{source}: structural field 'config.{field}' is {stored[field]!r} in the checkpoint, "
                                          f"configured {mine[field]!r}")


class CheckpointMissing(ConfigMismatchError):
    """A slot's entries are missing from (or extra in) the stored state."""


def _check_array(arr, key, shape, dtype, source):
    arr = np.asarray(arr)
    if arr.dtype != np.dtype(dtype):
        raise DTypeMismatchError(f"{source}: {key} is stored as {arr.dtype}, configured {np.dtype(dtype)} "
                                 "(no implicit f32<->bf16 conversion)")
    if tuple(arr.shape) != tuple(shape):
        raise ConfigMismatchError(f"{source}: {key} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    return arr


def _import_state(tensors, key, shape, dtype_name, source):
    if key not in tensors:
        raise CheckpointMissing(f"{source}: missing tensor {key!r}")
    want = np.float32 if dtype_name == "f32" else BF16
    arr = _check_array(tensors[key], key, shape, want, source)
    if dtype_name == "bf16":
        return np.ascontiguousarray(arr).view(np.uint16).copy()
    return np.ascontiguousarray(arr, dtype=np.float32).copy()


def f32(x):
    """A Python float (float64 arithmetic done) rounded once to float32."""
    return np.float32(x)


def dummy_state():
    """A 1-element placeholder passed for an unused state buffer."""
    return np.zeros(1, dtype=np.float32)


__all__ = ["Optimizer", "Slot", "OptimizerConfigError", "state_dtype_name", "check_range", "check_betas",
           "new_state", "f32", "dummy_state", "BF16"]
