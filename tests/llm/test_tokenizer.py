"""The GGUF byte-level BPE tokenizer: round trips, special tokens, streaming, errors."""
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

CORPUS = [
    "Hello world!",
    "   leading spaces and    runs\t\ttabs\n\n\nnewlines  ",
    "digits 1234567890 3.14159 -42 1e-6 0x1F",
    "punctuation!?.,;:'\"()[]{}<>@#$%^&*-_=+\\|/~`",
    "def f(x):\n    return x ** 2  # code\n",
    "emoji 🔥🚀😀👍🏽 and ZWJ 👨‍👩‍👧",
    "中文字符和日本語のテキスト、한국어",
    "mixed: café naïve Ärger São Paulo Ελληνικά русский עברית العربية",
    "contractions: don't, it's, we'll, they've, I'm, you'd, she's",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(GGUFFile(FIXTURES / "qwen3-mini-f32.gguf"))


@pytest.mark.parametrize("text", CORPUS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert tok.decode(ids, special=True) == text


def test_special_tokens_parsed_only_when_asked(tok):
    im_start = tok.vocab["<|im_start|>"]
    assert tok.encode("<|im_start|>user") [0] == im_start
    plain = tok.encode("<|im_start|>user", special=False)
    assert im_start not in plain and tok.decode(plain) == "<|im_start|>user"
    think = tok.vocab["<think>"]  # USER_DEFINED tokens are split out either way (llama.cpp rule)
    assert think in tok.encode("a<think>b", special=False)
    assert tok.decode([im_start]) == "" and tok.decode([im_start], special=True) == "<|im_start|>"


def test_merges_apply(tok):
    ids = tok.encode("the quick brown fox")
    assert len(ids) < len("the quick brown fox")  # the training corpus makes these words merge


def test_stream_decoder_never_splits_utf8(tok):
    text = "你好 🔥 café"
    ids = tok.encode(text)
    stream, pieces = tok.stream(), []
    for i in ids:
        piece = stream.push(i)
        piece.encode("utf-8")  # valid text on its own
        pieces.append(piece)
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)


def test_bos_and_end_ids(tok):
    assert tok.add_bos is False and tok.encode("hi") == tok.encode("hi", add_bos=False)
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id == tok.vocab["<|endoftext|>"]
    assert tok.is_end(tok.vocab["<|im_end|>"])


def test_missing_tokenizer(tmp_path):
    import gguf
    import numpy as np
    wr = gguf.GGUFWriter(str(tmp_path / "notok.gguf"), arch="qwen3")
    wr.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    wr.write_header_to_file(); wr.write_kv_data_to_file(); wr.write_tensors_to_file(); wr.close()
    with pytest.raises(UserError, match="notok.gguf: the GGUF has no tokenizer"):
        Tokenizer.from_gguf(GGUFFile(tmp_path / "notok.gguf"))


def test_out_of_range_id(tok):
    with pytest.raises(UserError, match="outside the vocabulary"):
        tok.decode([tok.n_vocab])
