"""The ES coordinator: hands members to es-member workers, gathers scalar rewards.

Trade-off: every worker holds a full parameter replica and applies the same
update from the shared reward vector itself (the rewards of iteration t-1
ride on the message that assigns iteration t's members), so one iteration is
one round trip of a few hundred bytes per worker, on one host (ipc://) or
across hosts (tcp://). The price is that every replica regenerates the whole
population's noise for the update (the one cost that does not shrink with
more workers); for a parameter set small enough to replicate that is cheaper
than publishing parameters, and it needs no shared memory across hosts.

Parameters cross the wire only for a state transfer: a worker joining
mid-run, a checkpoint, and the final digest (all replicas are asked for their
sha256 and must agree). The coordinator's own replica (the task passed in) is
brought up to date only then, from a worker's copy.

Liveness: workers send heartbeats when idle, the coordinator answers with its
own; a worker silent for `liveness` seconds (or a local worker process that
exited) is declared dead and its outstanding members are re-evaluated by the
survivors. Members are pure functions of (theta_t, member id), so the rewards,
and hence the run's bits, do not depend on who evaluated them.

Security: the default endpoint is an ipc:// socket in a private (0700) temp
directory; a tcp:// endpoint speaks CURVE with the run's keys (the runtime's
security.py), so only a peer holding worker.key can join, mid-run or not.
Past the handshake a worker is trusted for nothing it was not asked: rewards
count only for members assigned to that connection in this iteration, each
once; a center score only when it was asked for one; parameters only in
reply to a fetch. Anything else is logged and dropped.

Self-contained ROUTER/DEALER transport (pipeline/runtime had not landed when
this was written); protocol in pipeline/es/protocol.py.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from ..errors import FucinaError
from ..runtime import security
from ..runtime.transport import ServerContext
from ..threads import pin_env
from . import protocol
from .spirals import params_sha256

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_MESSAGE_BYTES = 64 << 20  # a params reply carries a replica; the spirals MLP is ~20 KB


class CoordinatorError(FucinaError):
    """The run cannot continue (no live workers, a worker failed, replicas disagree)."""


class _Worker:
    def __init__(self, ident: bytes, pid: int, host: str, proc=None):
        self.ident, self.pid, self.host, self.proc = ident, pid, host, proc
        self.applied_it = None  # the iteration this replica's parameters are at
        self.last_seen = time.monotonic()
        self.alive = True
        self.outstanding: set[int] = set()
        self.center = False  # asked to score theta itself this iteration
        self.fetch = None  # None, or the frames flag of the fetch it was sent
        self.cpu_ms_this_iteration = 0.0

    @property
    def name(self):
        return self.ident.decode(errors="replace")


class Coordinator:
    def __init__(self, task, bind: str | None = None, heartbeat: float = 1.0, liveness: float = 10.0,
                 log=None, keys: tuple[str, str] | None = None):
        """keys: (scheduler.key, worker.key) paths, required for a tcp:// `bind`."""
        self.task = task
        self.trainer = task.trainer
        self.heartbeat, self.liveness = heartbeat, liveness
        self.log = log or (lambda msg: None)
        self._private_dir = None
        if bind is None:
            self._private_dir = security.private_tempdir("fucina-es-")
            bind = f"ipc://{self._private_dir}/coordinator.sock"
        server_key, self.client_key_file = None, None
        if security.is_tcp(bind):
            if keys is None:
                raise CoordinatorError(f"{bind} is tcp:// and needs the run's CURVE keys (security.create_run_keys)")
            server_key, self.client_key_file = security.load_server_key(keys[0]), keys[1]
        self.server = ServerContext(server_key)
        self.ctx = self.server.ctx
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if server_key is not None:
            security.secure_server(self.sock, server_key)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.workers: dict[bytes, _Worker] = {}
        self.pending: dict[bytes, _Worker] = {}  # said hello, not yet welcomed
        self.procs: list[subprocess.Popen] = []
        self.it = self.trainer.iteration  # the iteration being evaluated next
        self.prev_rewards = None  # rewards of it-1, applied by replicas lazily
        self.replica_it = self.trainer.iteration
        self._results: dict[int, float] = {}
        self._center = None
        self._params_reply = None
        self._digests: dict[bytes, str] = {}
        self._last_beat = time.monotonic()

    # ------------------------------------------------------------ workers
    def spawn_local(self, n: int, threads: int = 1):
        """Start n `python -m workers.es_member` processes connected to our endpoint."""
        env = pin_env(threads, os.environ.copy())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        for k in range(n):
            cmd = [sys.executable, "-m", "workers.es_member", "--connect", self.endpoint,
                   "--name", f"local{len(self.procs)}-{os.getpid()}", "--liveness", str(self.liveness),
                   "--heartbeat", str(self.heartbeat)]
            if self.client_key_file:
                cmd += ["--key", self.client_key_file]
            self.procs.append(subprocess.Popen(cmd, env=env, cwd=str(REPO_ROOT)))

    def live(self) -> list[_Worker]:
        return [w for w in self.workers.values() if w.alive]

    def wait_for_workers(self, n: int, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while len(self.pending) + len(self.live()) < n:
            if time.monotonic() > deadline:
                raise CoordinatorError(f"only {len(self.pending) + len(self.live())} of {n} es-member workers "
                                       f"connected to {self.endpoint} within {timeout:.0f}s")
            self._poll(0.2)
        self._admit()

    def _send(self, w: _Worker, kind: str, raw=(), **fields):
        self.sock.send_multipart([w.ident, protocol.encode(kind, **fields), *raw])

    def _declare_dead(self, w: _Worker, why: str):
        if not w.alive:
            return
        w.alive = False
        self.log(f"worker {w.name} (pid {w.pid}) declared dead: {why}; "
                 f"re-assigning {len(w.outstanding)} member(s)")
        lost, had_center = sorted(w.outstanding), w.center
        w.outstanding, w.center = set(), False
        if lost or had_center:
            survivors = self.live()
            if not survivors:
                raise CoordinatorError(f"all es-member workers are dead (last: {w.name}: {why})")
            for k, target in enumerate(survivors):
                share = lost[k::len(survivors)]
                center = had_center and k == 0
                if share or center:
                    self._assign(target, share, center)

    def _check_liveness(self):
        now = time.monotonic()
        for w in list(self.workers.values()):
            if not w.alive:
                continue
            if w.proc is not None and w.proc.poll() is not None:
                self._declare_dead(w, f"process exited with code {w.proc.returncode}")
            elif now - w.last_seen > self.liveness:
                self._declare_dead(w, f"silent for {now - w.last_seen:.1f}s")
        if now - self._last_beat > self.heartbeat:
            self._last_beat = now
            for w in self.live() + list(self.pending.values()):  # pending ones too: they may wait long
                self._send(w, "heartbeat")

    def _poll(self, timeout: float):
        if self.sock.poll(int(timeout * 1000)):
            while True:
                try:
                    ident, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(ident, frames)
        self._check_liveness()

    def _handle(self, ident: bytes, frames):
        try:
            msg = protocol.decode(frames[0])
        except protocol.ProtocolError as e:
            self.log(f"dropped a frame from {ident!r}: {e}")
            return
        kind = msg["kind"]
        if kind == "hello":
            if ident in self.workers and self.workers[ident].alive:  # restarted under the same name
                self._declare_dead(self.workers[ident], "it re-joined (restarted)")
            proc = next((p for p in self.procs if p.pid == msg["pid"] and msg["host"] == socket.gethostname()), None)
            self.pending[ident] = _Worker(ident, msg["pid"], msg["host"], proc)
            return
        w = self.workers.get(ident)
        if w is None or not w.alive:
            return  # a late message from a worker already written off
        w.last_seen = time.monotonic()
        if kind == "rewards":
            self._take_rewards(w, msg)
        elif kind == "params":
            if w.fetch is None or msg["it"] != self.it:
                self.log(f"dropped params from {w.name}: no fetch of iteration {msg['it']} is outstanding there")
                return
            self._digests[ident] = msg["sha256"]
            if w.fetch and len(frames) > 1:
                self._params_reply = (msg, frames[1:])
            w.fetch = None
        elif kind == "failed":
            raise CoordinatorError(f"worker {w.name} failed: {msg['error']}")
        elif kind != "heartbeat":
            self.log(f"dropped a {kind!r} message from {w.name}: not one a worker sends")

    def _take_rewards(self, w: _Worker, msg):
        """Rewards count only for members assigned to this worker in this iteration, once; center only if asked."""
        if msg["it"] != self.it:
            return  # an earlier iteration's answer, overtaken by a re-assignment
        members, rewards = msg["members"], msg["rewards"]
        if len(members) != len(rewards) or not set(members) <= w.outstanding or len(set(members)) != len(members):
            self.log(f"dropped rewards from {w.name} for members {members[:8]}: not (all) assigned to it, "
                     f"or not one reward per member")
            return
        center = msg.get("center")
        if center is not None and not w.center:
            self.log(f"dropped rewards from {w.name}: a center score it was not asked for")
            return
        for m, r in zip(members, rewards):
            self._results.setdefault(m, float(r))
            w.outstanding.discard(m)
        if center is not None:
            self._center = tuple(center)
            w.center = False
        w.cpu_ms_this_iteration += float(msg.get("cpu_ms", 0.0))

    def _admit(self):
        """Welcome pending workers with the parameters at self.it (fetched from a live replica if needed)."""
        if not self.pending:
            return
        self.sync_replica()
        desc, raw = protocol.slot_frames(self.trainer.named_arrays())
        for ident, w in list(self.pending.items()):
            del self.pending[ident]
            self._send(w, "welcome", raw, run=self.task.run_config, it=self.it, slots=desc)
            w.applied_it = self.it
            w.last_seen = time.monotonic()
            self.workers[ident] = w
            self.log(f"worker {w.name} (pid {w.pid} on {w.host}) joined at iteration {self.it}")

    def _catchup(self, w: _Worker):
        """The rewards worker w still has to apply to reach self.it (None if it is there)."""
        if w.applied_it == self.it:
            return None
        if w.applied_it == self.it - 1 and self.prev_rewards is not None:
            return self.prev_rewards
        raise CoordinatorError(f"worker {w.name} is at iteration {w.applied_it}, cannot reach {self.it}")

    def _assign(self, w: _Worker, members, center: bool):
        self._send(w, "iter", it=self.it, catchup=self._catchup(w), members=list(members), center=center)
        w.applied_it = self.it
        w.outstanding |= set(members)
        w.center = w.center or center

    # ------------------------------------------------------------ iterations
    def iteration(self, it: int):
        """Rewards (float64, member order) of iteration it, and (ce, acc) of theta_it."""
        if it != self.it:
            raise CoordinatorError(f"asked for iteration {it}, coordinator is at {self.it}")
        self._poll(0)
        self._admit()
        live = self.live()
        if not live:
            raise CoordinatorError("no live es-member workers")
        pop = self.trainer.config.population
        self._results, self._center = {}, None
        for w in self.workers.values():
            w.cpu_ms_this_iteration = 0.0
        for k, w in enumerate(live):  # contiguous blocks of members, the first worker also scores theta
            self._assign(w, range(k * pop // len(live), (k + 1) * pop // len(live)), center=(k == 0))
        while len(self._results) < pop or self._center is None:
            self._poll(0.05)
        rewards = np.array([self._results[m] for m in range(pop)])
        self.busiest_cpu_ms = max(w.cpu_ms_this_iteration for w in self.workers.values())
        return rewards, self._center

    def commit(self, rewards):
        """Iteration self.it is done: its rewards become the next message's catch-up."""
        self.prev_rewards = [float(r) for r in rewards]
        self.it += 1

    def sync_replica(self):
        """Bring the coordinator's replica to self.it by fetching a live worker's parameters."""
        if self.replica_it == self.it:
            return
        live = self.live()
        if not live:
            raise CoordinatorError("no live es-member worker to fetch parameters from")
        w = live[0]
        self._params_reply = None
        self._send(w, "fetch", it=self.it, catchup=self._catchup(w), frames=True)
        w.applied_it, w.fetch = self.it, True
        while self._params_reply is None:
            if not w.alive:
                return self.sync_replica()
            self._poll(0.05)
        msg, frames = self._params_reply
        protocol.load_frames(self.trainer.named_arrays(), msg["slots"], frames, source=f"params from {w.name}")
        self.trainer.iteration = self.replica_it = self.it
        if params_sha256(self.trainer.named_arrays()) != msg["sha256"]:
            raise CoordinatorError(f"parameters from {w.name} do not match their sha256")

    def replica_digests(self) -> dict[str, str]:
        """sha256 of every live replica at self.it (they must all be equal)."""
        self._digests = {}
        live = self.live()
        for w in live:
            self._send(w, "fetch", it=self.it, catchup=self._catchup(w), frames=False)
            w.applied_it, w.fetch = self.it, False
        while any(w.alive and w.ident not in self._digests for w in live):
            self._poll(0.05)
        return {self.workers[i].name: d for i, d in self._digests.items()}

    def kill_one(self):
        """Fault-injection: SIGKILL the last live local worker (returns its name or None)."""
        for w in reversed(self.live()):
            if w.proc is not None:
                w.proc.kill()
                return w.name
        return None

    def close(self):
        for w in self.live():
            try:
                self._send(w, "shutdown", reason="run finished")
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.sock.close(0)
        self.server.close()
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)
