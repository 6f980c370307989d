"""The tokenizer of a GGUF, with llama.cpp's ids: byte-level BPE ("gpt2") and SentencePiece ("llama").

What llama.cpp (src/llama-vocab.cpp) does, and so what this does:
- Special tokens are cut out first: CONTROL and UNKNOWN tokens only when `special=True`, USER_DEFINED ones
  always, longest text first, each one's occurrences left to right (llama.cpp's tokenizer_st_partition).
- Byte-level BPE: the text between special tokens is split by the GGUF's pre-tokenizer
  (`tokenizer.ggml.pre`, see pretokenize.py), each word mapped to GPT-2's byte characters and merged by rank.
  Hugging Face `tokenizers` applies the merges (Rust); the split is ours, because llama.cpp's differs from
  the tokenizer.json regexes in details that change ids. No Unicode normalisation.
- SentencePiece (llm_tokenizer_spm): spaces become U+2581, a space is prepended to the text at the start and
  after every special token (when `tokenizer.ggml.add_space_prefix`, default true), then the adjacent pair of
  pieces whose concatenation is the highest-scoring token is merged, repeatedly; a character left without a
  token becomes its UTF-8 bytes' <0xNN> tokens (byte fallback).
- BOS / EOS are added as the GGUF says (tokenizer.ggml.add_bos_token / add_eos_token), else llama.cpp's default
  for the model (SentencePiece and Llama 3: BOS; others: nothing).
Decoding maps tokens back to bytes, so a stream of tokens decodes incrementally without splitting UTF-8.
"""
from __future__ import annotations

import codecs
import heapq
from array import array
from functools import cached_property

from ..errors import GGUFError, UserError
from ..untrusted import brief
from .pretokenize import PRE_TOKENIZERS, REFERENCE_REGEXES

# the Qwen2 tokenizer.json split regex (what tools/make_tiny_model.py trains its fixture vocabularies with)
QWEN2_PATTERN = REFERENCE_REGEXES["qwen2"][0]

# GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

BPE, SPM = "gpt2", "llama"   # tokenizer.ggml.model values
MODELS = {BPE: "byte-level BPE", SPM: "SentencePiece"}
SPM_SPACE = "\u2581"
SPM_CACHE_SIZE = 100_000   # cached SentencePiece runs (words, mostly) per tokenizer
_C_SPACE = " \t\n\v\f\r"   # C's isspace, what llama.cpp strips next to special tokens

# llama.cpp corrects token types by their text when it loads a vocabulary (llama_vocab::impl::load), which
# decides what is cut out and when: a special id the GGUF does not give is looked up among these texts and
# that token becomes CONTROL; end-of-generation texts always become CONTROL; a few become USER_DEFINED.
_DETECTED_BY_TEXT = {
    "tokenizer.ggml.eot_token_id": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                    "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]",
                                    "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>"),
    "tokenizer.ggml.eom_token_id": ("<|eom_id|>",),
    "tokenizer.ggml.fim_pre_token_id": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                                        "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>", "<|code_prefix|>",
                                        "<|prefix|>"),
    "tokenizer.ggml.fim_suf_token_id": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
                                        "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "tokenizer.ggml.fim_mid_token_id": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
                                        "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
# the GGUF keys llama.cpp also reads for three of them (deprecated names)
_DEPRECATED_KEYS = {"tokenizer.ggml.fim_pre_token_id": "tokenizer.ggml.prefix_token_id",
                    "tokenizer.ggml.fim_suf_token_id": "tokenizer.ggml.suffix_token_id",
                    "tokenizer.ggml.fim_mid_token_id": "tokenizer.ggml.middle_token_id"}
_END_OF_GENERATION = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["))
_ALWAYS_USER_DEFINED = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))


