"""`fucina finetune` validation and selection (--val-data / --val-split, --eval-every, --keep best), the defaults by
model width, the divergence warning, and the small things of issue 29 (no monitor hint in-process, conversations
not counted as pairs, a missing --resume reported as missing, run_started without a step, the compile notice)."""
import json
import os

import pytest
from test_export_fixtures import write_tiny_qwen3

from pipeline.cli import main
from pipeline.commands.finetune import DivergenceWatch, default_lr
from pipeline.commands.launch import _progress
from pipeline.finetune.build import split_records
from pipeline.finetune.spec import FinetuneSpec
from pipeline.llm import data as sft
from pipeline.runtime.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _run(capsys, *argv, json_out=True):
    rc = main(["finetune", "--model", MODEL, "--targets", "q,v", "--accum-steps", "1", "--max-new-tokens", "2",
               *argv, *(("--json",) if json_out else ())])
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1]) if rc == 0 and json_out else None
    return rc, summary, out


def test_the_split_is_whole_records_deterministic_and_seeded():
    records = list(range(20))
    train, val = split_records(records, 0.25, seed=3)
    assert len(val) == 5 and sorted(train + val) == records and train == sorted(train) and val == sorted(val)
    assert split_records(records, 0.25, seed=3) == (train, val)
    assert split_records(records, 0.25, seed=4)[1] != val
    with pytest.raises(Exception, match="both need at least one"):
        split_records(records[:2], 0.1, seed=0)


def test_validation_is_measured_kept_best_and_leaves_the_training_bits_alone(tmp_path, capsys):
    common = ("--steps", "4", "--val-split", "0.4", "--lr", "3e-3")
    rc, plain, _ = _run(capsys, "--steps", "4", "--lr", "3e-3", "--save", str(tmp_path / "nv"),
                        "--data", _pirate_file(tmp_path, 5), "--format", "instruction")
    assert rc == 0
    rc, summary, out = _run(capsys, *common, "--eval-every", "1", "--keep", "best", "--save", str(tmp_path / "v"),
                            "--data", _pirate_file(tmp_path, 5), "--format", "instruction")
    assert rc == 0, out.err
    evals = [r["eval"] for r in read_metrics(tmp_path / "v") if r.get("kind") == "metrics"]
    assert len(evals) == 4 and all(isinstance(v, float) and v > 0 for v in evals)
    assert summary["val_loss"] == evals[-1]
    best = json.loads((tmp_path / "v" / "best" / "best.json").read_text())
    assert best["val_loss"] == min(evals) and evals[best["step"] - 1] == min(evals)
    assert summary["best"] == best and "best val_loss" in out.err
    from pipeline.llm.lora_serve import load_lora
    assert len(load_lora(tmp_path / "v" / "best")) == 2 * 2  # a directory --lora and export-gguf take
    # 3 of the 5 records train either way? no: the split removes 2 from training, so compare against a run on
    # exactly the training records, without validation: validation must not change a bit
    train, _ = split_records(list(sft.PIRATE_PAIRS), 0.4, seed=42)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"instruction": p.instruction, "response": p.response}) + "\n" for p in train))
    rc, same, _ = _run(capsys, "--steps", "4", "--lr", "3e-3", "--data", str(path), "--save", str(tmp_path / "t"))
    assert rc == 0 and same["adapters_sha256"] == summary["adapters_sha256"]
    assert plain["adapters_sha256"] != summary["adapters_sha256"]


def test_val_data_file_and_bad_validation_flags(tmp_path, capsys):
    data = _pirate_file(tmp_path, 5)
    rc, summary, out = _run(capsys, "--steps", "2", "--val-data", data, "--save", str(tmp_path / "r"))
    assert rc == 0 and summary["val_loss"] is not None
    rc, _, out = _run(capsys, "--steps", "2", "--val-data", data, "--save", str(tmp_path / "r2"), json_out=False)
    assert rc == 0 and "val_loss " in out.out  # the progress line names it (not a bare "eval")
    rc, _, out = _run(capsys, "--steps", "2", "--keep", "best")
    assert rc == 2 and "keep = best needs a validation set" in out.err
    rc, _, out = _run(capsys, "--steps", "2", "--val-split", "0.3", "--val-data", data)
    assert rc == 2 and "val_data or val_split, not both" in out.err


def _pirate_file(tmp_path, n):
    path = tmp_path / "pirate.jsonl"
    path.write_text("".join(json.dumps({"instruction": p.instruction, "response": p.response}) + "\n"
                            for p in sft.PIRATE_PAIRS[:n]))
    return str(path)


def test_in_process_prints_no_monitor_hint_and_counts_conversations(tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": "Ahoy!"},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Fair winds."}]}) + "\n"
        for i in range(3)))
    rc, _, out = _run(capsys, "--steps", "1", "--data", str(chats), "--save", str(tmp_path / "c"), json_out=False)
    assert rc == 0
    assert "run dir " in out.out and "fucina monitor" not in out.out
    assert "; 3 conversations;" in out.out and "pairs" not in out.out


