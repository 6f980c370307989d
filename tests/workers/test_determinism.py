"""The headline guarantee: same bits in-process, with 1 or 2 trainers, and stopped+resumed."""
import os

import pytest

from helpers import LM, SPIRALS, launch
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime import ckpt
from pipeline.runtime.inprocess import run_inprocess
from pipeline.threads import pin_threads

SPIRALS_SPEC = {"steps": 40, "batch": 32, "micro_batches": 4, "checkpoint_every": 20, "eval_every": 20}


def _inprocess(tmp_path, name, spec, resume=None):
    pin_threads(1)
    job = get_job(name)
    return run_inprocess(job(build(job.Spec, spec)), str(tmp_path), resume=resume, log=lambda m: None)


def test_inprocess_resume_gives_the_same_bits(tmp_path):
    full = _inprocess(tmp_path / "full", "spirals", SPIRALS_SPEC)
    resumed = _inprocess(tmp_path / "resumed", "spirals", SPIRALS_SPEC,
                         resume=str(tmp_path / "full" / "checkpoint-step-20"))
    assert resumed["start_step"] == 20
    assert resumed["params_sha256"] == full["params_sha256"]
    stored = ckpt.read_params(full["checkpoint"])
    assert ckpt.params_sha256(stored) == full["params_sha256"]


def test_micro_batch_split_changes_bits_but_not_the_math(tmp_path):
    """A control: the digest is sensitive (a different plan gives different bits)."""
    a = _inprocess(tmp_path / "a", "spirals", SPIRALS_SPEC)
    b = _inprocess(tmp_path / "b", "spirals", {**SPIRALS_SPEC, "micro_batches": 2})
    assert a["params_sha256"] != b["params_sha256"]
    assert abs(a["final_loss"] - b["final_loss"]) < 0.05


def test_one_trainer_pipeline_equals_inprocess(tmp_path):
    inproc = _inprocess(tmp_path / "inproc", "spirals", SPIRALS_SPEC)
    piped = launch("spirals", tmp_path / "piped", "--trainers", "1", *SPIRALS)
    assert piped["params_sha256"] == inproc["params_sha256"]
    assert piped["steps"] == 40 and piped["final_loss"] == inproc["final_loss"]
    assert os.path.exists(os.path.join(piped["run_dir"], "loss.png"))


@pytest.mark.slow
def test_two_trainers_and_pipeline_resume_equal_inprocess(tmp_path):
    inproc = launch("spirals", tmp_path / "inproc", "--inprocess", *SPIRALS)
    two = launch("spirals", tmp_path / "two", "--trainers", "2", *SPIRALS)
    resumed = launch("spirals", tmp_path / "resumed", "--trainers", "2", "--resume",
                     str(tmp_path / "inproc" / "checkpoint-step-20"), *SPIRALS)
    assert two["params_sha256"] == inproc["params_sha256"]
    assert resumed["params_sha256"] == inproc["params_sha256"]


@pytest.mark.slow
def test_short_lm_is_bit_identical_everywhere(tmp_path):
    inproc = launch("lm", tmp_path / "inproc", "--inprocess", *LM)
    one = launch("lm", tmp_path / "one", "--trainers", "1", *LM)
    two = launch("lm", tmp_path / "two", "--trainers", "2", *LM)
    resumed = launch("lm", tmp_path / "resumed", "--trainers", "2", "--resume",
                     str(tmp_path / "one" / "checkpoint-step-3"), *LM)
    digests = {r["params_sha256"] for r in (inproc, one, two, resumed)}
    assert len(digests) == 1, digests
    assert os.path.getsize(two["gguf"]) > 0 and two["sample"].startswith("The for statement")


TINY_LM = {"steps": 4, "batch": 4, "micro_batches": 2, "seq": 16, "hidden": 16, "layers": 1, "heads": 2,
           "kv_heads": 1, "head_dim": 8, "ffn": 32, "checkpoint_every": 2, "eval_every": 2, "val_batches": 1,
           "sample_tokens": 4}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_lm_resume_is_bit_exact_with_each_optimizer_recipe(tmp_path, optimizer):
    spec = {**TINY_LM, "optimizer": optimizer, "weight_decay": 0.1}
    full = _inprocess(tmp_path / "full", "lm", spec)
    resumed = _inprocess(tmp_path / "resumed", "lm", spec, resume=str(tmp_path / "full" / "checkpoint-step-2"))
    assert resumed["params_sha256"] == full["params_sha256"]
    assert full["final_loss"] < 6.0 and os.path.exists(full["gguf"])
