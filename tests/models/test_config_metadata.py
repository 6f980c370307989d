"""The registry's config reading against hostile GGUF metadata: whatever type or value a key carries,
DecoderConfig.from_gguf returns a config or raises one UserError naming the file (and, for a value of
the wrong type or out of range, the key) — never ZeroDivisionError, TypeError or ValueError."""
import copy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.errors import GGUFError, UserError
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer
from pipeline.models.decoder import DecoderConfig

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gemma3-gemma-mini-f32.gguf"
KEYS = ["block_count", "embedding_length", "feed_forward_length", "context_length", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
        "rope.freq_base", "attention.layer_norm_rms_epsilon", "attention.sliding_window", "expert_count",
        "rope.scaling.type", "rope.scaling.factor"]
VALUES = st.one_of(st.integers(-2**63, 2**64), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                   st.text(max_size=8), st.lists(st.integers(0, 9), max_size=3), st.just(0), st.just(-1))


@pytest.fixture(scope="module")
def base():
    return GGUFFile(FIXTURE)


def _with(gg, key, value):
    hostile = copy.copy(gg)
    hostile.metadata = {**gg.metadata, key: value}
    return hostile


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=VALUES)
@example(key="attention.key_length", value=3)  # odd: the config's own RoPE check
@example(key="attention.head_count", value=2**40)
def test_any_value_of_a_config_key_is_a_config_or_one_user_error(base, key, value):
    full = f"gemma3.{key}"
    try:
        DecoderConfig.from_gguf(_with(base, full, value))
    except UserError as e:
        assert str(FIXTURE) in str(e)
        if isinstance(e, GGUFError):
            assert full in str(e)


@pytest.mark.parametrize("key,value,message", [
    ("attention.head_count", 0, r"'gemma3.attention.head_count' is 0; it must be in \[1, "),
    ("attention.head_count_kv", 0, r"'gemma3.attention.head_count_kv' is 0"),
    ("attention.head_count_kv", 3, r"head_count' \(4\) must be a multiple of 'gemma3.attention.head_count_kv' \(3\)"),
    ("block_count", [1, 2], r"'gemma3.block_count' must be an integer, got \[1, 2\]"),
    ("embedding_length", "64", r"'gemma3.embedding_length' must be an integer, got '64'"),
    ("rope.freq_base", float("nan"), r"'gemma3.rope.freq_base' is nan; it must be a finite number > 0"),
    ("attention.layer_norm_rms_epsilon", "x", r"must be a number, got 'x'"),
])
def test_the_crashes_the_parsers_helper_found_are_named_errors(base, key, value, message):
    with pytest.raises(GGUFError, match=message):
        DecoderConfig.from_gguf(_with(base, f"gemma3.{key}", value))


def test_a_list_pre_tokenizer_is_a_named_error(base):
    with pytest.raises(GGUFError, match=r"'tokenizer.ggml.pre' must be a string, got \['qwen2'\]"):
        Tokenizer.from_gguf(_with(base, "tokenizer.ggml.pre", ["qwen2"]))


@pytest.mark.parametrize("layers", [2**31, 2**20, 1000])
def test_a_block_count_the_tensor_table_cannot_hold_is_refused_before_the_shape_check(base, layers, monkeypatch):
    """Issue 32: 2^31 declared layers made the shape check build ~11 expected tensors per layer (3.7 GB,
    then MemoryError) before comparing anything; the count is now bounded by the tensors present first."""
    from pipeline.models import decoder
    monkeypatch.setattr(decoder, "_check_shapes", lambda *a: pytest.fail("the shape check ran"))
    n = len(base.tensor_names)
    with pytest.raises(GGUFError, match=rf"'gemma3.block_count' is {layers}: that many layers need at least "
                                        rf"{layers * decoder.TENSORS_PER_LAYER} tensors, the file has {n}"):
        decoder.DecoderLM.from_gguf(_with(base, "gemma3.block_count", layers))


def test_a_hostile_block_count_in_the_file_is_one_cli_error(tmp_path, capsys):
    """The same through the bytes of a real file and the CLI: rc 2, one line naming the key."""
    import struct
    from pipeline.cli import main
    data = bytearray(FIXTURE.read_bytes())
    at = data.find(b"gemma3.block_count") + len(b"gemma3.block_count")
    assert struct.unpack_from("<I", data, at)[0] == 4  # a u32 value follows
    struct.pack_into("<I", data, at + 4, 2**31)
    hostile = tmp_path / "hostile.gguf"
    hostile.write_bytes(data)
    assert main(["generate", "--model", str(hostile), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'gemma3.block_count' is 2147483648" in err[0], err


TOKENIZER_KEYS = ["tokens", "token_type", "merges", "scores", "bos_token_id", "eos_token_id", "eot_token_id",
                  "padding_token_id", "model", "pre"]


@pytest.mark.parametrize("key", TOKENIZER_KEYS)
@pytest.mark.parametrize("value", [0, 2**40, 1.5, "x", [1, 2], ["a", 3], True, [[1]]], ids=repr)
def test_any_value_of_a_tokenizer_key_is_a_tokenizer_or_one_user_error(base, key, value):
    """Found by the round-two audit: a u32 `tokens`, a scalar `token_type` or `scores`, a list `model` were
    TypeErrors; an out-of-range special id reached the embedding lookup."""
    from pipeline.llm.chat import ChatTemplate
    hostile = _with(base, f"tokenizer.ggml.{key}", value)
    for build in (lambda: Tokenizer.from_gguf(hostile).encode("hi <start_of_turn> there"),
                  lambda: ChatTemplate.from_gguf(hostile).render([{"role": "user", "content": "hi"}])):
        try:
            build()
        except UserError as e:
            assert str(FIXTURE) in str(e)
