"""--data sources, the held-out split by document, and the token-stream cache."""
import numpy as np
import pytest

from pretrain_helpers import small_documents, write_jsonl
from pipeline.errors import UserError
from pipeline.jobs import pretrain_data as pd
from pipeline.llm.bpe_train import END_OF_TEXT, train_bpe


def test_files_directories_globs_and_jsonl_in_a_fixed_order(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("bee")
    (tmp_path / "d" / "sub" / "a.md").write_text("ay")
    (tmp_path / "d" / ".hidden.txt").write_text("no")
    (tmp_path / "d" / "image.png").write_bytes(b"\x89PNG")
    write_jsonl(tmp_path / "c.jsonl", ["first", "  ", "second"], field="body")
    docs, _ = pd.read_documents(f"{tmp_path}/d,{tmp_path}/*.jsonl", text_field="body")
    assert docs == ["bee", "ay", "first", "second"]  # blank records dropped, hidden and non-text files skipped


@pytest.mark.parametrize("setup, data, message", [
    (lambda p: None, "missing.txt", "missing.txt: no such file or directory"),
    (lambda p: None, "*.nothing", "matches no files"),
    (lambda p: (p / "e.txt").write_text("  \n"), "e.txt", "the corpus is empty"),
    (lambda p: (p / "bad.txt").write_bytes(b"ok\nline two \xff\n"), "bad.txt", "bad.txt:2: not UTF-8"),
    (lambda p: (p / "bad.jsonl").write_text('{"text": "a"}\n{"text": 3}\n'), "bad.jsonl",
     "bad.jsonl:2: expected a JSON object with a string field 'text'"),
    (lambda p: (p / "cut.jsonl").write_text('{"text": "a"}\n\n{"text": \n'), "cut.jsonl",
     "cut.jsonl:3: malformed JSON"),
])
def test_bad_input_is_one_error_naming_file_and_line(tmp_path, monkeypatch, setup, data, message):
    monkeypatch.chdir(tmp_path)
    setup(tmp_path)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("*", r"\*")):
        pd.read_documents(data)


def test_split_is_by_whole_documents_and_independent_of_order():
    docs = [f"document number {i} " * (i % 7 + 1) for i in range(200)]
    train, val = pd.split_documents(docs, 0.1)
    assert len(train) + len(val) == 200 and set(train).isdisjoint(val)
    held = sum(len(d) for d in val) / sum(len(d) for d in docs)
    assert 0.1 <= held < 0.1 + max(len(d) for d in docs) / sum(len(d) for d in docs)
    _, val_reversed = pd.split_documents(docs[::-1], 0.1)
    assert sorted(val_reversed) == sorted(val)
    with pytest.raises(UserError, match="at least 2"):
        pd.split_documents(["only one"], 0.1)


def test_token_stream_is_tokenized_once_and_memory_mapped(tmp_path, monkeypatch):
    docs = small_documents(20_000)
    tok = train_bpe(docs, 320)
    eot = tok.token_to_id(END_OF_TEXT)
    first = pd.token_stream(str(tmp_path), "corpus", "tok", "train", tok, docs, eot)
    assert isinstance(first, np.memmap) and first.dtype == np.uint16
    expected = [eot] + tok.encode(docs[0], add_special_tokens=False).ids
    assert first[:len(expected)].tolist() == expected
    assert int((first == eot).sum()) == len(docs)

    def no_second_pass(*a, **k):
        raise AssertionError("re-tokenized")
    monkeypatch.setattr(pd, "encode_stream", no_second_pass)
    again = pd.token_stream(str(tmp_path), "corpus", "tok", "train", tok, docs, eot)
    assert np.array_equal(again, first)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_streamed_reading_and_batched_encoding_give_the_same_bits(tmp_path, monkeypatch):
    """A corpus read in 7-byte chunks (every multi-byte character of SAMPLE_TEXT straddles some boundary) and
    encoded 50 characters at a time (documents cut at pre-token boundaries): documents, split, digest and
    token streams equal the whole-file read and one encode_batch over the whole documents (what the reader
    and the encoder did before they streamed), for both pre-tokenizers."""
    from pretrain_helpers import SAMPLE_TEXT

    from pipeline.llm import data as llm_data
    texts = [SAMPLE_TEXT * (i + 1) + f"\ndocument {i}\n" for i in range(12)]
    for i, t in enumerate(texts):
        (tmp_path / f"d{i:02d}.txt").write_bytes(t.encode("utf-8"))
    whole = pd.load_corpus(str(tmp_path), "text", 0.2)
    monkeypatch.setattr(llm_data, "READ_CHUNK", 7)
    monkeypatch.setattr(pd, "ENCODE_CHARS", 50)
    streamed = pd.load_corpus(str(tmp_path), "text", 0.2)
    assert (streamed.train_docs, streamed.val_docs) == (whole.train_docs, whole.val_docs) and whole.val_docs
    assert sorted(streamed.train_docs + streamed.val_docs) == sorted(texts)
    assert (streamed.digest, streamed.n_bytes) == (whole.digest, whole.n_bytes)
    for pre in ("qwen2", "llama-bpe"):
        tok = train_bpe(small_documents(20_000) + [SAMPLE_TEXT] * 3, 320, pre)
        eot = tok.token_to_id(END_OF_TEXT)
        assert pd._cuttable(tok)
        for part, docs in (("train", streamed.train_docs), ("val", streamed.val_docs)):
            stream = pd.token_stream(str(tmp_path / "cache"), streamed.digest, pre, part, tok, docs, eot)
            one_pass = np.concatenate([np.array([eot] + e.ids, np.uint16)
                                       for e in tok.encode_batch(docs, add_special_tokens=False)])
            assert np.array_equal(stream, one_pass)
        pieces = [p for b in pd._batches(tok, streamed.train_docs, 50) for p in b]
        assert len(pieces) > 10 * len(streamed.train_docs)  # the documents were cut, many times each
    from tokenizers import normalizers
    tok.normalizer = normalizers.Strip()  # sees the whole text: a cut would change it, so none is made
    assert not pd._cuttable(tok)


def test_a_bad_byte_chunks_into_the_file_is_named_by_line_and_offset(tmp_path, monkeypatch):
    from pipeline.llm import data as llm_data
    monkeypatch.setattr(llm_data, "READ_CHUNK", 5)
    good = "héllo wörld\n" * 9  # 13 bytes a line
    (tmp_path / "bad.txt").write_bytes(good.encode("utf-8") + b"ab\xe9cd\n")
    offset = len(good.encode("utf-8")) + 2
    with pytest.raises(UserError, match=rf"bad.txt:10: not UTF-8 text \(byte 0xe9 at offset {offset}\)"):
        pd.read_documents(str(tmp_path / "bad.txt"))
