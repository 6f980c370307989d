"""The step scheduler against mock peers: plan order, in-order loss, lost trainers, stale generations."""
import os
import time

import pytest

from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime.scheduler import RunFailed, Scheduler
from pipeline.runtime.transport import DealerSocket, ipc_endpoints

M = 4


# one per process: the tests here and in test_remote_frames / test_bad_answers create real segments under this id
# (fucina-<id>-optimizer-params ...), and two xdist workers sharing one id mapped each other's (a .ci/run's three
# failures: a trainer that must find no segment found another test's). Not hex, so no run's leak check counts it.
RUN_ID = f"testrun{os.getpid()}"


def desc(role, what, owner):
    """A segment descriptor as that role would publish it."""
    return {"segment": f"fucina-{RUN_ID}-{role}-{what}", "tensors": [], "owner": owner}


class Fake:
    """A mock worker: a DEALER that records the tasks it is sent."""

    def __init__(self, ep, role, name, pid=0):
        self.id, self.role = name, role
        self.sock = DealerSocket(ep.control)
        self.token = f"token-of-{name}"
        self.sock.send("hello", role=role, worker=name, pid=pid, token=self.token)
        self.inbox = []
        self.silent = False

    def drain(self):
        while (msg := self.sock.recv(0)) is not None:
            if msg and msg["kind"] != "heartbeat":
                self.inbox.append(msg)

    def take(self, kind, wait_s=0.5):
        """Tasks of this kind received so far (waits a little: delivery is asynchronous)."""
        t_end = time.monotonic() + wait_s
        self.drain()
        while not any(m["kind"] == kind for m in self.inbox) and time.monotonic() < t_end:
            time.sleep(0.01)
            self.drain()
        got = [m for m in self.inbox if m["kind"] == kind]
        self.inbox = [m for m in self.inbox if m["kind"] != kind]
        return got

    def send(self, kind, step=0, **fields):
        if kind == "heartbeat":
            fields.setdefault("token", self.token)
        fields.setdefault("worker", self.id)
        self.sock.send(kind, step, **fields)


def _job():
    job_cls = get_job("spirals")
    return job_cls(build(job_cls.Spec, {"steps": 3, "batch": 8, "micro_batches": M, "checkpoint_every": 0,
                                        "eval_every": 0}))


@pytest.fixture
def rig(tmp_path):
    ep = ipc_endpoints(str(tmp_path))
    sched = Scheduler(_job(), str(tmp_path), RUN_ID, ep, trainers=2, log=lambda m: None, liveness_s=1.0)
    fakes = {n: Fake(ep, r, n) for n, r in [("loader", "loader"), ("optimizer", "optimizer"),
                                              ("checkpointer", "checkpointer"), ("t1", "trainer"), ("t2", "trainer")]}
    yield sched, fakes
    for f in fakes.values():
        f.sock.close()
    sched.close()


def spin(sched, fakes, seconds=0.3):
    t_end = time.monotonic() + seconds
    next_beat = 0.0
    while time.monotonic() < t_end:
        if time.monotonic() > next_beat:  # beat like a worker; drain so echoes never fill a queue
            next_beat = time.monotonic() + 0.1
            for f in fakes.values():
                if not f.silent:
                    f.send("heartbeat")
                f.drain()
        got = sched.router.recv(10)
        while got is not None:
            sched.handle(*got)
            got = sched.router.recv(0)
        sched.check_peers()
        sched.pump()


def start(sched, fakes):
    spin(sched, fakes)
    (init,) = fakes["optimizer"].take("init")
    assert init["resume"] == "" and init["gen"] == 0
    fakes["optimizer"].send("ready", 0, gen=0, params=desc("optimizer", "params", "optimizer"),
                            grads=desc("optimizer", "grads", "optimizer"))
    spin(sched, fakes)
    loads = fakes["loader"].take("load")
    assert sorted((m["step"], m["k"]) for m in loads) == [(s, k) for s in (0, 1) for k in range(M)]
    for m in loads:
        fakes["loader"].send("loaded", m["step"], gen=0, k=m["k"], slot=m["slot"],
                             batch=desc("loader", "batches", "loader"), ms=0.1)
    spin(sched, fakes)


