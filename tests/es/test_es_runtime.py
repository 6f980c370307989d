"""ES as a task kind of the runtime: the driver, the es_member role, the scheduler's rules, and real runs.

Fast tests drive the ESScheduler's handlers and an ESMember's task handlers
directly (no processes); the `slow` ones run `fucina es-spirals` with 1 and 2
member processes, a member SIGKILLed mid-run and a stop-and-resume, and pin
their final sha256 to the in-process run of the same configuration.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pipeline.es.checkpoint import load_es_checkpoint
from pipeline.es.run import ESSpiralsJob, ESSpiralsSpec, run_es_inprocess
from pipeline.runtime.ckpt import params_sha256
from pipeline.jobs import get_job
from pipeline.runtime import messages
from pipeline.runtime.es_scheduler import ESScheduler
from pipeline.runtime.transport import ipc_endpoints

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POP, ITERS = 16, 6


def _job(**fields):
    return ESSpiralsJob(ESSpiralsSpec(**{"population": POP, "iterations": ITERS, "model_seed": 3, **fields}))


def _inprocess(run_dir, **fields):
    with threadpool_limits(1):
        return run_es_inprocess(_job(**fields), str(run_dir), log=lambda m: None)


def test_es_spirals_is_a_runtime_job_of_the_es_kind():
    from pipeline.jobs import ES_JOBS, JOBS
    assert get_job("es-spirals") is ESSpiralsJob and "es-spirals" in ES_JOBS and "es-spirals" not in JOBS


def test_fucina_launch_runs_an_es_job_as_es_spirals_does(tmp_path, capsys):
    from pipeline.cli import main
    reference = _inprocess(tmp_path / "ref")
    with threadpool_limits(1):
        assert main(["launch", "es-spirals", "--inprocess", "--threads", "0", "--iterations", str(ITERS),
                     "--population", str(POP), "--model-seed", "3", "--run-dir", str(tmp_path / "l"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["params_sha256"] == reference["sha256"] and summary["iterations"] == ITERS
    assert main(["launch", "es-spirals", "--members", "0", "--run-dir", str(tmp_path / "m")]) == 2
    assert "--members must be >= 1" in capsys.readouterr().err


def test_inprocess_run_is_deterministic_and_resumes_bit_exactly(tmp_path):
    full = _inprocess(tmp_path / "a")
    assert _inprocess(tmp_path / "b")["sha256"] == full["sha256"] and full["iterations"] == ITERS
    first = _inprocess(tmp_path / "c", iterations=4, save_every=2)
    assert first["sha256"] != full["sha256"]
    assert sorted(p.name for p in (tmp_path / "c").glob("checkpoint-step-*")) == ["checkpoint-step-2",
                                                                                  "checkpoint-step-4"]
    with threadpool_limits(1):
        resumed = run_es_inprocess(_job(), str(tmp_path / "c"), resume=str(tmp_path / "c"), log=lambda m: None)
    assert resumed["resumed_from"].endswith("checkpoint-step-4") and resumed["iterations_this_run"] == 2
    assert resumed["sha256"] == full["sha256"]
    probe = _job().make_task()
    load_es_checkpoint(tmp_path / "c" / "checkpoint-step-4", probe.trainer)
    assert params_sha256(probe.trainer.named_arrays()) == first["sha256"]
    records = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    stats = [r for r in records if r["kind"] == "es_metrics"]
    assert [r["step"] for r in stats] == list(range(1, ITERS + 1))
    assert all(r["reward_min"] <= r["reward_mean"] <= r["reward_max"] and r["reward_std"] >= 0 for r in stats)
    plot = tmp_path / "a" / "loss.png"  # the reward per iteration: an ES run dir gets its plot too
    assert full["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Sent:
    """Stands in for a worker's DealerSocket: records what the handler sends."""

    def __init__(self):
        self.sent = []

    def send(self, kind, step=0, **fields):
        self.sent.append(messages.parse(messages.pack(kind, step, **fields)))


def _member():
    from workers.es_member import ESMember
    member = ESMember("ipc:///nowhere")
    member.job, member.run_dir, member.sock = _job(), "/nonexistent", _Sent()
    member.setup()
    return member


