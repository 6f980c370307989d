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


def test_es_spirals_is_a_runtime_job_not_a_launch_job():
    from pipeline.jobs import JOBS
    assert get_job("es-spirals") is ESSpiralsJob and "es-spirals" not in JOBS


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
