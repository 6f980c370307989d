"""Mutated GGUF files: the reader parses them or raises GGUFError, nothing else (issue 15, items 3 and 4)."""
import pytest
from fuzz_cases import EDGE_VALUES, MUTATIONS, mutate, small_gguf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_profiles import LONG, QUICK

from pipeline.errors import GGUFError
from pipeline.llm.gguf import GGUFFile

BASE = small_gguf()
HEADER_END = len(BASE) - 128  # the hand-built file ends with 128 bytes of tensor data
values = st.one_of(st.sampled_from(EDGE_VALUES), st.integers(0, 2**64 - 1))
edits = st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, HEADER_END), values), min_size=1, max_size=4)
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


@QUICK
@given(edits=edits, cut=cuts)
def test_mutated_headers_parse_or_raise_gguf_error(scratch, edits, cut):
    read_or_refuse(scratch, mutate(BASE, edits, cut))


@pytest.mark.slow
@LONG
@given(edits=edits, cut=cuts)
def test_mutated_headers_parse_or_raise_gguf_error_long(scratch, edits, cut):
    read_or_refuse(scratch, mutate(BASE, edits, cut))
