"""A trained BPE tokenizes the same in Hugging Face tokenizers, our llama.cpp-exact Tokenizer and llama.cpp."""
import gguf
import pytest

from llama_oracle import llama
from pretrain_helpers import SAMPLE_TEXT, small_documents
from pipeline.errors import UserError
from pipeline.jobs.lm_export import write_model_gguf
from pipeline.llm import bpe_train
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer
from pipeline.models.qwen3 import Qwen3, Qwen3Config


@pytest.fixture(scope="module", params=bpe_train.PRE_TOKENIZERS)
def trained(request, tmp_path_factory):
    docs = small_documents()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    bpe_train.save_tokenizer(bpe_train.train_bpe(docs, 600, request.param), str(path))
    return (*bpe_train.load_tokenizer(str(path)), docs)


def _tiny_gguf(path, tok, pre):
    cfg = Qwen3Config(vocab_size=tok.get_vocab_size(), hidden=16, layers=1, heads=2, kv_heads=2, head_dim=8,
                      ffn=32, context_length=64, tied_output=False)
    model = Qwen3.init_random(cfg, seed=1)
    weights = {n: w.data for n, w in model.named_weights().items()}
    write_model_gguf(str(path), cfg, weights, vocab=bpe_train.gguf_vocab(tok), pre=pre)
    return str(path)


def test_vocabulary_layout(trained):
    tok, pre, digest, _ = trained
    tokens, types, merges = bpe_train.gguf_vocab(tok)
    assert len(tokens) == tok.get_vocab_size() == 600
    assert tokens[:5] == [t for t, _ in bpe_train.SPECIAL_TOKENS]
    assert types[0] == gguf.TokenType.CONTROL and types[5] == gguf.TokenType.NORMAL
    assert len(merges) == 600 - 256 - 5 and len(digest) == 16
    lengths = bpe_train.token_byte_lengths(tok)
    assert lengths[:5] == [0] * 5 and min(lengths[5:]) == 1


def test_our_tokenizer_from_the_gguf_matches_hugging_face(trained, tmp_path):
    tok, pre, _, docs = trained
    gg = GGUFFile(_tiny_gguf(tmp_path / "m.gguf", tok, pre))
    assert gg.metadata["tokenizer.ggml.pre"] == pre
    ours = Tokenizer.from_gguf(gg)
    for text in [SAMPLE_TEXT, *docs[:40]]:
        assert ours.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(SAMPLE_TEXT), special=True) == SAMPLE_TEXT


def test_bad_tokenizer_files_are_one_error(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(UserError, match="x.json: not a tokenizer.json"):
        bpe_train.load_tokenizer(str(tmp_path / "x.json"))
    (tmp_path / "y.json").write_text('{"model": {"type": "BPE"}, "pre_tokenizer": null}')
    with pytest.raises(UserError, match="y.json: not a byte-level BPE"):
        bpe_train.load_tokenizer(str(tmp_path / "y.json"))
    with pytest.raises(UserError, match="below 261"):
        bpe_train.train_bpe(["abc"], 100)


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
def test_llama_cpp_tokenizes_the_gguf_the_same(trained, tmp_path):
    pytest.importorskip("llama_cpp")
    tok, pre, _, docs = trained
    llm = llama(_tiny_gguf(tmp_path / "m.gguf", tok, pre), vocab_only=True)  # a vocabulary needs no kernels
    for text in [SAMPLE_TEXT, *docs[:40]]:
        want = tok.encode(text, add_special_tokens=False).ids
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == want
