"""Small valid GGUF and safetensors files, a raw GGUF builder, and the byte mutations the fuzz tests apply.

The GGUF builder writes the format by hand (header, key/values, tensor infos, aligned data) so a test can
state exactly the malformed field it means, which gguf-py's writer would refuse to produce.
"""
from __future__ import annotations

import struct

import numpy as np

# Values that sit on the edges of the fields' integer types.
EDGE_VALUES = (0, 1, 3, 2**7, 2**8 - 1, 2**15, 2**16 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
MUTATIONS = ("flip", "u32", "u64", "insert", "delete")

U8, U32, F32, STRING, ARRAY, U64 = 0, 4, 6, 8, 9, 10
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8


def _str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    """One metadata entry: key, value type, the value's encoded bytes."""
    return _str(key) + struct.pack("<I", vtype) + payload


def u32(key, value):
    return kv(key, U32, struct.pack("<I", value))


def string(key, value):
    return kv(key, STRING, _str(value))


def array(key, etype, items):
    payload = b"".join(_str(i) if etype == STRING else struct.pack({U32: "<I", U8: "<B"}[etype], i) for i in items)
    return kv(key, ARRAY, struct.pack("<IQ", etype, len(items)) + payload)


def gguf_bytes(kvs, tensors, data=b"", align=32, version=3):
    """A GGUF file: kvs are kv() entries; tensors (name, dims in ggml order, ggml type, offset) over `data`."""
    infos = b"".join(_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
                     + struct.pack("<IQ", ttype, offset) for name, dims, ttype, offset in tensors)
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + infos
    return head + bytes(-len(head) % align) + data


def small_gguf() -> bytes:
    """A valid 3-tensor GGUF (F32 [2, 4], Q8_0 [2, 32], F16 [8]) with string, int and array metadata."""
    f32 = np.arange(8, dtype=np.float32).tobytes()
    q8 = bytes(range(68))                   # two Q8_0 blocks of 34 bytes (an f16 scale + 32 int8)
    f16 = np.ones(8, np.float16).tobytes()
    data = f32 + q8 + bytes(-len(f32 + q8) % 32) + f16
    kvs = [string("general.architecture", "qwen3"), u32("general.alignment", 32), u32("qwen3.block_count", 2),
           array("tokenizer.ggml.tokens", STRING, ["a", "bc", "<|x|>"]),
           array("tokenizer.ggml.token_type", U32, [1, 1, 3])]
    tensors = [("f32.weight", [4, 2], GGML_F32, 0), ("q8.weight", [32, 2], GGML_Q8_0, 32),
               ("norm.weight", [8], GGML_F16, len(f32 + q8) + (-len(f32 + q8) % 32))]
    return gguf_bytes(kvs, tensors, data)


_WIDTHS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every integer field of a VALID GGUF's header: counts, lengths, value and tensor
    types, scalar values, dims, offsets. Overwriting one of them is how most malformed files are malformed."""
    fields, pos = [], 4

    def field(width):
        nonlocal pos
        fields.append((pos, width))
        pos += width
        return int.from_bytes(data[pos - width:pos], "little")

    def skip_string():
        nonlocal pos
        length = field(8)  # (read before `pos +=` loads pos)
        pos += length

    def skip_value(vtype):
        if vtype == STRING:
            skip_string()
        elif vtype == ARRAY:
            etype, count = field(4), field(8)
            for _ in range(count):
                skip_value(etype)
        else:
            field(_WIDTHS[vtype])

    field(4)
    n_tensors, n_kv = field(8), field(8)
    for _ in range(n_kv):
        skip_string()
        skip_value(field(4))
    for _ in range(n_tensors):
        skip_string()
        for _ in range(field(4)):
            field(8)
        field(4)
        field(8)
    return fields


def set_fields(data: bytes, fields, edits) -> bytes:
    """Overwrite fields[i] (offset, width) with value % 2^(8 width), for each (i, value) in edits."""
    buf = bytearray(data)
    for i, value in edits:
        offset, width = fields[i % len(fields)]
        buf[offset:offset + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    return bytes(buf)


def small_safetensors(path) -> bytes:
    """A valid state-dict file (f32, bf16, i64 and an empty tensor) written by save_state_dict."""
    import ml_dtypes

    from pipeline.train.state_dict import save_state_dict
    save_state_dict(path, {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
                           "b": np.ones(4, ml_dtypes.bfloat16), "step": np.array([7], np.int64),
                           "empty": np.zeros((0, 3), np.float32)}, metadata={"format": "fucina.weights/1"})
    return path.read_bytes()


def mutate(data: bytes, edits, cut=None) -> bytes:
    """Apply edits [(mutation, position, value)] in turn, then truncate to `cut` bytes (None: no cut).

    flip xors a byte; u32/u64 overwrite 4/8 bytes with a little-endian value (a count, a length, a dim);
    insert puts 8 bytes in; delete takes 1-16 bytes out. Positions wrap around the current length.
    """
    buf = bytearray(data)
    for op, pos, value in edits:
        pos = pos % (len(buf) + 1)
        if op == "flip" and pos < len(buf):
            buf[pos] ^= value % 255 + 1
        elif op in ("u32", "u64"):
            width = 4 if op == "u32" else 8
            buf[pos:pos + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
        elif op == "insert":
            buf[pos:pos] = (value % 2**64).to_bytes(8, "little")
        elif op == "delete":
            del buf[pos:pos + value % 16 + 1]
    return bytes(buf if cut is None else buf[:cut % (len(buf) + 1)])
