"""Monitor and plot: a subscriber sees what the scheduler publishes; plots come from metrics.jsonl."""
import json
import os
import subprocess
import sys
import time

import pytest

from helpers import ROOT, env
from pipeline.errors import UserError
from pipeline.runtime import transport
from pipeline.runtime.metrics import MetricsLog, plot_run
from pipeline.runtime.monitor import find_events_endpoint


def test_monitor_prints_published_metrics_and_stops_at_run_finished(tmp_path):
    ep = transport.ipc_endpoints(str(tmp_path))
    with open(tmp_path / "run.json", "w") as fh:
        json.dump({"endpoints": ep.to_wire()}, fh)
    pub = transport.Publisher(ep.events)
    mon = subprocess.Popen([sys.executable, "-m", "workers.monitor", "--run-dir", str(tmp_path), "--jsonl",
                            "--timeout", "60"], cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True)
    try:
        step = 0
        t_end = time.time() + 60
        first = None
        while first is None and time.time() < t_end:  # publish until the late joiner hears us
            step += 1
            pub.publish("metrics", step, total=100, loss=1.0 / step, lr=0.1, grad_norm=0.5, tokens_per_s=10.0,
                        step_ms=1.0, roles={})
            time.sleep(0.05)
            if mon.poll() is not None:
                break
            first = step if step > 40 else None
        pub.publish("event", step, event="run_finished", detail={"steps": step})
        out, _ = mon.communicate(timeout=30)
    finally:
        pub.close()
        if mon.poll() is None:
            mon.kill()
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[-1]["event"] == "run_finished"
    metrics = [m for m in lines if m["kind"] == "metrics"]
    assert metrics and all(m["total"] == 100 for m in metrics)
    steps = [m["step"] for m in metrics]
    assert steps == sorted(steps)


def test_endpoint_lookup(tmp_path):
    assert find_events_endpoint(connect="tcp://127.0.0.1:9") == "tcp://127.0.0.1:9"
    assert find_events_endpoint(run_dir=str(tmp_path)) == f"ipc://{tmp_path}/sockets/events.sock"  # not started
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        find_events_endpoint(run_dir=str(tmp_path))


def test_plot_redraws_from_metrics_and_replayed_steps_win(tmp_path):
    log = MetricsLog(str(tmp_path))
    for step, loss in [(1, 3.0), (2, 2.0), (3, 9.0), (2, 2.5), (3, 1.5)]:  # steps 2-3 replayed after a restart
        log.write({"kind": "metrics", "step": step, "loss": loss})
    log.write({"kind": "metrics", "step": 4, "loss": 1.0, "eval": 1.2, "eval_name": "val_loss"})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"kind": "metr')  # a line cut by a crash
    out = plot_run(str(tmp_path))
    assert os.path.getsize(out) > 1000


def test_plot_without_metrics_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no metrics.jsonl"):
        plot_run(str(tmp_path))
