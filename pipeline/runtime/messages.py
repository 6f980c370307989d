"""Every message kind on the wire, in one module (the zguide/jupyter_client way).

Wire format: one ZeroMQ frame holding a msgpack map
    {"kind": str, "v": SCHEMA_VERSION, "step": int, "seq": int, ...fields}
Tensors never travel in messages: they live in shared memory and messages carry
descriptors (see shm.py). msgpack only, never pickle: a peer can send us bytes
but never code.

Trade-off: schemas are plain dicts checked against a table of required fields
rather than classes; that keeps encode/decode one function each and lets a
monitor written in any language read the stream. A message whose kind is
unknown, whose version differs, or that lacks a required field is logged and
dropped by `decode` (returns None) - a bad peer can never crash a worker.
"""
from __future__ import annotations

import itertools
import logging

import msgpack

SCHEMA_VERSION = 1
log = logging.getLogger("fucina.messages")

# kind -> required fields (beyond kind/v/step/seq).  Control plane first.
KINDS: dict[str, tuple[str, ...]] = {
    # worker -> scheduler
    "hello": ("role", "worker", "pid"),          # a worker announces itself
    "heartbeat": ("worker",),                    # both ways (scheduler echoes)
    "loaded": ("worker", "gen", "k", "slot", "batch", "ms"),  # loader filled a slot of segment `batch`
    "grad_done": ("worker", "gen", "k", "loss", "rows", "ms"),  # trainer wrote grad slot k
    "stepped": ("worker", "gen", "lr", "grad_norm", "ms"),  # optimizer published version `step`
    "snapshot_ready": ("worker", "gen", "segment", "tensors", "meta"),  # optimizer copied state to shm
    "ready": ("worker", "gen", "params", "grads"),  # optimizer finished init/restore; segment descriptors
    "committed": ("worker", "path", "ms"),       # checkpointer wrote a checkpoint dir (step = its step)
    "failed": ("worker", "error"),               # a task failed for a reason retrying will not fix
    "bye": ("worker",),                          # a worker exits cleanly
    # scheduler -> worker
    "welcome": ("worker", "run"),                # handshake reply: run description
    "load": ("gen", "k", "slot"),                # loader: produce micro-batch (step, k) into slot
    "grad": ("gen", "k", "slot", "batch", "params", "grads"),  # trainer: forward+backward micro-batch k
                                                 # against params version `step`, gradient into grads slot k
    "step": ("gen", "micro_batches"),            # optimizer: reduce slots 0..M-1 in order, step
    "init": ("gen", "resume"),                   # optimizer: (re)load state (resume dir or "")
    "snapshot": ("gen",),                        # optimizer: copy params+state to a shm segment
    "write": ("segment", "tensors", "meta", "dir"),  # checkpointer: write a checkpoint dir
    "shutdown": ("reason",),                     # any worker: exit now
    # PUB (metrics and events)
    "metrics": ("loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "roles"),
    "event": ("event", "detail"),
}

_seq = itertools.count()


class MessageError(ValueError):
    """Raised by `make` for a message we would refuse to receive ourselves."""


def make(kind: str, step: int = 0, **fields) -> dict:
    """Build a message dict; refuses unknown kinds and missing fields early."""
    if kind not in KINDS:
        raise MessageError(f"message: unknown kind {kind!r} (known: {', '.join(sorted(KINDS))})")
    missing = [f for f in KINDS[kind] if f not in fields]
    if missing:
        raise MessageError(f"message {kind!r}: missing field(s) {missing}")
    return {"kind": kind, "v": SCHEMA_VERSION, "step": int(step), "seq": next(_seq), **fields}


def encode(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def pack(kind: str, step: int = 0, **fields) -> bytes:
    return encode(make(kind, step, **fields))


def decode(frame: bytes) -> dict | None:
    """bytes -> message dict, or None (logged) when the frame is not a valid message."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - any garbage from the wire is dropped
        log.warning("dropped a frame that is not msgpack (%d bytes): %s", len(frame), e)
        return None
    if not isinstance(msg, dict):
        log.warning("dropped a msgpack frame that is not a map: %r", type(msg).__name__)
        return None
    kind, version = msg.get("kind"), msg.get("v")
    if kind not in KINDS:
        log.warning("dropped a message of unknown kind %r", kind)
        return None
    if version != SCHEMA_VERSION:
        log.warning("dropped %r message with schema version %r (we speak %d)", kind, version, SCHEMA_VERSION)
        return None
    missing = [f for f in ("step", "seq", *KINDS[kind]) if f not in msg]
    if missing:
        log.warning("dropped %r message missing field(s) %s", kind, missing)
        return None
    return msg
