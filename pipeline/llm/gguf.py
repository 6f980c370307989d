"""Reading GGUF files: metadata, the tensor table, memory-mapped weights.

Trade-off: gguf-py's GGUFReader does the parsing (it memory-maps the file and
already knows every format's block geometry); this module only turns its
output into plain Python values and `FrozenWeight`s, and turns every way a file
can be wrong (truncated, not GGUF, unknown tensor type) into one `UserError`
naming the file. Nothing is dequantized at load: weights stay in the file's
format, mapped from disk, until a kernel reads them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

from ..errors import UserError
from .quants import SUPPORTED_NAMES, FrozenWeight, format_of


class GGUFFile:
    """An opened GGUF: `metadata` (key -> value), `tensor_types`, `weight(name)`."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"{self.path}: no such GGUF file")
        try:
            reader = GGUFReader(self.path, "r")
        except Exception as e:  # gguf-py raises ValueError/struct/index errors on bad bytes
            raise UserError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e}); "
                            "is it truncated or another format?") from None
        self._reader = reader
        self.metadata = {name: _field_value(f) for name, f in reader.fields.items()
                         if not name.startswith("GGUF.")}
        self._tensors = {t.name: t for t in reader.tensors}

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
        return self._tensors[name].tensor_type.name

    def weight(self, name: str) -> FrozenWeight:
        """The tensor as a FrozenWeight with numpy-order shape (rows = ggml ne[1])."""
        t = self._tensors.get(name)
        if t is None:
            raise UserError(f"{self.path}: tensor '{name}' is missing")
        fmt = format_of(t.tensor_type)
        if fmt is None:
            raise UserError(f"{self.path}: tensor '{name}' has type {t.tensor_type.name}, "
                            f"which Fucina cannot read (supported: {SUPPORTED_NAMES})")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if len(shape) == 1:
            shape = (1, shape[0])
        if len(shape) != 2:
            raise UserError(f"{self.path}: tensor '{name}' has {len(shape)} dimensions {shape}; expected 1 or 2")
        raw = t.data.reshape(shape[0], -1)
        if fmt.name == "BF16":
            raw = raw.view(np.uint16)
        return FrozenWeight(fmt, raw, shape, name)

    def vector(self, name: str) -> np.ndarray:
        """A 1-D tensor (norm weights) as f32."""
        return self.weight(name).dequantize().reshape(-1)


def _field_value(field):
    """A reader field as a Python value (str, int, float, bool, or list of those)."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    return field.parts[-1].tolist()[0]


def open_gguf(path) -> GGUFFile:
    return GGUFFile(path)
