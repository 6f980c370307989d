"""Reading GGUF files: metadata, the tensor table, memory-mapped weights.

Trade-off: a small parser of our own instead of gguf-py's GGUFReader. The
format is simple (header, key/value pairs, tensor infos, aligned data), and
GGUFReader materialises every vocabulary string as numpy arrays: on a
151936-token Qwen3 vocabulary that costs ~45 s and ~450 MB before the first
weight is touched, where this parser takes well under a second. gguf-py still
supplies the type enums and block geometry, so those can never drift from the
file format. Nothing is dequantized at load: weights stay in the file's
format, memory-mapped, until a kernel reads them.

Every way a file can be wrong becomes one `GGUFError` naming the file and the
field, checked as llama.cpp's gguf.cpp checks it (or stricter): every count
and length against the bytes left BEFORE anything is allocated, unknown value
and tensor types, duplicate keys and tensor names, `general.alignment` a u32
power of two, at most 4 dims whose element count fits int64, a row length
(ne[0]) that is a multiple of the type's block size, offsets aligned, tensor
data inside the file and not overlapping.
"""
from __future__ import annotations

import math
import struct
import sys
from array import array
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import GGUFError
from ..untrusted import brief, not_a_regular_file
from .quants import SUPPORTED_NAMES, FrozenWeight, format_of

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
U32, F32, STRING, ARRAY, U64 = 4, 6, 8, 9, 10
# f32 metadata arrays of at least this many values (a vocabulary's tokenizer.ggml.scores) are kept as one
# array.array("f"): indexing gives the same Python floats tolist() would, without 262k float objects (8 MB)
COMPACT_F32 = 1024
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 2**63 - 1  # a tensor's elements must fit ggml's int64 ne, its bytes numpy's intp
# The fewest bytes one entry can take, to bound a count by the bytes left before looping over it.
_MIN_KV_BYTES = 8 + 4 + 1             # key length, value type, a 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims (0), type, offset
_MIN_STRING_BYTES = 8                  # its length field


class _Malformed(Exception):
    """A defect, described by the field it is in; GGUFFile adds the file name."""


