"""Named state dicts over safetensors: round trips, matching by name, validation."""
import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from pipeline.autograd import Module, Tensor
from pipeline.errors import CheckpointError, DTypeMismatchError
from pipeline.train.state_dict import (
    assign_state, load_into, load_state_dict, model_state_dict, read_safetensors, save_state_dict)

BF16 = np.dtype(ml_dtypes.bfloat16)


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "h": rng.standard_normal(5).astype(np.float16),
        "b": rng.standard_normal((2, 2)).astype(np.float32).astype(BF16),
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
    }


class Net(Module):
    def __init__(self, seed, requires_grad=True):
        rng = np.random.default_rng(seed)
        self.w1 = Tensor(rng.standard_normal((4, 2)).astype(np.float32), requires_grad=requires_grad)
        self.layers = [{"q": Tensor(rng.standard_normal((3, 3)).astype(np.float32), requires_grad=requires_grad)}]
        self.b = Tensor(rng.standard_normal(3).astype(np.float32).astype(BF16), requires_grad=requires_grad)


def test_round_trip_keeps_dtypes_and_bits(tmp_path):
    path = tmp_path / "sd.safetensors"
    src = arrays()
    save_state_dict(path, src, metadata={"note": "x"})
    back, meta = read_safetensors(path)
    assert meta == {"note": "x"}
    assert set(back) == set(src)
    for name, arr in src.items():
        assert back[name].dtype == arr.dtype and back[name].shape == arr.shape
        assert back[name].tobytes() == arr.tobytes()


def test_file_is_plain_safetensors(tmp_path):
    """Any safetensors reader opens our files; we read files written by the library."""
    path = tmp_path / "sd.safetensors"
    src = {"w": arrays()["w"], "h": arrays()["h"]}
    save_state_dict(path, src)
    theirs = safetensors.numpy.load_file(str(path))
    assert all(np.array_equal(theirs[k], v) for k, v in src.items())
    other = tmp_path / "lib.safetensors"
    safetensors.numpy.save_file(src, str(other))
    assert all(np.array_equal(load_state_dict(other)[k], v) for k, v in src.items())


