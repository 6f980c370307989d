"""The GGUF tokenizers: round trips, special tokens, streaming, every pre-tokenizer, SentencePiece, errors."""
import random
import sys
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.llm import pretokenize
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.pretokenize import PRE_TOKENIZERS, REFERENCE_REGEXES
from pipeline.llm.tokenizer import CONTROL, NORMAL, Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_tokenizer_fixtures as vocab_tool  # noqa: E402

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


def test_stream_decoder_invalid_byte_does_not_swallow_what_follows():
    """A lone continuation byte (a model may emit any byte token) becomes U+FFFD at once; the character after
    it, split over two pushes, still comes out whole."""
    from pipeline.llm.tokenizer import StreamDecoder

    class Bytes:  # token i is the one byte chunk CHUNKS[i]
        CHUNKS = [b"a", b"\x80", "é".encode()[:1], "é".encode()[1:], b"b"]

        def token_bytes(self, token_id, special=False):
            return self.CHUNKS[token_id]

    stream = StreamDecoder(Bytes(), special=False)
    assert [stream.push(i) for i in range(5)] == ["a", "\ufffd", "", "é", "b"]
    assert stream.flush() == ""
    stream.push(2)  # half a character at the end of the output
    assert stream.flush() == "\ufffd"


def test_bos_and_end_ids(tok):
    assert tok.add_bos is False and tok.encode("hi") == tok.encode("hi", add_bos=False)
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id == tok.vocab["<|endoftext|>"]
    assert tok.is_end(tok.vocab["<|im_end|>"])


def test_missing_tokenizer(tmp_path):
    import gguf
    import numpy as np
    wr = gguf.GGUFWriter(str(tmp_path / "notok.gguf"), arch="qwen3")
    wr.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(UserError, match="notok.gguf: the GGUF has no tokenizer"):
        Tokenizer.from_gguf(GGUFFile(tmp_path / "notok.gguf"))


def test_out_of_range_id(tok):
    with pytest.raises(UserError, match="outside the vocabulary"):
        tok.decode([tok.n_vocab])


# --- every pre-tokenizer, SentencePiece, the GGUF's rules (tiny committed vocabularies) -----------------------
VOCABS = FIXTURES / "tokenizers"
# each llama.cpp name -> the reference regexes of its family
REFERENCE_OF = {"gpt-2": "gpt-2", "mpt": "gpt-2", "qwen2": "qwen2", "qwen35": "qwen35", "llama-bpe": "llama-bpe",
                "llama3": "llama-bpe", "llama-v3": "llama-bpe", "smollm": "starcoder", "starcoder": "starcoder",
                "refact": "starcoder", "command-r": "starcoder", "deepseek-llm": "deepseek-llm",
                "deepseek-coder": "deepseek-coder", "falcon": "falcon", "default": "default"}
TRICKY = [
    "", " ", "  ", "   Hello", "\t", "\n", "\n\n\n", "\t\n", " \n \n  x", "a  \t b\r\n\r\nc   ", "trailing   ",
    "3", "33", "333", "3333", "33333333", "1,234,567.89 -0.5e-10 v2 x86_64 ٣٤٥ ²³ Ⅻ",
    "don't it's we'll they've I'm you'd she's 're 'RE 'Ll DON'T IT'S 'sa ''s", "' era",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙.cpp",
    "нещо на Български Ελληνικά café naïve e\u0301 Ärger ｱｲｳ ！？。、 한국어 日本語",
    "def f(x):\n    return x ** 2  # code\n\tif a<=b and c!=d: pass {}[]()$+^~|`",
    "nbsp\u00a0here nel\x85line ideographic\u3000space thin\u2009space zero\u200bwidth",
    "<tag attr='v'>text</tag> <|im_start|> [INST] @user #tag %50 &amp;",
]
ALPHABET = (list("aZé'sStTdDmMlLrReEvV 0123456789\t\n\r.,!?-_()[]{}$+<=>^~|`\"#@")
            + list("中文한٣²Ⅻ🦙\u0301ñΩ\u200bµｱ！。’\u00a0\x85\u3000\u2009") + ["  ", "\n\n"])
