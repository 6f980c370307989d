"""Token ids equal llama.cpp's on the vocabularies llama.cpp tests its own tokenizers with.

The files (models/ggml-vocab-*.gguf with .gguf.inp / .gguf.out, as llama.cpp's tests/test-tokenizer-0 reads
them) come from the llama-cpp-python sdist: `python tools/fetch_llama_vocabs.py DIR`, then run with
FUCINA_LLAMA_VOCABS=DIR. Without it these tests skip. Every vocabulary whose tokenizer model and
pre-tokenizer we support is run; each input is tokenized as test-tokenizer-0 does (no BOS/EOS, special
tokens not parsed) and compared with the .out ids exactly.
"""
import os
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer

pytestmark = pytest.mark.parity

SEPARATOR = "\n__ggml_vocab_test__\n"
# vocabularies with .inp/.out whose model or pre-tokenizer we do not support (yet): the test checks they are
# refused with the one-line error, so a silently wrong tokenizer cannot hide among the skips
UNSUPPORTED = {"bert-bge", "gemma-4", "qwen35"}


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
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in Path(where).glob("ggml-vocab-*.gguf.inp"))


@pytest.mark.parametrize("name", _vocab_names())
def test_llama_cpp_vocab(name):
    vocab = _vocab_dir() / f"ggml-vocab-{name}.gguf"
    cases = read_cases(vocab)
    if name in UNSUPPORTED:
        with pytest.raises(UserError, match="is not supported"):
            Tokenizer.from_gguf(GGUFFile(vocab))
        return
    tok = Tokenizer.from_gguf(GGUFFile(vocab))
    mismatches = [(text, want, got) for text, want in cases
                  if (got := tok.encode(text, special=False, add_bos=False, add_eos=False)) != want]
    assert not mismatches, (f"{name}: {len(mismatches)}/{len(cases)} inputs differ from llama.cpp, first: "
                            f"{mismatches[0][0]!r}: want {mismatches[0][1]}, got {mismatches[0][2]}")
