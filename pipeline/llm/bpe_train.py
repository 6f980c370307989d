"""Train a byte-level BPE tokenizer with Hugging Face `tokenizers`, in a form llama.cpp tokenizes the same.

The pre-tokenizer is the Unicode regex of a pre-tokenizer llama.cpp knows by name (pretokenize.py's
REFERENCE_REGEXES: "qwen2" by default, or "llama-bpe"), followed by GPT-2's byte-to-unicode map; the GGUF
records that name as `tokenizer.ggml.pre`, so pipeline.llm.tokenizer and llama.cpp cut words the same way
the trainer did. The vocabulary is: the ChatML special tokens (ids 0..4, `<|endoftext|>` first), the 256
byte tokens, then the learned merges in order.

Trade-off: the trainer's own word counts are a pure function of the text, but we still pass the documents
in a fixed order and record the tokenizer.json digest, so a cache keyed by it can never mix two vocabularies.
"""
from __future__ import annotations

import hashlib
import json
import os

import gguf

from ..errors import UserError
from ..untrusted import open_regular
from .pretokenize import REFERENCE_REGEXES

SPECIAL_TOKENS = [("<|endoftext|>", gguf.TokenType.CONTROL), ("<|im_start|>", gguf.TokenType.CONTROL),
                  ("<|im_end|>", gguf.TokenType.CONTROL), ("<think>", gguf.TokenType.USER_DEFINED),
                  ("</think>", gguf.TokenType.USER_DEFINED)]
END_OF_TEXT = "<|endoftext|>"
PRE_TOKENIZERS = ("qwen2", "llama-bpe")  # single-regex splits llama.cpp runs by name
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
MAX_TOKENIZER_BYTES = 256 << 20  # a 262K-token vocabulary's tokenizer.json is ~35 MB


def _hf_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers
    (regex,) = REFERENCE_REGEXES[pre]
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_bpe(documents, vocab_size: int = 8192, pre: str = "qwen2", min_frequency: int = 2):
    """documents: an iterable of str -> a Hugging Face Tokenizer (byte-level BPE, ChatML specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if pre not in PRE_TOKENIZERS:
        raise UserError(f"tokenizer: pre-tokenizer {pre!r} is not supported for training "
                        f"(supported: {', '.join(PRE_TOKENIZERS)})")
    if vocab_size < MIN_VOCAB:
        raise UserError(f"tokenizer: vocab size {vocab_size} is below {MIN_VOCAB} "
                        f"(256 byte tokens + {len(SPECIAL_TOKENS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _hf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[t for t, _ in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    return tok


def save_tokenizer(tok, path):
    """Write tokenizer.json atomically (temp file + rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, path)
    return path


def pre_tokenizer_name(data: dict):
    """The llama.cpp pre-tokenizer name whose regex the tokenizer.json's Split uses, or None."""
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    regexes = [st.get("pattern", {}).get("Regex") for st in steps if st.get("type") == "Split"]
    byte_level = [st for st in steps if st.get("type") == "ByteLevel"]
    for name in PRE_TOKENIZERS:
        if regexes == list(REFERENCE_REGEXES[name]) and len(byte_level) == 1:
            return name
    return None


def load_tokenizer(path):
    """-> (Hugging Face Tokenizer, pre name, sha256 of the file) of a tokenizer.json written by save_tokenizer."""
    from tokenizers import Tokenizer
    if not os.path.exists(path):
        raise UserError(f"{path}: no such tokenizer file")
    with open_regular(path, UserError, "tokenizer.json") as fh:  # a FIFO would block, /dev/zero never end
        raw = fh.read(MAX_TOKENIZER_BYTES + 1)
    if len(raw) > MAX_TOKENIZER_BYTES:
        raise UserError(f"{path}: over {MAX_TOKENIZER_BYTES} bytes; not a tokenizer.json")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: not a tokenizer.json ({e})") from None
    pre = pre_tokenizer_name(data) if isinstance(data, dict) else None
    if pre is None or not isinstance(data.get("model"), dict) or data["model"].get("type") != "BPE":
        raise UserError(f"{path}: not a byte-level BPE tokenizer.json whose pre-tokenizer llama.cpp knows "
                        f"(a Split on the {' or '.join(PRE_TOKENIZERS)} regex, then ByteLevel), "
                        "as `fucina tokenizer train` writes")
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a malformed file
        raise UserError(f"{path}: tokenizers cannot load it: {e}") from None
    return tok, pre, hashlib.sha256(raw).hexdigest()[:16]


def gguf_vocab(tok):
    """(tokens, types, merges) in id order, as tokenizer.ggml.tokens / token_type / merges."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {t: int(kind) for t, kind in SPECIAL_TOKENS}
    types = [special.get(t, int(gguf.TokenType.NORMAL)) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def token_byte_lengths(tok):
    """UTF-8 byte length of every token id's text (special tokens count 0: they are not text), for bits per byte."""
    tokens, types, _ = gguf_vocab(tok)
    # a byte-level token spells each of its bytes as one character of GPT-2's byte-to-unicode map
    return [len(t) if ty == int(gguf.TokenType.NORMAL) else 0 for t, ty in zip(tokens, types)]
