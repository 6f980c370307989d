"""`fucina finetune` end to end on a tiny GGUF (the finetune job run in-process): resume bit-exactness,
the job == today's accumulation windows, checkpoints, verify-grads, clear errors. The multiprocess runs
(1 and 2 trainers, a trainer killed, resumed) are in test_finetune_runtime.py."""
import json
import os

import pytest

from pipeline.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_path():
    """The committed tiny Qwen3 in Q8_0: a quantized frozen base."""
    return os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run without --save gets runs/finetune-<time> in the working directory


def _run(capsys, *argv):
    rc = main(["finetune", "--targets", "q,v", "--accum-steps", "1", *argv, "--json", "--max-new-tokens", "3"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out.strip().splitlines()[-1]) if rc == 0 else None), out.err


COMMON = ("--accum-steps", "2", "--shuffle", "--dropout", "0.1", "--lr", "3e-3")


def test_stop_and_resume_is_bit_identical(model_path, tmp_path, capsys):
    rc, full, _ = _run(capsys, "--model", model_path, "--steps", "4", *COMMON)
    assert rc == 0 and full["steps"] == 4
    rc, half, _ = _run(capsys, "--model", model_path, "--steps", "2", "--save", str(tmp_path / "a"), *COMMON)
    assert rc == 0 and half["adapters_sha256"] != full["adapters_sha256"]
    state = json.loads((tmp_path / "a" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["accum_steps"] == 2
    assert state["config"]["lora"]["alpha"] == 16.0 and state["config"]["lora"]["rank"] == 8
    assert state["config"]["job"] == "finetune" and state["loader"]["rows_consumed"] == 4
    # the resumed run keeps the checkpoint's accum_steps and lr even if the flags say otherwise
    rc, resumed, err = _run(capsys, "--model", model_path, "--steps", "4", "--load", str(tmp_path / "a"),
                            "--accum-steps", "2", "--shuffle", "--dropout", "0.1", "--lr", "1e-1")
    assert rc == 0, err
    assert resumed["adapters_sha256"] == full["adapters_sha256"]
    assert resumed["final_loss"] == full["final_loss"]
    assert resumed["params_sha256"] == full["params_sha256"]
    from safetensors.numpy import load_file
    names = sorted(load_file(tmp_path / "a" / "adapters.safetensors"))
    assert names[0] == "layers.0.q.lora_a" and len(names) == 2 * 2 * 2


def test_the_job_computes_what_accumulation_windows_in_one_process_compute(model_path, capsys):
    """The finetune job (loader slots, pre-scaled micro-batch gradients reduced in index order, the
    optimizer role) against Session.window, the plain loop of backward passes over the Loader's order."""
    import argparse
    from pipeline.commands import finetune as command
    from pipeline.finetune.model import adapters_sha256
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    flags = ["--steps", "3", *COMMON, "--warmup", "1", "--decay", "cosine", "--clip", "0.5"]
    args = parser.parse_args(["--model", model_path, "--targets", "q,v", *flags])
    session, _ = command.build(args, log=lambda m: None)
    windows = [session.window()[0] for _ in range(3)]
    assert session.optimizer.lr == pytest.approx(3e-3 * 0.5)  # step 2 of 3: half way down the cosine after warm-up
    rc, job_run, err = _run(capsys, "--model", model_path, *flags)
    assert rc == 0, err
    assert job_run["adapters_sha256"] == adapters_sha256(session.trainer)
    assert job_run["initial_loss"] == windows[0] and job_run["final_loss"] == windows[-1]


def test_epochs_batch_size_and_decay_resume_bit_identically(model_path, tmp_path, capsys):
    """--epochs 2 of the 5 pirate pairs in batches of 3: ceil(10 / 3) = 4 steps (the last topped up from the
    third epoch's order). Stopped at step 2 and resumed with other --batch-size / --decay flags, the run keeps the
    checkpoint's and ends with the uninterrupted run's bits."""
    flags = ("--shuffle", "--lr", "3e-3", "--warmup", "1", "--decay", "linear")
    rc, full, err = _run(capsys, "--model", model_path, "--epochs", "2", "--batch-size", "3", *flags)
    assert rc == 0, err
    assert full["steps"] == 4 and "batch 3; 4 steps" in err
    rc, half, _ = _run(capsys, "--model", model_path, "--steps", "2", "--batch-size", "3", *flags,
                       "--save", str(tmp_path / "a"))
    assert rc == 0 and half["adapters_sha256"] != full["adapters_sha256"]
    state = json.loads((tmp_path / "a" / "trainer_state.json").read_text())
    assert state["config"]["spec"]["batch_size"] == 3 and state["schedule"]["decay"] == "linear"
    rc, resumed, err = _run(capsys, "--model", model_path, "--epochs", "2", "--batch-size", "2", "--shuffle",
                            "--lr", "3e-3", "--warmup", "1", "--decay", "constant", "--resume", str(tmp_path / "a"))
    assert rc == 0, err
    assert "batch size 3" in err and "decay linear" in err
    assert resumed["steps"] == 4 and resumed["adapters_sha256"] == full["adapters_sha256"]
    assert resumed["final_loss"] == full["final_loss"]


def test_pack_is_the_unpacked_run_within_float_tolerance_and_resumes_bit_identically(model_path, tmp_path, capsys):
    """--pack: 3 samples of 64-75 tokens per step in windows of 160 (two samples in one, the third alone, and an
    empty window: the bound on windows per step is 3, from the data alone): the same
    step losses as one sample per micro-batch within float tolerance (dropout 0), and a packed run with dropout
    stopped at step 2 and resumed (without --pack on the command line: the checkpoint's wins) ends with the bits
    of the uninterrupted packed run."""
    import math
    flags = ("--batch-size", "3", "--seq-max", "160", "--shuffle", "--lr", "3e-3", "--steps", "3")
    rc, plain, err = _run(capsys, "--model", model_path, *flags)
    assert rc == 0, err
    rc, pack, err = _run(capsys, "--model", model_path, *flags, "--pack")
    assert rc == 0, err
    assert "batch 3 packed" in err
    assert pack["initial_loss"] == pytest.approx(plain["initial_loss"], rel=1e-5)
    assert pack["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-4)
    from pipeline.finetune.job import Finetune
    from pipeline.finetune.spec import FinetuneSpec
    job = Finetune(FinetuneSpec(model=model_path, batch_size=3, seq_max=160, shuffle=True, pack=True, lr=3e-3))
    assert job.micro_batches == 3 and [[len(s.inputs) for s in w] for w in job.windows(0)] == [[68, 72], [65]]
    dropout = ("--dropout", "0.1", "--checkpoint-layers")
    rc, full, _ = _run(capsys, "--model", model_path, *flags, "--pack", *dropout)
    rc2, half, _ = _run(capsys, "--model", model_path, *flags[:-1], "2", "--pack", *dropout, "--save",
                        str(tmp_path / "p"))
    assert rc == rc2 == 0 and math.isfinite(full["final_loss"])
    state = json.loads((tmp_path / "p" / "trainer_state.json").read_text())
    assert state["config"]["spec"]["pack"] is True and state["accum_steps"] == 3  # windows a step can need
    rc, resumed, err = _run(capsys, "--model", model_path, *flags, *dropout, "--resume", str(tmp_path / "p"))
    assert rc == 0, err
    assert resumed["adapters_sha256"] == full["adapters_sha256"] and resumed["final_loss"] == full["final_loss"]


def test_steps_and_epochs_exclude_each_other(model_path, capsys):
    rc, _, err = _run(capsys, "--model", model_path, "--steps", "3", "--epochs", "1")
    assert rc == 2 and "--steps 3 and --epochs 1 exclude each other" in err
    rc, _, err = _run(capsys, "--model", model_path, "--epochs", "-1")
    assert rc == 2 and "epochs must be >= 0" in err


def test_save_every_and_checkpoint_layers(model_path, tmp_path, capsys):
    rc, plain, _ = _run(capsys, "--model", model_path, "--steps", "2", "--dropout", "0.2")
    rc2, ckpt, _ = _run(capsys, "--model", model_path, "--steps", "2", "--dropout", "0.2", "--checkpoint-layers",
                        "--save", str(tmp_path / "r"), "--save-every", "1")
    assert rc == rc2 == 0
    assert ckpt["adapters_sha256"] == plain["adapters_sha256"]
    assert (tmp_path / "r" / "checkpoint-step-1" / "trainer_state.json").is_file()
    assert (tmp_path / "r" / "checkpoint-step-1" / "adapters.safetensors").is_file()
    assert (tmp_path / "r" / "adapters.safetensors").is_file() and (tmp_path / "r" / "trainer_state.json").is_file()
    assert (tmp_path / "r" / "metrics.jsonl").is_file() and (tmp_path / "r" / "loss.png").is_file()


def test_loss_falls_and_json_summary(model_path, capsys):
    rc, s, _ = _run(capsys, "--model", model_path, "--steps", "8", "--lr", "1e-2")
    assert rc == 0
    assert set(s) >= {"initial_loss", "final_loss", "before", "after", "steps", "adapters_sha256"}
    assert s["final_loss"] < s["initial_loss"]


def test_verify_grads_passes(model_path, capsys):
    rc = main(["finetune", "--model", model_path, "--verify-grads", "--targets", "q,v,down", "--accum-steps", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("[PASS]") == 4


def test_rank_mismatch_on_resume_is_a_config_error(model_path, tmp_path, capsys):
    assert _run(capsys, "--model", model_path, "--steps", "1", "--save", str(tmp_path / "c"))[0] == 0
    rc, _, err = _run(capsys, "--model", model_path, "--steps", "2", "--load", str(tmp_path / "c"), "--rank", "4")
    assert rc == 2 and "config.lora.rank" in err and "is 8" in err


def test_bad_inputs_are_one_line_errors(model_path, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "response": "b"}\n{"instruction": "a" "response": "b"}\n')
    rc, _, err = _run(capsys, "--model", model_path, "--data", str(bad))
    assert rc == 2 and "bad.jsonl:2: malformed JSON" in err
    rc, _, err = _run(capsys, "--model", model_path, "--seq-max", "8")
    assert rc == 2 and "sample too long" in err
    rc, _, err = _run(capsys, "--model", str(tmp_path / "none.gguf"))
    assert rc == 2 and "no such file" in err
    rc, _, err = _run(capsys, "--model", model_path, "--targets", "q,z")
    assert rc == 2 and "targets" in err
    rc, _, err = _run(capsys, "--model", model_path, "--save-every", "2")
    assert rc == 2 and "--save" in err
    rc, _, err = _run(capsys, "--model", model_path, "--inprocess", "--trainers", "2")
    assert rc == 2 and "--inprocess" in err
    assert _run(capsys, "--model", model_path, "--steps", "1", "--save", str(tmp_path / "d"))[0] == 0
    rc, _, err = _run(capsys, "--model", model_path, "--steps", "1", "--save", str(tmp_path / "d"))
    assert rc == 2 and "already holds checkpoints" in err and "--resume" in err


def test_tensorboard_dir_gets_the_step_records(model_path, tmp_path, capsys):
    """--tensorboard DIR: one event file with each step's loss/lr/tokens/s as metrics.jsonl has them; an
    unwritable DIR is refused before the model is loaded."""
    import glob

    import numpy as np

    from pipeline.runtime.metrics import read_metrics
    from pipeline.runtime.tensorboard import read_events
    rc, s, _ = _run(capsys, "--model", model_path, "--steps", "2", "--save", str(tmp_path / "r"),
                    "--tensorboard", str(tmp_path / "tb"))
    assert rc == 0
    (path,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    events = read_events(path)[1:]
    records = [r for r in read_metrics(s["run_dir"]) if r["kind"] == "metrics"]
    assert [e["step"] for e in events] == [1, 2]
    assert [e["scalars"]["train/loss"] for e in events] == [float(np.float32(r["loss"])) for r in records]
    assert all({"train/lr", "train/tokens_per_s", "train/gflop_per_s"} <= set(e["scalars"]) for e in events)
    (tmp_path / "file").write_text("x")
    rc, _, err = _run(capsys, "--model", model_path, "--tensorboard", str(tmp_path / "file" / "tb"))
    assert rc == 2 and f"--tensorboard {tmp_path}/file/tb: cannot write there" in err
