"""Hypothesis strategies for the msgpack decoders (runtime messages and the ES protocol).

Frames are either raw bytes or msgpack maps that look almost right: a known
kind (or any value at all, lists and maps included), the right version (or
not), and a few of the kind's field names holding arbitrary values - the
inputs that reach the deepest checks. Used by tests/runtime/test_messages.py
and tests/es/test_es_distributed.py.
"""
import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

QUICK = settings(max_examples=400, derandomize=True, deadline=None)  # default suite: deterministic, seconds
LONG = settings(max_examples=5000, deadline=None)                    # the slow fuzz: ~a minute each


def frames(kinds, field_names, version):
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                        st.text(max_size=8), st.binary(max_size=8))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                          max_leaves=12)
    maps = st.builds(lambda kind, v, fields: {"kind": kind, "v": v, **fields},
                     st.one_of(st.sampled_from(sorted(kinds)), values),
                     st.one_of(st.just(version), values),
                     st.dictionaries(st.sampled_from(sorted(field_names)), values, max_size=6))
    return st.one_of(st.binary(max_size=64), maps.map(lambda m: msgpack.packb(m, use_bin_type=True)))


def run(profile, strategy, check):
    """Run `check(frame)` over `strategy` under a settings profile (QUICK or LONG)."""
    profile(given(strategy)(check))()
