"""--tensorboard DIR: the event files we write ourselves (TFRecord framing, crc32c, hand-encoded Event protobufs),
read back by our reader (crcs checked) and, when TensorBoard is installed, by its own EventAccumulator; the
step records of a run land there as the same values metrics.jsonl holds; the progress line's share of peak."""
import glob
import os
import struct

import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime import peak, tensorboard as tb
from pipeline.runtime.inprocess import run_inprocess
from pipeline.runtime.metrics import MetricsLog, gflop_rate, read_metrics
from pipeline.threads import pin_threads

SPEC = {"steps": 6, "batch": 32, "micro_batches": 2, "checkpoint_every": 3, "eval_every": 3}


def _f32(x):
    return float(np.float32(x))


def test_crc32c_is_castagnoli_and_a_frame_is_tfrecord():
    assert tb.crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert tb.crc32c(b"") == 0
    data = b"hello"
    framed = tb.frame(data)
    assert struct.unpack("<Q", framed[:8])[0] == 5 and framed[12:17] == data and len(framed) == 5 + 16
    c = tb.crc32c(data)
    assert struct.unpack("<I", framed[-4:])[0] == (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_events_round_trip_and_a_flipped_byte_is_caught(tmp_path):
    w = tb.EventWriter(str(tmp_path / "tb"))
    w.scalars(1, {"train/loss": 2.5, "train/lr": 1e-3}, wall_time=123.25)
    w.scalars(2 ** 40, {"eval/val_loss": -0.125, "skipped": None, "flag": True})  # non-numbers are left out
    w.scalars(3, {})  # nothing to write: no record
    w.close()
    assert os.path.basename(w.path).startswith("events.out.tfevents.")
    events = tb.read_events(w.path)
    assert events[0]["file_version"] == "brain.Event:2" and events[0]["scalars"] == {}
    assert events[1] == {"wall_time": 123.25, "step": 1, "scalars": {"train/loss": 2.5, "train/lr": _f32(1e-3)}}
    assert events[2]["step"] == 2 ** 40 and events[2]["scalars"] == {"eval/val_loss": -0.125}
    assert len(events) == 3
    assert tb.decode_event(tb.encode_event(0.0, -1))["step"] == -1  # int64 as ten varint bytes
    raw = bytearray(open(w.path, "rb").read())
    raw[-6] ^= 1
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="bad data crc"):
        tb.read_events(str(bad))
    bad.write_bytes(bytes(raw[:-2]))
    with pytest.raises(ValueError, match="cut short"):
        tb.read_events(str(bad))


def test_metrics_log_sends_step_records_only(tmp_path):
    log = MetricsLog(str(tmp_path), tensorboard=str(tmp_path / "tb"))
    log.write({"kind": "event", "event": "run_started", "step": 0})
    log.write({"kind": "metrics", "step": 1, "loss": 3.0, "lr": 0.5, "grad_norm": 1.0, "tokens_per_s": 10.0,
               "step_ms": 4.0, "gflop_per_s": 0.25, "eval": 2.0, "eval_name": "val_loss", "roles": {"loader": 1.0}})
    log.write({"kind": "metrics", "step": 2, "loss": None, "lr": 0.5, "grad_norm": 0.0, "tokens_per_s": 1.0,
               "step_ms": 4.0})
    log.write({"kind": "es_metrics", "step": 3, "reward_mean": -1.0, "reward_std": 0.5, "reward_min": -2.0,
               "reward_max": 0.0, "evals_per_s": 8.0, "step_ms": 2.0, "eval": 0.75, "eval_name": "center accuracy"})
    log.close()
    (path,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    events = tb.read_events(path)[1:]
    assert [e["step"] for e in events] == [1, 2, 3]
    assert events[0]["scalars"] == {"train/loss": 3.0, "train/lr": 0.5, "train/grad_norm": 1.0,
                                    "train/tokens_per_s": 10.0, "train/step_ms": 4.0, "train/gflop_per_s": 0.25,
                                    "eval/val_loss": 2.0}
    assert "train/loss" not in events[1]["scalars"]  # every micro-batch skipped: no point
    assert events[2]["scalars"]["es/reward_mean"] == -1.0 and events[2]["scalars"]["eval/center accuracy"] == 0.75
    times = [r["time"] for r in read_metrics(str(tmp_path)) if r["kind"] != "event"]
    assert [round(e["wall_time"], 3) for e in events] == times  # one clock for both files


def test_an_unwritable_dir_is_one_error_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=f"--tensorboard {blocker}/tb: cannot write there"):
        MetricsLog(str(tmp_path), tensorboard=str(blocker / "tb"))
    from pipeline.commands._args import check_job_inputs
    job = get_job("spirals")
    with pytest.raises(UserError, match="--tensorboard .*cannot write there"):
        check_job_inputs(build(job.Spec, {**SPEC, "tensorboard": str(blocker / "tb")}))
    check_job_inputs(build(job.Spec, {**SPEC, "tensorboard": str(tmp_path / "new" / "tb")}))
    assert (tmp_path / "new" / "tb").is_dir() and not os.listdir(tmp_path / "new" / "tb")  # made, probe removed


