"""Pre-tokenization (splitting text into words before BPE), as llama.cpp does it per `tokenizer.ggml.pre`.

llama.cpp (src/llama-vocab.cpp, src/unicode.cpp) gives each pre-tokenizer a list of regexes applied in turn,
each one cutting every piece the previous one left into matches and the text between them. It does not run
four of those regexes (GPT-2's, Llama 3's, Qwen2's, Qwen3.5's) as regexes but as hand-written scanners, and runs the
others with std::regex on a "collapsed" copy of the text where every non-ASCII character is replaced by one
byte standing for its Unicode category (so `\\p{N}` becomes a character class of that byte plus 0-9). The ids
depend on those details, so this module reproduces them rather than handing the original tokenizer.json regex
to a Unicode regex engine: the scanners are re-implemented here and the other regexes go through the same
collapse into Python's `re` (which lacks `\\p{..}` and does not need it after the collapse).

Unicode categories come from Python's `unicodedata` (llama.cpp generates its table from UnicodeData.txt the
same way, category -> flag); the two can differ only on code points assigned after this Python's Unicode
version. Whitespace is Unicode's White_Space property, as in llama.cpp.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# llama.cpp's regex strings, verbatim (their form decides which code path runs, as in unicode_regex_split)
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK_LLM_REGEXES = (
    "[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-"
    "\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57"
    "\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-"
    "\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
    "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-"
    "\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-"
    "\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
DEEPSEEK_CODER_REGEXES = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
                          "\\p{N}")
FALCON_REGEXES = ("[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2_REGEX, "[0-9][0-9][0-9]")
# llama.cpp's fallback for "default" or a GGUF without tokenizer.ggml.pre (it warns that quality may suffer)
DEFAULT_REGEXES = ("[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2_REGEX, "\\p{N}+", "[0-9][0-9][0-9]")

# What a Unicode regex engine (Hugging Face `tokenizers`' Split, Oniguruma) runs to cut text the same way, for
# tests and for training fixture vocabularies: the models' tokenizer.json originals where llama.cpp rewrote
# them (as scanners, or GPT-2's without its final |\s+), llama.cpp's own lists where it runs them as regexes.
_GPT2_ORIGINAL = GPT2_REGEX + r"|\s+"
REFERENCE_REGEXES = {
    "gpt-2": (_GPT2_ORIGINAL,),
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "starcoder": (r"\p{N}", _GPT2_ORIGINAL),   # StarCoder's Digits(individual_digits) + GPT-2's ByteLevel regex
    "deepseek-llm": DEEPSEEK_LLM_REGEXES,
    "deepseek-coder": DEEPSEEK_CODER_REGEXES,
    "falcon": FALCON_REGEXES,
    "default": DEFAULT_REGEXES,
}


@dataclass(frozen=True)
class PreTokenizer:
    """One `tokenizer.ggml.pre` family: its regexes, in order, and the llama.cpp flags that come with it."""
    regexes: tuple[str, ...]
    ignore_merges: bool = False   # a word that is itself a token is emitted whole, merges unused (Llama 3)
    add_bos: bool = False         # llama.cpp's default when the GGUF has no tokenizer.ggml.add_bos_token

    def split(self, text: str) -> list[str]:
        pieces = [text]
        for regex in self.regexes:
            splitter = _splitter(regex)
            pieces = [word for piece in pieces for word in splitter(piece)]
        return pieces


_GPT2 = PreTokenizer((GPT2_REGEX,))
_STARCODER = PreTokenizer(("\\p{N}", GPT2_REGEX))
_LLAMA3 = PreTokenizer((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)

# tokenizer.ggml.pre -> behaviour; names share an entry where llama.cpp gives them the same regexes and encoding
# flags (its clean_spaces flag differs among some, but changes only its detokenizer's optional clean-up)
PRE_TOKENIZERS = {
    "gpt-2": _GPT2, "mpt": _GPT2,
    "qwen2": PreTokenizer((QWEN2_REGEX,)),
    "qwen35": PreTokenizer((QWEN35_REGEX,)),
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "smollm": _STARCODER, "starcoder": _STARCODER, "refact": _STARCODER, "command-r": _STARCODER,
    "deepseek-llm": PreTokenizer(DEEPSEEK_LLM_REGEXES),
    "deepseek-coder": PreTokenizer(DEEPSEEK_CODER_REGEXES),
    "falcon": PreTokenizer(FALCON_REGEXES),
    "default": PreTokenizer(DEFAULT_REGEXES),
}


# --- Unicode classes ----------------------------------------------------------------------------------------
LETTER, NUMBER, SPACE, OTHER = "L", "N", "W", "O"
WHITESPACE = frozenset(map(chr, [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                                 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]))


class _CharTable(dict):
    """A str.translate table that classifies each character the first time it is seen (translate runs in C)."""

    def __init__(self, classify):
        super().__init__()
        self.classify = classify

    def __missing__(self, code: int) -> str:
        value = self[code] = self.classify(chr(code))
        return value


def _kind(ch: str) -> str:
    cat = unicodedata.category(ch)[0]
    return SPACE if ch in WHITESPACE else LETTER if cat == "L" else NUMBER if cat == "N" else OTHER


_KINDS = _CharTable(_kind)   # text.translate(_KINDS): one kind letter per character
_KINDS_MARKS_AS_LETTERS = _CharTable(lambda ch: LETTER if unicodedata.category(ch)[0] == "M" else _kind(ch))


def kind(ch: str) -> str:
    """LETTER (\\p{L}), NUMBER (\\p{N}), SPACE (White_Space) or OTHER: what llama.cpp's scanners test."""
    return _KINDS[ord(ch)]


