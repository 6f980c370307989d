"""`--tensorboard DIR`: the run's step records as TensorBoard scalars, beside metrics.jsonl, with no dependency.

The event-file format is written here: a TFRecord stream (u64 length, masked crc32c of the length bytes, the
data, masked crc32c of the data; little endian) whose records are serialized `tensorflow.Event` protobufs,
hand-encoded (wall_time = field 1 double, step = 2 varint, file_version = 3 string, summary = 5 message; a
Summary's value = 1 repeated message of tag = 1 string and simple_value = 2 float). The first record is the
file_version "brain.Event:2" event TensorBoard expects. `read_events` reads a file back (every crc checked):
the tests' reader, and a way to look at one without TensorBoard.

One file per writer, DIR/events.out.tfevents.<unix time>.<host>.<pid>.<n>: a resumed run appends a new file
beside the old ones, and TensorBoard's reader drops the older file's steps past the one the run resumed from
(its purge of orphaned data when a step goes backwards), as MetricsLog.rewind does for metrics.jsonl. Each
step's record is flushed as it is written, so a TensorBoard pointed at DIR follows a running run.
"""
from __future__ import annotations

import itertools
import os
import socket
import struct
import time

from ..errors import UserError

FILE_VERSION = "brain.Event:2"


def _crc32c_table():
    poly, table = 0x82F63B78, []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord frames carry (the records are a few hundred bytes)."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord: length, its masked crc, the data, its masked crc."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


# --- protobuf, the few fields an Event of scalars needs ------------------------------------------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: a negative is its two's complement, ten bytes
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int = 0, scalars: dict | None = None,
                 file_version: str | None = None) -> bytes:
    """A serialized Event: wall_time, step and either a file_version or a Summary of simple_value scalars."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _bytes_field(5, values)
    return out


def _fields(buf: bytes):
    """(field number, wire type, value) of one message: an int for varints, bytes for the rest."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire} is not one an Event uses")
        if i > len(buf):
            raise ValueError("protobuf message cut short")
        yield number, wire, value


def _read_varint(buf: bytes, i: int):
    n = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("protobuf varint cut short")
        b = buf[i]
        n |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return n, i


def decode_event(data: bytes) -> dict:
    """{wall_time, step, file_version?, scalars {tag: value}} of a serialized Event (other fields skipped)."""
    event = {"wall_time": 0.0, "step": 0, "scalars": {}}
    for number, wire, value in _fields(data):
        if number == 1 and wire == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and wire == 2:
            event["file_version"] = value.decode()
        elif number == 5 and wire == 2:
            for vn, vw, v in _fields(value):
                if vn != 1 or vw != 2:
                    continue
                tag, simple = None, None
                for n, w, x in _fields(v):
                    if n == 1 and w == 2:
                        tag = x.decode()
                    elif n == 2 and w == 5:
                        simple = struct.unpack("<f", x)[0]
                if tag is not None and simple is not None:
                    event["scalars"][tag] = simple
    return event


def read_events(path: str) -> list[dict]:
    """Every Event of an event file, each frame's crcs checked (ValueError naming the offset if one fails)."""
    with open(path, "rb") as fh:
        buf = fh.read()
    out, i = [], 0
    while i < len(buf):
        if len(buf) - i < 12:
            raise ValueError(f"{path}: record header cut short at byte {i}")
        length = buf[i:i + 8]
        (n,) = struct.unpack("<Q", length)
        if struct.unpack("<I", buf[i + 8:i + 12])[0] != masked_crc(length):
            raise ValueError(f"{path}: bad length crc at byte {i}")
        data = buf[i + 12:i + 12 + n]
        tail = buf[i + 12 + n:i + 16 + n]
        if len(data) != n or len(tail) != 4:
            raise ValueError(f"{path}: record cut short at byte {i}")
        if struct.unpack("<I", tail)[0] != masked_crc(data):
            raise ValueError(f"{path}: bad data crc at byte {i}")
        out.append(decode_event(data))
        i += 16 + n
    return out


# --- the writer ----------------------------------------------------------------------------------------------
_count = itertools.count()


def check_dir(path: str, flag: str = "--tensorboard") -> str:
    """Create DIR (and its parents) and prove a file can be written there; UserError naming the path if not.
    A run is refused at its start rather than trained without the curves it was asked for."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".fucina-write-test-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    return path


class EventWriter:
    """Appends scalar events to a new DIR/events.out.tfevents.* file (flushed per step)."""

    def __init__(self, directory: str, flag: str = "--tensorboard"):
        check_dir(directory, flag)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{next(_count)}"
        self.path = os.path.join(directory, name)
        try:
            self.fh = open(self.path, "ab")
        except OSError as e:
            raise UserError(f"{flag} {directory}: cannot write there ({e.strerror or e})") from None
        self._write(encode_event(time.time(), 0, file_version=FILE_VERSION))

    def _write(self, data: bytes):
        self.fh.write(frame(data))
        self.fh.flush()

    def scalars(self, step: int, values: dict, wall_time: float | None = None):
        values = {t: float(v) for t, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if values:
            self._write(encode_event(time.time() if wall_time is None else wall_time, step, values))

    def close(self):
        self.fh.close()


def step_scalars(record: dict) -> dict:
    """The TensorBoard tags of a metrics.jsonl step record: train/* (loss, lr, grad_norm, tokens_per_s, step_ms,
    gflop_per_s) or es/* (the reward statistics, evals_per_s, step_ms), and eval/<eval_name> (val_loss, an
    accuracy). A step whose loss is None (every micro-batch skipped) has no train/loss point."""
    prefix = "es" if record.get("kind") == "es_metrics" else "train"
    keys = (("reward_mean", "reward_std", "reward_min", "reward_max", "evals_per_s", "step_ms") if prefix == "es"
            else ("loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "gflop_per_s"))
    out = {f"{prefix}/{k}": record[k] for k in keys if record.get(k) is not None}
    if record.get("eval") is not None:
        out[f"eval/{record.get('eval_name') or 'eval'}"] = record["eval"]
    return out
