"""Writing GGUF files: verbatim re-emit, transcode (f32/f16/bf16/q4_0/q4_1/q5_0/q5_1/q8_0/q4_k/q5_k/q6_k and
the q4_k_m/q5_k_m mixes), raw writes.

Trade-off: gguf-py's GGUFWriter does the framing (header, key/values, tensor
table, aligned data), and we feed it raw bytes only: every key keeps its
stored GGUF value type (an int32 stays int32), every tensor we do not convert
keeps its stored bytes. That costs a little care (the writer's automatic
`general.architecture` key is replaced by the source's own ordered table) and
buys the contract that makes the exporter trustworthy: re-emitting any
GGUF v3 file verbatim produces a byte-identical file (`cmp` clean).

Transcode follows llama-quantize's policy: only matrix weights (n_dims >= 2,
name `*.weight`, no "norm" in the name) change type; 1-D tensors and norms keep
theirs; a K-quant target on a row length that is not a multiple of 256 keeps
the source type (reported); an already-quantized source tensor is re-emitted
verbatim, never re-quantized. The `_k_m` mixes take llama-quantize's per-tensor
choice instead (pipeline/llm/quant_mix.py), shape fallbacks included. Files are written atomically (temp + fsync +
rename): a failed export leaves nothing behind.
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT
from gguf.gguf_writer import GGUFValue

from pipeline.kernels.formats import block_sizes, format_of
from pipeline.kernels.quantize import quantize, to_bf16_bits, to_f16
from pipeline.errors import GGUFError, UserError
from pipeline.untrusted import brief, not_a_regular_file

from .quant_mix import MIXES, mix_types

DENSE = (QT.F32, QT.F16, QT.BF16)
TARGETS = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0,
           "q5_1": QT.Q5_1, "q8_0": QT.Q8_0, "q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K, **MIXES}
# general.file_type a llama-quantize run with the matching ftype writes
FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16,
              "q4_0": LlamaFileType.MOSTLY_Q4_0, "q4_1": LlamaFileType.MOSTLY_Q4_1, "q5_0": LlamaFileType.MOSTLY_Q5_0,
              "q5_1": LlamaFileType.MOSTLY_Q5_1, "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_k": LlamaFileType.MOSTLY_Q4_K_S,
              "q5_k": LlamaFileType.MOSTLY_Q5_K_S, "q6_k": LlamaFileType.MOSTLY_Q6_K,
              "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q5_k_m": LlamaFileType.MOSTLY_Q5_K_M}
QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION, written by llama-quantize into quantized files


@dataclass
class GGUFTensor:
    """One tensor as stored: `data` is uint8 (rows..., row_bytes); `shape` is numpy order (elements)."""
    name: str
    qtype: QT
    shape: tuple[int, ...]
    data: np.ndarray

    def dense(self) -> np.ndarray:
        """float32 copy of a F32/F16/BF16 tensor (numpy-order shape)."""
        if self.qtype == QT.F32:
            return self.data.view(np.float32).reshape(self.shape).copy()
        if self.qtype == QT.F16:
            return self.data.view(np.float16).reshape(self.shape).astype(np.float32)
        if self.qtype == QT.BF16:
            bits = self.data.view(np.uint16).reshape(self.shape).astype(np.uint32) << np.uint32(16)
            return bits.view(np.float32)
        raise UserError(f"tensor '{self.name}' is {self.qtype.name}, not a dense f32/f16/bf16 tensor")


@dataclass
class GGUFContents:
    """A GGUF read for re-emit: ordered metadata (key -> GGUFValue), tensors in file order."""
    path: Path
    metadata: dict
    tensors: list[GGUFTensor]
    alignment: int

    @property
    def architecture(self) -> str:
        v = self.metadata.get("general.architecture")
        return _as_str(v.value) if v is not None else "<missing>"

    def tensor(self, name) -> GGUFTensor | None:
        if len(getattr(self, "_by_name", ())) != len(self.tensors):
            self._by_name = {t.name: t for t in self.tensors}
        return self._by_name.get(name)


def _as_str(v):
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)


def encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 (..., n) -> the stored bytes of `qtype` as uint8 (..., row_bytes)."""
    values = np.ascontiguousarray(values, np.float32)
    if qtype == QT.F32:
        out = values
    elif qtype == QT.F16:
        out = to_f16(values)
    elif qtype == QT.BF16:
        out = to_bf16_bits(values)
    else:
        return quantize(values, qtype.name.lower())
    return out.view(np.uint8).reshape(*values.shape[:-1], -1)


# ---------------------------------------------------------------- reading

