"""A stranger on the control plane: `fucina launch lm` and `fucina es-spirals` on tcp:// finish with the reference bits.

The stranger holds the run's worker.key (it is past authentication, like a
buggy or stale worker) and, for the whole run: sends garbage and the frame
{"kind": [1]}, says hello as every singleton role, forges every result kind
and bye/failed/heartbeats under the real workers' ids (learned from the event
stream), and - for ES - forges es_rewards under the members' ids, joins as an
es_member, answers for members it was not assigned, then goes silent. A peer without the key
sends a hello too and is never heard. The runs must end with the same
params_sha256 as in-process.
"""
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from helpers import LM, ROOT, env, events, free_port_pair, launch, wait_for
from pipeline.runtime import messages, security, transport

M = int(LM[LM.index("--micro-batches") + 1])
STEPS = LM.index("--steps") + 1
# long enough for several rounds of attack after the start: at 30 steps a fast machine once ended the run 0.55 s
# after its start, and at 150 a Zen 5 host (2026-12-04, 2 xdist workers) ended it 2.4 s after its start, each time
# before the stranger's singleton hellos were queued: nothing queued, a failure. 400 steps: ~6 s there
ADVERSARY_LM = [*LM[:STEPS], "400", *LM[STEPS + 1:]]


def _run_json(run_dir):
    try:
        with open(os.path.join(run_dir, "run.json")) as fh:
            info = json.load(fh)
    except (OSError, ValueError):
        return None
    return info if "worker_key" in info else None


class PipelineStranger(threading.Thread):
    def __init__(self, run_dir):
        super().__init__(daemon=True)
        self.run_dir, self.stop, self.error = run_dir, threading.Event(), None
        self.ids: dict[str, set] = {}
        self.singleton_hellos = 0  # sent, once the run had started (a failure's message says how many)
        self.trace = {}  # first time (monotonic) each stage was reached: a failure's message shows where it stalled

    def run(self):
        try:
            self.attack()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def attack(self):
        info = wait_for(lambda: _run_json(self.run_dir), timeout=180)
        key = security.load_client_key(info["worker_key"])
        control, rid = info["endpoints"]["control"], info["run_id"]
        ctx = zmq.Context()
        listen = transport.Subscriber(info["endpoints"]["events"], ctx, key)
        forger = transport.DealerSocket(control, ctx, key)
        keyless = ctx.socket(zmq.DEALER)
        keyless.setsockopt(zmq.LINGER, 0)
        keyless.connect(control)
        # a full send queue raises zmq.Again instead of blocking: a stranger stuck in send() attacks nothing
        # (a .ci/run once saw no hello after the start) and outlives the run (join's 30 s, every time)
        for sock in (forger.sock, keyless):
            sock.setsockopt(zmq.SNDTIMEO, 0)
        hellos, step, last_hello, n = [], 0, 0.0, 0
        self.trace.setdefault("connected", time.monotonic())
        try:
            while not self.stop.is_set():
                self.trace.setdefault("loop", time.monotonic())
                while (msg := listen.recv(0)) is not None:
                    if msg["kind"] == "metrics":
                        step = msg["step"]
                    elif msg["event"] == "worker_joined":
                        self.ids.setdefault(msg["detail"]["role"], set()).add(msg["detail"]["worker"])
                self.learn_ids_from_pids()
                # singleton hellos on fresh connections, once the real roles hold theirs (before that, a
                # key holder that says hello first simply is the run's loader: the key is the admission)
                if time.monotonic() - last_hello > 2 and self.run_started():
                    last_hello = time.monotonic()
                    self.trace.setdefault("hellos", last_hello)
                    for role in ("optimizer", "loader", "checkpointer"):
                        n += 1
                        s = transport.DealerSocket(control, ctx, key)
                        s.send("hello", role=role, worker=f"stranger-{n}", pid=os.getpid(), token="t")
                        hellos.append(s)
                        self.singleton_hellos += 1
                with contextlib.suppress(zmq.Again):  # the scheduler not reading (starting, busy, gone): skip
                    forger.sock.send(b"\xc1 garbage")
                    forger.sock.send(b"\x81\xa4kind\x91\x01")
                    self.forge(forger, rid, step)
                with contextlib.suppress(zmq.Again):  # never admitted: its queue fills and stays full
                    keyless.send(messages.pack("hello", role="optimizer", worker="no-key", pid=1, token="t"))
                self.trace.setdefault("forged", time.monotonic())
                time.sleep(0.1)  # a steady stream, not a flood: steering is under test here, not load
        finally:
            for s in [listen, forger, *hellos]:
                s.close()
            keyless.close(0)
            ctx.term()

    def run_started(self):
        """run.json is written before metrics.jsonl: until the latter exists the run has not started."""
        return os.path.exists(os.path.join(self.run_dir, "metrics.jsonl")) and events(self.run_dir, "run_started")

    def learn_ids_from_pids(self):
        """Worker ids are role-pid, and pids.json lists the pids (the events name them too, for late joiners)."""
        try:
            with open(os.path.join(self.run_dir, "pids.json")) as fh:
                pids = json.load(fh)
        except (OSError, ValueError):
            return
        for name, pid in pids.items():
            role = name.split("-")[0]
            if role != "scheduler":
                self.ids.setdefault(role, set()).add(f"{role}-{pid}")

    def forge(self, sock, rid, step):
        def seg(role, what, owner):  # a descriptor exactly as that role would publish it
            return {"segment": f"fucina-{rid}-{role}-{what}", "tensors": [], "owner": owner}
        for gen in (0, 1):
            for t in self.ids.get("trainer", ()):
                for k in range(M):
                    sock.send("grad_done", step, worker=t, gen=gen, k=k, loss=0.0, rows=1, ms=0.0)
                sock.send("heartbeat", worker=t, token="0" * 32)
            for ld in self.ids.get("loader", ()):
                for k in range(M):
                    sock.send("loaded", step + 1, worker=ld, gen=gen, k=k, slot=((step + 1) % 2) * M + k,
                              batch=seg("loader", "batches", ld), ms=0.0)
            for o in self.ids.get("optimizer", ()):
                sock.send("stepped", step + 1, worker=o, gen=gen, lr=1.0, grad_norm=0.0, ms=0.0)
                sock.send("ready", step, worker=o, gen=gen, params=seg("optimizer", "params", o),
                          grads=seg("optimizer", "grads", o))
                sock.send("snapshot_ready", step, worker=o, gen=gen, segment=f"fucina-{rid}-loader-batches",
                          tensors=[], meta={})
                sock.send("bye", worker=o)
            for c in self.ids.get("checkpointer", ()):
                sock.send("committed", step, worker=c, path="/", ms=0.0)
        for t in self.ids.get("trainer", ()):
            sock.send("failed", worker=t, error="forged")


