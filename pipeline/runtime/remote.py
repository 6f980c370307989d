"""Tensors as ZeroMQ buffer frames, for trainers that cannot map the scheduler host's shared memory.

A trainer started with `--remote` (on another host, or a Ray actor) says so in
its `hello`; the scheduler then ships it what a local trainer would read from
shared memory, and writes back what it would have written:

    scheduler -> trainer   `params` (version v, layout) + frames   only when v changed since its last task
    scheduler -> trainer   `grad` (as for a local trainer)  + frames of the batch slot
    trainer -> scheduler   `grad_done`                      + frames of its gradient

The frames are views of the shared segments (zero-copy on the sending side:
ZeroMQ reads the mapped pages itself); the receiver copies each frame once
into its destination (its private parameter/batch arrays, or the `grads` slot
in shared memory). Tensors are sent in layout order, each cut into chunks of
at most CHUNK_BYTES so no frame exceeds the control socket's MAXMSGSIZE. The
receiver knows the layout, so it checks the exact count and size of every
frame before copying a byte: a short, long or extra frame refuses the whole
message, nothing half-written.

Safety of the zero-copy send: a segment is changed in place only after the
step whose tasks read it has collected every gradient (parameters), or after
that step is committed (a batch slot is refilled two steps later), and a
remote trainer answers only after it has received its frames - so the pages
a queued frame points at do not change under it while its task is live. A
task re-queued because its trainer was lost may leave frames queued to that
dead connection; those bytes are never used.
"""
from __future__ import annotations

import numpy as np

from .messages import MAX_FRAME_BYTES
from .shm import TensorSpec, np_dtype

CHUNK_BYTES = 8 << 20
assert CHUNK_BYTES <= MAX_FRAME_BYTES


class FrameError(ValueError):
    """Frames that do not match the layout they claim to carry."""


def chunk_sizes(nbytes: int) -> list[int]:
    """The frame sizes one tensor of `nbytes` travels in (an empty tensor: one empty frame)."""
    if nbytes == 0:
        return [0]
    return [min(CHUNK_BYTES, nbytes - off) for off in range(0, nbytes, CHUNK_BYTES)]


def np_nbytes(shape, dtype) -> int:
    """The bytes of a tensor of this shape and dtype."""
    n = np.dtype(np_dtype(dtype) if isinstance(dtype, str) else dtype).itemsize
    for d in shape:
        n *= int(d)
    return n


def to_frames(arrays) -> list[memoryview]:
    """Views of C-contiguous arrays cut into frames; no byte is copied here."""
    frames = []
    for a in arrays:
        if not a.flags.c_contiguous:
            raise FrameError(f"a tensor of shape {a.shape} is not contiguous")
        raw = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
        off = 0
        for size in chunk_sizes(a.nbytes):
            frames.append(raw[off:off + size])
            off += size
    return frames


def from_frames(frames, destinations: list[np.ndarray]):
    """Copy frames into `destinations` (in layout order) after checking every frame's size; else FrameError."""
    want = [size for d in destinations for size in chunk_sizes(d.nbytes)]
    got = [len(memoryview(f)) for f in frames]
    if got != want:
        raise FrameError(f"{len(got)} frames of {sum(got)} bytes where the layout needs {len(want)} frames of "
                         f"{sum(want)} bytes")
    it = iter(frames)
    for d in destinations:
        flat = d.reshape(-1).view(np.uint8)
        off = 0
        for size in chunk_sizes(d.nbytes):
            flat[off:off + size] = np.frombuffer(next(it), dtype=np.uint8)
            off += size


def arrays_for(specs) -> dict[str, np.ndarray]:
    """Private arrays for a wire layout ([{name, dtype, shape, offset}] or TensorSpecs)."""
    specs = [s if isinstance(s, TensorSpec) else TensorSpec.from_wire(s) for s in specs]
    return {s.name: np.empty(s.shape, dtype=np_dtype(s.dtype)) for s in specs}


class SegmentViews:
    """The scheduler's read/write views of the segments its remote trainers need.

    Re-attaches a segment whose owner changed (a restarted role re-creates it
    under the same name, and an old mapping would point at the unlinked one)."""

    def __init__(self, registry):
        self.registry = registry
        self.owners: dict[str, str] = {}

    def tensors(self, desc) -> dict[str, np.ndarray]:
        name = desc["segment"]
        if self.owners.get(name) not in (None, desc["owner"]):
            self.registry.detach(name)
        self.owners[name] = desc["owner"]
        return self.registry.attach(name, desc["tensors"]).tensors

    def close(self):
        self.registry.close()
