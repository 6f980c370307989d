"""The byte-level BPE tokenizer of a GGUF (tokenizer.ggml.model "gpt2", qwen2 pre-tokenizer).

Trade-off: Hugging Face `tokenizers` does the heavy lifting (regex split,
byte-level mapping, merge application in Rust), built from the GGUF's token
list and merges; this module only reproduces llama.cpp's rules around it so the
ids are llama.cpp's ids: no Unicode normalisation, special tokens split out
before BPE (CONTROL tokens only when `special=True`, USER_DEFINED ones always),
BOS prepended only when the GGUF says so. Decoding maps the byte-level
characters back to bytes ourselves, so a stream of tokens can be decoded
incrementally without splitting UTF-8 sequences.
"""
from __future__ import annotations


from ..errors import UserError

# llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 split pattern (same as Qwen2's tokenizer.json)
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_PRE = {"qwen2"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, plus the special ids (bos/eos/eot)."""

    def __init__(self, tokens: list[str], types: list[int], merges: list[str], *, bos_id=None, eos_id=None,
                 eot_id=None, pad_id=None, add_bos=False, source="<tokenizer>"):
        self.tokens, self.types, self.merges, self.source = list(tokens), list(types), list(merges), source
        self.bos_id, self.eos_id, self.eot_id, self.pad_id, self.add_bos = bos_id, eos_id, eot_id, pad_id, add_bos
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.special_ids = {i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED)}
        self._hf = {}  # special=True/False -> tokenizers.Tokenizer

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_gguf(cls, gg) -> "Tokenizer":
        md, path = gg.metadata, gg.path
        model = md.get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in md:
            raise UserError(f"{path}: the GGUF has no tokenizer (tokenizer.ggml.model/tokens missing); "
                            "pass token ids instead of text")
        if model != "gpt2":
            raise UserError(f"{path}: tokenizer model '{model}' is not supported (only byte-level BPE 'gpt2')")
        pre = md.get("tokenizer.ggml.pre", "default")
        if pre not in SUPPORTED_PRE:
            raise UserError(f"{path}: pre-tokenizer '{pre}' is not supported (supported: {sorted(SUPPORTED_PRE)})")
        tokens = md["tokenizer.ggml.tokens"]
        types = md.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
        merges = md.get("tokenizer.ggml.merges")
        if not merges:
            raise UserError(f"{path}: tokenizer.ggml.merges is missing; a BPE tokenizer needs its merges")
        eos = md.get("tokenizer.ggml.eos_token_id")
        eot = md.get("tokenizer.ggml.eot_token_id")
        if eot is None and "<|im_end|>" in tokens:
            eot = tokens.index("<|im_end|>")
        return cls(tokens, types, merges, bos_id=md.get("tokenizer.ggml.bos_token_id"), eos_id=eos, eot_id=eot,
                   pad_id=md.get("tokenizer.ggml.padding_token_id"),
                   add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)), source=str(path))

    # --- encoding -------------------------------------------------------------
    def _backend(self, special: bool):
        if special not in self._hf:
            from tokenizers import AddedToken, Regex, models, pre_tokenizers
            from tokenizers import Tokenizer as HFTokenizer
            merges = [tuple(m.split(" ", 1)) for m in self.merges]
            tok = HFTokenizer(models.BPE(vocab=self.vocab, merges=merges, ignore_merges=False))
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
            split_types = (CONTROL, USER_DEFINED) if special else (USER_DEFINED,)
            added = [AddedToken(t, special=True, normalized=False) for t, ty in zip(self.tokens, self.types)
                     if ty in split_types]
            tok.add_special_tokens(added)
            self._hf[special] = tok
        return self._hf[special]

    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of text. special=True parses control tokens like <|im_start|> (llama.cpp parse_special)."""
        ids = self._backend(special).encode(text, add_special_tokens=False).ids if text else []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    # --- decoding -------------------------------------------------------------
    def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for; control tokens give b'' unless special=True."""
        if not 0 <= token_id < self.n_vocab:
            raise UserError(f"{self.source}: token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        text, ty = self.tokens[token_id], self.types[token_id]
        if ty == CONTROL:
            return text.encode() if special else b""
        if ty in (USER_DEFINED, UNUSED):
            return text.encode()
        return bytes(BYTE_DECODER.get(c, 0x3F) for c in text)

    def decode(self, ids, *, special: bool = False) -> str:
        return b"".join(self.token_bytes(int(i), special=special) for i in ids).decode("utf-8", errors="replace")

    def stream(self, *, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special)

    def is_end(self, token_id: int) -> bool:
        return token_id in (self.eos_id, self.eot_id)

    def __repr__(self):
        return f"Tokenizer({self.n_vocab} tokens, {len(self.merges)} merges, from {self.source})"


class StreamDecoder:
    """Incremental decode: push(id) returns the text completed so far (never half a UTF-8 character)."""

    def __init__(self, tokenizer: Tokenizer, special: bool):
        self.tok, self.special, self.pending = tokenizer, special, b""

    def push(self, token_id: int) -> str:
        self.pending += self.tok.token_bytes(token_id, special=self.special)
        for cut in range(len(self.pending), max(len(self.pending) - 4, -1), -1):
            try:
                text = self.pending[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.pending = self.pending[cut:]
            return text
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text

    def flush(self) -> str:
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text


def tokenizer_json(tok: Tokenizer) -> str:
    """The tokenizer as a Hugging Face tokenizer.json string (for inspection and export)."""
    return tok._backend(True).to_str()


__all__ = ["Tokenizer", "StreamDecoder", "QWEN2_PATTERN", "tokenizer_json"]
