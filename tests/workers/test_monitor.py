"""Monitor and plot: a subscriber sees what the scheduler publishes; plots come from metrics.jsonl."""
import argparse
import io
import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from helpers import ROOT, env
from pipeline.errors import UserError
from pipeline.runtime import transport
from pipeline.runtime.metrics import MetricsLog, plot_run
from pipeline.runtime.monitor import Watch, find_events_endpoint, live_view, newest_run_dir
from workers import monitor


def _run_json(run_dir, **extra):
    ep = transport.ipc_endpoints(str(run_dir))
    with open(run_dir / "run.json", "w") as fh:
        json.dump({"endpoints": ep.to_wire(), **extra}, fh)
    return ep


def _publish_until_heard(pub, heard, steps_after=5):
    """Publish metrics until the late-joining monitor has shown one (PUB drops what precedes a
    subscription), a few more, then run_finished. Returns the last step published."""
    step, t_end = 0, time.time() + 60
    while not heard() and time.time() < t_end:
        step += 1
        pub.publish("metrics", step, total=100, loss=1.0 / step, lr=0.1, grad_norm=0.5, tokens_per_s=10.0,
                    step_ms=1.0, roles={})
        time.sleep(0.05)
    for _ in range(steps_after):
        step += 1
        pub.publish("metrics", step, total=100, loss=1.0 / step, lr=0.1, grad_norm=0.5, tokens_per_s=10.0,
                    step_ms=1.0, roles={})
        time.sleep(0.02)
    pub.publish("event", step, event="checkpoint_committed", detail={"path": "ckpt", "step": step})
    pub.publish("event", step, event="run_finished", detail={"steps": step, "final_loss": 1.0 / step})
    return step


def _args(run_dir, **overrides):
    values = dict(connect=None, run_dir=run_dir and str(run_dir), jsonl=False, wait=5.0, timeout=60.0, idle=None,
                  follow=False, key=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_monitor_prints_published_metrics_and_stops_at_run_finished(tmp_path):
    ep = _run_json(tmp_path)
    pub = transport.Publisher(ep.events)
    mon = subprocess.Popen([sys.executable, "-m", "workers.monitor", "--run-dir", str(tmp_path), "--jsonl",
                            "--timeout", "60"], cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in mon.stdout], daemon=True).start()
    try:
        last = _publish_until_heard(pub, lambda: not lines.empty() or mon.poll() is not None)
        assert mon.wait(timeout=30) == 0
    finally:
        pub.close()
        if mon.poll() is None:
            mon.kill()
    time.sleep(0.1)  # the reader thread drains the pipe
    records = [json.loads(line) for line in list(lines.queue)]
    assert records[-1]["event"] == "run_finished"
    metrics = [m for m in records if m["kind"] == "metrics"]
    assert metrics and all(m["total"] == 100 for m in metrics)
    steps = [m["step"] for m in metrics]
    assert steps == list(range(steps[0], last + 1))


def test_without_a_terminal_it_prints_one_plain_line_per_step(tmp_path):
    ep = _run_json(tmp_path)
    pub = transport.Publisher(ep.events)
    out, result = io.StringIO(), {}
    watcher = threading.Thread(target=lambda: result.update(rc=monitor.watch(_args(tmp_path), out=out)))
    watcher.start()
    try:
        last = _publish_until_heard(pub, lambda: out.getvalue() != "")
        watcher.join(30)
    finally:
        pub.close()
    assert result["rc"] == 0
    lines = out.getvalue().splitlines()
    steps = [line for line in lines if not line.startswith(f"step {last}: ")]
    first = int(steps[0].split()[1].split("/")[0])
    assert steps == [f"step {s}/100  loss {1.0 / s:.4f}  lr 0.1  |g| 0.500  10 tok/s  1.0 ms/step"
                     for s in range(first, last + 1)]
    assert lines[-2:] == [f"step {last}: checkpoint_committed path=ckpt, step={last}",
                          f"step {last}: run_finished steps={last}, final_loss={1.0 / last}"]


def test_a_finished_run_is_reported_after_the_wait(tmp_path, capsys):
    _run_json(tmp_path, scheduler_pid=2 ** 22 + 1)  # above Linux's pid_max: no such process
    log = MetricsLog(str(tmp_path))
    log.write({"kind": "event", "event": "run_started", "step": 0, "detail": {}})
    log.write({"kind": "metrics", "step": 12, "loss": 0.5})
    log.write({"kind": "event", "event": "run_finished", "step": 12, "detail": {"steps": 12, "final_loss": 0.5}})
    log.close()
    t0 = time.monotonic()
    assert monitor.watch(_args(tmp_path, wait=1.0)) == 1
    assert time.monotonic() - t0 >= 1.0
    err = capsys.readouterr().err
    assert "the run has finished (step 12, final loss 0.5)" in err and f"fucina plot {tmp_path}" in err


