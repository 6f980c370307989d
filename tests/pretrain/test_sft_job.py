"""The sft job: a tiny pretrained model fine-tuned on chat JSONL; assistant-only labels, same bits resumed."""
import json

import numpy as np
import pytest

from pretrain_helpers import small_documents, write_jsonl
from pipeline.errors import UserError
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.llm.data import IGNORE_INDEX
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer
from pipeline.models.registry import load_model
from pipeline.runtime.inprocess import run_inprocess
from pipeline.threads import pin_threads

SFT = get_job("sft")
CHATS = [[{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
         for a in range(3) for b in range(2)]


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    base = tmp_path_factory.mktemp("sft")
    pretrain = get_job("pretrain")
    pin_threads(1)
    pre = run_inprocess(pretrain(build(pretrain.Spec, {
        "preset": "tiny", "data": write_jsonl(base / "docs.jsonl", small_documents(30_000)), "vocab_size": 300,
        "steps": 1, "batch_tokens": 256, "micro_batches": 2, "eval_every": 0, "sample_tokens": 0,
        "cache_dir": str(base / "cache")})), str(base / "pretrain"), log=lambda m: None)
    chats = base / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    return {"model": pre["gguf"], "data": str(chats), "steps": 4, "batch": 4, "micro_batches": 2, "seq": 32,
            "warmup": 1, "checkpoint_every": 2}


def _run(run_dir, spec, resume=None):
    pin_threads(1)
    return run_inprocess(SFT(build(SFT.Spec, spec)), str(run_dir), resume=resume, log=lambda m: None)


def test_labels_are_the_assistant_turns_only(spec):
    job = SFT(build(SFT.Spec, spec))
    tok = Tokenizer.from_gguf(GGUFFile(spec["model"]))
    for i, chat in enumerate(CHATS):
        supervised = job.labels[i][job.labels[i] != IGNORE_INDEX]
        assert tok.decode(supervised.tolist(), special=True) == chat[1]["content"] + "<|im_end|>"


def test_sft_resumed_has_the_same_bits_and_writes_a_loadable_gguf(spec, tmp_path):
    full = _run(tmp_path / "full", spec)
    resumed = _run(tmp_path / "resumed", spec, resume=str(tmp_path / "full" / "checkpoint-step-2"))
    assert resumed["params_sha256"] == full["params_sha256"]
    before, after = load_model(spec["model"]), load_model(full["gguf"])
    ids = np.array(Tokenizer.from_gguf(GGUFFile(full["gguf"])).encode("<|im_start|>user\nhi"))
    assert not np.array_equal(before.infer(ids), after.infer(ids))  # the weights did move
    assert Tokenizer.from_gguf(GGUFFile(full["gguf"])).tokens == Tokenizer.from_gguf(GGUFFile(spec["model"])).tokens
    from pipeline.cli import main  # the last checkpoint exported is the run's model.gguf, byte for byte
    assert main(["export-gguf", "--from-checkpoint", str(tmp_path / "full"), "--out", str(tmp_path / "x.gguf")]) == 0
    assert (tmp_path / "x.gguf").read_bytes() == open(full["gguf"], "rb").read()


def test_sft_bad_input(spec, tmp_path):
    with pytest.raises(UserError, match="no such file"):
        SFT(build(SFT.Spec, {**spec, "model": str(tmp_path / "none.gguf")}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}\n')
    with pytest.raises(UserError, match="bad.jsonl:1"):
        SFT(build(SFT.Spec, {**spec, "data": str(bad)}))