# llama.cpp hands DeepSeek's regexes to std::regex after replacing non-ASCII whitespace with \x0b (std::regex's
# \s would miss it), which also takes it out of their [ࠀ-一] (U+0800-U+4E00) class: there, and only there, its
# pieces differ from the regexes' (see test_deepseek_whitespace_is_not_cjk)
DEEPSEEK_MOVED = {c for c in pretokenize.WHITESPACE if 0x800 <= ord(c) <= 0x4E00}


def _random_texts(seed, alphabet, n=300):
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16))) for _ in range(n)]


def _reference_split(regexes):
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes])


def _texts_for(pre):
    alphabet = ALPHABET
    if pre.startswith("deepseek"):
        alphabet = [a for a in ALPHABET if not DEEPSEEK_MOVED & set(a)]
        return [t for t in TRICKY if not DEEPSEEK_MOVED & set(t)] + _random_texts(pre, alphabet)
    return TRICKY + _random_texts(pre, alphabet)


def test_every_pre_tokenizer_has_a_reference():
    assert set(REFERENCE_OF) == set(PRE_TOKENIZERS)
    for name, family in REFERENCE_OF.items():
        assert PRE_TOKENIZERS[name] is PRE_TOKENIZERS[family]


@pytest.mark.parametrize("pre", sorted(REFERENCE_REGEXES))
def test_split_matches_reference_regex(pre):
    """Our scanners and collapsed regexes cut text as the models' own regexes do under a Unicode regex engine
    (Hugging Face tokenizers' Split), on digits, contractions, whitespace runs, mixed scripts and emoji."""
    reference = _reference_split(REFERENCE_REGEXES[pre])
    for text in _texts_for(pre):
        want = [piece for piece, _ in reference.pre_tokenize_str(text)]
        assert PRE_TOKENIZERS[pre].split(text) == want, repr(text)


def test_deepseek_whitespace_is_not_cjk():
    # llama.cpp: U+3000 reaches [一-龥ࠀ-一가-퟿] as \x0b, so it is not joined to the CJK run around it;
    # a Unicode regex engine would give one piece "中\u3000文"
    assert PRE_TOKENIZERS["deepseek-llm"].split("中\u3000文") == ["中", "\u3000", "文"]
    # \s?\p{L}+ takes it with the letter after it
    assert PRE_TOKENIZERS["deepseek-coder"].split("a\u2009b") == ["a", "\u2009b"]


