"""metrics.jsonl after a resume holds each step once, equal to the uninterrupted run's records."""
import json
import os

import pytest

from pipeline.errors import CheckpointError
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime.inprocess import run_inprocess
from pipeline.runtime.metrics import MetricsLog, read_metrics
from pipeline.threads import pin_threads

SPEC = {"steps": 12, "batch": 32, "micro_batches": 2, "checkpoint_every": 4, "eval_every": 4}
SAME = ("loss", "lr", "grad_norm", "eval")  # the values the determinism contract fixes (not times)


def _steps(run_dir):
    return [r for r in read_metrics(run_dir) if r.get("kind") == "metrics"]


def test_rewind_drops_later_step_records_and_a_cut_line_keeps_events(tmp_path):
    log = MetricsLog(tmp_path)
    for s in (1, 2, 3):
        log.write({"kind": "metrics", "step": s, "loss": s / 7})
        log.write({"kind": "event", "event": "checkpoint_committed", "step": s})
    log.fh.write('{"kind": "metrics", "step": 4, "lo')  # the crash cut this line
    log.close()
    log = MetricsLog(tmp_path)
    assert log.rewind(2)
    log.write({"kind": "metrics", "step": 3, "loss": 3 / 7})
    log.close()
    records = read_metrics(tmp_path)
    assert [(r["kind"], r["step"]) for r in records] == [("metrics", 1), ("event", 1), ("metrics", 2), ("event", 2),
                                                         ("event", 3), ("metrics", 3)]
    assert records[-1]["loss"] == 3 / 7
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    log = MetricsLog(tmp_path)
    assert not log.rewind(3)  # nothing after step 3: the file is left as it is
    log.close()


def test_an_inprocess_resume_into_the_same_run_dir_records_each_step_once(tmp_path):
    pin_threads(1)
    job = get_job("spirals")
    ref = run_inprocess(job(build(job.Spec, SPEC)), str(tmp_path / "ref"), log=lambda m: None)
    run_dir = str(tmp_path / "run")
    run_inprocess(job(build(job.Spec, SPEC)), run_dir, log=lambda m: None)
    out = run_inprocess(job(build(job.Spec, SPEC)), run_dir, resume=os.path.join(run_dir, "checkpoint-step-4"),
                        log=lambda m: None)
    assert out["params_sha256"] == ref["params_sha256"]
    got, want = _steps(run_dir), _steps(str(tmp_path / "ref"))
    assert [r["step"] for r in got] == list(range(1, 13))
    assert [[r.get(k) for k in SAME] for r in got] == [[r.get(k) for k in SAME] for r in want]  # bitwise (JSON repr)
    started = [r for r in read_metrics(run_dir) if r.get("event") == "run_started"]
    assert len(started) == 2  # the history of the restart is kept
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        assert all(json.loads(line) for line in fh)


def test_a_rewind_that_cannot_write_names_the_file_and_leaves_it_whole(tmp_path):
    log = MetricsLog(tmp_path)
    for s in (1, 2, 3):
        log.write({"kind": "metrics", "step": s, "loss": s / 7})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    (tmp_path / f"metrics.jsonl.tmp-{os.getpid()}").mkdir()  # the temp file's name taken: open() fails
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl: cannot rewind the metrics log to step 1"):
        log.rewind(1)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert (tmp_path / f"metrics.jsonl.tmp-{os.getpid()}").is_dir()  # not ours: not removed
    log.write({"kind": "metrics", "step": 4, "loss": 4 / 7})  # the log is still open for appends
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