# --- llama.cpp's hand-written scanners -------------------------------------------------------------------------
def _contraction(s: str, pos: int, fold_case: bool) -> int:
    """Length of 's 't 're 've 'm 'll 'd at pos (0 if none); fold_case for (?i:...)."""
    n = len(s)
    if s[pos] != "'" or pos + 1 >= n:
        return 0
    nxt = s[pos + 1:pos + 3]
    if fold_case:   # per character; no non-ASCII character lowercases to one of these ASCII letters
        nxt = "".join(c.lower() if c.isascii() else c for c in nxt)
    if nxt[:1] in ("s", "t", "m", "d"):
        return 2
    return 3 if pos + 2 < n and nxt in ("re", "ve", "ll") else 0


def _whitespace_end(s: str, kinds: str, pos: int, newline_runs: bool) -> int:
    """End of the whitespace token at pos: \\s*[\\r\\n]+ (if newline_runs), \\s+(?!\\S), \\s+, else one char."""
    n, end, last_newline = len(s), pos, 0
    while end < n and kinds[end] == SPACE:
        if s[end] in "\r\n":
            last_newline = end + 1
        end += 1
    if newline_runs and last_newline:
        return last_newline
    if end - pos > 1 and end < n:   # leave the last space to the word after it
        return end - 1
    return end if end > pos else pos + 1