def read_gguf(path) -> GGUFContents:
    """Read a GGUF for re-emit; a file that cannot be re-emitted exactly raises UserError."""
    path = Path(path)
    problem = not_a_regular_file(path, "GGUF file")
    if problem:
        raise UserError(problem.replace(": no such file", ": no such GGUF file"))
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises assorted errors on bad bytes
        raise UserError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); is it truncated?") from None
    version = int(reader.fields["GGUF.version"].parts[-1][0])
    if version != 3:
        raise UserError(f"{path}: GGUF version {version}; only version 3 files can be re-emitted")
    metadata = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            metadata[key] = _field_to_value(path, key, field)
    alignment = int(metadata["general.alignment"].value) if "general.alignment" in metadata else GGUF_DEFAULT_ALIGNMENT
    tensors = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        # the formats table's geometry; a type Fucina has no row for (re-emitted verbatim) from gguf-py's
        row = format_of(t.tensor_type)
        block, type_bytes = (row.block, row.block_bytes) if row else GGML_QUANT_SIZES[t.tensor_type]
        row_bytes = shape[-1] // block * type_bytes
        raw = reader.data[t.data_offset:t.data_offset + t.n_bytes]
        tensors.append(GGUFTensor(t.name, QT(t.tensor_type), shape, raw.reshape(*shape[:-1], row_bytes)))
    _check_layout(path, reader, alignment)
    return GGUFContents(path, metadata, tensors, alignment)


def _field_to_value(path, key, field) -> GGUFValue:
    vtype = field.types[0]
    if vtype == GGUFValueType.STRING:
        return GGUFValue(bytes(field.parts[field.data[0]]), vtype)
    if vtype == GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else GGUFValueType.UINT8
        if sub == GGUFValueType.ARRAY:
            raise UserError(f"{path}: metadata key '{key}' is an array of arrays, which this writer cannot re-emit")
        if sub == GGUFValueType.STRING:
            items = [bytes(field.parts[i]) for i in field.data]
        else:
            items = [field.parts[i][0] for i in field.data]
        return GGUFValue(items, vtype, sub)
    return GGUFValue(field.parts[field.data[0]][0], vtype)


