"""A diverging run under `fucina launch`: spirals at lr 1e38 overflows at step 2 (a real NaN, no injection).

Default: the run stops with one error line naming the step, the trainer and the tensor, and checkpoint 1 stays
the latest; `--on-nonfinite skip` leaves every non-finite micro-batch out and ends on the in-process bits."""
import os
import subprocess

import pytest

from helpers import ROOT, env, launch, launch_cmd
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime import ckpt
from pipeline.runtime.inprocess import run_inprocess
from pipeline.runtime.monitor import metrics_line
from pipeline.threads import pin_threads

SPEC = {"steps": 4, "lr": 1e38, "warmup": 0, "checkpoint_every": 1, "eval_every": 0}
FLAGS = ["--steps", "4", "--lr", "1e38", "--warmup", "0", "--checkpoint-every", "1", "--eval-every", "0"]


def test_the_monitor_line_reports_skipped_micro_batches():
    line = metrics_line({"kind": "metrics", "step": 3, "total": 9, "loss": 0.5, "lr": 0.1, "grad_norm": 1.0,
                         "tokens_per_s": 10.0, "step_ms": 1.0, "skipped": [1, 3]})
    assert line.endswith("skipped non-finite micro-batches [1, 3]")


@pytest.mark.slow
def test_a_diverging_launch_stops_at_the_first_nan_with_one_line_and_its_last_checkpoint(tmp_path):
    out = subprocess.run(launch_cmd("spirals", tmp_path, "--trainers", "2", *FLAGS), capture_output=True,
                         text=True, timeout=240, env=env(), cwd=ROOT)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "optimizer step 2, micro-batch " in lines[0]
    assert "computed a non-finite (NaN, inf or |x| >= 2^64) loss" in lines[0]
    assert f"the latest checkpoint is {tmp_path}/checkpoint-step-1" in lines[0] and "trainer-" in lines[0]
    assert ckpt.latest_checkpoint(tmp_path).endswith("checkpoint-step-1")


@pytest.mark.slow
def test_skip_leaves_every_nonfinite_micro_batch_out_and_matches_inprocess(tmp_path):
    pin_threads(1)
    job = get_job("spirals")
    ref = run_inprocess(job(build(job.Spec, {**SPEC, "on_nonfinite": "skip"})), str(tmp_path / "ref"),
                        log=lambda m: None)
    out = launch("spirals", tmp_path / "run", "--trainers", "2", *FLAGS, "--on-nonfinite", "skip")
    assert out["nonfinite_skipped"] == ref["nonfinite_skipped"] == 3 * 4  # steps 2-4, every micro-batch
    assert out["params_sha256"] == ref["params_sha256"]
    assert os.path.isdir(tmp_path / "run" / "checkpoint-step-4")