@pytest.mark.slow
def test_a_stranger_with_the_key_cannot_steer_a_tcp_lm_run(tmp_path):
    reference = launch("lm", tmp_path / "ref", "--inprocess", *ADVERSARY_LM)
    run_dir = tmp_path / "tcp"
    stranger = PipelineStranger(str(run_dir))
    stranger.start()
    t0 = time.monotonic()
    try:
        out = launch("lm", run_dir, "--trainers", "2", "--port", str(free_port_pair()), *ADVERSARY_LM, timeout=600)
    finally:
        t_end = time.monotonic()
        stranger.stop.set()
        stranger.join(30)
    assert not stranger.is_alive(), "the stranger outlived the run by 30 s: stuck in a socket call"
    assert stranger.error is None, stranger.error
    assert stranger.ids.get("trainer"), "the stranger never learned a worker id: it attacked nothing"
    disruptions = events(run_dir, "worker_lost") + events(run_dir, "run_restarting")
    assert out["params_sha256"] == reference["params_sha256"]
    assert out["restarts"] == 0, disruptions
    joined = {e["detail"]["worker"] for e in events(run_dir, "worker_joined")}
    queued = {e["detail"]["worker"] for e in events(run_dir, "worker_queued")}
    assert not any(w.startswith("stranger") or w == "no-key" for w in joined), joined
    assert queued and all(w.startswith("stranger") for w in queued) and "no-key" not in queued, \
        (f"queued {queued}; the stranger sent {stranger.singleton_hellos} singleton hellos after the start; launch "
         f"took {t_end - t0:.1f} s, the stranger reached {({k: round(v - t0, 2) for k, v in stranger.trace.items()})}; "
         f"events: {sorted({e.get('event') for e in events(run_dir, None)} - {None})}")
    with open(run_dir / "workers.log") as fh:
        log = fh.read()
    assert "dropped" in log and "Traceback" not in log


