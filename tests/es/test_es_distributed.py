"""ES across processes: wire protocol, the member handler (driven by a mock coordinator), and real runs.

The multiprocess runs all compare the final sha256 with the in-process run of
the same configuration: workers 1 and 2, two workers over tcp loopback, a
worker SIGKILLed mid-run, and a distributed stop-and-resume.
"""
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.es import protocol
from pipeline.es.run import RunOptions, run_spirals
from pipeline.es.spirals import SpiralsTask, params_sha256, spirals_config
from pipeline.runtime import security
from workers.es_member import Member

REPO = Path(__file__).resolve().parents[2]
ITERS = 8


def _task(population=24):
    return SpiralsTask(spirals_config(population=population), model_seed=1)


@pytest.fixture(scope="module")
def reference():
    """The in-process run every distributed run must reproduce bit for bit."""
    return run_spirals(_task(), RunOptions(max_iterations=ITERS))


def test_protocol_roundtrip_and_refusals():
    msg = protocol.decode(protocol.encode("iter", it=3, catchup=[0.5, -1.0], members=[1, 2], center=True))
    assert msg["kind"] == "iter" and msg["catchup"] == [0.5, -1.0] and msg["v"] == protocol.VERSION
    with pytest.raises(protocol.ProtocolError, match="missing field"):
        protocol.encode("rewards", it=1)
    with pytest.raises(protocol.ProtocolError, match="undecodable|unknown"):
        protocol.decode(b"\xc1garbage")
    import msgpack
    with pytest.raises(protocol.ProtocolError, match="schema version 99"):
        protocol.decode(msgpack.packb({"kind": "heartbeat", "v": 99}))
    with pytest.raises(protocol.ProtocolError, match="unknown message kind"):
        protocol.decode(msgpack.packb({"kind": "pickle", "v": 1}))


def test_member_handler_against_a_mock_coordinator():
    coord = _task()
    desc, raw = protocol.slot_frames(coord.trainer.named_arrays())
    member = Member()
    refused = member.handle({"kind": "iter", "it": 0, "catchup": None, "members": [0], "center": False}, [])
    assert refused[0][0] == "failed"
    assert member.handle({"kind": "welcome", "run": coord.run_config, "it": 0, "slots": desc}, raw) == []
    [(kind, fields, _)] = member.handle({"kind": "iter", "it": 0, "catchup": None, "members": [3, 7], "center": True},
                                        [])
    assert kind == "rewards" and fields["members"] == [3, 7]
    assert np.array_equal(fields["rewards"], coord.rewards([3, 7]))
    assert fields["center"] == list(coord.center())
    rewards = coord.rewards(range(24))
    coord.trainer.update(rewards)  # what every replica does with the shared reward vector
    [(kind, fields, frames)] = member.handle({"kind": "fetch", "it": 1, "catchup": rewards.tolist(), "frames": True},
                                             [])
    assert kind == "params" and fields["sha256"] == params_sha256(coord.trainer.named_arrays()) and len(frames) == 6
    with pytest.raises(RuntimeError, match="replica is at iteration 1, asked for 3"):
        member.handle({"kind": "iter", "it": 3, "catchup": None, "members": [0], "center": False}, [])
    assert member.handle({"kind": "shutdown", "reason": "done"}, []) is None


def test_welcome_with_mismatched_slots_is_refused():
    coord = _task()
    desc, raw = protocol.slot_frames(coord.trainer.named_arrays())
    desc[2][1] = "float16"
    with pytest.raises(protocol.ProtocolError, match="slot 'w2' float16"):
        Member().handle({"kind": "welcome", "run": coord.run_config, "it": 0, "slots": desc}, raw)


def test_two_local_workers_match_inprocess(reference):
    result = run_spirals(_task(), RunOptions(workers=2, max_iterations=ITERS))
    assert result["replicas_checked"] == 2
    assert result["sha256"] == reference["sha256"]


@pytest.mark.slow
def test_one_worker_matches_inprocess(reference):
    assert run_spirals(_task(), RunOptions(workers=1, max_iterations=ITERS))["sha256"] == reference["sha256"]


@pytest.mark.slow
def test_killed_worker_does_not_change_the_result(reference):
    logs = []
    result = run_spirals(_task(), RunOptions(workers=2, max_iterations=ITERS, kill_worker_at=3, log=logs.append))
    assert any("declared dead" in line for line in logs), logs
    assert result["replicas_checked"] == 1
    assert result["sha256"] == reference["sha256"]


