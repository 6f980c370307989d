"""Write the two tiny tokenizer-only GGUFs tests/llm/test_tokenizer.py runs on (a few KB each):

- tests/fixtures/tokenizers/bpe-tiny.gguf: a byte-level BPE ("gpt2", pre-tokenizer qwen2) trained with
  Hugging Face `tokenizers` on the corpus below, plus CONTROL and USER_DEFINED special tokens;
- tests/fixtures/tokenizers/spm-tiny.gguf: a SentencePiece-style vocabulary ("llama"): <unk>, <s>, </s>,
  the 256 <0xNN> byte tokens, then pieces with U+2581 for spaces learned by BPE over U+2581-joined words,
  each scored minus its rank (as Llama's sentencepiece BPE scores are), so earlier merges win.

    python tools/make_tokenizer_fixtures.py          # rewrites both files
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tokenizers"

CORPUS = """\
The quick brown fox jumps over the lazy dog. She's sure they'll say we've done it, and I'm glad you'd agree.
DON'T SHOUT, IT'S LOUD! numbers 0 1 12 123 1234 12345 3.14159 -42 1e-6 0x1F 2026-12-01
def tokenize(text):\\n    return [t for t in text.split() if t]  # code
    indented\\n\\n\\ttabs\\tand   runs   of    spaces
café naïve Ärger São Paulo Ελληνικά русский 中文字符 日本語 한국어
"""
N_MERGES_BPE, N_MERGES_SPM = 160, 120
BPE_SPECIALS = [("<|endoftext|>", gguf.TokenType.CONTROL), ("<|im_start|>", gguf.TokenType.CONTROL),
                ("<|im_end|>", gguf.TokenType.CONTROL), ("<think>", gguf.TokenType.USER_DEFINED)]
SPM_SPACE = "\u2581"


def _train(pre_tokenizer, alphabet, n_merges, lines):
    from tokenizers import Tokenizer, models, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + n_merges, min_frequency=2, show_progress=False,
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    tok.train_from_iterator(lines, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def bpe_vocab():
    from tokenizers import Regex, pre_tokenizers
    from pipeline.llm.pretokenize import REFERENCE_REGEXES
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(REFERENCE_REGEXES["qwen2"][0]), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokens, merges = _train(pre, pre_tokenizers.ByteLevel.alphabet(), N_MERGES_BPE, CORPUS.splitlines() * 3)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for text, ttype in BPE_SPECIALS:
        tokens.append(text)
        types.append(ttype)
    return tokens, types, merges


def spm_vocab():
    """Pieces learned on ASCII letters and U+2581 only, so everything else goes through byte fallback."""
    from tokenizers import pre_tokenizers
    alphabet = [SPM_SPACE] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("TDSI'.,")
    lines = [SPM_SPACE + line.replace(" ", SPM_SPACE) for line in CORPUS.splitlines()] * 3
    pieces, _ = _train(pre_tokenizers.Split(SPM_SPACE, behavior="merged_with_next"), alphabet, N_MERGES_SPM,
                       lines)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(rank))
    tokens.append("<|user|>")   # a CONTROL token past the pieces, as chat models add them
    types.append(gguf.TokenType.CONTROL)
    scores.append(0.0)
    return tokens, types, scores


def write_vocab(path, tokens, types, *, model, merges=None, scores=None, pre=None, bos=None, eos=None,
                metadata=None):
    """A tokenizer-only GGUF (no tensors), like llama.cpp's models/ggml-vocab-*.gguf."""
    wr = gguf.GGUFWriter(str(path), arch="llama")
    wr.add_tokenizer_model(model)
    if pre is not None:
        wr.add_tokenizer_pre(pre)
    wr.add_token_list(tokens)
    wr.add_token_types([int(t) for t in types])
    if merges is not None:
        wr.add_token_merges(merges)
    if scores is not None:
        wr.add_token_scores(scores)
    if bos is not None:
        wr.add_bos_token_id(bos)
    if eos is not None:
        wr.add_eos_token_id(eos)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            wr.add_bool(key, value)
        else:
            raise TypeError(f"{key}: only boolean extra keys are written here")
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return Path(path)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    tokens, types, merges = bpe_vocab()
    write_vocab(OUT / "bpe-tiny.gguf", tokens, types, model="gpt2", merges=merges, pre="qwen2",
                bos=tokens.index("<|endoftext|>"), eos=tokens.index("<|im_end|>"))
    tokens, types, scores = spm_vocab()
    write_vocab(OUT / "spm-tiny.gguf", tokens, types, model="llama", scores=scores, bos=1, eos=2)
    for p in sorted(OUT.glob("*.gguf")):
        print(p, p.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