def _es_cmd(run_dir, *flags):
    return [sys.executable, "-m", "pipeline.cli", "es-spirals", "--population", "24", "--model-seed", "1",
            "--max-iterations", "8", "--progress-every", "0", "--out", str(run_dir), "--json", *flags]


def _es_stranger(run_dir, stop, said):
    """Forges es_rewards under the real members' ids, joins as an es_member and answers for members it was
    not assigned (then goes silent), and says hello without the key."""
    info = wait_for(lambda: _run_json(run_dir), timeout=180)
    key = security.load_client_key(info["worker_key"])
    control = info["endpoints"]["control"]
    ctx = zmq.Context()
    forger, joiner = transport.DealerSocket(control, ctx, key), transport.DealerSocket(control, ctx, key)
    keyless = ctx.socket(zmq.DEALER)
    keyless.setsockopt(zmq.LINGER, 0)
    keyless.connect(control)
    for sock in (forger.sock, keyless):  # never blocked in send(): see PipelineStranger
        sock.setsockopt(zmq.SNDTIMEO, 0)
    keyless.send(messages.pack("hello", role="es_member", worker="no-key", pid=1, token="t"))
    joiner.send("hello", role="es_member", worker="stranger-b", pid=os.getpid(), token="t")
    try:
        while not stop.is_set():
            try:
                with open(os.path.join(run_dir, "pids.json")) as fh:
                    ids = [f"es_member-{pid}" for name, pid in json.load(fh).items() if name != "scheduler"]
            except (OSError, ValueError):
                ids = []
            with contextlib.suppress(zmq.Again):
                for it in range(10):
                    forger.sock.send(b"\xc1 garbage")
                    forger.sock.send(b"\x81\xa4kind\x91\x01")
                    forger.sock.send(msgpack.packb({"kind": "es_rewards", "v": 1, "step": it, "seq": 0, "worker": "x",
                                                    "members": ["x"], "rewards": [1], "ms": 0}))
                    for wid in ids:
                        forger.send("es_rewards", it, worker=wid, members=list(range(24)), rewards=[9.0] * 24,
                                    ms=0.0)
                        forger.send("failed", it, worker=wid, error="forged")
            msg = joiner.recv(50) if joiner is not None else None
            if msg is not None:
                said.append(msg["kind"])
                if msg["kind"] == "es_eval":  # answer for everyone else's members, then go silent
                    others = [m for m in range(24) if m not in msg["members"]]
                    joiner.send("es_rewards", msg["step"], worker="stranger-b", members=others,
                                rewards=[9.0] * len(others), ms=0.0)
                    joiner.close()
                    joiner = None
            time.sleep(0.05)
    finally:
        for s in (forger, joiner):
            if s is not None:
                s.close()
        keyless.close(0)
        ctx.term()


@pytest.mark.slow
def test_a_stranger_with_the_key_cannot_steer_a_tcp_es_run(tmp_path):
    ref = subprocess.run(_es_cmd(tmp_path / "ref", "--inprocess"), cwd=ROOT, env=env(), capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    run_dir = tmp_path / "tcp"
    stop, said = threading.Event(), []
    stranger = threading.Thread(target=_es_stranger, args=(str(run_dir), stop, said), daemon=True)
    stranger.start()
    try:
        out = subprocess.run(_es_cmd(run_dir, "--workers", "2", "--bind", f"tcp://127.0.0.1:{free_port_pair()}",
                                     "--liveness", "3"), cwd=ROOT, env=env(), capture_output=True, text=True,
                             timeout=600)
    finally:
        stop.set()
        stranger.join(30)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "es_state" in said and "es_eval" in said, said  # it was admitted and assigned members
    sha256 = [json.loads(r.stdout.strip().splitlines()[-1])["sha256"] for r in (out, ref)]
    assert sha256[0] == sha256[1]
    lost = {e["detail"]["worker"] for e in events(run_dir, "worker_lost")}
    joined = {e["detail"]["worker"] for e in events(run_dir, "worker_joined")}
    assert "stranger-b" in lost and "no-key" not in joined
    with open(run_dir / "workers.log") as fh:
        log = fh.read()
    assert "dropped 'es_rewards'" in log and "Traceback" not in log