def test_a_missing_resume_directory_is_reported_as_missing(tmp_path, capsys):
    rc, _, out = _run(capsys, "--steps", "2", "--resume", str(tmp_path / "nowhere"))
    assert rc == 2 and f"--resume {tmp_path / 'nowhere'}: no such directory" in out.err


def test_run_started_is_shown_without_a_step():
    started = {"event": "run_started", "step": 0, "detail": {"trainers": 2, "steps": 8}}
    assert _progress.event_line(started) == "run_started trainers=2, steps=8"
    saved = {"event": "checkpoint_committed", "step": 6, "detail": {"path": "x"}}
    assert _progress.event_line(saved) == "step 6: checkpoint_committed path=x"


def test_the_first_call_says_it_compiles_and_a_warm_one_does_not(capsys):
    """The commands that compile in-process listen for numba's compile event (pipeline/compile_notice.py):
    a call that compiles prints the notice on stderr; the same call again compiles nothing and prints nothing."""
    assert main(["eval-logits", "--model", MODEL, "--tokens", "1,2", "--json"]) == 0
    capsys.readouterr()  # compiled now (or loaded from the cache)
    assert main(["eval-logits", "--model", MODEL, "--tokens", "1,2", "--json"]) == 0
    assert "compiling" not in capsys.readouterr().err


def test_the_default_lr_follows_the_models_width(tmp_path):
    assert default_lr(MODEL) == 1e-2  # the small models (the pirate demo's documented flags)
    wide = write_tiny_qwen3(tmp_path / "wide.gguf", hidden=512, layers=1, heads=4, kv_heads=2, head_dim=128, ffn=512)
    assert default_lr(wide) == 2e-4   # a real model's width: PEFT's usual LoRA rate


def test_a_diverging_loss_is_said_loudly_once():
    said = []
    watch = DivergenceWatch(FinetuneSpec(model="m", lr=1e-2), said.append)
    for loss in (3.0, 3.5, 2.0, 7.5, 9.0):
        watch({"loss": loss})
    assert len(said) == 1 and "rose from 3.0000 to 7.5000" in said[0] and "--lr 0.001" in said[0]
    assert "--targets q,k,v,o" in said[0]
    assert not DivergenceWatch.diverged(0.4, 1.3) and DivergenceWatch.diverged(6.8, 14.13)


# val_loss here: 40.4 .. 16.40 (step 5), then 16.65, 16.71: the stop at step 7
PATIENCE = ("--lr", "0.1", "--eval-every", "1", "--patience", "2")


def _val_file(tmp_path):
    """Held-out answers the pirate training moves away from: its validation loss stops falling within a few steps."""
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps({"instruction": p.instruction, "response": "I do not know."}) + "\n"
                            for p in sft.PIRATE_PAIRS))
    return str(path)


def test_patience_stops_early_with_the_same_bits_resumed(tmp_path, capsys):
    """--patience 2: the run ends at the second evaluation in a row without a lower val_loss, that step's checkpoint
    its last; a run stopped before it and resumed stops at the same step with the same bits, and resuming the
    stopped run trains no further."""
    val = _val_file(tmp_path)
    rc, full, out = _run(capsys, "--steps", "12", "--val-data", val, *PATIENCE, "--save", str(tmp_path / "a"))
    assert rc == 0, out.err
    evals = [r["eval"] for r in read_metrics(tmp_path / "a") if r.get("kind") == "metrics"]
    best = evals.index(min(evals))
    assert full["steps"] == len(evals) == best + 3 < 12 and min(evals[best + 1:]) >= evals[best]
    assert f"early stop at step {full['steps']} of 12" in out.err
    rc, part, _ = _run(capsys, "--steps", str(full["steps"] - 1), "--val-data", val, *PATIENCE,
                       "--save", str(tmp_path / "b"))
    assert rc == 0 and part["steps"] == full["steps"] - 1
    rc, resumed, out = _run(capsys, "--steps", "12", "--val-data", val, *PATIENCE, "--resume", str(tmp_path / "b"))
    assert rc == 0, out.err
    assert (resumed["steps"], resumed["adapters_sha256"]) == (full["steps"], full["adapters_sha256"])
    rc, again, _ = _run(capsys, "--steps", "12", "--val-data", val, *PATIENCE, "--resume", str(tmp_path / "a"))
    assert rc == 0 and (again["steps"], again["adapters_sha256"]) == (full["steps"], full["adapters_sha256"])


@pytest.mark.slow
def test_patience_on_trainers_stops_where_in_process_does(tmp_path, capsys):
    val = _val_file(tmp_path)
    rc, here, _ = _run(capsys, "--steps", "12", "--val-data", val, *PATIENCE, "--save", str(tmp_path / "a"))
    rc2, there, out = _run(capsys, "--steps", "12", "--val-data", val, *PATIENCE, "--trainers", "2",
                           "--save", str(tmp_path / "b"))
    assert rc == rc2 == 0, out.err
    assert (there["steps"], there["adapters_sha256"]) == (here["steps"], here["adapters_sha256"]) and here["steps"] < 12


def test_patience_needs_a_validation_set(capsys):
    rc, _, out = _run(capsys, "--steps", "2", "--patience", "2")
    assert rc == 2 and "patience" in out.err and "needs a validation set" in out.err