def _tcp_run(tmp_path):
    """A loopback endpoint, the run's keys, and the command a remote worker runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    keys = security.create_run_keys(str(tmp_path))
    return endpoint, keys, [sys.executable, "-m", "workers.es_member", "--connect", endpoint, "--key", keys[1]]


@pytest.mark.slow
def test_two_workers_over_tcp_loopback(reference, tmp_path):
    endpoint, keys, cmd = _tcp_run(tmp_path)
    procs = [subprocess.Popen(cmd + ["--name", f"tcp{k}"], cwd=REPO) for k in range(2)]
    try:
        result = run_spirals(_task(), RunOptions(remote_workers=2, bind=endpoint, keys=keys, max_iterations=ITERS))
    finally:
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    assert result["workers"] == 2 and result["replicas_checked"] == 2
    assert result["sha256"] == reference["sha256"]
    assert [p.returncode for p in procs] == [0, 0]


@pytest.mark.slow
def test_distributed_stop_and_resume(reference, tmp_path):
    run_spirals(_task(), RunOptions(workers=2, max_iterations=5, save_every=5, out=str(tmp_path)))
    resumed = run_spirals(_task(), RunOptions(workers=2, max_iterations=ITERS, resume=str(tmp_path)))
    assert resumed["iterations_this_run"] == ITERS - 5
    assert resumed["sha256"] == reference["sha256"]


@pytest.mark.slow
def test_es_spirals_reaches_full_accuracy_from_random_init():
    """The acceptance run: population 128, default tuning, two workers, pure ES to 100% training accuracy."""
    task = SpiralsTask(spirals_config(), model_seed=0)
    result = run_spirals(task, RunOptions(workers=2, max_iterations=3000))
    assert result["converged"] and result["accuracy"] == 1.0, result
    assert result["replicas_checked"] == 2


@pytest.mark.slow
def test_silent_remote_worker_is_declared_dead_by_heartbeat(reference, tmp_path):
    """A tcp worker the coordinator did not spawn (no process handle) dies: only the heartbeat
    liveness timeout can notice, and its members are re-evaluated by the survivor."""
    endpoint, keys, cmd = _tcp_run(tmp_path)
    procs = [subprocess.Popen(cmd + ["--name", f"hb{k}"], cwd=REPO) for k in range(2)]
    logs = []

    def kill_at_3(it, backend):
        if it == 3:
            procs[1].kill()

    try:
        opts = RunOptions(remote_workers=2, bind=endpoint, keys=keys, max_iterations=ITERS, liveness=3.0,
                          log=logs.append)
        result = run_spirals(_task(), opts, on_iteration=kill_at_3)
    finally:
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    assert any("hb1" in line and "silent for" in line for line in logs), logs
    assert result["replicas_checked"] == 1
    assert result["sha256"] == reference["sha256"]


def test_coordinator_takes_rewards_only_for_assigned_members_once_and_center_only_when_asked():
    from pipeline.es.coordinator import Coordinator, _Worker
    coord = Coordinator(_task(population=8))
    try:
        a, b = _Worker(b"a", 1, "h"), _Worker(b"b", 2, "h")
        coord.workers = {b"a": a, b"b": b}
        a.outstanding, b.outstanding, b.center = {0, 1, 2, 3}, {4, 5, 6, 7}, True

        def send(w, **fields):
            coord._handle(w.ident, [protocol.encode("rewards", it=coord.it, **fields)])
        send(a, members=[4, 5], rewards=[9.0, 9.0])           # b's members
        send(a, members=[0, 1], rewards=[9.0, 9.0], center=[0.0, 1.0])  # a center it was not asked for
        send(a, members=[0, 0], rewards=[9.0, 9.0])           # one member twice
        send(a, members=[0, 1], rewards=[9.0])                # not one reward per member
        coord._handle(b"stranger", [protocol.encode("rewards", it=coord.it, members=[6], rewards=[9.0])])
        coord._handle(b"a", [b"\x81\xa4kind\x91\x01"])        # {"kind": [1]}: dropped, not raised
        coord._handle(b"a", [protocol.encode("params", it=coord.it, sha256="x", slots=[]), b"raw"])  # never asked
        assert coord._results == {} and coord._center is None and coord._params_reply is None
        send(a, members=[0, 1], rewards=[1.0, 2.0])
        send(a, members=[0], rewards=[5.0])                   # a second answer for a member
        send(b, members=[4], rewards=[3.0], center=[0.5, 0.25])
        assert coord._results == {0: 1.0, 1: 2.0, 4: 3.0} and coord._center == (0.5, 0.25)
        assert a.outstanding == {2, 3} and b.outstanding == {5, 6, 7} and not b.center
    finally:
        coord.close()


def _es_decode_raises_only_protocol_error(frame):
    try:
        msg = protocol.decode(frame)
    except protocol.ProtocolError:
        return
    assert msg["kind"] in protocol.REQUIRED


def _es_frames():
    from wire_fuzz import frames
    names = {f for fields in (*protocol.REQUIRED.values(), *protocol.OPTIONAL.values()) for f in fields}
    return frames(protocol.REQUIRED, names, protocol.VERSION)


def test_es_decode_raises_only_protocol_error_fuzz():
    import wire_fuzz
    wire_fuzz.run(wire_fuzz.QUICK, _es_frames(), _es_decode_raises_only_protocol_error)


@pytest.mark.slow
def test_es_decode_raises_only_protocol_error_long_fuzz():
    import wire_fuzz
    wire_fuzz.run(wire_fuzz.LONG, _es_frames(), _es_decode_raises_only_protocol_error)
