"""The ES wire protocol: message kinds, their fields, and the frame layout.

Trade-off: a small self-contained schema module for the ES coordinator and
its members (ROUTER <-> DEALER), kept apart from pipeline/runtime's general
messages until the two are unified. msgpack maps only (never pickle: a peer
can send bytes, not code); tensors travel only in the rare state transfer
(a joining worker, a checkpoint, the final digest) as raw frames after the
header. Per iteration only (iteration, member ids) go out and float64
rewards come back: every replica regenerates the noise and applies the same
update itself.

    frame 0: msgpack {"kind": str, "v": VERSION, ...fields}
    frames 1..: raw little-endian slot bytes (kinds "welcome" and "params" only),
                described by header["slots"] = [[name, dtype_str, shape], ...]

    worker -> coordinator
      hello      {worker, pid, host}                   join request
      rewards    {it, members, rewards, center?, cpu_ms?}  center = [ce, acc] of theta_it when asked;
                                                         cpu_ms = worker CPU time spent on the task
      params     {it, sha256, slots} + frames          reply to fetch
      heartbeat  {}                                    while idle
      failed     {error}                               the worker cannot continue (desync, bad config)
    coordinator -> worker
      welcome    {run, it, slots} + frames             run config and the parameters at iteration it
      iter       {it, catchup, members, center}        catchup = rewards of it-1 if not yet applied
      fetch      {it, catchup, frames}                 reply with params (frames=False: digest only)
      heartbeat  {}
      shutdown   {reason}
"""
from __future__ import annotations

import msgpack
import numpy as np

VERSION = 1
REQUIRED = {
    "hello": ("worker", "pid", "host"),
    "rewards": ("it", "members", "rewards"),
    "params": ("it", "sha256", "slots"),
    "heartbeat": (),
    "failed": ("error",),
    "welcome": ("run", "it", "slots"),
    "iter": ("it", "catchup", "members", "center"),
    "fetch": ("it", "catchup", "frames"),
    "shutdown": ("reason",),
}


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol version."""


def encode(kind: str, **fields) -> bytes:
    missing = [f for f in REQUIRED[kind] if f not in fields]
    if missing:
        raise ProtocolError(f"message {kind!r}: missing field(s) {missing}")
    return msgpack.packb({"kind": kind, "v": VERSION, **fields}, use_bin_type=True)


def decode(frame: bytes) -> dict:
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage input
        raise ProtocolError(f"undecodable frame ({type(e).__name__}: {e})") from None
    if not isinstance(msg, dict) or msg.get("kind") not in REQUIRED:
        raise ProtocolError(f"unknown message kind {msg.get('kind') if isinstance(msg, dict) else type(msg).__name__!r}")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"message {msg['kind']!r}: schema version {msg.get('v')!r}, expected {VERSION}")
    missing = [f for f in REQUIRED[msg["kind"]] if f not in msg]
    if missing:
        raise ProtocolError(f"message {msg['kind']!r}: missing field(s) {missing}")
    return msg


def slot_frames(named_arrays) -> tuple[list, list[bytes]]:
    """([[name, dtype_str, shape], ...], [raw bytes per slot]) for a state transfer."""
    desc = [[name, arr.dtype.name, list(arr.shape)] for name, arr in named_arrays]
    return desc, [np.ascontiguousarray(arr).tobytes() for _, arr in named_arrays]


def load_frames(named_arrays, desc, frames, source="params"):
    """Copy transferred slot bytes into the local arrays after checking names, dtypes and shapes."""
    if len(desc) != len(named_arrays) or len(frames) != len(desc):
        raise ProtocolError(f"{source}: {len(desc)} slot(s)/{len(frames)} frame(s), replica has {len(named_arrays)}")
    for (name, arr), (dname, dtype, shape), raw in zip(named_arrays, desc, frames):
        if name != dname or dtype != arr.dtype.name or list(shape) != list(arr.shape) or len(raw) != arr.nbytes:
            raise ProtocolError(f"{source}: slot {dname!r} {dtype} {shape} does not match replica slot "
                                f"{name!r} {arr.dtype.name} {list(arr.shape)}")
    for (name, arr), raw in zip(named_arrays, frames):
        np.copyto(arr, np.frombuffer(raw, dtype=arr.dtype).reshape(arr.shape))
