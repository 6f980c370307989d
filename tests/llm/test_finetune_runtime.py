"""`fucina finetune --trainers N` on the multiprocess runtime: the same final bits as in-process for 1 and 2
trainers, a stopped-and-resumed run and a trainer SIGKILLed mid-run; no shared-memory segment left behind;
`fucina monitor` attaches to the running fine-tune. Slow: every run starts six Python processes."""
import json
import os
import subprocess
import sys

import pytest

from pipeline.runtime import shm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")
FLAGS = ["--targets", "q,v", "--accum-steps", "2", "--shuffle", "--dropout", "0.1", "--lr", "3e-3",
         "--max-new-tokens", "3", "--threads", "1"]

pytestmark = pytest.mark.slow


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _finetune(run_dir, *flags, timeout=600, **extra_env):
    cmd = [sys.executable, "-m", "pipeline.cli", "finetune", "--model", MODEL, *FLAGS, "--save", str(run_dir),
           "--json", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(**extra_env), cwd=ROOT)
    assert out.returncode == 0, f"finetune failed ({out.returncode}):\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def _no_segments_left(run_dir):
    with open(os.path.join(run_dir, "run.json")) as fh:
        assert shm.run_segments(json.load(fh)["run_id"]) == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _finetune(tmp_path_factory.mktemp("ref") / "run", "--steps", "4")


def _same_bits(run, reference):
    assert run["adapters_sha256"] == reference["adapters_sha256"]
    assert run["params_sha256"] == reference["params_sha256"]
    assert run["final_loss"] == reference["final_loss"]


@pytest.mark.parametrize("trainers", [1, 2])
def test_n_trainers_equal_in_process(trainers, reference, tmp_path):
    run = _finetune(tmp_path / "run", "--steps", "4", "--trainers", str(trainers))
    assert reference["mode"] == "in-process" and run["mode"] == f"trainers {trainers}"
    _same_bits(run, reference)
    _no_segments_left(tmp_path / "run")


def test_a_trainer_killed_mid_run_is_replaced_and_the_bits_stay(reference, tmp_path):
    run = _finetune(tmp_path / "run", "--steps", "4", "--trainers", "2", FUCINA_FAULT="trainer:grad:1")
    assert (tmp_path / "run" / "fault-trainer-grad-1.fired").exists()  # the SIGKILL happened
    _same_bits(run, reference)
    _no_segments_left(tmp_path / "run")


def test_stopped_and_resumed_on_the_runtime(reference, tmp_path):
    half = _finetune(tmp_path / "a", "--steps", "2", "--trainers", "2")
    assert half["adapters_sha256"] != reference["adapters_sha256"]
    resumed = _finetune(tmp_path / "b", "--steps", "4", "--trainers", "1", "--resume", str(tmp_path / "a"))
    _same_bits(resumed, reference)
    _no_segments_left(tmp_path / "b")


def test_packed_on_two_trainers_equals_in_process(tmp_path):
    """--pack (3 samples per step in windows of 160 tokens: a window of two, one of one, an empty one) on the
    runtime: two trainers end with the in-process run's bits."""
    flags = ("--steps", "3", "--pack", "--seq-max", "160", "--accum-steps", "3")
    reference = _finetune(tmp_path / "a", *flags)
    run = _finetune(tmp_path / "b", *flags, "--trainers", "2")
    assert run["mode"] == "trainers 2"
    _same_bits(run, reference)
    _no_segments_left(tmp_path / "b")


def test_monitor_attaches_to_a_running_finetune(tmp_path):
    """The monitor is started first and waits for the run (a tiny step takes milliseconds once warm: a monitor
    started after the run could miss it), then follows it to run_finished."""
    run_dir = tmp_path / "run"
    monitor = [sys.executable, "-m", "pipeline.cli", "monitor", "--run-dir", str(run_dir), "--jsonl", "--wait", "300",
               "--timeout", "600"]
    mon = subprocess.Popen(monitor, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        summary = _finetune(run_dir, "--steps", "40", "--trainers", "1")
        out, err = mon.communicate(timeout=300)
    finally:
        if mon.poll() is None:
            mon.kill()
    assert mon.returncode == 0, err[-2000:]
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    metrics = [r for r in records if r["kind"] == "metrics"]
    assert metrics, records
    assert all(r["total"] == 40 and r["loss"] > 0 and r["tokens_per_s"] > 0 for r in metrics)
    finished = [r for r in records if r["kind"] == "event" and r["event"] == "run_finished"]
    assert finished and finished[-1]["detail"]["adapters_sha256"] == summary["adapters_sha256"]
    assert metrics[-1]["loss"] == summary["final_loss"]


def test_the_procfile_starts_a_finetune_from_a_job_file(tmp_path):
    job_file = tmp_path / "finetune.toml"
    job_file.write_text(f'model = "{MODEL}"\nsteps = 3\ntargets = "q,v"\nbatch_size = 2\n')
    honcho = os.path.join(os.path.dirname(sys.executable), "honcho")
    out = subprocess.run([honcho, "start", "-c", "trainer=1"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=_env(PYTHON=sys.executable, JOB="finetune", CONFIG=str(job_file),
                                  RUN_DIR=str(tmp_path / "run")))
    assert '"event": "run_finished"' in out.stdout, out.stdout[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["job"] == "finetune" and summary["steps"] == 3
    assert (tmp_path / "run" / "adapters.safetensors").is_file() and (tmp_path / "run" / "loss.png").is_file()
    _no_segments_left(tmp_path / "run")


def test_validation_and_keep_best_on_two_trainers_equal_in_process(tmp_path):
    """--val-split / --eval-every / --keep best run by the optimizer role: the same val losses, best checkpoint and
    training bits as in-process."""
    flags = ("--steps", "3", "--val-split", "0.4", "--eval-every", "1", "--keep", "best")
    here = _finetune(tmp_path / "inproc", *flags)
    there = _finetune(tmp_path / "two", *flags, "--trainers", "2")
    _same_bits(there, here)
    assert there["val_loss"] == here["val_loss"] is not None and there["best"] == here["best"]
    assert (tmp_path / "two" / "best" / "adapters.safetensors").read_bytes() == \
        (tmp_path / "inproc" / "best" / "adapters.safetensors").read_bytes()