def llama_cpp_token_types(md: dict, tokens: list[str], types: list[int]) -> tuple[list[int], set[int]]:
    """The token types llama.cpp tokenizes with, and the ids whose following whitespace it strips (RSTRIP).

    Where several tokens carry texts of one detected id, llama.cpp takes the first in its hash map's order;
    we take the lowest id (it matters only when that token was not CONTROL already)."""
    types = list(types)
    # llama.cpp's text -> id keeps the last one (a dict, not a list per text: 262k lists were 25 MB at load)
    last_id = {text: i for i, text in enumerate(tokens)}
    for key, texts in _DETECTED_BY_TEXT.items():
        if key in md or _DEPRECATED_KEYS.get(key) in md:
            continue
        found = sorted(last_id[t] for t in texts if t in last_id)
        if found:
            types[found[0]] = CONTROL
    for text in _END_OF_GENERATION & last_id.keys():
        types[last_id[text]] = CONTROL
    for text in _ALWAYS_USER_DEFINED & last_id.keys():
        types[last_id[text]] = USER_DEFINED
    rstrip = set()
    name = str(md.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:   # llama.cpp: Phi-3's special tokens eat the whitespace after them
        rstrip = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED, UNKNOWN)}
        rstrip |= {last_id[t] for t in ("</s>",) if t in last_id}
        rstrip -= {last_id[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in last_id}
    return types, rstrip


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_token_value(text: str) -> int | None:
    """0xNN for a '<0xNN>' token text, else None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, plus the special ids (bos/eos/eot)."""

    def __init__(self, tokens: list[str], types: list[int], merges: list[str], *, bos_id=None, eos_id=None,
                 eot_id=None, pad_id=None, add_bos=False, add_eos=False, model=BPE, pre="qwen2", scores=None,
                 add_space_prefix=None, rstrip_ids=(), source="<tokenizer>"):
        if model not in MODELS:
            raise UserError(f"{source}: tokenizer model '{model}' is not supported (supported: "
                            + ", ".join(f"'{m}' ({name})" for m, name in MODELS.items()) + ")")
        # llama.cpp renames an empty token text (which would match everywhere) to [EMPTY_<id>]
        self.tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.types, self.merges, self.source = list(types), list(merges), source
        self.model = model
        self.bos_id, self.eos_id, self.eot_id, self.pad_id = bos_id, eos_id, eot_id, pad_id
        self.add_bos, self.add_eos = add_bos, add_eos
        # llama.cpp: only SentencePiece prepends the space when encoding; any model strips it when decoding
        self.add_space_prefix = (model == SPM) if add_space_prefix is None else bool(add_space_prefix)
        self.vocab = {t: i for i, t in enumerate(self.tokens)}   # a repeated text maps to its last id
        self.rstrip_ids = set(rstrip_ids)
        # the texts cut out before tokenizing, longest first (ties by id: llama.cpp's std::sort leaves them
        # in an unspecified order)
        cut = [i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED, UNKNOWN)]
        self._cut_order = sorted(cut, key=lambda i: (-len(self.tokens[i].encode()), i))
        if model == BPE:
            if pre not in PRE_TOKENIZERS:
                raise UserError(f"{source}: pre-tokenizer '{pre}' is not supported (supported: "
                                f"{', '.join(sorted(PRE_TOKENIZERS))})")
            self.pre, self._pre = pre, PRE_TOKENIZERS[pre]
            self._hf = None   # built on the first encode (seconds for a large vocabulary)
        else:
            self.pre, self._pre = None, None
            # a GGUF's scores come as one f32 array (pipeline/llm/gguf.py COMPACT_F32), kept as they are
            self.scores = (scores if isinstance(scores, array) else list(scores)) if scores is not None \
                else [0.0] * len(self.tokens)
            self._byte_ids = {}
            # every two-character substring of a token: no merge can join characters whose pair is not here
            self._spm_pairs = {text[k:k + 2] for text in self.tokens for k in range(len(text) - 1)}
            self._spm_cache: dict[str, list[int]] = {}
            for i, text in enumerate(self.tokens):
                value = _byte_token_value(text)
                if value is not None:
                    self._byte_ids.setdefault(value, self.vocab[text])

    def _pairs_of_merges(self) -> list[tuple[str, str]]:
        """The merges as pairs, checked (Hugging Face's BPE would panic on a merge outside the vocabulary)."""
        pairs = []
        for k, m in enumerate(self.merges):   # llama.cpp cuts a merge at its first space after character 1
            cut = m.find(" ", 1)
            if cut < 0:
                continue   # matches no pair
            left, right = m[:cut], m[cut + 1:]
            if not (left in self.vocab and right in self.vocab and left + right in self.vocab):
                raise UserError(f"{self.source}: tokenizer.ggml.merges[{k}] '{m}' names a token that is not in "
                                "the vocabulary")
            pairs.append((left, right))
        return pairs

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (its text's length: a byte-level token spells
        each byte as one character, a SentencePiece one each space as one), so a text of more than
        n * max_token_chars characters needs more than n tokens: checkable before tokenizing it."""
        return max(1, max(map(len, self.tokens), default=1))

    def check_fits(self, text: str, n_tokens: int, what: str = "the prompt"):
        """UserError when `text` cannot encode to n_tokens or fewer (decided from its length alone)."""
        if len(text) > n_tokens * self.max_token_chars:
            raise UserError(f"{what} is {len(text):,} characters: more than the model's context of {n_tokens} "
                            f"tokens can hold (at most {self.max_token_chars} characters per token); "
                            "refused before tokenizing")

    @classmethod
    def from_gguf(cls, gg) -> "Tokenizer":
        from .gguf import metadata_of
        md, path = gg.metadata, gg.path
        model = metadata_of(gg, "tokenizer.ggml.model", "string")
        if model is None or "tokenizer.ggml.tokens" not in md:
            raise UserError(f"{path}: the GGUF has no tokenizer (tokenizer.ggml.model/tokens missing); "
                            "pass token ids instead of text")
        # every value is typed by the file: a wrong type is one GGUFError naming its key, never a TypeError
        tokens = metadata_of(gg, "tokenizer.ggml.tokens", "strings")
        types = metadata_of(gg, "tokenizer.ggml.token_type", "integers", [NORMAL] * len(tokens))
        metadata_of(gg, "tokenizer.ggml.scores", "numbers")
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                    "tokenizer.ggml.padding_token_id"):
            value = metadata_of(gg, key, "integer")
            if value is not None and not 0 <= value < len(tokens):
                raise GGUFError(f"{path}: metadata key '{key}' is {value}, not a token id (the vocabulary has "
                                f"{len(tokens)} tokens)")
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if key in md and len(md[key]) < len(tokens):
                raise UserError(f"{path}: {key} has {len(md[key])} entries for {len(tokens)} tokens")
        types, rstrip = llama_cpp_token_types(md, tokens, types)
        merges, pre, scores = [], None, None
        if model == BPE:
            pre = md.get("tokenizer.ggml.pre") or "default"   # llama.cpp's fallback, with a warning
            if not isinstance(pre, str):
                raise GGUFError(f"{path}: metadata key 'tokenizer.ggml.pre' must be a string, got {brief(pre)}")
            merges = metadata_of(gg, "tokenizer.ggml.merges", "strings")
            if not merges:
                raise UserError(f"{path}: tokenizer.ggml.merges is missing; a BPE tokenizer needs its merges")
        elif model == SPM:
            scores = md.get("tokenizer.ggml.scores")
        eot = md.get("tokenizer.ggml.eot_token_id")
        if eot is None and "<|im_end|>" in tokens:
            eot = tokens.index("<|im_end|>")
        default_bos = model == SPM or (pre in PRE_TOKENIZERS and PRE_TOKENIZERS[pre].add_bos)
        # llama.cpp's default ids when the GGUF names none (SentencePiece: <s> = 1, </s> = 2)
        spm_default = {"bos": 1, "eos": 2} if model == SPM else {}
        return cls(tokens, types, merges, bos_id=md.get("tokenizer.ggml.bos_token_id", spm_default.get("bos")),
                   eos_id=md.get("tokenizer.ggml.eos_token_id", spm_default.get("eos")), eot_id=eot,
                   pad_id=md.get("tokenizer.ggml.padding_token_id"),
                   add_bos=bool(md.get("tokenizer.ggml.add_bos_token", default_bos)),
                   add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)), model=model, pre=pre,
                   scores=scores, add_space_prefix=md.get("tokenizer.ggml.add_space_prefix"), rstrip_ids=rstrip,
                   source=str(path))

    # --- encoding -------------------------------------------------------------
    def encode(self, text: str, *, special: bool = True, add_bos: bool | None = None,
               add_eos: bool | None = None, continuation: bool = False) -> list[int]:
        """Token ids of text. special=True parses control tokens like <|im_start|> (llama.cpp parse_special);
        add_bos / add_eos default to the GGUF's rule. continuation=True: text continues a text encoded just
        before (a segment of one rendering), so SentencePiece adds no space prefix at its start."""
        ids = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.append(self.bos_id)
        # SentencePiece: the text at the start and after a special token gets a space
        after_special = not continuation
        for piece in self._partition(text, special):
            if isinstance(piece, int):
                ids.append(piece)
                after_special = True
            elif self.model == BPE:
                ids += self._encode_bpe(piece)
            else:
                ids += self._encode_spm((" " if self.add_space_prefix and after_special else "") + piece)
                after_special = False
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _partition(self, text: str, special: bool) -> list:
        """text -> [str | special token id]: llama.cpp's tokenizer_st_partition."""
        pieces = [text] if text else []
        for tid in self._cut_order:
            if not special and self.types[tid] in (CONTROL, UNKNOWN):
                continue
            cut = self.tokens[tid]
            if cut not in text:
                continue
            out = []
            for piece in pieces:
                if isinstance(piece, int) or cut not in piece:
                    out.append(piece)
                    continue
                parts = piece.split(cut)
                for k, part in enumerate(parts):
                    if k:
                        out.append(tid)
                        if tid in self.rstrip_ids:
                            part = part.lstrip(_C_SPACE)
                    if part:
                        out.append(part)
            pieces = out
        return pieces

    def _bpe_backend(self):
        if self._hf is None:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import models, pre_tokenizers
            tok = HFTokenizer(models.BPE(vocab=self.vocab, merges=self._pairs_of_merges(),
                                         ignore_merges=self._pre.ignore_merges))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            self._hf = tok
        return self._hf

    def _encode_bpe(self, text: str) -> list[int]:
        words = self._pre.split(text)
        return self._bpe_backend().encode(words, is_pretokenized=True, add_special_tokens=False).ids

    def _encode_spm(self, text: str) -> list[int]:
        """llm_tokenizer_spm over the text with spaces as U+2581. A merge makes a token, so it never joins two
        characters whose pair is in no token: the text falls apart there into runs merged independently, with
        the same result as merging it whole, and the runs (mostly words) are cached."""
        text = text.replace(" ", SPM_SPACE)
        ids, start = [], 0
        for k in range(1, len(text) + 1):
            if k == len(text) or text[k - 1:k + 1] not in self._spm_pairs:
                run = text[start:k]
                cached = self._spm_cache.get(run)
                if cached is None:
                    if len(self._spm_cache) >= SPM_CACHE_SIZE:
                        self._spm_cache.clear()
                    cached = self._spm_cache[run] = self._merge_spm(run)
                ids += cached
                start = k
        return ids

    def _merge_spm(self, text: str) -> list[int]:
        """llm_tokenizer_spm: merge the best-scoring adjacent pair until none is a token; bytes for the rest."""
        pieces = list(text)             # one symbol per character; merged symbols become "" on the right
        nxt = list(range(1, len(pieces))) + [-1]
        prev = list(range(-1, len(pieces) - 1))
        heap = []

        def offer(left, right):
            if left >= 0 and right >= 0:
                joined = pieces[left] + pieces[right]
                tid = self.vocab.get(joined)
                if tid is not None:   # highest score first, then leftmost
                    heapq.heappush(heap, (-self.scores[tid], left, right, len(joined)))

        for i in range(1, len(pieces)):
            offer(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not pieces[left] or not pieces[right] or len(pieces[left]) + len(pieces[right]) != size:
                continue   # one side already merged elsewhere
            pieces[left] += pieces[right]
            pieces[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            offer(prev[left], left)
            offer(left, nxt[left])
        ids, i = [], 0
        while i >= 0 and pieces:
            tid = self.vocab.get(pieces[i])
            if tid is not None:
                ids.append(tid)
            else:
                ids += [self._byte_token(b) for b in pieces[i].encode()]
            i = nxt[i]
        return ids

    def _byte_token(self, value: int) -> int:
        tid = self._byte_ids.get(value)
        if tid is None:
            tid = self.vocab.get(chr(value)) if value < 0x80 else None
        if tid is None:
            raise UserError(f"{self.source}: the vocabulary has no token for byte 0x{value:02X} "
                            f"(no <0x{value:02X}> byte-fallback token)")
        return tid

    # --- decoding -------------------------------------------------------------
    def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for (llama.cpp's token_to_piece); control tokens give b'' unless special."""
        if not 0 <= token_id < self.n_vocab:
            raise UserError(f"{self.source}: token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        text, ty = self.tokens[token_id], self.types[token_id]
        if ty in (CONTROL, UNKNOWN):
            return text.encode() if special else b""
        if ty == USER_DEFINED:
            return text.encode()
        if ty == BYTE:
            value = _byte_token_value(text)
            return bytes([value]) if value is not None else b""
        if ty != NORMAL:
            return b""
        if self.model == SPM:
            return text.replace(SPM_SPACE, " ").encode()
        return bytes(BYTE_DECODER.get(c, 0x3F) for c in text)

    def decode(self, ids, *, special: bool = False) -> str:
        """The text of a whole sequence; like llama.cpp's detokenize, the first token loses the space that
        add_space_prefix put in front of it (without llama.cpp's optional clean-up of spaces)."""
        pieces = [self.token_bytes(int(i), special=special) for i in ids]
        if pieces and self.add_space_prefix and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def stream(self, *, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special)

    def is_end(self, token_id: int) -> bool:
        return token_id in (self.eos_id, self.eot_id)

    def __repr__(self):
        kind = f"{MODELS[self.model]}, pre-tokenizer {self.pre}" if self.model == BPE else MODELS[self.model]
        return f"Tokenizer({self.n_vocab} tokens, {kind}, from {self.source})"


def load_tokenizer(gg) -> Tokenizer:
    """Tokenizer.from_gguf, also accepting a pure byte vocab without merges (what `fucina launch lm`
    writes: token b is byte b, one token per byte), which from_gguf refuses. Every fine-tuning path
    (the backprop job, ES, its rewards, the commands) loads its tokenizer through this one fallback."""
    md = gg.metadata
    tokens = md.get("tokenizer.ggml.tokens") or []
    byte_chars = [_bytes_to_unicode()[b] for b in range(256)]
    if md.get("tokenizer.ggml.merges") or tokens[:256] != byte_chars:
        return Tokenizer.from_gguf(gg)
    eot = tokens.index("<|im_end|>") if "<|im_end|>" in tokens else md.get("tokenizer.ggml.eot_token_id")
    return Tokenizer(tokens, md.get("tokenizer.ggml.token_type", [1] * len(tokens)), [],
                     bos_id=md.get("tokenizer.ggml.bos_token_id"), eos_id=md.get("tokenizer.ggml.eos_token_id"),
                     eot_id=eot, pad_id=md.get("tokenizer.ggml.padding_token_id"),
                     add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)), source=str(gg.path))


class StreamDecoder:
    """Incremental decode: push(id) returns the text completed so far (never half a UTF-8 character).

    The incremental UTF-8 decoder holds back a trailing incomplete character until its next bytes arrive,
    and replaces an invalid sequence (a model can emit any byte token) by U+FFFD at once, without
    swallowing a valid character that follows it."""

    def __init__(self, tokenizer: Tokenizer, special: bool):
        self.tok, self.special = tokenizer, special
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self.utf8.decode(self.tok.token_bytes(token_id, special=self.special))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)


__all__ = ["Tokenizer", "StreamDecoder", "QWEN2_PATTERN"]
