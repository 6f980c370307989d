"""`fucina tokenizer train` and `fucina pretrain` as a user runs them."""
import json
import os
import subprocess
import sys

import pytest

from pretrain_helpers import small_documents, write_jsonl
from pipeline.cli import main
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.llm.bpe_train import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tokenizer_train_writes_a_tokenizer_pretrain_can_use(tmp_path, capsys):
    data = write_jsonl(tmp_path / "docs.jsonl", small_documents(20_000))
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--data", data, "--vocab-size", "300", "--out", str(out)]) == 0
    tok, pre, digest = load_tokenizer(str(out))
    assert tok.get_vocab_size() == 300 and pre == "qwen2" and digest in capsys.readouterr().out
    job_cls = get_job("pretrain")
    job = job_cls(build(job_cls.Spec, {"preset": "tiny", "data": data, "tokenizer": str(out),
                                       "cache_dir": str(tmp_path / "cache"), "tokens": 5000}))
    assert job.tok_digest == digest and job.config.vocab_size == 300
    assert job.steps == 5 == -(-5000 // job.batch_tokens)  # --tokens decides the step count


@pytest.mark.parametrize("argv, message", [
    (["tokenizer", "train", "--data", "nowhere.txt"], "--data nowhere.txt: no such file or directory"),
    (["pretrain", "--data", "nowhere.txt", "--inprocess"], "--data nowhere.txt: no such file or directory"),
    (["pretrain", "--preset", "tiny", "--batch-tokens", "1000", "--inprocess"], "multiple of every window length"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, message):
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not os.listdir(tmp_path)


def test_pretrain_inprocess_end_to_end(tmp_path):
    data = write_jsonl(tmp_path / "docs.jsonl", small_documents(30_000))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "pretrain", "--inprocess", "--json", "--preset",
                           "tiny", "--data", data, "--vocab-size", "300", "--steps", "2", "--batch-tokens", "256",
                           "--micro-batches", "2", "--eval-every", "1", "--val-windows", "1", "--sample-tokens", "2",
                           "--cache-dir", str(tmp_path / "cache"), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["val_bpb"] > 0
    for name in ("model.gguf", "samples.jsonl", "pretrain.png", "pretrain-log.png", "metrics.jsonl", "pretrain.json"):
        assert (run_dir / name).is_file(), name