def test_an_inprocess_run_writes_what_metrics_jsonl_holds(tmp_path):
    pin_threads(1)
    job_cls = get_job("spirals")
    run_dir, tb_dir = str(tmp_path / "run"), str(tmp_path / "tb")
    job = job_cls(build(job_cls.Spec, {**SPEC, "tensorboard": tb_dir}))
    run_inprocess(job, run_dir, log=lambda m: None)
    records = [r for r in read_metrics(run_dir) if r["kind"] == "metrics"]
    (path,) = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
    events = tb.read_events(path)[1:]
    assert [e["step"] for e in events] == [r["step"] for r in records] == list(range(1, 7))
    for e, r in zip(events, records):
        assert e["scalars"]["train/loss"] == _f32(r["loss"]) and e["scalars"]["train/lr"] == _f32(r["lr"])
        assert e["scalars"]["train/tokens_per_s"] == _f32(r["tokens_per_s"])
        assert e["scalars"]["train/gflop_per_s"] == _f32(r["gflop_per_s"])
        assert ("eval/accuracy" in e["scalars"]) == (r.get("eval") is not None)
    assert [e["step"] for e in events if "eval/accuracy" in e["scalars"]] == [3, 6]
    # a resume writes a second file; the first is left as it was
    job = job_cls(build(job_cls.Spec, {**SPEC, "steps": 8, "tensorboard": tb_dir}))
    run_inprocess(job, run_dir, resume=os.path.join(run_dir, "checkpoint-step-3"), log=lambda m: None)
    files = sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")), key=os.path.getmtime)
    assert len(files) == 2 and [e["step"] for e in tb.read_events(files[1])[1:]] == list(range(4, 9))


def test_flops_per_token_is_six_times_the_matrix_parameters():
    job_cls = get_job("spirals")
    job = job_cls(build(job_cls.Spec, SPEC))
    matrices = sum(int(np.prod(s)) for _, s, _ in job.param_layout() if len(s) == 2)
    assert matrices > 0 and job.flops_per_token() == 6.0 * matrices
    assert gflop_rate(job, 1e9) == 6.0 * matrices
    assert gflop_rate(job, 2e9) == 12.0 * matrices  # the estimate is computed once, the rate per step


def test_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(peak.PEAK_ENV, raising=False)
    calls = []

    def measure():
        calls.append(1)
        return 40.0

    first = peak.peak_gflops(measure)
    assert first == 40.0 * peak.cores() and peak.peak_gflops(measure) == first and len(calls) == 1
    assert os.path.isfile(tmp_path / "fucina" / "peak.json")
    monkeypatch.setenv(peak.PEAK_ENV, "250")
    assert peak.peak_gflops(measure) == 250.0
    monkeypatch.setenv(peak.PEAK_ENV, "0")
    assert peak.peak_gflops(measure) is None and len(calls) == 1
    monkeypatch.setenv(peak.PEAK_ENV, "fast")
    with pytest.raises(UserError, match="FUCINA_PEAK_GFLOPS='fast': not a number"):
        peak.peak_gflops(measure)
    assert peak.share_text(12.0, 100.0) == "12% of peak"
    assert peak.share_text(None, 100.0) == "" and peak.share_text(12.0, None) == ""


def test_the_progress_line_shows_tokens_per_s_and_the_share(monkeypatch):
    from pipeline.commands.launch import _progress
    monkeypatch.setenv(peak.PEAK_ENV, "200")
    bar = _progress(3, quiet=False)
    shown = []
    with bar:
        monkeypatch.setattr(bar.bar, "update", lambda task, **kw: shown.append(kw["info"]))
        bar.update({"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0, "gflop_per_s": 50.0})
        bar.update({"step": 2, "loss": None, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 10.0})
    assert "1234 tok/s (25% of peak)" in shown[0]
    assert shown[1].startswith("loss -") and "of peak" not in shown[1]


@pytest.mark.parity
def test_tensorboard_itself_reads_our_file(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    log = MetricsLog(str(tmp_path), tensorboard=str(tmp_path / "tb"))
    for step in (1, 2, 3):
        log.write({"kind": "metrics", "step": step, "loss": 4.0 / step, "lr": 1e-3 * step, "grad_norm": 1.0,
                   "tokens_per_s": 100.0 * step, "step_ms": 5.0,
                   **({"eval": 1.5, "eval_name": "val_loss"} if step == 3 else {})})
    log.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/tokens_per_s", "eval/val_loss"} <= set(tags)
    assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(1, 4.0), (2, 2.0), (3, _f32(4.0 / 3))]
    assert [(s.step, s.value) for s in acc.Scalars("eval/val_loss")] == [(3, 1.5)]
    assert [s.value for s in acc.Scalars("train/tokens_per_s")] == [100.0, 200.0, 300.0]