class _Cursor:
    """Sequential little-endian reads over the mapped file; every read is bounded by the bytes left."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n, field, index=None):
        if n > self.left:
            name = field if index is None else f"{field}[{index}]"
            raise _Malformed(f"{name} needs {n} bytes at offset {self.pos}, only {self.left} are left (truncated?)")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, vtype, field, index=None):
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field, index))[0]

    def string(self, field, index=None):
        return bytes(self.take(self.scalar(U64, field, index), field, index)).decode("utf-8", errors="replace")

    def count(self, field, min_item_bytes):
        """A u64 count of items of at least min_item_bytes each, refused if they cannot fit in the bytes left."""
        n = self.scalar(U64, field)
        if n * min_item_bytes > self.left:
            raise _Malformed(f"{field} is {n}: that many need at least {n * min_item_bytes} bytes, "
                             f"only {self.left} are left")
        return n

    def value(self, vtype, field):
        if vtype == STRING:
            return self.string(field)
        if vtype == ARRAY:
            etype = self.scalar(U32, f"{field} element type")
            if etype == STRING:
                return [self.string(field, i) for i in range(self.count(f"{field} count", _MIN_STRING_BYTES))]
            if etype not in _NP:
                raise _Malformed(f"{field}: array of unknown value type {etype}")
            itemsize = np.dtype(_NP[etype]).itemsize
            count = self.count(f"{field} count", itemsize)
            if etype == F32 and count >= COMPACT_F32:  # SentencePiece scores: 4 bytes each, not a 32-byte float
                values = array("f", bytes(self.take(count * itemsize, field)))
                if sys.byteorder != "little":
                    values.byteswap()
                return values
            return np.frombuffer(self.take(count * itemsize, field), _NP[etype]).tolist()
        if vtype not in _SCALARS:
            raise _Malformed(f"{field}: unknown value type {vtype}")
        return self.scalar(vtype, field)


def _alignment(metadata, types) -> int:
    """general.alignment: absent -> 32; else it must be a u32 power of two (as llama.cpp requires)."""
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    value = metadata["general.alignment"]
    if types["general.alignment"] != U32 or value <= 0 or value & (value - 1):
        raise _Malformed(f"metadata key 'general.alignment' must be a u32 power of two, got {brief(value)}")
    return value


def _block_geometry(where, ttype):
    """(type name, elements per block, bytes per block) of a ggml type id; unknown ids are refused."""
    try:
        qtype = GGMLQuantizationType(ttype)
        block, size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise _Malformed(f"{where} has unknown ggml type {ttype}") from None
    return qtype.name, block, size


class GGUFFile:
    """An opened GGUF: `metadata` (key -> value), `tensor_types`, `weight(name)`."""

    def __init__(self, path):
        self.path = Path(path)
        problem = not_a_regular_file(self.path, "GGUF file")  # a FIFO or /dev/zero is named as one, not mapped
        if problem:
            raise GGUFError(problem.replace(": no such file", ": no such GGUF file"))
        try:  # numpy cannot map an empty file; an empty buffer fails the magic check like any short file
            empty = self.path.stat().st_size == 0
            self._map = np.zeros(0, np.uint8) if empty else np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot read: {e.strerror or e}") from None
        try:
            self.metadata, self._tensors = self._parse()
        except _Malformed as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file: {e}") from None

    def _parse(self):
        cur = _Cursor(memoryview(self._map))
        magic = bytes(cur.take(4, "magic"))
        if magic != GGUF_MAGIC:
            raise _Malformed(f"magic is {magic!r}, expected {GGUF_MAGIC!r} (is it another format?)")
        version = cur.scalar(U32, "version")
        if version not in (2, 3):
            raise _Malformed(f"version {version} is not supported (2 or 3)")
        n_tensors = cur.count("tensor count", _MIN_TENSOR_INFO_BYTES)
        n_kv = cur.count("metadata count", _MIN_KV_BYTES)
        metadata, types = {}, {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in metadata:
                raise _Malformed(f"metadata key {key!r} appears twice")
            types[key] = cur.scalar(U32, f"metadata key {key!r} type")
            metadata[key] = cur.value(types[key], f"metadata key {key!r}")
        align = _alignment(metadata, types)
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor #{i} name")
            where = f"tensor '{name}'"
            n_dims = cur.scalar(U32, f"{where} n_dims")
            if n_dims > MAX_DIMS:
                raise _Malformed(f"{where} has n_dims {n_dims}, at most {MAX_DIMS}")
            dims = [cur.scalar(U64, f"{where} dims") for _ in range(n_dims)]
            infos.append((name, dims, cur.scalar(U32, f"{where} type"), cur.scalar(U64, f"{where} offset")))
        data_start = -(-cur.pos // align) * align
        tensors, spans = {}, []
        for name, dims, ttype, offset in infos:
            where = f"tensor '{name}'"
            if name in tensors:
                raise _Malformed(f"{where} appears twice")
            type_name, block, size = _block_geometry(where, ttype)
            # Even beside a zero dim (no elements), numpy refuses dims whose product or bytes pass int64.
            extent = math.prod(d or 1 for d in dims)
            if extent > MAX_ELEMENTS or -(-extent // block) * size > MAX_ELEMENTS:
                raise _Malformed(f"{where} has dims {dims}: more than 2^63 - 1 elements or bytes")
            n = math.prod(dims)
            row = dims[0] if dims else 1
            if row % block:
                raise _Malformed(f"{where} has rows of {row} elements (ne[0]), "
                                 f"not a multiple of {type_name}'s block size {block}")
            if offset % align:
                raise _Malformed(f"{where} has offset {offset}, not a multiple of the alignment {align}")
            start, nbytes = data_start + offset, n // block * size
            if start + nbytes > len(self._map):
                raise _Malformed(f"{where} needs bytes {start}..{start + nbytes}, the file has {len(self._map)} "
                                 "(truncated?)")
            tensors[name] = (dims, ttype, start, nbytes)
            if nbytes:
                spans.append((start, start + nbytes, where))
        spans.sort()
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise _Malformed(f"{second}'s data overlaps {first}'s")
        return metadata, tensors

    # --- metadata -------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def require(self, key):
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key '{key}' is missing")
        return self.metadata[key]

    # --- tensors --------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_dims(self, name: str) -> list[int]:
        """The tensor's ggml dims (ne[0] first), without mapping it."""
        return list(self._tensors[name][0])

    def tensor_type(self, name: str) -> str:
        return GGMLQuantizationType(self._tensors[name][1]).name  # the parse refused unknown type ids

    def weight(self, name: str) -> FrozenWeight:
        """The tensor as a FrozenWeight with numpy-order shape (rows = ggml ne[1])."""
        info = self._tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: tensor '{name}' is missing")
        dims, ttype, start, nbytes = info
        fmt = format_of(ttype)
        if fmt is None:
            raise GGUFError(f"{self.path}: tensor '{name}' has type {self.tensor_type(name)}, "
                            f"which Fucina cannot read (supported: {SUPPORTED_NAMES})")
        shape = tuple(int(d) for d in reversed(dims))
        if len(shape) == 1:
            shape = (1, shape[0])
        if len(shape) != 2:
            raise GGUFError(f"{self.path}: tensor '{name}' has {len(shape)} dimensions {shape}; expected 1 or 2")
        data = self._map[start:start + nbytes]
        if fmt.quantized:
            raw = data.reshape(shape[0], fmt.row_bytes(shape[1]))
        else:
            raw = data.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[fmt.name]).reshape(shape)
        return FrozenWeight(fmt, raw, shape, name)

    def vector(self, name: str) -> np.ndarray:
        """A 1-D tensor (norm weights) as f32."""
        return self.weight(name).dequantize().reshape(-1)


_KINDS = {  # what metadata_of checks: a GGUF's values are typed by the file, so any type can arrive anywhere
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "integers": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    "numbers": lambda v: (isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                      for x in v)) or (isinstance(v, array) and v.typecode == "f"),
}


def metadata_of(gg, key: str, kind: str, default=None):
    """Metadata `key` of an open GGUF (default when absent), which must be a `kind` ('string', 'integer',
    'strings', 'integers', 'numbers' - a list of those): anything else is one GGUFError naming the key."""
    if key not in gg.metadata:
        return default
    value = gg.metadata[key]
    if not _KINDS[kind](value):
        want = {"string": "a string", "integer": "an integer"}.get(kind, f"a list of {kind}")
        raise GGUFError(f"{gg.path}: metadata key '{key}' must be {want}, got {brief(value)}")
    return value


def open_gguf(path) -> GGUFFile:
    return GGUFFile(path)
