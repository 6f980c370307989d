"""Malformed and mutated safetensors files: read_safetensors returns consistent arrays or raises
SafetensorsError naming the file, nothing else (issue 15, items 3 and 4)."""
import json
import struct

import numpy as np
import pytest
from fuzz_cases import EDGE_VALUES, MUTATIONS, mutate, small_safetensors
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_profiles import LONG, QUICK

from pipeline.errors import CheckpointError, SafetensorsError
from pipeline.train.state_dict import CRC_KEY, DTYPES, read_safetensors


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(path to overwrite, a valid file's bytes, its header as a dict, its data bytes)."""
    base = tmp_path_factory.mktemp("st_fuzz") / "base.safetensors"
    blob = small_safetensors(base)
    (n,) = struct.unpack("<Q", blob[:8])
    return base.with_name("mutated.safetensors"), blob, json.loads(blob[8:8 + n]), blob[8 + n:]


def file_bytes(header, data, header_text=None):
    text = header_text if header_text is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def read_or_refuse(path, data):
    """A SafetensorsError naming the file is a pass; a success must tile the data with its arrays, no aliasing."""
    path.write_bytes(data)
    try:
        tensors, metadata = read_safetensors(path)
    except SafetensorsError as e:
        assert str(e).startswith(f"{path}: ")
        return
    (n,) = struct.unpack("<Q", data[:8])
    assert sum(a.nbytes for a in tensors.values()) == len(data) - 8 - n
    assert all(isinstance(v, str) for v in metadata.values())


def _refused(files, match, header=None, text=None, data=None):
    path, _, base_header, base_data = files
    path.write_bytes(file_bytes(header if header is not None else base_header,
                                base_data if data is None else data, text))
    with pytest.raises(SafetensorsError, match=match) as err:
        read_safetensors(path)
    assert str(err.value).startswith(f"{path}: ")


def _with(files, name, **fields):
    header = json.loads(json.dumps(files[2]))
    header[name].update(fields)
    return header


# --- the crash inputs of issue 15 and their neighbours -------------------------------------------

def test_the_unmutated_file_reads(files):
    path, blob, _, _ = files
    path.write_bytes(blob)
    tensors, metadata = read_safetensors(path)
    assert np.array_equal(tensors["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert metadata == {"format": "fucina.weights/1"} and tensors["empty"].shape == (0, 3)


@pytest.mark.parametrize("shape,match", [
    ([2**64], r"field 'shape' \[18446744073709551616\] is too large"),   # was OverflowError
    ([2**62, 2**62, 0], "field 'shape' .* is too large"),                    # no bytes, yet numpy cannot shape it
    ([-1], r"field 'shape' is \[-1\], not a list of at most 32 non-negative integers"),
    ([True, 2], "field 'shape' is \\[True, 2\\]"),
    ([2.0, 3], "field 'shape' is \\[2.0, 3\\]"),
    ([1] * 33, "field 'shape' is .*, not a list of at most 32"),
    ("23", "field 'shape' is '23'"),
])
def test_bad_shapes_are_named(files, shape, match):
    _refused(files, f"tensor 'w': {match}", _with(files, "w", shape=shape))


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, None, "F128", "f32"])
def test_dtype_must_be_a_known_string(files, dtype):  # a list was TypeError
    _refused(files, "tensor 'w': field 'dtype' is .*, not one of F64, F32", _with(files, "w", dtype=dtype))


@pytest.mark.parametrize("offsets,match", [
    ([0], "field 'data_offsets' is \\[0\\], not \\[begin, end\\]"),
    ("ab", "field 'data_offsets' is 'ab'"),
    ([0, -24], "field 'data_offsets' is"),
    ([24, 0], r"data offsets \[24, 0\] do not fit F32\[2, 3\] \(24 bytes\)"),
    ([2**64, 2**64 + 24], "truncated file"),
])
def test_bad_offsets_are_named(files, offsets, match):
    _refused(files, f"tensor 'w': {match}", _with(files, "w", data_offsets=offsets))


def test_tensors_must_tile_the_data(files):
    w = files[2]["w"]["data_offsets"]
    _refused(files, "data offsets .* overlap the previous tensor", _with(files, "empty", data_offsets=[w[0] + 4] * 2))
    _refused(files, "stray bytes after the tensor data", data=files[3] + bytes(8))


@pytest.mark.parametrize("text,match", [
    (b"[" * 100_000 + b"]" * 100_000, "JSON nested 100000 levels deep, the limit is 8"),   # was RecursionError
    (json.dumps({"a": {"dtype": "[" * 100_000, "shape": [1], "data_offsets": [0, 4]}}).encode(),
     "tensor 'a': field 'dtype' is '\\[\\[\\["),  # brackets inside a string are no nesting
    (b'{"w": 1, "w": 2}', "duplicate key 'w'"),
    (b"{" + b"1" * 5000 + b"}", "not valid JSON"),
    (b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}', "not valid JSON"),
    (b"\xff{}", "corrupt safetensors header"),
    (b"[]", "not a JSON object"),
])
def test_bad_header_json_is_named(files, text, match):
    _refused(files, match, text=text)


def test_metadata_must_map_str_to_str(files):
    for meta in ([], {"a": 1}, "x"):
        _refused(files, "corrupt safetensors metadata", {**files[2], "__metadata__": meta})
    deep = {**files[2], "__metadata__": {CRC_KEY: "[" * 10_000}}
    _refused(files, f"metadata '{CRC_KEY}': JSON nested 10000 levels deep", deep)


def test_header_length_is_bounded_by_the_file(files):
    path, blob, _, _ = files
    for claimed in (len(blob), 2**63, 2**64 - 1):
        path.write_bytes(struct.pack("<Q", claimed) + blob[8:])
        with pytest.raises(SafetensorsError, match=f"header claims {claimed} bytes"):
            read_safetensors(path)
    assert issubclass(SafetensorsError, CheckpointError)


# --- systematic and property tests ---------------------------------------------------------------

def edit_fields(header, edits):
    header = json.loads(json.dumps(header))
    for name, field, value in edits:
        if field is None or not isinstance(header.get(name), dict):
            header[name] = value
        else:
            header[name][field] = value
    return header


HOSTILE = [None, True, 0, -1, 1.5, 2**63, 2**64, -2**64, "", "F32", [], {}, [2**64], [-1], [True], [1.5], ["F32"],
           [0, 2**64], [2**64, 0], [0] * 40, [[0, 24]], {"dtype": "F32"}, "[" * 50]


def test_every_field_at_every_hostile_value(files):
    """Systematic, not sampled: each field of each entry (and each whole entry, and the metadata) replaced by
    each hostile JSON value in turn."""
    for name in [*files[2], "new"]:
        for field in ("dtype", "shape", "data_offsets", None):
            for value in HOSTILE:
                read_or_refuse(files[0], file_bytes(edit_fields(files[2], [(name, field, value)]), files[3]))


values = st.one_of(st.sampled_from(EDGE_VALUES), st.integers(0, 2**64 - 1))
byte_edits = st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 400), values), min_size=1, max_size=4)
json_values = st.recursive(
    st.none() | st.booleans() | st.sampled_from(EDGE_VALUES) | st.integers(-2**70, 2**70) | st.floats()
    | st.sampled_from([*DTYPES, "f32", ""]) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["dtype", "shape", "data_offsets", "x"]), inner, max_size=3),
    max_leaves=8)
field_edits = st.lists(st.tuples(st.sampled_from(["w", "b", "step", "empty", "__metadata__", "new"]),
                                 st.sampled_from(["dtype", "shape", "data_offsets", None]), json_values),
                       min_size=1, max_size=3)


@QUICK
@given(edits=byte_edits, cut=st.none() | st.integers(0, 600))
def test_byte_mutations_read_or_raise_safetensors_error(files, edits, cut):
    read_or_refuse(files[0], mutate(files[1], edits, cut))


@QUICK
@given(edits=field_edits)
def test_field_mutations_read_or_raise_safetensors_error(files, edits):
    read_or_refuse(files[0], file_bytes(edit_fields(files[2], edits), files[3]))


@pytest.mark.slow
@LONG
@given(edits=byte_edits, cut=st.none() | st.integers(0, 600))
def test_byte_mutations_long(files, edits, cut):
    read_or_refuse(files[0], mutate(files[1], edits, cut))


@pytest.mark.slow
@LONG
@given(edits=field_edits)
def test_field_mutations_long(files, edits):
    read_or_refuse(files[0], file_bytes(edit_fields(files[2], edits), files[3]))