def test_mixed_dtypes_and_odd_sizes_open_in_the_library(tmp_path):
    path = tmp_path / "mixed.safetensors"
    src = {"h3": np.arange(3, dtype=np.float16), "d": np.arange(5, dtype=np.float64),
           "scalar": np.array(2.5, np.float32),
           "empty": np.zeros((0, 4), np.float32), "flag": np.array([True, False]), "i8": np.arange(7, dtype=np.int8),
           "b": np.arange(3, dtype=np.float32).astype(BF16)}
    save_state_dict(path, src)
    assert (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 8 == 0  # data starts 8-byte aligned
    from safetensors import safe_open
    with safe_open(str(path), framework="np") as f:
        for name in ("h3", "d", "scalar", "empty", "flag", "i8"):
            assert np.array_equal(f.get_tensor(name), src[name]) and f.get_tensor(name).dtype == src[name].dtype
    back = load_state_dict(path)
    assert all(back[n].dtype == a.dtype and back[n].tobytes() == a.tobytes() for n, a in src.items())
    back["d"][0] = 7.0  # loaded arrays are writable


def test_bf16_is_stored_as_BF16_raw_bits(tmp_path):
    path = tmp_path / "b.safetensors"
    b = np.array([1.5, -2.25, 3.0e38], dtype=np.float32).astype(BF16)
    save_state_dict(path, {"b": b})
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    assert json.loads(blob[8:8 + n])["b"]["dtype"] == "BF16"
    assert blob[8 + n:] == b.view(np.uint16).astype("<u2").tobytes()


def test_model_round_trip_by_name(tmp_path):
    path = tmp_path / "m.safetensors"
    src, dst = Net(1), Net(2)
    save_state_dict(path, model_state_dict(src))
    assert set(load_state_dict(path)) == {"w1", "layers.0.q", "b"}
    load_into(dst, path)
    for (n1, a), (n2, b) in zip(model_state_dict(src).items(), model_state_dict(dst).items()):
        assert n1 == n2 and a.tobytes() == b.tobytes() and a.dtype == b.dtype


def test_order_of_entries_is_free(tmp_path):
    path = tmp_path / "m.safetensors"
    src = model_state_dict(Net(1))
    save_state_dict(path, list(reversed(list(src.items()))))
    dst = Net(2)
    load_into(dst, path)
    assert dst.w1.data.tobytes() == src["w1"].tobytes()


def test_gradient_free_model_loads_with_trainable_only_false(tmp_path):
    path = tmp_path / "m.safetensors"
    save_state_dict(path, model_state_dict(Net(1)))
    frozen = Net(3, requires_grad=False)
    with pytest.raises(CheckpointError, match="not in the model"):
        load_into(frozen, path)  # it has no trainable tensors
    load_into(frozen, path, trainable_only=False)
    assert frozen.w1.data.tobytes() == Net(1).w1.data.tobytes()


def test_strict_lists_missing_and_extra_names(tmp_path):
    path = tmp_path / "m.safetensors"
    sd = model_state_dict(Net(1))
    sd["extra.one"] = np.zeros(2, np.float32)
    del sd["w1"]
    save_state_dict(path, sd)
    dst = Net(2)
    before = dst.b.data.copy()
    with pytest.raises(CheckpointError) as err:
        load_into(dst, path)
    msg = str(err.value)
    assert str(path) in msg and "missing from the file: w1" in msg and "not in the model: extra.one" in msg
    assert dst.b.data.tobytes() == before.tobytes()  # nothing written on failure
    report = load_into(dst, path, strict=False)
    assert report.missing == ["w1"] and report.unexpected == ["extra.one"]
    assert dst.b.data.tobytes() == sd["b"].tobytes()


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    path = tmp_path / "m.safetensors"
    sd = model_state_dict(Net(1))
    sd["layers.0.q"] = np.zeros((3, 4), np.float32)
    save_state_dict(path, sd)
    with pytest.raises(CheckpointError, match=r"layers\.0\.q.*\[3, 4\].*\[3, 3\]") as err:
        load_into(Net(2), path)
    assert str(path) in str(err.value)


def test_dtype_mismatch_is_never_converted(tmp_path):
    path = tmp_path / "m.safetensors"
    sd = model_state_dict(Net(1))
    sd["b"] = sd["b"].astype(np.float32)  # f32 in the file, bf16 in the model
    save_state_dict(path, sd)
    dst = Net(2)
    with pytest.raises(DTypeMismatchError, match=r"'b' is F32 in the file, BF16 in the model"):
        load_into(dst, path)
    assert dst.b.data.dtype == BF16


@pytest.mark.parametrize("cut", [0, 5, 8, 20, -1, -7])
def test_truncated_file_is_a_clear_error(tmp_path, cut):
    path = tmp_path / "m.safetensors"
    save_state_dict(path, arrays())
    blob = path.read_bytes()
    path.write_bytes(blob[:cut] if cut >= 0 else blob[:len(blob) + cut])
    with pytest.raises(CheckpointError, match="truncated|corrupt") as err:
        load_state_dict(path)
    assert str(path) in str(err.value)


def test_corrupt_header_is_a_clear_error(tmp_path):
    path = tmp_path / "m.safetensors"
    save_state_dict(path, arrays())
    blob = bytearray(path.read_bytes())
    blob[8] = ord("#")  # the header's opening brace: no longer JSON
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_state_dict(path)


def test_offsets_that_lie_about_the_shape_are_caught(tmp_path):
    path = tmp_path / "m.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(CheckpointError, match=r"tensor 'w'.*do not fit F32\[2, 2\]"):
        load_state_dict(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        load_state_dict(tmp_path / "nope.safetensors")


def test_failed_write_leaves_previous_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_state_dict(path, {"w": np.ones(3, np.float32)})
    with pytest.raises(CheckpointError):
        save_state_dict(path, {"w": np.ones(3, np.float32), "bad": np.ones(2, np.complex128)})
    assert np.array_equal(load_state_dict(path)["w"], np.ones(3, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_assign_state_dry_run_writes_nothing():
    t = Tensor(np.zeros(3, np.float32), requires_grad=True)
    assign_state({"t": t}, {"t": np.ones(3, np.float32)}, dry_run=True)
    assert not t.data.any()
    assign_state({"t": t}, {"t": np.ones(3, np.float32)})
    assert t.data.all()


def test_flipped_data_byte_is_caught_by_the_crc(tmp_path):
    path = tmp_path / "m.safetensors"
    save_state_dict(path, arrays())
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x10  # inside the last tensor's data
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="CRC32 mismatch") as err:
        load_state_dict(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("offsets,message", [
    ([[0, 8], [4, 12]], "overlap the previous tensor"),
    ([[0, 8], [12, 20]], "leave a gap"),
])
def test_overlapping_or_gapped_offsets_are_caught(tmp_path, offsets, message):
    path = tmp_path / "m.safetensors"
    header = {f"t{i}": {"dtype": "F32", "shape": [2], "data_offsets": o} for i, o in enumerate(offsets)}
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(max(o[1] for o in offsets)))
    with pytest.raises(CheckpointError, match=message):
        load_state_dict(path)


def test_big_endian_arrays_are_stored_little_endian(tmp_path):
    path = tmp_path / "be.safetensors"
    src = np.arange(4, dtype=">f4")
    save_state_dict(path, {"x": src})
    back = load_state_dict(path)["x"]
    assert back.dtype == np.float32 and np.array_equal(back, src)