def test_a_resumed_run_is_not_taken_for_the_finished_one(tmp_path):
    log = MetricsLog(str(tmp_path))
    log.write({"kind": "event", "event": "run_finished", "step": 12, "detail": {"steps": 12}})
    log.write({"kind": "event", "event": "run_started", "step": 12, "detail": {}})
    log.close()
    _run_json(tmp_path, scheduler_pid=os.getpid())  # a live scheduler: keep listening
    watch = Watch(transport.ipc_endpoints(str(tmp_path)).events, str(tmp_path), wait_s=0.2, timeout_s=1.0)
    assert list(watch) == [] and watch.ended == "timeout"


@pytest.mark.parametrize("make_dir", [False, True])
def test_an_absent_run_is_reported_after_the_wait(short_tmp, capsys, make_dir):
    run_dir = short_tmp / "runs" / "lm-nothing"  # an ipc:// path: pytest's tmp_path may be too long (xdist)
    if make_dir:
        run_dir.mkdir(parents=True)
    assert monitor.watch(_args(run_dir, wait=0.5)) == 1
    err = capsys.readouterr().err
    why = f"no scheduler of {run_dir} is running" if make_dir else f"there is no run directory {run_dir}"
    assert f"nothing published on ipc://{run_dir}/sockets/events.sock for 0.5 s and {why}" in err


def test_no_run_under_runs_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="no run found under ./runs"):
        monitor.watch(_args(None))


@pytest.fixture
def short_tmp():
    """A temp dir short enough for ipc:// socket paths under runs/<job>-<time>/sockets/ (pytest's are not)."""
    import shutil
    import tempfile
    from pathlib import Path
    path = Path(tempfile.mkdtemp(prefix="fm-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_newest_run_is_named_by_its_dir_not_by_the_latest_link(short_tmp, monkeypatch):
    tmp_path = short_tmp
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "lm-20261201-101500").mkdir(parents=True)
    _run_json(tmp_path / "runs" / "lm-20261201-101500")
    (tmp_path / "runs" / "lm-latest").symlink_to("lm-20261201-101500")
    assert newest_run_dir() == os.path.join("runs", "lm-20261201-101500")


def test_the_live_views_first_frame_has_no_none(tmp_path):
    import rich
    buffer = io.StringIO()
    rich.reconfigure(file=buffer, force_terminal=True, width=100)
    try:
        live_view(Watch(transport.ipc_endpoints(str(tmp_path)).events, str(tmp_path), wait_s=0.3))
    finally:
        rich.reconfigure()
    frame = buffer.getvalue()
    assert "waiting for the first step" in frame and "None" not in frame


def test_endpoint_lookup(tmp_path):
    assert find_events_endpoint(connect="tcp://127.0.0.1:9") == "tcp://127.0.0.1:9"
    assert find_events_endpoint(run_dir=str(tmp_path)) == f"ipc://{tmp_path}/sockets/events.sock"  # not started
    with pytest.raises(UserError, match="too long for an ipc:// socket"):
        find_events_endpoint(run_dir=str(tmp_path / ("d" * 120)))
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


def test_the_monitor_attaches_to_a_tcp_run_with_its_key(tmp_path):
    """A tcp:// run's events are CURVE-authenticated: the monitor takes the worker.key run.json names (or
    --key FILE) and hears the run; without a key it is one clear error, not a silent wait."""
    import zmq
    from pipeline.runtime import security
    server_path, client_path = security.create_run_keys(str(tmp_path))
    server_key = security.load_server_key(server_path)
    server = transport.ServerContext(server_key)
    pub = transport.Publisher("tcp://127.0.0.1:0", server.ctx, server_key)
    endpoint = pub.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with pytest.raises(UserError, match="CURVE-authenticated; pass --key"):
            monitor.events_key(endpoint)
        _run_json(tmp_path, worker_key=client_path)
        key = monitor.events_key(endpoint, str(tmp_path))
        seen = iter(Watch(endpoint, str(tmp_path), wait_s=5, timeout_s=20, key=key))
        heard = []

        def listen():
            heard.append(next(seen))

        t = threading.Thread(target=listen)
        t.start()
        for _ in range(400):  # slow joiner: publish until the subscription is live
            pub.publish("event", event="ping", detail={})
            t.join(0.05)
            if not t.is_alive():
                break
        assert heard and heard[0]["event"] == "ping"
        seen.close()
    finally:
        pub.close()
        server.close()


def test_a_hostile_run_json_or_metrics_line_is_one_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "run.json").write_text(deep)
    with pytest.raises(UserError, match="unreadable"):
        find_events_endpoint(run_dir=str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text(deep + "\n" + json.dumps({"kind": "metrics", "step": 1}) + "\n")
    from pipeline.runtime.metrics import read_metrics
    assert read_metrics(str(tmp_path)) == [{"kind": "metrics", "step": 1}]
