"""Mutated GGUF files: the reader parses them or raises GGUFError, nothing else (issue 15, items 3 and 4)."""
import pytest
from fuzz_cases import EDGE_VALUES, MUTATIONS, gguf_fields, mutate, set_fields, small_gguf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_profiles import LONG, QUICK

from pipeline.errors import GGUFError
from pipeline.llm.gguf import GGUFFile

BASE = small_gguf()
FIELDS = gguf_fields(BASE)
HEADER_END = len(BASE) - 128  # the hand-built file ends with 128 bytes of tensor data
values = st.one_of(st.sampled_from(EDGE_VALUES), st.integers(0, 2**64 - 1))
# field edits set a count, length, type, dim or offset to an edge value; byte edits break anything else
field_edits = st.lists(st.tuples(st.integers(0, len(FIELDS) - 1), values), max_size=3)
edits = st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, HEADER_END), values), max_size=3)
cuts = st.none() | st.integers(0, len(BASE))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_fuzz") / "mutated.gguf"


def read_or_refuse(path, data):
    """Parse `data` and take every tensor; a GGUFError is a pass, a weight's bytes must fit its shape."""
    path.write_bytes(data)
    try:
        gg = GGUFFile(path)
    except GGUFError as e:
        assert str(e).startswith(f"{path}: ")
        return
    for name in gg.tensor_names:
        try:
            w = gg.weight(name)
        except GGUFError:
            continue
        assert w.raw.nbytes == w.shape[0] * w.format.row_bytes(w.shape[1]) == w.nbytes


def test_the_unmutated_file_reads(scratch):
    read_or_refuse(scratch, BASE)
    assert GGUFFile(scratch).tensor_names == ["f32.weight", "q8.weight", "norm.weight"]
    # version, 2 counts, 5 keys' (length, type), their values (1 + 1 + 1 + 2 + 3 + 2 + 3), 3 tensors' (name length,
    # n_dims, type, offset) and their 2 + 2 + 1 dims: every integer of the header is found
    assert len(FIELDS) == 1 + 2 + 5 * 2 + 13 + 3 * 4 + 5


def test_every_header_integer_at_every_edge_value(scratch):
    """Systematic, not sampled: each count, length, type, value, dim and offset set to each edge value in turn
    (alignment 0, dims of 2^32, a 2^63-byte string, ...)."""
    for index in range(len(FIELDS)):
        for value in EDGE_VALUES:
            read_or_refuse(scratch, set_fields(BASE, FIELDS, [(index, value)]))


@QUICK
@given(fields=field_edits, edits=edits, cut=cuts)
def test_mutated_headers_parse_or_raise_gguf_error(scratch, fields, edits, cut):
    read_or_refuse(scratch, mutate(set_fields(BASE, FIELDS, fields), edits, cut))


@pytest.mark.slow
@LONG
@given(fields=field_edits, edits=edits, cut=cuts)
def test_mutated_headers_parse_or_raise_gguf_error_long(scratch, fields, edits, cut):
    read_or_refuse(scratch, mutate(set_fields(BASE, FIELDS, fields), edits, cut))
