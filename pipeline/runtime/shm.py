"""Shared-memory tensors: named segments holding a header and a tensor layout.

A segment is `/dev/shm/<name>`: a 64-byte header (a little-endian uint64
*version* counter, then zeros) followed by tensors at 64-byte aligned offsets.
Messages carry only descriptors - {segment, offset, dtype, shape, version} - and
the receiver attaches and views the bytes in place (zero copies on one host).

Every segment of a run is named `fucina-<run_id>-<role>-<what>`, so cleanup has
two layers: each process keeps a `Registry` of what it created and unlinks it on
exit, SIGTERM or a fatal error; and the launcher (which outlives SIGKILLed
workers) calls `unlink_run(run_id)`, which removes every segment with the run's
prefix. Trade-off: the prefix scan is Linux-specific (/dev/shm), and a segment
name is the only thing two processes need to share, which keeps messages small.

Python 3.11's resource_tracker would unlink a segment when *any* attaching
process exits; we unregister from it and own the lifetime ourselves.
"""
from __future__ import annotations

import atexit
import os
import signal
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

HEADER_BYTES = 64
ALIGN = 64
SHM_DIR = "/dev/shm"


def run_prefix(run_id: str) -> str:
    return f"fucina-{run_id}-"


def _untrack(shm):
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - see module docstring
    except Exception:  # noqa: BLE001 - tracker absent or already unregistered
        pass


def np_dtype(name: str) -> np.dtype:
    """A dtype from its name; 'bfloat16' comes from ml_dtypes (bf16 optimizer state)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple
    offset: int

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * np_dtype(self.dtype).itemsize

    def to_wire(self):
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}

    @staticmethod
    def from_wire(d):
        return TensorSpec(d["name"], d["dtype"], tuple(d["shape"]), int(d["offset"]))


def layout(named_shapes) -> tuple[list[TensorSpec], int]:
    """[(name, shape, dtype)] -> (specs with aligned offsets, total segment bytes)."""
    specs, off = [], HEADER_BYTES
    for name, shape, dtype in named_shapes:
        spec = TensorSpec(name, np.dtype(dtype).name, tuple(int(s) for s in shape), off)
        specs.append(spec)
        off += -(-max(spec.nbytes, 1) // ALIGN) * ALIGN
    return specs, off


class Segment:
    """One named shared-memory segment with a version header and a tensor layout."""

    def __init__(self, shm, specs, owner: bool):
        self._shm = shm
        self.name = shm.name
        self.specs = list(specs)
        self.owner = owner
        self._version = np.ndarray((1,), dtype="<u8", buffer=shm.buf, offset=0)
        self.tensors = {s.name: self._view(s) for s in self.specs}

    def _view(self, s: TensorSpec):
        if s.offset + s.nbytes > self._shm.size:
            raise ValueError(f"shm {self.name}: tensor {s.name!r} {s.shape} {s.dtype} at offset {s.offset} "
                             f"runs past the segment end ({self._shm.size} bytes)")
        return np.ndarray(s.shape, dtype=np_dtype(s.dtype), buffer=self._shm.buf, offset=s.offset)

    @property
    def version(self) -> int:
        return int(self._version[0])

    @version.setter
    def version(self, v: int):
        self._version[0] = v

    def describe(self, name: str) -> dict:
        """Descriptor of one tensor: what a message carries instead of the data."""
        s = next(s for s in self.specs if s.name == name)
        return {"segment": self.name, "offset": s.offset, "dtype": s.dtype, "shape": list(s.shape),
                "version": self.version}

    def layout_wire(self):
        return [s.to_wire() for s in self.specs]

    def close(self):
        self.tensors = {}
        self._version = None
        try:
            self._shm.close()
        except BufferError:  # a numpy view still alive somewhere: the mapping goes at exit
            pass


class Registry:
    """Segments this process created; all unlinked on close, exit, SIGTERM or Ctrl-C."""

    def __init__(self, run_id: str, role: str):
        self.run_id, self.role = run_id, role
        self.created: dict[str, Segment] = {}
        self.attached: dict[str, Segment] = {}
        atexit.register(self.close)

    def create(self, what: str, named_shapes) -> Segment:
        specs, size = layout(named_shapes)
        name = f"{run_prefix(self.run_id)}{self.role}-{what}"
        unlink_name(name)  # a stale segment of a crashed earlier incarnation of this role
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        _untrack(shm)
        seg = Segment(shm, specs, owner=True)
        self.created[name] = seg
        return seg

    def attach(self, name: str, specs) -> Segment:
        seg = self.attached.get(name)
        if seg is not None:
            return seg
        specs = [s if isinstance(s, TensorSpec) else TensorSpec.from_wire(s) for s in specs]
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            raise FileNotFoundError(f"shm: segment {name!r} does not exist "
                                    "(its owner exited or never created it)") from None
        _untrack(shm)
        seg = Segment(shm, specs, owner=False)
        self.attached[name] = seg
        return seg

    def detach(self, name: str):
        seg = self.attached.pop(name, None)
        if seg is not None:
            seg.close()

    def unlink(self, name: str):
        seg = self.created.pop(name, None)
        if seg is not None:
            seg.close()
            unlink_name(name)

    def close(self):
        for name in list(self.attached):
            self.detach(name)
        for name in list(self.created):
            self.unlink(name)


def unlink_name(name: str):
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def run_segments(run_id: str) -> list[str]:
    prefix = run_prefix(run_id)
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def unlink_run(run_id: str) -> list[str]:
    """Remove every segment of a run (the launcher's last word); returns the names removed."""
    names = run_segments(run_id)
    for n in names:
        unlink_name(n)
    return names


def exit_on_signals():
    """Turn SIGTERM (and SIGHUP) into SystemExit so `finally` blocks and atexit run.

    Ctrl-C already raises KeyboardInterrupt. Call once, in the main thread.
    """
    def _raise(signum, _frame):
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)