def test_a_member_scores_its_members_as_the_driver_would_and_catches_up_from_rewards():
    from pipeline.es.run import state_fields
    driver = _job().make_task()
    member = _member()
    member.on_es_state(messages.parse(messages.pack("es_state", 0, **state_fields(driver.trainer))))
    with threadpool_limits(1):
        member.on_es_eval(messages.parse(messages.pack("es_eval", 0, members=[3, 9], catchup=None)))
        rewards = driver.rewards(range(POP))
        driver.trainer.update(rewards)
        member.on_es_eval(messages.parse(messages.pack("es_eval", 1, members=[0], catchup=rewards.tolist())))
        member.on_es_digest(messages.parse(messages.pack("es_digest", 1, catchup=None)))
        want = driver.rewards([0]).tolist()  # BLAS on one thread, as everywhere rewards are computed
    first, second, digest = member.sock.sent
    assert first["members"] == [3, 9] and first["rewards"] == rewards[[3, 9]].tolist()
    assert second["step"] == 1 and second["rewards"] == want
    assert digest["sha256"] == params_sha256(driver.trainer.named_arrays())
    with pytest.raises(RuntimeError, match="replica is at iteration 1, asked for 3"):
        member.on_es_eval(messages.parse(messages.pack("es_eval", 3, members=[0], catchup=None)))


def _hello(sched, identity, role="es_member"):
    wid = identity.decode()
    sched.handle(identity, messages.make("hello", role=role, worker=wid, pid=0, token="t"))
    return sched.peers.get(wid)


def _rewards(sched, identity, step, members, value=1.0, worker=None):
    sched.handle(identity, messages.make("es_rewards", step, worker=worker or identity.decode(), members=members,
                                         rewards=[value] * len(members), ms=0.0))


def test_the_scheduler_counts_a_reward_only_for_the_members_assigned_to_that_connection_once(tmp_path):
    sched = ESScheduler(_job(), str(tmp_path), "t3st", ipc_endpoints(str(tmp_path)), trainers=2,
                        log=lambda m: None)
    try:
        a, b = _hello(sched, b"es_member-1"), _hello(sched, b"es_member-2")
        assert _hello(sched, b"trainer-3", role="trainer") is None  # a role this run does not have
        sched.pump()
        assert a.task == (0, tuple(range(8))) and b.task == (0, tuple(range(8, 16)))
        _rewards(sched, b"es_member-1", 0, list(range(8, 16)), 9.0)      # b's members
        _rewards(sched, b"es_member-1", 0, list(range(8)), 9.0, worker="es_member-2")  # claims another id
        _rewards(sched, b"es_member-1", 1, list(range(8)), 9.0)           # another iteration
        _rewards(sched, b"stranger", 0, list(range(16)), 9.0)             # never said hello
        sched.handle(b"es_member-1", messages.make("es_rewards", 0, worker="es_member-1", members=list(range(8)),
                                                   rewards=[9.0], ms=0.0))  # not one reward per member
        assert sched.rewards == {} and sched.dropped == 4
        _rewards(sched, b"es_member-1", 0, list(range(8)), 1.0)
        _rewards(sched, b"es_member-1", 0, list(range(8)), 9.0)           # a second answer: nothing outstanding
        assert sched.rewards == dict.fromkeys(range(8), 1.0) and sched.dropped == 5
        sched.lost("es_member-2", "its process exited")                   # its chunk goes to the survivor
        sched.pump()
        assert a.task == (0, tuple(range(8, 16)))
        assert sched.es.iteration == 0
        _rewards(sched, b"es_member-1", 0, list(range(8, 16)), 2.0)
        sched.pump()  # all 16 in: the scheduler's replica applies the update
        assert sched.es.iteration == 1 and sched.prev_rewards == [1.0] * 8 + [2.0] * 8
        sched.pump()  # iteration 1 is handed out, with iteration 0's rewards as the catch-up
        assert a.task == (1, tuple(range(16)))
    finally:
        sched.close()


