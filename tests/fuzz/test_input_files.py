"""Input files that are not files (issue 32): a FIFO, /dev/zero, a directory given to any input flag is refused
with what it is ("is a FIFO (named pipe), not a regular file"), never opened in a way that blocks or never ends;
corpora stream, so a 2 GB one-line file is refused at `file:1` after its first 64 MiB, not read whole."""
import os
import tracemalloc
from pathlib import Path

import pytest

from pipeline.cli import main as fucina
from pipeline.errors import UserError
from pipeline.llm.data import MAX_LINE_BYTES, load_jsonl, read_text
from pipeline.untrusted import not_a_regular_file, open_regular

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MODEL = str(FIXTURES / "qwen3-mini-f32.gguf")


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.jsonl"
    os.mkfifo(path)
    return str(path)


def test_what_a_path_is_is_named(tmp_path, fifo):
    assert not_a_regular_file(MODEL) is None
    assert not_a_regular_file(tmp_path / "absent") == f"{tmp_path / 'absent'}: no such file"
    assert not_a_regular_file(tmp_path, "GGUF file") == f"{tmp_path} is a directory, not a GGUF file"
    assert not_a_regular_file(fifo, "GGUF file") == f"{fifo} is a FIFO (named pipe), not a regular file " \
                                                    "(expected a GGUF file)"
    assert not_a_regular_file("/dev/zero") == "/dev/zero is a character device, not a regular file (expected a file)"


@pytest.mark.timeout(60)
def test_opening_a_fifo_does_not_block(fifo):
    """No writer ever opens the FIFO: a plain open() would wait forever; open_regular refuses it at once."""
    with pytest.raises(UserError, match="is a FIFO"):
        open_regular(fifo, UserError)
    with pytest.raises(UserError, match="is a FIFO"):
        load_jsonl(fifo)
    with pytest.raises(UserError, match="/dev/zero is a character device"):
        read_text("/dev/zero")
    with open_regular(MODEL, UserError) as fh:
        assert fh.read(4) == b"GGUF"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,flag,what", [
    (["generate", "--model", "{fifo}", "--prompt", "x"], "--model", "GGUF file"),
    (["eval-logits", "--model", "{fifo}", "--text", "x"], "--model", "GGUF file"),
    (["finetune", "--model", MODEL, "--data", "{fifo}"], "--data", "JSONL file"),
    (["finetune", "--model", MODEL, "--data", "/dev/zero"], "--data", "JSONL file"),
    (["es-finetune", "--model", "{fifo}"], "--model", "GGUF file"),
    (["tokenizer", "train", "--data", "{fifo}"], "--data", "text or JSONL file"),
    (["tokenizer", "train", "--data", "/dev/zero"], "--data", "text or JSONL file"),
    (["pretrain", "--data", "{fifo}", "--inprocess"], "--data", "text or JSONL file"),
    (["sft", "--model", "{fifo}", "--data", "x.jsonl", "--inprocess"], "--model", "GGUF file"),
    (["launch", "finetune", "--model", MODEL, "--data", "/dev/zero", "--inprocess"], "--data", "JSONL file"),
    (["launch", "pretrain", "--tokenizer", "{fifo}", "--inprocess"], "--tokenizer", "tokenizer.json"),
    (["generate", "--model", MODEL, "--prompt", "x", "--chat", "--chat-template", "{fifo}"], "--chat-template",
     "jinja chat template file"),
])
def test_every_input_flag_names_a_fifo_or_a_device(argv, flag, what, fifo, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a job that got further would write its run dir here
    argv = [a.replace("{fifo}", fifo) for a in argv]
    path = argv[argv.index(flag) + 1]
    kind = "a character device" if path == "/dev/zero" else "a FIFO (named pipe)"
    assert fucina(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag} {path} is {kind}, not a regular file (expected a {what})" in err, err
    assert not (tmp_path / "runs").exists()


def test_export_gguf_names_a_fifo(fifo, tmp_path, capsys):
    assert fucina(["export-gguf", "--from-gguf", fifo, "--out", str(tmp_path / "o.gguf")]) == 2
    assert f"{fifo} is a FIFO (named pipe), not a regular file (expected a GGUF file)" in capsys.readouterr().err


# --- streamed text ------------------------------------------------------------------------------------------
def test_read_text_is_the_file_decoded_across_any_chunking(tmp_path):
    text = "é\nü\nab\n€x\n\n𝄞\nend"  # multi-byte characters that small chunks cut in the middle
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    for cap in (4, 5, 7, 64, MAX_LINE_BYTES):
        assert read_text(path, max_line_bytes=cap) == text
    assert read_text(path, keep=False) is None
    with pytest.raises(UserError, match=r"t\.txt:5: a line of over 4 bytes"):
        path.write_bytes(b"ab\ncd\n\nabcd\nabcde\nx")
        read_text(path, max_line_bytes=4)


def test_read_text_names_the_line_and_offset_of_bad_utf8(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes("line one\nzwei é\n".encode() + b"\xff tail\n")
    for cap in (8, 9, MAX_LINE_BYTES):  # the same message whatever the chunking
        with pytest.raises(UserError, match=r"bad\.txt:3: not UTF-8 text \(byte 0xff at offset 17\)$"):
            read_text(path, max_line_bytes=cap)
    path.write_bytes(b"ok\n\xe2\x82")  # a character cut by the end of the file
    with pytest.raises(UserError, match=r"bad\.txt:2: not UTF-8 text \(byte 0xe2 at offset 3\)"):
        read_text(path, max_line_bytes=2)


def test_a_sparse_2gb_one_line_corpus_is_refused_without_reading_it_whole(tmp_path, capsys, monkeypatch):
    """`tokenizer train` on it peaked at 4.3 GB before refusing it; now one 64 MiB line's worth is read, in 1 MiB
    chunks, none of it kept (the peak of Python allocations stays a few MiB)."""
    monkeypatch.chdir(tmp_path)
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.truncate(2 << 30)  # a hole: no disk used
    tracemalloc.start()
    try:
        code = fucina(["tokenizer", "train", "--data", str(big), "--out", str(tmp_path / "tok.json")])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 2 and peak < 64 << 20, peak
    assert capsys.readouterr().err == (f"fucina tokenizer: error: {big}:1: a line of over {MAX_LINE_BYTES} bytes; "
                                       "refused before reading it whole (not a text document)\n")
    assert not (tmp_path / "tok.json").exists()