def test_step_loss_is_summed_in_micro_batch_order_not_arrival_order(rig):
    sched, fakes = rig
    start(sched, fakes)
    losses = [1e16, 1.0, -1e16, 1.0]  # in order: 1.0; in reverse arrival order: 0.0
    done = 0
    while done < M:
        tasks = fakes["t1"].take("grad") + fakes["t2"].take("grad")
        assert all(t["step"] == 0 and t["params"] == desc("optimizer", "params", "optimizer") for t in tasks)
        for t in sorted(tasks, key=lambda t: -t["k"]):  # results arrive highest k first
            fakes[_who(sched, t)].send("grad_done", 0, gen=0, k=t["k"], loss=losses[t["k"]], rows=2, ms=1)
            done += 1
        spin(sched, fakes)
    (step,) = fakes["optimizer"].take("step")
    assert step["step"] == 0 and step["micro_batches"] == M
    assert sched.losses[1] == 1.0


def _who(sched, task):
    """The trainer the scheduler assigned this task to."""
    return sched.grads[task["k"]][1]


def test_a_silent_trainer_is_declared_lost_and_its_task_rerun(rig):
    sched, fakes = rig
    start(sched, fakes)
    first = fakes["t1"].take("grad") + fakes["t2"].take("grad")
    assert len(first) == 2  # two trainers, one task each
    victim = _who(sched, first[0])
    fakes[victim].silent = True
    spin(sched, fakes, seconds=1.6)
    assert victim not in sched.peers
    lost_k = first[0]["k"]
    survivor = "t2" if victim == "t1" else "t1"
    fakes[survivor].send("grad_done", 0, gen=0, k=first[1]["k"], loss=0.5, rows=2, ms=1)
    spin(sched, fakes)
    rerun = [t["k"] for t in fakes[survivor].take("grad")]
    assert lost_k in rerun


def test_optimizer_loss_rewinds_under_a_new_generation_and_ignores_old_results(rig):
    sched, fakes = rig
    start(sched, fakes)
    tasks = fakes["t1"].take("grad")
    fakes["optimizer"].silent = True
    spin(sched, fakes, seconds=1.6)
    assert sched.gen == 1 and not sched.ready
    fakes["t1"].send("grad_done", 0, gen=0, k=tasks[0]["k"], loss=9.0, rows=2, ms=1)  # an old-generation result
    spin(sched, fakes)
    assert sched.grads == {}
    new_opt = Fake(ipc_endpoints(sched.run_dir), "optimizer", "optimizer2")
    fakes["optimizer2"] = new_opt
    spin(sched, fakes)
    (init,) = new_opt.take("init")
    assert init["gen"] == 1 and init["resume"] == ""


def test_a_failed_task_fails_the_run(rig):
    sched, fakes = rig
    start(sched, fakes)
    fakes["t1"].send("failed", 0, error="boom")
    with pytest.raises(RunFailed, match="boom"):
        spin(sched, fakes)


class Stranger:
    """A connection the scheduler never welcomed, speaking under other workers' names."""

    def __init__(self, ep):
        self.sock = DealerSocket(ep.control)

    def send(self, kind, step=0, **fields):
        self.sock.send(kind, step, **fields)

    def told(self):
        got = []
        while (msg := self.sock.recv(50)) is not None:
            got.append(msg and msg["kind"])
        return got


def test_forged_results_and_garbage_change_nothing(rig):
    sched, fakes = rig
    start(sched, fakes)
    stranger = Stranger(ipc_endpoints(sched.run_dir))
    try:
        tasks = {_who(sched, t): t for t in fakes["t1"].take("grad") + fakes["t2"].take("grad")}
        k1, k2 = tasks["t1"]["k"], tasks["t2"]["k"]
        stranger.sock.sock.send(b"\xc1 garbage")
        stranger.sock.sock.send(b"\x81\xa4kind\x91\x01")  # {"kind": [1]}: unhashable
        stranger.send("grad_done", 0, worker="t1", gen=0, k=k1, loss=0.0, rows=2, ms=1)  # as t1, its task
        stranger.send("stepped", 1, worker="optimizer", gen=0, lr=0.1, grad_norm=1.0, ms=1)
        stranger.send("bye", worker="optimizer")
        stranger.send("failed", worker="t1", error="forged")
        fakes["t2"].send("grad_done", 0, gen=0, k=k1, loss=0.0, rows=2, ms=1)  # a real trainer, not its task
        fakes["t2"].send("grad_done", 0, worker="t1", gen=0, k=k2, loss=0.0, rows=2, ms=1)  # its task, t1's name
        spin(sched, fakes)
        assert sched.grads[k1] == ("issued", "t1") and sched.grads[k2] == ("issued", "t2")
        assert sched.cur == 0 and {"optimizer", "t1", "t2"} <= set(sched.peers)
        assert "shutdown" in stranger.told()
        for name, t in tasks.items():  # the real answers still count
            fakes[name].send("grad_done", 0, gen=0, k=t["k"], loss=1.0, rows=2, ms=1)
        spin(sched, fakes)
        assert sched.grads[k1][0] == sched.grads[k2][0] == "done"
    finally:
        stranger.sock.close()


