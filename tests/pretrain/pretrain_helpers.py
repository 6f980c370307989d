"""A small corpus for the pretrain tests: a slice of the built-in one, written as JSONL and text files."""
import json

from pipeline.jobs.corpus import stdlib_documents

SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog.\n"
               "def forward(self, x):\n    return self.down(silu(self.gate(x)) * self.up(x))\n"
               "Numbers: 0 1 42 256 1024 3.14159 2026-11-29 12:35  it's, we'll, I'D\n"
               "   indented\n\n\ttabs\tand   runs of    spaces \r\n"
               "你好，世界。 こんにちは 안녕하세요 café naïve Ärger 🔥🚀\n"
               "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>after")


def small_documents(n_bytes=60_000):
    docs, total = [], 0
    for d in stdlib_documents():
        if total >= n_bytes:
            break
        docs.append(d[:4000])
        total += len(docs[-1])
    return docs


def write_jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({field: d}) + "\n")
    return str(path)
