"""Reading GGUF files: metadata, the tensor table, memory-mapped weights.

Trade-off: a small parser of our own instead of gguf-py's GGUFReader. The
format is simple (header, key/value pairs, tensor infos, aligned data), and
GGUFReader materialises every vocabulary string as numpy arrays: on a
151936-token Qwen3 vocabulary that costs ~45 s and ~450 MB before the first
weight is touched, where this parser takes well under a second. gguf-py still
supplies the type enums and block geometry, so those can never drift from the
file format. Every way a file can be wrong (truncated, not GGUF, unknown
tensor type) becomes one `UserError` naming the file. Nothing is dequantized
at load: weights stay in the file's format, memory-mapped, until a kernel
reads them.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import UserError
from .quants import SUPPORTED_NAMES, FrozenWeight, format_of

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class _Truncated(Exception):
    pass


class _Cursor:
    """Sequential little-endian reads over the mapped file."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, n):
        if self.pos + n > len(self.buf):
            raise _Truncated(f"needs {n} bytes at offset {self.pos}, the file has {len(self.buf)}")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, vtype):
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self):
        return bytes(self.take(self.scalar(10))).decode("utf-8", errors="replace")

    def value(self, vtype):
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.scalar(4), self.scalar(10)
            if etype == STRING:
                return [self.string() for _ in range(count)]
            if etype not in _NP:
                raise ValueError(f"array of unknown value type {etype}")
            return np.frombuffer(self.take(count * np.dtype(_NP[etype]).itemsize), _NP[etype]).tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown value type {vtype}")
        return self.scalar(vtype)


class GGUFFile:
    """An opened GGUF: `metadata` (key -> value), `tensor_types`, `weight(name)`."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"{self.path}: no such GGUF file")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            self.metadata, self._tensors = self._parse()
        except (_Truncated, ValueError, struct.error, OSError, UnicodeDecodeError) as e:
            raise UserError(f"{self.path}: not a readable GGUF file ({e}); is it truncated or another format?") from None

    def _parse(self):
        cur = _Cursor(memoryview(self._map))
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = cur.scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar(10) for _ in range(cur.scalar(4))]
            infos.append((name, dims, cur.scalar(4), cur.scalar(10)))
        align = int(metadata.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
        tensors = {}
        for name, dims, ttype, offset in infos:
            n = int(np.prod(dims)) if dims else 1
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                block, size = None, None
            start = data_start + offset
            nbytes = n // block * size if block else 0
            if start + nbytes > len(self._map):
                raise _Truncated(f"tensor '{name}' needs bytes {start}..{start + nbytes}, the file has {len(self._map)}")
            tensors[name] = (dims, ttype, start, nbytes)
        return metadata, tensors

    # --- metadata -------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def require(self, key):
        if key not in self.metadata:
            raise UserError(f"{self.path}: metadata key '{key}' is missing")
        return self.metadata[key]

    # --- tensors --------------------------------------------------------------
    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        ttype = self._tensors[name][1]
        try:
            return GGMLQuantizationType(ttype).name
        except ValueError:
            return f"<unknown type {ttype}>"

    def weight(self, name: str) -> FrozenWeight:
        """The tensor as a FrozenWeight with numpy-order shape (rows = ggml ne[1])."""
        info = self._tensors.get(name)
        if info is None:
            raise UserError(f"{self.path}: tensor '{name}' is missing")
        dims, ttype, start, nbytes = info
        fmt = format_of(ttype)
        if fmt is None:
            raise UserError(f"{self.path}: tensor '{name}' has type {self.tensor_type(name)}, "
                            f"which Fucina cannot read (supported: {SUPPORTED_NAMES})")
        shape = tuple(int(d) for d in reversed(dims))
        if len(shape) == 1:
            shape = (1, shape[0])
        if len(shape) != 2:
            raise UserError(f"{self.path}: tensor '{name}' has {len(shape)} dimensions {shape}; expected 1 or 2")
        data = self._map[start:start + nbytes]
        if fmt.quantized:
            raw = data.reshape(shape[0], fmt.row_bytes(shape[1]))
        else:
            raw = data.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[fmt.name]).reshape(shape)
        return FrozenWeight(fmt, raw, shape, name)

    def vector(self, name: str) -> np.ndarray:
        """A 1-D tensor (norm weights) as f32."""
        return self.weight(name).dequantize().reshape(-1)


def open_gguf(path) -> GGUFFile:
    return GGUFFile(path)