def test_a_second_singleton_hello_waits_until_the_incumbent_is_lost(rig):
    sched, fakes = rig
    start(sched, fakes)
    fakes["optimizer2"] = Fake(ipc_endpoints(sched.run_dir), "optimizer", "optimizer2")
    spin(sched, fakes)
    assert sched.one("optimizer").id == "optimizer" and "optimizer2" not in sched.peers
    assert fakes["optimizer2"].take("welcome", wait_s=0.1) == []
    fakes["optimizer"].silent = True
    spin(sched, fakes, seconds=1.6)
    assert sched.one("optimizer").id == "optimizer2" and sched.gen == 1
    assert len(fakes["optimizer2"].take("welcome")) == 1
    (init,) = fakes["optimizer2"].take("init")
    assert init["gen"] == 1


def test_heartbeats_without_the_workers_token_do_not_keep_it_alive(rig):
    sched, fakes = rig
    start(sched, fakes)
    stranger = Stranger(ipc_endpoints(sched.run_dir))
    try:
        fakes["t1"].silent = True
        for _ in range(16):
            stranger.send("heartbeat", worker="t1", token="a guess")
            stranger.send("heartbeat", worker="t1", token="ünïcode")  # hmac.compare_digest raises on these as str
            spin(sched, fakes, seconds=0.1)
        assert "t1" not in sched.peers
    finally:
        stranger.sock.close()


def test_a_missing_role_fails_the_run_after_a_bounded_wait(tmp_path):
    ep = ipc_endpoints(str(tmp_path))
    sched = Scheduler(_job(), str(tmp_path), RUN_ID, ep, trainers=1, log=lambda m: None, role_wait_s=0.5)
    fakes = {n: Fake(ep, r, n) for n, r in [("optimizer", "optimizer"), ("checkpointer", "checkpointer"),
                                              ("t1", "trainer")]}
    try:
        with pytest.raises(RunFailed, match="no loader has been connected"):
            spin(sched, fakes, seconds=5)
    finally:
        for f in fakes.values():
            f.sock.close()
        sched.close()


def test_a_local_worker_whose_process_exits_is_lost_at_once(tmp_path):
    import subprocess
    import sys
    ep = ipc_endpoints(str(tmp_path))
    sched = Scheduler(_job(), str(tmp_path), RUN_ID, ep, trainers=2, log=lambda m: None, liveness_s=60.0)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    fakes = {n: Fake(ep, r, n) for n, r in [("loader", "loader"), ("optimizer", "optimizer"),
                                              ("checkpointer", "checkpointer"), ("t1", "trainer")]}
    fakes["t2"] = Fake(ep, "trainer", "t2", pid=proc.pid)
    try:
        start(sched, fakes)
        assert "t2" in sched.peers
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while "t2" in sched.peers and time.monotonic() - t0 < 5:
            spin(sched, fakes, seconds=0.05)
        assert "t2" not in sched.peers and time.monotonic() - t0 < 1.0  # not the 60 s liveness
    finally:
        proc.kill()
        for f in fakes.values():
            f.sock.close()
        sched.close()


def test_the_welcome_carries_the_liveness_and_a_worker_waits_as_long(rig):
    """--liveness 60 must not leave a worker giving up on a busy scheduler after the default 5 s."""
    from pipeline.runtime.transport import LIVENESS_S
    from pipeline.runtime.worker import _liveness
    sched, _ = rig
    assert sched.run_description()["liveness_s"] == 1.0  # the rig's liveness_s, in every welcome
    assert _liveness(60.0) == 60.0 and _liveness(60) == 60.0
    assert _liveness(1.0) == LIVENESS_S  # never less patient than the default
    assert _liveness(None) == _liveness("5") == _liveness(-3) == _liveness(float("nan")) == LIVENESS_S
