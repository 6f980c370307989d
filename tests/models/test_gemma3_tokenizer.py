"""Gemma 3's vocabulary as llama.cpp reads it: SentencePiece-style (`tokenizer.ggml.model` "llama"), byte
fallback, <pad>/<eos>/<bos>/<unk> at ids 0-3, the turn markers as control tokens, and the rules
convert_hf_to_gguf's Gemma3Model writes (add_space_prefix false, add_bos true). The fixture vocabulary is
tools/make_tokenizer_fixtures.py's SentencePiece pieces laid out that way, written at test time; ids are
compared with llama.cpp's (parity) on random text mixing scripts, spaces and the special tokens.
(llama.cpp's own ggml-vocab-gemma-4.gguf is the `gemma4` tokenizer model, another algorithm: not this one.)"""
import random
import sys
from pathlib import Path

import gguf
import pytest

from llama_oracle import llama
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_tokenizer_fixtures as tf  # noqa: E402

SPECIALS = [("<pad>", gguf.TokenType.CONTROL), ("<eos>", gguf.TokenType.CONTROL), ("<bos>", gguf.TokenType.CONTROL),
            ("<unk>", gguf.TokenType.UNKNOWN), ("<mask>", gguf.TokenType.USER_DEFINED),
            ("<start_of_turn>", gguf.TokenType.CONTROL), ("<end_of_turn>", gguf.TokenType.CONTROL)]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    tokens, types, scores = tf.spm_vocab()
    keep = [i for i, t in enumerate(tokens) if t not in ("<unk>", "<s>", "</s>", "<|user|>")]
    tokens = [t for t, _ in SPECIALS] + [tokens[i] for i in keep]
    types = [ty for _, ty in SPECIALS] + [types[i] for i in keep]
    scores = [0.0] * len(SPECIALS) + [scores[i] for i in keep]
    path = tmp_path_factory.mktemp("gemma-vocab") / "gemma-style.gguf"
    return tf.write_vocab(path, tokens, types, model="llama", scores=scores, bos=2, eos=1,
                          metadata={"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": True,
                                    "tokenizer.ggml.add_eos_token": False})


@pytest.fixture(scope="module")
def tok(vocab):
    return Tokenizer.from_gguf(GGUFFile(vocab))


def test_gemma_rules_from_the_file(tok):
    ids = tok.encode("<start_of_turn>user\nhi the<end_of_turn>")
    assert ids[0] == 2 and ids[1] == tok.tokens.index("<start_of_turn>")   # BOS, then the marker as one token
    assert ids[-1] == tok.tokens.index("<end_of_turn>")
    assert tok.tokens[ids[2]] != "\u2581user" and tok.tokens[ids[2]].startswith("u")  # no space prefix added
    assert tok.decode(tok.encode("hé 🔥", add_bos=False)) == "hé 🔥"           # byte fallback round trip


@pytest.mark.parity
def test_ids_match_llama_cpp(vocab, tok):
    pytest.importorskip("llama_cpp")
    llm = llama(vocab, vocab_only=True)  # a vocabulary needs no kernels
    alphabet = list("aZthe sTdmlr 09\t\n.,!?-()") + list("中한🦙ñΩ\u00a0\u2581") + ["  ", "\n\n", " \u2581"]
    specials = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<mask>", "<pad>"]
    rng = random.Random("gemma3")
    for trial in range(400):
        pool = alphabet + (specials if trial % 2 else [])
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 16)))
        special, add = trial % 4 >= 2, trial % 3 == 0
        want = llm.tokenize(text.encode(), add_bos=add, special=special)
        got = tok.encode(text, special=special, add_bos=None if add else False, add_eos=None if add else False)
        assert got == want, (text, special, add)
