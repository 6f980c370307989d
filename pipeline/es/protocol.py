"""The ES wire protocol: message kinds, their fields, and the frame layout.

Trade-off: a small self-contained schema module for the ES coordinator and
its members (ROUTER <-> DEALER), kept apart from pipeline/runtime's general
messages until the two are unified. msgpack maps only (never pickle: a peer
can send bytes, not code); tensors travel only in the rare state transfer
(a joining worker, a checkpoint, the final digest) as raw frames after the
header. Per iteration only (iteration, member ids) go out and float64
rewards come back: every replica regenerates the noise and applies the same
update itself. Every field is checked for its type on decode (the runtime's
field predicates, pipeline/runtime/messages.py), so `decode` raises only
ProtocolError; which members a reward may name is the coordinator's check.

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

from ..runtime.messages import (BOOL, INT, INTS, MAP, MAX_FRAME_BYTES, NUM, NUMS, OPT_NUMS, STR, MessageError,
                                check_fields)

VERSION = 1
SLOTS = ("a list of [name, dtype, shape]",
         lambda v: type(v) is list and all(type(s) is list and len(s) == 3 and STR[1](s[0]) and STR[1](s[1])
                                           and INTS[1](s[2]) for s in v))
CENTER = ("a [ce, accuracy] pair", lambda v: NUMS[1](v) and len(v) == 2)
REQUIRED = {
    "hello": {"worker": STR, "pid": INT, "host": STR},
    "rewards": {"it": INT, "members": INTS, "rewards": NUMS},
    "params": {"it": INT, "sha256": STR, "slots": SLOTS},
    "heartbeat": {},
    "failed": {"error": STR},
    "welcome": {"run": MAP, "it": INT, "slots": SLOTS},
    "iter": {"it": INT, "catchup": OPT_NUMS, "members": INTS, "center": BOOL},
    "fetch": {"it": INT, "catchup": OPT_NUMS, "frames": BOOL},
    "shutdown": {"reason": STR},
}
OPTIONAL = {"rewards": {"center": CENTER, "cpu_ms": NUM}}


class ProtocolError(MessageError):
    """A frame that is not a message of this protocol version."""


def encode(kind: str, **fields) -> bytes:
    missing = [f for f in REQUIRED[kind] if f not in fields]
    if missing:
        raise ProtocolError(f"message {kind!r}: missing field(s) {missing}")
    return msgpack.packb({"kind": kind, "v": VERSION, **fields}, use_bin_type=True)


def decode(frame: bytes) -> dict:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a header frame of {len(frame)} bytes (the limit is {MAX_FRAME_BYTES})")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for garbage input
        raise ProtocolError(f"undecodable frame ({type(e).__name__}: {e})") from None
    kind = msg.get("kind") if type(msg) is dict else None
    if type(kind) is not str or kind not in REQUIRED:  # an unhashable kind must not reach the dict lookup
        what = repr(kind)[:80] if type(msg) is dict else type(msg).__name__
        raise ProtocolError(f"unknown message kind {what}")
    if msg.get("v") != VERSION or type(msg.get("v")) is not int:
        raise ProtocolError(f"message {kind!r}: schema version {repr(msg.get('v'))[:80]}, expected {VERSION}")
    check_fields(msg, REQUIRED[kind], OPTIONAL.get(kind, {}), error=ProtocolError)
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