def test_without_a_center_score_the_next_iteration_is_handed_out_before_the_schedulers_own_update(tmp_path):
    """es-finetune's stop test needs no parameters: members start on t+1 from the catch-up rewards while the
    scheduler's replica updates; a member that needs a state transfer gets the updated parameters after."""
    job = _job()
    job.center_scored = False
    sched = ESScheduler(job, str(tmp_path), "t3st", ipc_endpoints(str(tmp_path)), trainers=2, log=lambda m: None)
    try:
        a, b = _hello(sched, b"es_member-1"), _hello(sched, b"es_member-2")
        sched.pump()
        assert a.task == (0, tuple(range(8))) and b.task == (0, tuple(range(8, 16)))
        c = _hello(sched, b"es_member-3")  # joins mid-iteration: its replica is nowhere yet
        tasks_at_update, commit = [], sched.es.commit
        sched.es.commit = lambda rewards: (tasks_at_update.append((a.task, b.task, c.task)), commit(rewards))[1]
        _rewards(sched, b"es_member-1", 0, list(range(8)), 1.0)
        _rewards(sched, b"es_member-2", 0, list(range(8, 16)), 2.0)
        sent = []
        sched.send = lambda peer, kind, step, **f: sent.append((peer.id, kind, step))
        sched.pump()
        assert tasks_at_update == [((1, tuple(range(5))), (1, tuple(range(5, 10))), None)]
        assert sched.es.iteration == 1 and c.task == (1, tuple(range(10, 16)))
        assert sent == [("es_member-1", "es_eval", 1), ("es_member-2", "es_eval", 1),
                        ("es_member-3", "es_state", 1), ("es_member-3", "es_eval", 1)]
    finally:
        sched.close()


def _cli(run_dir, *flags, **env):
    cmd = [sys.executable, "-m", "pipeline.cli", "es-spirals", "--population", str(POP), "--model-seed", "3",
           "--max-iterations", str(ITERS), "--out", str(run_dir), "--json", *flags]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT, **env})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _segments_of(run_dirs):
    """The /dev/shm segments named after these runs (other jobs on the machine have their own)."""
    ids = []
    for d in run_dirs:
        with open(d / "run.json") as fh:
            ids.append(json.load(fh)["run_id"])
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"fucina-{i}-") for i in ids)]


@pytest.mark.slow
def test_members_1_and_2_killed_and_resumed_give_the_inprocess_bits(tmp_path):
    reference = _cli(tmp_path / "inprocess", "--inprocess")
    one = _cli(tmp_path / "one", "--workers", "1")
    two = _cli(tmp_path / "two", "--workers", "2")
    killed = _cli(tmp_path / "killed", "--workers", "2", "--kill-worker-at", "3")
    _cli(tmp_path / "stopped", "--workers", "2", "--max-iterations", "4")
    resumed = _cli(tmp_path / "stopped", "--workers", "2", "--resume", str(tmp_path / "stopped"))
    assert {r["sha256"] for r in (one, two, killed, resumed)} == {reference["sha256"]}
    assert one["replicas_checked"] == 1 and two["replicas_checked"] == 2 and resumed["iterations_this_run"] == 2
    assert killed["respawns"] == 1 and os.path.exists(tmp_path / "killed" / "fault-es_member-eval-3.fired")
    lost = [json.loads(line) for line in open(tmp_path / "killed" / "metrics.jsonl")]
    assert any(r.get("event") == "worker_lost" for r in lost)
    assert _segments_of([tmp_path / d for d in ("one", "two", "killed", "stopped")]) == []
    assert np.isfinite(two["ce"])