def _check_layout(path, reader, alignment):
    """The writer packs tensor data back to back (each padded to the alignment), as llama.cpp does.

    A file laid out otherwise would not re-emit byte-identically: say so up front."""
    expected = 0
    for t in reader.tensors:
        if t.data_offset - reader.data_offset != expected:
            raise UserError(f"{path}: tensor '{t.name}' is stored at an unusual offset "
                            f"({t.data_offset - reader.data_offset}, expected {expected}); "
                            "cannot guarantee an exact re-emit")
        expected += -(-int(t.n_bytes) // alignment) * alignment
    if reader.data_offset + expected != len(reader.data):
        raise UserError(f"{path}: {len(reader.data) - reader.data_offset - expected} unexpected bytes after "
                        "the tensor data (truncated or appended to?); cannot guarantee an exact re-emit")


# ---------------------------------------------------------------- writing

class _ExactWriter(GGUFWriter):
    """GGUFWriter that also packs empty metadata arrays (llama.cpp files may carry them)."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if vtype == GGUFValueType.ARRAY and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return (head + self._pack("I", sub_type if sub_type is not None else GGUFValueType.UINT8)
                    + self._pack("Q", 0))

        return super()._pack_val(val, vtype, add_vtype, sub_type)


def write_gguf(path, metadata: dict, tensors: list[GGUFTensor], alignment: int = GGUF_DEFAULT_ALIGNMENT) -> Path:
    """Write `metadata` (ordered key -> GGUFValue) and `tensors` to `path`, atomically: into a temp file beside
    it, renamed over `path` once complete. A write that fails (a full disk, a read-only directory, a file
    size limit) removes the temp file and is one UserError naming `path`; `path` itself is never touched."""
    path = Path(path)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise UserError(f"{path}: duplicate tensor names {dup}")
    arch = metadata.get("general.architecture")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = _ExactWriter(tmp, arch=_as_str(arch.value) if arch is not None else "")
    writer.kv_data[0] = dict(metadata)  # the source's own ordered table, not the writer's default key
    writer.data_alignment = alignment
    try:
        for t in tensors:
            writer.add_tensor(t.name, np.ascontiguousarray(t.data).view(np.uint8), raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        for f in writer.fout:
            f.flush()
            os.fsync(f.fileno())
        writer.close()
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # closing flushes: on a full disk that fails again
            writer.close()
        with contextlib.suppress(OSError):  # on a read-only directory even a missing file's unlink fails
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            why = e.strerror or f"{e}: a short write (a full disk or a file size limit?)"
            raise UserError(f"{path}: cannot write the GGUF ({why}); nothing was written") from None
        raise
    return path


def set_value(metadata: dict, key: str, value, vtype: GGUFValueType) -> None:
    """Replace a key's value in place (keeps its position) or append it."""
    metadata[key] = GGUFValue(value, vtype)


# ---------------------------------------------------------------- transcode

def is_matrix_weight(t: GGUFTensor) -> bool:
    """llama-quantize's test for a tensor it may convert."""
    return len(t.shape) >= 2 and t.name.endswith(".weight") and "norm" not in t.name


def plan_tensor(t: GGUFTensor, target: QT, why: str = "converted") -> tuple[QT, str]:
    """(stored type in the output, reason) for one tensor under a transcode to `target` (`why` if converted)."""
    if not is_matrix_weight(t):
        return t.qtype, "kept: not a matrix weight (1-D, norm, or not *.weight)"
    if t.qtype == target:
        return t.qtype, "kept: already the target type"
    if t.qtype not in DENSE:
        return t.qtype, f"kept: source is already quantized ({t.qtype.name}); re-emitted verbatim, never re-quantized"
    block = block_sizes(target)[0]
    if t.shape[-1] % block != 0:
        return t.qtype, (f"kept {t.qtype.name}: row length {t.shape[-1]} is not a multiple of "
                         f"{block} required by {target.name}")
    return target, why


def _block_count(contents: GGUFContents) -> int:
    """The model's layer count: `<arch>.block_count`, else the number of distinct blk.N prefixes."""
    key = f"{contents.architecture}.block_count"
    value = contents.metadata.get(key)
    if value is not None:
        if isinstance(value.value, (bool, np.bool_)) or not isinstance(value.value, (int, np.integer)):
            raise GGUFError(f"{contents.path}: metadata key '{key}' must be an integer, got {brief(value.value)}")
        return int(value.value)
    return len({t.name.split(".")[1] for t in contents.tensors if t.name.startswith("blk.")})


def _nothing_to_convert(src, dtype, plans, tensors) -> str:
    """Why a --dtype target converts no tensor of src, and which targets would."""
    reasons = Counter(reason for *_, reason in plans)
    would = [name for name, qtype in TARGETS.items()
             if any(plan_tensor(t, qtype)[1] == "converted" for t in tensors)]
    return (f"--dtype {dtype}: no tensor of {src} converts to {TARGETS[dtype.lower()].name} ("
            + "; ".join(f"{n} {reason}" for reason, n in reasons.items()) + "); nothing written. "
            + (f"Targets that convert this file: {', '.join(would)}" if would else "No target converts this file")
            + "; without --dtype the file is copied verbatim")


def transcode(src, dst, dtype: str, log=None) -> list[tuple[str, str, str, str]]:
    """Re-emit `src` to `dst` with matrix weights converted to `dtype`; None keeps everything verbatim.

    Returns one (name, from, to, reason) row per tensor; `log` (if given) is
    called with a line for every tensor that did not get the target type. A
    target that converts no tensor is refused (UserError) before anything is
    written, so general.file_type never names a type the file does not hold.
    """
    contents = read_gguf(src)
    target = None
    if dtype is not None:
        if dtype.lower() not in TARGETS:
            raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(TARGETS)}")
        target = TARGETS[dtype.lower()]
    mix = {}
    if dtype is not None and dtype.lower() in MIXES:
        matrices = [(t.name, t.shape[-1]) for t in contents.tensors if is_matrix_weight(t)]
        mix = mix_types(matrices, dtype.lower(), _block_count(contents))
    plans = [(t, *((t.qtype, "verbatim") if target is None
                   else plan_tensor(t, *mix.get(t.name, (target, "converted")))))
             for t in contents.tensors]
    if target is not None and not any(new != t.qtype for t, new, _ in plans):
        raise UserError(_nothing_to_convert(src, dtype, plans, contents.tensors))
    rows, out = [], []
    for t, new, reason in plans:
        if new != t.qtype:
            t = GGUFTensor(t.name, new, t.shape, encode(t.dense(), new))
        rows.append((t.name, contents.tensor(t.name).qtype.name, new.name, reason))
        if log is not None and target is not None and new != target and is_matrix_weight(t):
            log(f"{t.name}: {reason}")
        out.append(t)
    metadata = dict(contents.metadata)
    if target is not None:  # the file holds the target type: the refusal above guarantees a conversion
        set_value(metadata, "general.file_type", int(FILE_TYPES[dtype.lower()]), GGUFValueType.UINT32)
        if target not in DENSE:
            set_value(metadata, "general.quantization_version", QUANTIZATION_VERSION, GGUFValueType.UINT32)
    write_gguf(dst, metadata, out, contents.alignment)
    return rows


def dense_values(t: GGUFTensor) -> np.ndarray:
    """float32 copy of a stored tensor of any type Fucina reads (quantized blocks dequantized), numpy-order shape."""
    if t.qtype in DENSE:
        return t.dense()
    from pipeline.kernels import dequant
    rows = t.data.reshape(-1, t.data.shape[-1])
    return np.asarray(dequant.dequantize_rows(int(t.qtype), rows, t.shape[-1]), np.float32).reshape(t.shape)


def write_dequantized(src, dst) -> int:
    """`src` re-emitted to `dst` with every quantized tensor dequantized to F32 (dense tensors verbatim): the
    exact forward of the quantized model, whatever runs it (`fucina bench llm`'s accuracy reference). -> the
    number of tensors dequantized."""
    contents = read_gguf(src)
    out = [t if t.qtype in DENSE else GGUFTensor(t.name, QT.F32, t.shape, encode(dense_values(t), QT.F32))
           for t in contents.tensors]
    metadata = dict(contents.metadata)
    set_value(metadata, "general.file_type", int(LlamaFileType.ALL_F32), GGUFValueType.UINT32)
    write_gguf(dst, metadata, out, contents.alignment)
    return sum(t.qtype not in DENSE for t in contents.tensors)
