"""The pretrain job's data: documents from text/JSONL files, a held-out split by document, a cached token stream.

Sources (`--data`, comma-separated): a text file (one document), a JSONL file (one document per line, the
string in field `text_field`), a directory (its *.txt, *.md, *.rst, *.py and *.jsonl files, recursively, in
sorted path order, hidden entries skipped) or a glob of those. Empty means the built-in corpus
(corpus.stdlib_documents). Bad input - a missing path, a glob that matches nothing, bytes that are not
UTF-8, a JSONL line that is not an object with a string field, an empty corpus - is one UserError naming
the file (and line).

Held-out split: documents are ordered by the sha256 of their bytes and taken for validation until
`val_share` of the corpus bytes is held out (at least one document, at least one left to train on). A
document's side depends only on its own bytes and the corpus size, never on a seed or a thread count.

Token stream: every document is preceded by `<|endoftext|>`, then encoded and concatenated, train and
held-out separately. The arrays are written once per (corpus digest, tokenizer digest) as raw uint16/uint32
files in the cache directory (temp file + rename, under a file lock so concurrent workers tokenize once)
and memory-mapped afterwards, so a restart or another worker does not re-tokenize.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import re
from dataclasses import dataclass

import numpy as np

from ..errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
MAX_DOCUMENT_BYTES = 64 << 20  # one JSONL record (the SFT reader's default cap of 1 MiB is for chat samples)
ENCODE_CHARS = 1 << 20  # text per tokenizer call while writing a token stream (see _pieces)


@dataclass
class Corpus:
    train_docs: list
    val_docs: list
    digest: str       # sha256 over every document (length-prefixed, in source order), 16 hex digits
    source: str       # what --data named (or "built-in")
    n_bytes: int


def _read_utf8(path) -> str:
    """The text of one text document, streamed in chunks (pipeline.llm.data.read_text, READ_CHUNK bytes at a
    time, UTF-8 validated incrementally, a character split by a chunk boundary carried over): the file's raw
    bytes are never held whole, and its first invalid byte is named as `path:line` with its offset."""
    from ..llm.data import read_text
    return read_text(path)


def _jsonl_documents(path, text_field):
    """One document per record, read with pipeline.llm.data's hardened JSONL reader (byte cap per line,
    bounded nesting, `file:line` errors); a pretraining document may be a whole book, hence the cap."""
    from ..llm.data import read_jsonl
    docs = []
    for where, record in read_jsonl(path, max_record_bytes=MAX_DOCUMENT_BYTES):
        if not isinstance(record.get(text_field), str):
            raise UserError(f"{where}: expected a JSON object with a string field {text_field!r}")
        if record[text_field].strip():
            docs.append(record[text_field])
    return docs


def _file_documents(path, text_field):
    if path.endswith(".jsonl"):
        return _jsonl_documents(path, text_field)
    text = _read_utf8(path)
    return [text] if text.strip() else []


def _expand(entry) -> list:
    """One --data entry -> the files it names, in a fixed order."""
    if os.path.isdir(entry):
        found = []
        for root, dirs, files in os.walk(entry):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found += [os.path.join(root, f) for f in files if not f.startswith(".") and f.endswith(TEXT_SUFFIXES)]
        if not found:
            raise UserError(f"--data {entry}: the directory holds no {', '.join(TEXT_SUFFIXES)} files")
        return sorted(found)
    if os.path.isfile(entry):
        return [entry]
    if glob.has_magic(entry):
        matches = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
        if not matches:
            raise UserError(f"--data {entry}: the pattern matches no files")
        return matches
    raise UserError(f"--data {entry}: no such file or directory")


def read_documents(data: str, text_field: str = "text") -> tuple[list, str]:
    """-> (documents, source description)."""
    if not data:
        from .corpus import stdlib_documents
        return stdlib_documents(), "built-in"
    docs = []
    for entry in (e.strip() for e in data.split(",")):
        if entry:
            for path in _expand(entry):
                docs += _file_documents(path, text_field)
    if not docs:
        raise UserError(f"--data {data}: the corpus is empty (no non-blank documents)")
    return docs, data


def documents_digest(docs) -> str:
    h = hashlib.sha256()
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:16]


def split_documents(docs, val_share: float) -> tuple[list, list]:
    """(train, held-out), each in corpus order; see the module docstring for the rule."""
    if len(docs) < 2:
        raise UserError(f"the corpus has {len(docs)} document; a held-out split needs at least 2 "
                        "(give more files, or JSONL with one document per line)")
    keys, sizes = [], []
    for i, d in enumerate(docs):  # one document's bytes at a time, not a second copy of the corpus
        b = d.encode("utf-8")
        keys.append((hashlib.sha256(b).digest(), i))
        sizes.append(len(b))
        del b
    order = sorted(range(len(docs)), key=keys.__getitem__)
    want, held, taken = val_share * sum(sizes), set(), 0
    for i in order[:-1]:  # at least one document stays for training
        if held and taken >= want:
            break
        held.add(i)
        taken += sizes[i]
    return ([d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held])


def load_corpus(data: str, text_field: str, val_share: float) -> Corpus:
    docs, source = read_documents(data, text_field)
    train, val = split_documents(docs, val_share)
    return Corpus(train, val, documents_digest(docs), source, sum(len(d.encode("utf-8")) for d in docs))


class _Lock:
    """An exclusive flock on PATH.lock for the duration of a with-block (one tokenizer/tokenization per key)."""

    def __init__(self, path):
        self.path = f"{path}.lock"

    def __enter__(self):
        self.fh = open(self.path, "w")
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()
        return False


def cached(path, make):
    """The file at `path`, made by make(tmp_path) once (under a lock, renamed into place) if absent."""
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with _Lock(path):
        if not os.path.exists(path):
            tmp = f"{path}.tmp-{os.getpid()}"
            try:
                make(tmp)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return path


_SAFE_CUT = re.compile(r"\n(?=\S)")


def _pieces(doc, size, cuttable):
    """`doc` cut into pieces of about `size` characters, each cut just after a newline that a non-space
    character follows. Neither pre-tokenizer regex (qwen2, llama-bpe: pipeline.llm.pretokenize) has a match
    that holds a newline and a following non-space character, and none looks behind, so such a cut is a
    pre-token boundary and a byte-level BPE never merges across one: the pieces' ids are the document's.
    Only for a tokenizer of exactly that shape (`cuttable`, see _cuttable); any other gets the document whole."""
    if len(doc) <= size or not cuttable:
        yield doc
        return
    start = 0
    while len(doc) - start > size:
        cut = _SAFE_CUT.search(doc, start + size)
        if cut is None:
            break
        yield doc[start:cut.end()]
        start = cut.end()
    yield doc[start:]


def _cuttable(tok) -> bool:
    """A BPE without normalizer (a Strip, say, sees the whole text) whose pre-tokenizer is exactly the Split +
    ByteLevel that bpe_train builds (no prefix space, which every piece would get)."""
    import json

    from tokenizers import Tokenizer, models

    from ..llm import bpe_train
    data = json.loads(tok.to_str())
    pre = bpe_train.pre_tokenizer_name(data)
    if pre is None or data.get("normalizer") is not None or (data.get("model") or {}).get("type") != "BPE":
        return False
    reference = Tokenizer(models.BPE())
    reference.pre_tokenizer = bpe_train._hf_pre_tokenizer(pre)
    return data["pre_tokenizer"] == json.loads(reference.to_str())["pre_tokenizer"]


def _batches(tok, docs, size):
    """Runs of (starts a document, piece) of about `size` characters in all, in corpus order."""
    cuttable, batch, chars = _cuttable(tok), [], 0
    for doc in docs:
        for i, piece in enumerate(_pieces(doc, size, cuttable)):
            batch.append((i == 0, piece))
            chars += len(piece)
            if chars >= size:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def encode_stream(tok, docs, eot_id: int, out=None) -> np.ndarray:
    """<|endoftext|> before every document, then its ids; uint16 when the vocabulary fits, else uint32.

    The text goes to the tokenizer's encode_batch ENCODE_CHARS characters at a time (a long document cut at
    pre-token boundaries, see _pieces: the same ids as encoding it whole), so its Encoding objects (hundreds
    of bytes per token) exist for one run of text, not the corpus. With `out` (a binary file) the ids are
    appended to it as they come and their count returned."""
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    parts, n, eot = [], 0, np.array([eot_id], dtype)
    for batch in _batches(tok, docs, ENCODE_CHARS):
        encoded = tok.encode_batch([piece for _, piece in batch], add_special_tokens=False)
        ids = []
        for (first, _), enc in zip(batch, encoded):
            if first:
                ids.append(eot)
            ids.append(np.array(enc.ids, dtype=dtype))
        del encoded
        run = np.concatenate(ids)
        if out is None:
            parts.append(run)
            continue
        out.write(run.tobytes())
        n += len(run)
    if out is not None:
        return n
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def token_stream(cache_dir, corpus_digest, tok_digest, part, tok, docs, eot_id) -> np.ndarray:
    """The memory-mapped token stream of `docs` ('train' or 'val'), tokenized once per (corpus, tokenizer)."""
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    path = os.path.join(cache_dir, f"tokens-{corpus_digest}-{tok_digest}-{part}.{np.dtype(dtype).name}")

    def make(tmp):
        with open(tmp, "wb") as fh:
            encode_stream(tok, docs, eot_id, out=fh)
    cached(path, make)
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")
