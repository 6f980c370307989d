"""Token ids equal llama.cpp's on the vocabularies llama.cpp tests its own tokenizers with.

The files (models/ggml-vocab-*.gguf with .gguf.inp / .gguf.out, as llama.cpp's tests/test-tokenizer-0 reads
them) come from the llama-cpp-python sdist: `python tools/fetch_llama_vocabs.py DIR`, then run with
FUCINA_LLAMA_VOCABS=DIR. Without it these tests skip. Every vocabulary whose tokenizer model and
pre-tokenizer we support is run; each input is tokenized as test-tokenizer-0 does (no BOS/EOS, special
tokens not parsed) and compared with the .out ids exactly. With llama-cpp-python installed, random text and
every token's piece are compared with llama.cpp itself too, also on the vocabularies without .inp files.
"""
import os
from pathlib import Path

import pytest

from llama_oracle import llama
from pipeline.errors import UserError
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import BYTE_DECODER, CONTROL, UNKNOWN, USER_DEFINED, Tokenizer

pytestmark = pytest.mark.parity

SEPARATOR = "\n__ggml_vocab_test__\n"
# vocabularies with .inp/.out whose model or pre-tokenizer we do not support (yet): the test checks they are
# refused with the one-line error, so a silently wrong tokenizer cannot hide among the skips
UNSUPPORTED = {"bert-bge", "gemma-4", "nomic-bert-moe"}


def _vocab_dir() -> Path:
    where = os.environ.get("FUCINA_LLAMA_VOCABS")
    if not where:
        pytest.skip("FUCINA_LLAMA_VOCABS is not set (python tools/fetch_llama_vocabs.py DIR)")
    path = Path(where)
    if not any(path.glob("ggml-vocab-*.gguf.inp")):
        pytest.fail(f"FUCINA_LLAMA_VOCABS={where} has no ggml-vocab-*.gguf.inp files")
    return path


def read_cases(vocab: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs the way test-tokenizer-0 reads them: inputs cut at the separator (a trailing one
    ends the list), one line of space-separated ids per input."""
    raw = Path(f"{vocab}.inp").read_text(encoding="utf-8")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        texts.pop()
    lines = Path(f"{vocab}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{vocab}: {len(texts)} inputs but {len(lines)} outputs"
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


def _vocab_names() -> list[str]:
    where = os.environ.get("FUCINA_LLAMA_VOCABS")
    if not where:
        return ["(no FUCINA_LLAMA_VOCABS)"]
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in Path(where).glob("ggml-vocab-*.gguf"))


@pytest.fixture(scope="module", params=_vocab_names())
def name(request):
    return request.param


@pytest.fixture(scope="module")
def vocab(name):
    return _vocab_dir() / f"ggml-vocab-{name}.gguf"


@pytest.fixture(scope="module")
def tok(name, vocab):
    """The vocabulary loaded once for all tests of it (the big ones take seconds)."""
    if name in UNSUPPORTED:
        pytest.skip(f"{name}: not supported; test_llama_cpp_vocab checks that it is refused")
    return Tokenizer.from_gguf(GGUFFile(vocab))


def test_llama_cpp_vocab(name, vocab, request):
    if name in UNSUPPORTED:
        with pytest.raises(UserError, match="is not supported"):
            Tokenizer.from_gguf(GGUFFile(vocab))
        return
    if not Path(f"{vocab}.inp").exists():
        pytest.skip(f"{name}: llama.cpp ships no .inp/.out cases for it (the random-text test covers it)")
    cases = read_cases(vocab)
    tok = request.getfixturevalue("tok")
    mismatches = [(text, want, got) for text, want in cases
                  if (got := tok.encode(text, special=False, add_bos=False, add_eos=False)) != want]
    assert not mismatches, (f"{name}: {len(mismatches)}/{len(cases)} inputs differ from llama.cpp, first: "
                            f"{mismatches[0][0]!r}: want {mismatches[0][1]}, got {mismatches[0][2]}")


# --- beyond the .inp files: random text against llama.cpp itself (llama-cpp-python) -------------------------
ALPHABET = (list("aZé'sStTdDmMlLrReEvV 0123456789\t\n\r.,!?-_()[]{}$+<=>^~|`\"#@")
            + list("中文한٣²Ⅻ🦙\u0301ñΩ\u200bµｱ！。’\u00a0\x85\u3000\u2009\u2581") + ["  ", "\n\n", " \u2581"])


@pytest.fixture(scope="module")
def llm(tok, vocab):
    pytest.importorskip("llama_cpp")
    return llama(vocab, vocab_only=True)  # a vocabulary needs no kernels


def test_random_text_matches_llama_cpp(name, tok, llm):
    """600 random strings mixing scripts, whitespace, digits and the vocabulary's special tokens, with and
    without parse_special and add_special (BOS/EOS as the GGUF says)."""
    import random
    cut = sorted((t for t, ty in zip(tok.tokens, tok.types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)), key=len)
    specials = cut[-40:]   # the longest, as they are cut first
    rng = random.Random(name)
    for trial in range(600):
        alphabet = ALPHABET + (specials if trial % 2 else [])
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        special, add = trial % 4 >= 2, trial % 3 == 0
        want = llm.tokenize(text.encode(), add_bos=add, special=special)   # add_bos is llama.cpp's add_special
        got = tok.encode(text, special=special, add_bos=None if add else False, add_eos=None if add else False)
        assert got == want, (text, special, add)


def test_token_pieces_match_llama_cpp(tok, llm):
    """Every token's bytes equal llama.cpp's token_to_piece, with and without special tokens rendered; and a
    whole sequence decodes as llama_detokenize does (leading space of add_space_prefix dropped)."""
    import ctypes

    import llama_cpp
    lvocab = llama_cpp.llama_model_get_vocab(llm.model)
    size = 1 + max(len(t.encode()) for t in tok.tokens)
    buf = ctypes.create_string_buffer(size)
    byte_chars = set(BYTE_DECODER)
    for special in (False, True):
        for i, text in enumerate(tok.tokens):
            if tok.model == "gpt2" and tok.types[i] == 1 and not set(text) <= byte_chars:
                continue   # llama.cpp prints "[UNK_BYTE_0x..]" debug text for such malformed tokens; we print '?'
            n = llama_cpp.llama_token_to_piece(lvocab, i, buf, size, 0, special)
            assert tok.token_bytes(i, special=special) == buf.raw[:n], (i, text, special)
    ids = tok.encode(" Hello world, this is 🦙 a test\n\n  x")
    out = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_detokenize(lvocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), out, 4096, False, False)
    assert tok.decode(ids) == out.raw[:n].decode()