def test_on_tcp_an_es_member_without_the_key_is_never_heard(tmp_path):
    import socket
    import time

    import zmq

    from pipeline.runtime import security, transport
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server_key, client_key = security.create_run_keys(str(tmp_path))
    endpoints = transport.tcp_endpoints(port)
    sched = ESScheduler(_job(), str(tmp_path), "t3st", endpoints, log=lambda m: None,
                        key=security.load_server_key(server_key))
    ctx = zmq.Context()
    keyless = ctx.socket(zmq.DEALER)
    keyless.setsockopt(zmq.LINGER, 0)
    keyless.connect(endpoints.control)
    keyed = transport.DealerSocket(endpoints.control, ctx, security.load_client_key(client_key))
    try:
        keyless.send(messages.pack("hello", role="es_member", worker="no-key", pid=0, token="t"))
        keyed.send("hello", role="es_member", worker="es_member-9", pid=0, token="t")
        heard, deadline = [], time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            got = sched.router.recv(100)
            if got is not None:
                heard.append(got[1]["worker"])
                sched.handle(*got)
        time.sleep(0.3)
        while (got := sched.router.recv(100)) is not None:
            heard.append(got[1]["worker"])
        assert heard == ["es_member-9"] and list(sched.peers) == ["es_member-9"]
    finally:
        keyless.close(0)
        keyed.close()
        ctx.term()
        sched.close()


def test_the_monitor_shows_an_es_iterations_reward_stats():
    import io

    from pipeline.runtime.monitor import metrics_line, plain_view
    stats = {"reward_mean": -0.5, "reward_std": 0.25, "reward_min": -1.0, "reward_max": -0.125, "evals_per_s": 800.0,
             "step_ms": 20.0, "eval": 0.75, "eval_name": "center accuracy"}
    msg = messages.parse(messages.pack("es_metrics", 4, total=0, **stats))
    line = metrics_line(msg)
    assert line.startswith("iteration 4  mean -0.5000  std 0.2500  min -1.0000  max -0.1250"), line
    assert "center accuracy 0.7500" in line and "800 member-evals/s" in line
    out = io.StringIO()
    plain_view([msg, messages.parse(messages.pack("event", 4, event="worker_lost", detail={"worker": "w"}))], out)
    assert out.getvalue().splitlines() == [line, "step 4: worker_lost worker=w"]


@pytest.mark.slow
def test_the_procfile_runs_es_spirals_and_a_monitor_attaches_while_it_runs(tmp_path):
    """JOB=es-spirals CONFIG=es.toml honcho start: the trainer-plan roles stand by, the es_member scores; a
    `fucina monitor` started once the first iteration is in sees the later iterations' reward stats. The run is
    long enough (4000 iterations, ~10 s here) that the monitor's own start (~1-2 s) lands mid-run: 250 iterations
    ended before it attached on a fast machine."""
    import time
    iterations = 4000
    job_file, run_dir = tmp_path / "es.toml", tmp_path / "run"
    job_file.write_text(f"iterations = {iterations}\npopulation = {POP}\nmodel_seed = 3\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHON": sys.executable, "JOB": "es-spirals",
           "CONFIG": str(job_file), "RUN_DIR": str(run_dir)}
    honcho = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "honcho"), "start"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    monitor = None
    try:
        deadline, attached_at = time.monotonic() + 120, None
        while attached_at is None and time.monotonic() < deadline and honcho.poll() is None:
            time.sleep(0.1)
            if (run_dir / "metrics.jsonl").exists():
                its = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl") if '"es_metrics"' in line]
                attached_at = its[-1] if its else None
        assert attached_at is not None, "the run never reached its first iteration"
        monitor = subprocess.run([sys.executable, "-m", "pipeline.cli", "monitor", "--run-dir", str(run_dir),
                                  "--jsonl", "--timeout", "120"], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=180)
        out, _ = honcho.communicate(timeout=180)
    finally:
        if honcho.poll() is None:
            honcho.kill()
    assert monitor.returncode == 0, monitor.stderr[-2000:]
    seen = [json.loads(line) for line in monitor.stdout.splitlines() if line.strip()]
    stats = [r for r in seen if r["kind"] == "es_metrics"]
    assert stats and stats[-1]["step"] == iterations and min(r["step"] for r in stats) > attached_at
    assert all(r["reward_min"] <= r["reward_mean"] <= r["reward_max"] and r["reward_std"] >= 0 for r in stats)
    assert any(r["kind"] == "event" and r["event"] == "run_finished" for r in seen)
    assert "has no trainer role; standing by" in out and '"event": "run_finished"' in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["job"] == "es-spirals" and summary["iterations"] == iterations and summary["replicas_checked"] == 1
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert _segments_of([run_dir]) == []