def split_gpt2(s: str) -> list[str]:
    """GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    kinds, n, out, pos = s.translate(_KINDS), len(s), [], 0
    while pos < n:
        start = pos
        step = _contraction(s, pos, fold_case=False)
        if step:
            pos += step
        else:
            k = (kinds[pos + 1] if pos + 1 < n else None) if s[pos] == " " else kinds[pos]
            if k in (LETTER, NUMBER, OTHER):
                pos += s[pos] == " "
                while pos < n and kinds[pos] == k:
                    pos += 1
            else:
                pos = _whitespace_end(s, kinds, pos, newline_runs=False)
        out.append(s[start:pos])
    return out


def _split_llama3_like(s: str, max_digits: int, marks_are_letters: bool = False) -> list[str]:
    """Llama 3 (max_digits 3) and Qwen2 (1): (?i:contractions)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,max}|
    ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+. Qwen3.5 (marks_are_letters) reads \\p{L} as
    [\\p{L}\\p{M}] throughout, as its scanner in llama.cpp does."""
    kinds, n, out, pos = s.translate(_KINDS_MARKS_AS_LETTERS if marks_are_letters else _KINDS), len(s), [], 0
    while pos < n:
        start, ch, k = pos, s[pos], kinds[pos]
        step = _contraction(s, pos, fold_case=True)
        if step:
            pos += step
        elif ch not in "\r\n" and k != NUMBER and (k == LETTER or (pos + 1 < n and kinds[pos + 1] == LETTER)):
            pos += 1
            while pos < n and kinds[pos] == LETTER:
                pos += 1
        elif k == NUMBER:
            while pos < n and kinds[pos] == NUMBER and pos - start < max_digits:
                pos += 1
        elif ((kinds[pos + 1] if pos + 1 < n else None) if ch == " " else k) in (OTHER, None):
            pos += ch == " "
            while pos < n and kinds[pos] == OTHER:
                pos += 1
            while pos < n and s[pos] in "\r\n":
                pos += 1
        else:
            pos = _whitespace_end(s, kinds, pos, newline_runs=True)
        out.append(s[start:pos])
    return out


def split_llama3(s: str) -> list[str]:
    return _split_llama3_like(s, 3)


def split_qwen2(s: str) -> list[str]:
    return _split_llama3_like(s, 1)


def split_qwen35(s: str) -> list[str]:
    return _split_llama3_like(s, 1, marks_are_letters=True)


_SCANNERS = {GPT2_REGEX: split_gpt2, LLAMA3_REGEX: split_llama3, QWEN2_REGEX: split_qwen2,
             QWEN35_REGEX: split_qwen35}


# --- the std::regex path, through the collapse ---------------------------------------------------------------
# category -> the byte standing for it in the collapsed text, and the ASCII members the class keeps
_CATEGORY_BYTE = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_CATEGORY_ASCII = {"N": "0-9", "L": "A-Za-z", "P": r"!-#%-*,-/:-;?-@\[-\]_{}", "M": "", "S": r"$+<->^`|~"}
_PROPERTY = re.compile(r"\\p\{(L[ultmo]?|N|P|M|S)\}")
# what std::regex sees: with categories collapsed, or with non-ASCII whitespace as \x0b (its \s misses it)
_COLLAPSE = _CharTable(lambda ch: ch if ch < "\x80" else "\x0b" if ch in WHITESPACE
                       else _CATEGORY_BYTE.get(unicodedata.category(ch)[0], "\xd0"))
_WHITESPACE_AS_VT = _CharTable(lambda ch: "\x0b" if ch > "\x7f" and ch in WHITESPACE else ch)


def _collapse_regex(regex: str) -> str:
    """\\p{X} -> [<byte of X><ASCII members of X>] (no extra brackets inside a class), as llama.cpp does."""
    out, inside, i = [], False, 0
    while i < len(regex):
        c = regex[i]
        if c == "[" and (i == 0 or regex[i - 1] != "\\"):
            inside = True
        elif c == "]" and inside and regex[i - 1] != "\\":
            inside = False
        m = _PROPERTY.match(regex, i)
        if m:
            cat = m.group(1)[0]
            members = _CATEGORY_BYTE[cat] + _CATEGORY_ASCII[cat]
            out.append(members if inside else f"[{members}]")
            i = m.end()
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _regex_splitter(regex: str):
    collapse = _PROPERTY.search(regex) is not None
    pattern = _collapse_regex(regex) if collapse else regex
    # ECMAScript's $ (no multiline) is the end of the piece; \s is ASCII whitespace (the rest became \x0b)
    pattern = re.sub(r"(?<!\\)\$$", r"\\Z", pattern)
    compiled = re.compile(pattern, re.ASCII)

    def split(s: str) -> list[str]:
        view = s.translate(_COLLAPSE if collapse else _WHITESPACE_AS_VT)
        out, done = [], 0
        for m in compiled.finditer(view):
            if m.start() > done:
                out.append(s[done:m.start()])
            out.append(s[m.start():m.end()])
            done = m.end()
        if done < len(s):
            out.append(s[done:])
        return out
    return split


_SPLITTERS: dict[str, object] = {}


def _splitter(regex: str):
    if regex not in _SPLITTERS:
        _SPLITTERS[regex] = _SCANNERS.get(regex) or _regex_splitter(regex)
    return _SPLITTERS[regex]


__all__ = ["PreTokenizer", "PRE_TOKENIZERS", "REFERENCE_REGEXES", "kind", "split_gpt2", "split_llama3",
           "split_qwen2", "split_qwen35"]