@pytest.fixture(scope="module")
def bpe_lists():
    tok = Tokenizer.from_gguf(GGUFFile(VOCABS / "bpe-tiny.gguf"))
    return tok.tokens, tok.types, tok.merges


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_bpe_ids_match_reference_tokenizer(bpe_lists, pre):
    """The whole encode (split, byte mapping, merges by rank, Llama 3's ignore_merges) on the tiny vocabulary
    equals a Hugging Face tokenizer built from the same lists and the reference regexes."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    tokens, types, merges = bpe_lists
    tok = Tokenizer(tokens, types, merges, pre=pre)
    vocab = {t: i for i, t in enumerate(tokens)}
    ref = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                 ignore_merges=PRE_TOKENIZERS[pre].ignore_merges))
    ref.pre_tokenizer = pre_tokenizers.Sequence([_reference_split(REFERENCE_REGEXES[REFERENCE_OF[pre]]),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for text in _texts_for(REFERENCE_OF[pre]):
        assert tok.encode(text, special=False) == ref.encode(text, add_special_tokens=False).ids, repr(text)


def test_ignore_merges_takes_whole_words(bpe_lists):
    """Llama 3 (llama.cpp's ignore_merges): a word that is a token is that token even when no merge makes it."""
    tokens, types, merges = bpe_lists
    tokens, types = tokens + ["zqxj"], types + [NORMAL]   # in the vocabulary, unreachable by the merges
    assert Tokenizer(tokens, types, merges, pre="llama-bpe").encode("zqxj", add_bos=False) == [len(tokens) - 1]
    assert Tokenizer(tokens, types, merges, pre="qwen2").encode("zqxj") == [tokens.index(c) for c in "zqxj"]


@pytest.fixture(scope="module")
def spm():
    return Tokenizer.from_gguf(GGUFFile(VOCABS / "spm-tiny.gguf"))


def naive_spm(tok, text):
    """SentencePiece BPE by its definition: merge the adjacent pair whose concatenation is the best-scoring
    token (leftmost on ties) until no pair is a token; pieces without a token become <0xNN> byte tokens."""
    pieces = list(text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(pieces) - 1):
            tid = tok.vocab.get(pieces[i] + pieces[i + 1])
            if tid is not None and (best is None or tok.scores[tid] > best[0]):
                best = (tok.scores[tid], i)
        if best is None:
            break
        i = best[1]
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    ids = []
    for p in pieces:
        ids += [tok.vocab[p]] if p in tok.vocab else [tok.vocab[f"<0x{b:02X}>"] for b in p.encode()]
    return ids


def test_spm_matches_its_definition(spm):
    words = vocab_tool.CORPUS.split() + ["🦙", "中文", "  ", "\n", "ñ"]
    rng = random.Random(7)
    texts = TRICKY + [" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in range(200)]
    for text in texts:
        if text:   # the space prefix is llama.cpp's; the merging is the definition's
            assert spm.encode(text, add_bos=False) == naive_spm(spm, " " + text), repr(text)


def test_spm_byte_fallback_and_decode(spm):
    ids = spm.encode("🦙", add_bos=False)
    assert [spm.tokens[i] for i in ids] == ["\u2581", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert spm.decode(ids) == "🦙"   # the prefix space is dropped again, as llama.cpp's detokenize does
    for text in TRICKY:
        assert spm.decode(spm.encode(text, add_bos=False)) == text, repr(text)
    pieces, stream = [], spm.stream()
    pieces = [stream.push(i) for i in spm.encode("the 中文 fox", add_bos=False)] + [stream.flush()]
    assert "".join(pieces) == " the 中文 fox"   # a stream is a continuation: its first space stays


def test_spm_bos_and_space_after_special_tokens(spm):
    bos, user = spm.vocab["<s>"], spm.vocab["<|user|>"]
    assert spm.add_bos and spm.bos_id == bos and spm.eos_id == spm.vocab["</s>"]
    assert spm.encode("the fox") == [bos] + naive_spm(spm, " the fox")
    # a space is prepended to the text at the start and after every special token
    assert spm.encode("<|user|>the fox", add_bos=False) == [user] + naive_spm(spm, " the fox")
    assert spm.encode("a<s>b", add_bos=False) == naive_spm(spm, " a") + [bos] + naive_spm(spm, " b")
    # unparsed, they are text (and CONTROL ids decode to nothing unless asked)
    assert bos not in spm.encode("a<s>b", special=False, add_bos=False)
    assert spm.decode([bos]) == "" and spm.decode([bos], special=True) == "<s>"


def _variant(tmp_path, name, model, **metadata):
    """The tiny vocabulary of `model` rewritten with other tokenizer.ggml.* booleans / pre-tokenizer."""
    base = Tokenizer.from_gguf(GGUFFile(VOCABS / f"{'spm' if model == 'llama' else 'bpe'}-tiny.gguf"))
    pre = metadata.pop("pre", "qwen2" if model == "gpt2" else None)
    extra = {f"tokenizer.ggml.{k}": v for k, v in metadata.items()}
    return GGUFFile(vocab_tool.write_vocab(
        tmp_path / name, base.tokens, base.types, model=model, pre=pre,
        merges=base.merges if model == "gpt2" else None, scores=base.scores if model == "llama" else None,
        bos=base.bos_id, eos=base.eos_id, metadata=extra))


def test_add_bos_eos_and_space_prefix_follow_the_gguf(tmp_path, spm):
    text = "the fox"
    no_prefix = Tokenizer.from_gguf(_variant(tmp_path, "a.gguf", "llama", add_space_prefix=False))
    assert no_prefix.encode(text, add_bos=False) == naive_spm(spm, text)
    assert no_prefix.decode(no_prefix.encode(" " + text, add_bos=False)) == " " + text
    plain = Tokenizer.from_gguf(_variant(tmp_path, "b.gguf", "llama", add_bos_token=False, add_eos_token=True))
    assert plain.encode(text) == naive_spm(spm, " " + text) + [plain.eos_id]
    assert plain.encode(text, add_eos=False) == naive_spm(spm, " " + text)
    # BPE: no BOS unless the GGUF says so, except Llama 3's pre-tokenizer (llama.cpp's default there)
    qwen = Tokenizer.from_gguf(_variant(tmp_path, "c.gguf", "gpt2"))
    llama3 = Tokenizer.from_gguf(_variant(tmp_path, "d.gguf", "gpt2", pre="llama-bpe"))
    llama3_off = Tokenizer.from_gguf(_variant(tmp_path, "e.gguf", "gpt2", pre="llama-bpe", add_bos_token=False))
    assert qwen.encode(text)[0] != qwen.bos_id and llama3.encode(text)[0] == llama3.bos_id
    assert llama3_off.encode(text) == qwen.encode(text) == llama3.encode(text)[1:]
    # no tokenizer.ggml.pre: llama.cpp's "default" regexes
    assert Tokenizer.from_gguf(_variant(tmp_path, "f.gguf", "gpt2", pre=None)).pre == "default"


def test_unsupported_model_and_pre_are_one_line(tmp_path):
    base = Tokenizer.from_gguf(GGUFFile(VOCABS / "bpe-tiny.gguf"))
    bert = vocab_tool.write_vocab(tmp_path / "bert.gguf", base.tokens, base.types, model="bert")
    with pytest.raises(UserError) as err:
        Tokenizer.from_gguf(GGUFFile(bert))
    assert "\n" not in str(err.value)
    assert "bert.gguf: tokenizer model 'bert' is not supported (supported: 'gpt2'" in str(err.value)
    with pytest.raises(UserError) as err:
        Tokenizer.from_gguf(_variant(tmp_path, "glm.gguf", "gpt2", pre="chatglm-bpe"))
    assert "\n" not in str(err.value)
    assert "pre-tokenizer 'chatglm-bpe' is not supported (supported: " in str(err.value)
    for name in ("qwen2", "llama-bpe", "smollm", "gpt-2", "deepseek-llm", "starcoder"):
        assert name in str(err.value)


def test_detected_end_tokens_become_control(tmp_path, bpe_lists):
    """llama.cpp makes end-of-generation texts CONTROL whatever the GGUF says, so they are text unless
    special tokens are parsed."""
    tokens, types, merges = bpe_lists
    types = [NORMAL if t == "<|im_end|>" else ty for t, ty in zip(tokens, types)]
    path = vocab_tool.write_vocab(tmp_path / "eog.gguf", tokens, types, model="gpt2", merges=merges, pre="qwen2")
    tok = Tokenizer.from_gguf(GGUFFile(path))
    im_end = tokens.index("<|im_end|>")
    assert tok.types[im_end] == CONTROL
    assert tok.encode("a<|im_end|>") [-1] == im_end and im_end not in tok.encode("a<|im_end|>", special=False)


def test_merge_outside_the_vocabulary_is_one_error(bpe_lists):
    tokens, types, merges = bpe_lists
    tok = Tokenizer(tokens, types, merges + ["zq xj"], source="bad.gguf")
    with pytest.raises(UserError, match=r"bad.gguf: tokenizer.ggml.merges\[\d+\] 'zq xj' names a token that is not"):
        tok.encode("hello")


def test_short_scores_and_empty_tokens(tmp_path, spm):
    short = vocab_tool.write_vocab(tmp_path / "short.gguf", spm.tokens, spm.types, model="llama",
                                   scores=spm.scores[:-1])
    with pytest.raises(UserError, match=f"short.gguf: tokenizer.ggml.scores has {spm.n_vocab - 1} entries for "
                                        f"{spm.n_vocab} tokens"):
        Tokenizer.from_gguf(GGUFFile(short))
    # an empty CONTROL text would be cut everywhere; llama.cpp names it [EMPTY_<id>] instead
    tok = Tokenizer(spm.tokens + [""], spm.types + [CONTROL], [], model="llama", scores=spm.scores + [0.0])
    assert tok.tokens[-1] == f"[EMPTY_{spm.n_vocab}]"
    assert tok.encode("the fox", add_bos=False) == spm.encode("the fox", add_bos=False)
