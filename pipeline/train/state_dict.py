"""Named state dicts over safetensors: name -> array, matched by name, validated.

A state dict file is a plain safetensors file (8-byte header length, JSON
header, raw little-endian tensor bytes), so it opens in any safetensors tool;
interop with the `safetensors` library is tested both ways. We write and read
the format ourselves because it is simple and it lets us stream each array
straight into the file (no serialised copy of the whole state in memory) and
read the file with one readinto.

Trade-off: reading the whole file (instead of mmap) costs memory for the
whole file, but lets us validate every entry (header, offsets, dtypes,
shapes, CRCs) BEFORE any target is touched, name the file and tensor in every
error, and treat bf16 the same whatever the installed safetensors does.

Dtypes are kept as stored: f32/f16/bf16 in, the same bytes out, and a load
into a target of another dtype is an error, never a silent conversion.
"""
from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from ..autograd import Tensor, named_parameters
from ..errors import CheckpointError, DTypeMismatchError, SafetensorsError
from ..untrusted import brief, parse_json

# safetensors dtype tag <-> numpy dtype (bf16 through ml_dtypes).
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_TAGS = {dt: tag for tag, dt in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors spec's own header limit
# A header is {name: {"dtype", "shape": [...], "data_offsets": [...]}}: three levels deep; the rest is slack.
_MAX_HEADER_DEPTH = 8
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
_MAX_DIMS = 32  # numpy 1.26's limit on an array's dimensions
_MAX_ARRAY_BYTES = 2**63 - 1  # numpy's index type (intp) bounds an array's size in bytes
# safetensors has no checksum; ours goes in the metadata (JSON {name: crc32})
# so a flipped data byte is caught. Files from other tools simply lack it.
CRC_KEY = "fucina.crc32"


def dtype_tag(dtype) -> str:
    """'F32', 'BF16', ... for a numpy dtype (a readable name in error messages)."""
    return _TAGS.get(np.dtype(dtype), str(np.dtype(dtype)))


# --- atomic files -------------------------------------------------------------

def fsync_dir(path) -> None:
    """Make a rename/creation inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, write) -> None:
    """Create `path` so readers see the old file or the whole new one.

    `write(f)` fills a temp file in the same directory; then fsync + rename +
    directory fsync. A crash at any point leaves no file / the previous file,
    or the complete new one.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # disk full, permissions, a directory in the way, ...
            raise CheckpointError(f"{path}: cannot write: {e.strerror or e}") from None
        raise


def atomic_write_bytes(path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


# --- safetensors files ----------------------------------------------------------

def _as_array(value, name):
    arr = value.data if isinstance(value, Tensor) else value
    if not isinstance(arr, np.ndarray):
        raise CheckpointError(f"state dict entry {name!r}: expected a numpy array or Tensor, "
                              f"got {type(value).__name__}")
    if arr.dtype.byteorder == ">":  # the format is little-endian
        arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
    if arr.dtype not in _TAGS:
        raise CheckpointError(f"state dict entry {name!r}: dtype {arr.dtype} cannot be stored in safetensors")
    return arr if arr.flags.c_contiguous else arr.copy(order="C")  # (ascontiguousarray would make 0-d 1-d)


def _raw(arr):
    """The bytes of a contiguous array, as a flat uint8 view (works for bf16 too)."""
    return arr.reshape(-1).view(np.uint8)


def _pairs(tensors):
    """A mapping or an iterable of (name, array|Tensor) pairs -> list of pairs."""
    return list(tensors.items()) if hasattr(tensors, "items") else list(tensors)


def save_state_dict(path, tensors, metadata: dict[str, str] | None = None) -> None:
    """Atomically write name -> array (or Tensor) as a safetensors state dict.

    tensors: mapping or iterable of (name, array|Tensor); names must be unique.
    metadata: str -> str, stored in the header's "__metadata__" (plus our
    per-tensor CRC32s under CRC_KEY).
    """
    arrays = {}
    for name, value in _pairs(tensors):
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{path}: tensor names must be non-empty strings, got {name!r}")
        if name in arrays:
            raise CheckpointError(f"{path}: duplicate tensor name {name!r}")
        arrays[name] = _as_array(value, name)
    metadata = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{path}: safetensors metadata must map str -> str")
    metadata[CRC_KEY] = json.dumps({name: zlib.crc32(_raw(arr)) for name, arr in arrays.items()}, sort_keys=True)
    # Wider dtypes first (then by name), as the safetensors library lays files out,
    # so every tensor starts aligned to its item size for mmap readers.
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header, offset = {"__metadata__": metadata}, 0
    for name in order:
        arr = arrays[name]
        header[name] = {"dtype": _TAGS[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # the spec's padding: the data starts 8-byte aligned

    def write(f):
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in order:
            f.write(_raw(arrays[name]))
    atomic_write(path, write)


def _is_index(value) -> bool:
    """A non-negative JSON integer (JSON true/false parse as bool, a subclass of int: refused)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_layout(where, entry, data_len):
    """One header entry -> (dtype, shape, begin, end), every field checked before it is used."""
    if not isinstance(entry, dict) or not _ENTRY_FIELDS <= entry.keys():
        raise SafetensorsError(
            f"{where}: corrupt header entry {brief(entry)} (needs {', '.join(sorted(_ENTRY_FIELDS))})")
    tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not (isinstance(tag, str) and tag in DTYPES):
        raise SafetensorsError(f"{where}: field 'dtype' is {brief(tag)}, not one of {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(_is_index(d) for d in shape)):
        raise SafetensorsError(f"{where}: field 'shape' is {brief(shape)}, not a list of at most {_MAX_DIMS} "
                               "non-negative integers")
    dtype = DTYPES[tag]
    # Python integers: no overflow. A zero dim makes the product 0, yet numpy refuses dims whose non-zero
    # product overflows its index type, so that product is bounded too.
    if math.prod(d for d in shape if d) * dtype.itemsize > _MAX_ARRAY_BYTES:
        raise SafetensorsError(f"{where}: field 'shape' {brief(shape)} is too large for an array")
    nbytes = math.prod(shape) * dtype.itemsize
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_index(o) for o in offsets)):
        raise SafetensorsError(f"{where}: field 'data_offsets' is {brief(offsets)}, not [begin, end]")
    begin, end = offsets
    if end - begin != nbytes:
        raise SafetensorsError(f"{where}: data offsets [{begin}, {end}] do not fit {tag}{shape} ({nbytes} bytes)")
    if end > data_len:
        raise SafetensorsError(f"{where}: truncated file (tensor data ends at byte {end}, file data has {data_len})")
    return dtype, shape, begin, end


def read_safetensors(path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read and fully validate a safetensors file -> ({name: array}, metadata).

    Any defect (missing, truncated, a header length past the file, a header
    that is not JSON or nests too deep, an unknown dtype, a shape that is not
    a list of non-negative integers, offsets that do not match the shape or
    overlap, a CRC mismatch) raises SafetensorsError naming the file (and the
    tensor and field). The arrays are writable views into one buffer holding
    the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            blob = np.empty(os.fstat(f.fileno()).st_size, np.uint8)  # uninitialised: no memset of the whole file
            got = f.readinto(memoryview(blob))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    blob = blob[:got]  # a file that shrank while we read it
    if len(blob) < 8:
        raise SafetensorsError(f"{path}: truncated safetensors file ({len(blob)} bytes, no header)")
    (header_len,) = struct.unpack("<Q", blob[:8].tobytes())
    if header_len > _MAX_HEADER or 8 + header_len > len(blob):
        raise SafetensorsError(
            f"{path}: truncated or corrupt safetensors file "
            f"(header claims {header_len} bytes, file has {len(blob) - 8})")
    try:
        text = blob[8:8 + header_len].tobytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
    header = parse_json(text, f"{path}: corrupt safetensors header", SafetensorsError, max_depth=_MAX_HEADER_DEPTH)
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: corrupt safetensors metadata (must map str -> str)")
    crcs = parse_json(metadata.pop(CRC_KEY, "{}"), f"{path}: corrupt safetensors metadata {CRC_KEY!r}",
                      SafetensorsError, max_depth=1)
    if not isinstance(crcs, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors metadata ({CRC_KEY})")
    body = blob[8 + header_len:]
    tensors, spans = {}, []
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        dtype, shape, begin, end = _entry_layout(where, entry, len(body))
        if name in crcs and zlib.crc32(body[begin:end]) != crcs[name]:
            raise SafetensorsError(f"{where}: corrupt data (CRC32 mismatch)")
        tensors[name] = body[begin:end].view(dtype).reshape(shape)  # a writable view: no copy
        spans.append((begin, end, name))
    # The spec's layout: tensors tile the data exactly, no gaps, no overlaps (so no two views alias).
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise SafetensorsError(f"{path}: tensor {name!r}: data offsets [{begin}, {end}] "
                                   f"{'overlap the previous tensor' if begin < covered else 'leave a gap'}")
        covered = end
    if covered != len(body):
        raise SafetensorsError(
            f"{path}: corrupt safetensors file ({len(body) - covered} stray bytes after the tensor data)")
    return tensors, metadata


# --- named state dicts --------------------------------------------------------

def load_state_dict(path) -> dict[str, np.ndarray]:
    """Read a state dict file: {name: array}, dtypes exactly as stored."""
    return read_safetensors(path)[0]


def model_state_dict(model, trainable_only=True) -> dict[str, np.ndarray]:
    """{dotted name: array} of a model's tensors (the registry walk of autograd.module)."""
    return {name: t.data for name, t in named_parameters(model, trainable_only=trainable_only)}


@dataclass
class LoadReport:
    """What a non-strict load did not match (torch's missing/unexpected keys)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _listed(names, limit=8):
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def assign_state(targets, stored: dict[str, np.ndarray], source="state dict", strict=True,
                 dry_run=False) -> LoadReport:
    """Copy stored arrays into target Tensors matched by name.

    targets: mapping or pairs name -> Tensor. Everything is validated first
    (names, then shapes and dtypes); only then is any target written, so a
    failed load leaves every target untouched. strict: both sides must match
    one-to-one; otherwise unknown stored names are skipped and unmatched
    targets kept, and both are returned in the LoadReport. dry_run: validate only.
    """
    targets = dict(_pairs(targets))
    report = LoadReport(missing=sorted(set(targets) - set(stored)), unexpected=sorted(set(stored) - set(targets)))
    if strict and (report.missing or report.unexpected):
        parts = []
        if report.missing:
            parts.append(f"missing from the file: {_listed(report.missing)}")
        if report.unexpected:
            parts.append(f"not in the model: {_listed(report.unexpected)}")
        raise CheckpointError(f"{source}: names do not match ({'; '.join(parts)})")
    matched = [(name, t, stored[name]) for name, t in targets.items() if name in stored]
    for name, t, arr in matched:
        if arr.shape != t.data.shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(arr.shape)} in the file, {list(t.data.shape)} in the model")
        if arr.dtype != t.data.dtype:
            raise DTypeMismatchError(
                f"{source}: tensor {name!r} is {dtype_tag(arr.dtype)} in the file, "
                f"{dtype_tag(t.data.dtype)} in the model "

                "(no implicit conversion: convert the model or the file explicitly)")
    if dry_run:
        return report
    for name, t, arr in matched:
        if t.data.flags.writeable:
            np.copyto(t.data, arr)
        else:
            t.data = arr.copy()
    return report


def load_into(model, path, strict=True, trainable_only=True) -> LoadReport:
    """Load a state dict file into a model's named tensors (see assign_state).

    trainable_only=False also fills tensors that do not require grad, e.g. a
    gradient-free inference copy of the model.
    """
    return assign_state(named_parameters(model, trainable_only=trainable_only), load_state_dict(path),
                        source=str(path), strict=strict)
