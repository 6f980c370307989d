"""The deterministic step scheduler: the plan, the step counter, the commit order.

The plan of a run is the grid of tasks keyed by (step, micro-batch k):

    load(step, k) -> grad(step, k) for k = 0..M-1 -> step(step) -> [snapshot -> write]

Tasks go to whichever worker is idle, results may arrive in any order, but the
optimizer always reduces gradient slots 0..M-1 in index order, so *who* ran a
task never changes the bits. The scheduler only decides *when*.

Generations: when a stateful role (optimizer, loader) is lost, the run restarts
from the last committed checkpoint under a new generation number `gen`; every
task carries its gen and late results of an older gen are ignored. A lost
trainer's task is simply re-queued (tasks are idempotent). A lost
checkpointer's write is re-sent (the snapshot segment outlives it).

A stranger cannot steer it: every result is matched to the connection the
ROUTER reports (never to the `worker` field), and accepted only for the task
that connection was assigned in this generation, with the segment names the
run's roles create; anything else is logged and dropped. A second `hello` for
a singleton role (loader, optimizer, checkpointer) waits in a queue until the
incumbent is declared dead - it never displaces a live one. A role missing for
`role_wait_s` fails the run with a message saying which, instead of hanging.
A local worker whose process exits (its pid is gone) is declared dead at
once, without waiting out the heartbeat liveness.

A trainer whose hello says `remote` (it cannot map this host's shared memory)
gets its parameters and batch as buffer frames cut from the segments, and its
gradient frames are copied into its slot here (remote.py); it is watched by
heartbeats only, since its pid is another host's.

Trade-off: one hub process sees every message (simple, auditable ordering) at
the cost of one extra hop per task and a single point of failure - which is
why every worker exits when the scheduler's heartbeats stop.
"""
from __future__ import annotations

import hmac
import json
import os
import threading
import time
from dataclasses import dataclass, field

from ..errors import FucinaError
from ..jobs.spec import to_dict
from . import ckpt
from .metrics import MetricsLog, gflop_rate, plot_run
from .ckpt import checkpoint_dir
from .roles import checkpoint_due, first_nonfinite, nonfinite_message, usable
from .remote import FrameError, SegmentViews, chunk_sizes, from_frames, np_nbytes, to_frames
from .shm import Registry, run_prefix
from .transport import LIVENESS_S, Liveness, Publisher, RouterSocket, ServerContext, process_exited

SINGLETONS = ("loader", "optimizer", "checkpointer")
START_GRACE_S = 120.0  # how long to wait for every requested trainer before starting with fewer
ROLE_WAIT_S = 300.0    # how long a run may lack a role (a respawn under load takes seconds) before it fails
PID_CHECK_S = 0.1      # how often the pids of local workers are checked
DROP_LOG_S = 1.0       # refused messages are logged at most once a second (with a count): a flood is not a log
STOP_WAIT_S = 60.0     # a run stopped by a NaN first lets the checkpoints of its good steps commit, this long
MAX_STRIKES = 3        # bad answers (frames that do not fit, a NaN another trainer contradicts) before eviction
# the results each role may send; anything else from it is dropped
RESULTS = {"loaded": ("loader",), "grad_done": ("trainer",), "ready": ("optimizer",), "stepped": ("optimizer",),
           "snapshot_ready": ("optimizer",), "committed": ("checkpointer",),
           "failed": (*SINGLETONS, "trainer"), "bye": (*SINGLETONS, "trainer")}


@dataclass
class Peer:
    id: str
    role: str
    identity: bytes
    pid: int
    token: str = ""             # the secret its heartbeats carry
    local: bool = False         # its pid was a live process here at hello: watch it
    task: tuple | None = None   # (gen, step, k) for trainers, (step,) for the checkpointer
    remote: bool = False        # a trainer fed by buffer frames instead of shared memory
    shipped: tuple | None = None  # (gen, version) of the parameters a remote trainer holds
    strikes: int = 0            # bad answers so far; MAX_STRIKES evicts it
    born: float = field(default_factory=time.monotonic)


class RunFailed(FucinaError):
    pass


def fault(run_dir, point: str, step: int):
    """FUCINA_FAULT=scheduler:POINT:STEP SIGKILLs the scheduler once there (tests; see worker.Worker.fault)."""
    if f"scheduler:{point}:{step}" not in os.environ.get("FUCINA_FAULT", "").split(","):
        return
    marker = os.path.join(run_dir, f"fault-scheduler-{point}-{step}.fired")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


class Scheduler:
    RESULTS = RESULTS                       # kind -> the roles that may send it
    ROLES = (*SINGLETONS, "trainer")        # the roles this plan admits, each required

    def __init__(self, job, run_dir, run_id, endpoints, trainers=1, resume=None, log=print, liveness_s=LIVENESS_S,
                 key=None, role_wait_s=ROLE_WAIT_S):
        self.job, self.run_dir, self.run_id, self.endpoints = job, run_dir, run_id, endpoints
        self.trainers_wanted, self.resume, self.log = trainers, resume, log
        self.M = job.micro_batches
        self.server = ServerContext(key)  # on tcp://, admits only the run's worker key
        self.router = RouterSocket(endpoints.control, self.server.ctx, key, *self.buffer_limits())
        self.pub = Publisher(endpoints.events, self.server.ctx, key)
        self.liveness = Liveness(liveness_s)
        self.incarnation = os.urandom(8).hex()  # in every heartbeat echo: a worker of a previous scheduler leaves
        self.role_wait_s = role_wait_s
        self.metrics = MetricsLog(run_dir, getattr(job.spec, "tensorboard", ""))
        self.peers: dict[str, Peer] = {}          # worker id -> a peer that holds its role
        self.by_identity: dict[bytes, Peer] = {}  # ROUTER identity -> peer (holding or queued)
        self.queued: dict[str, list[Peer]] = {r: [] for r in SINGLETONS}  # waiting for the incumbent to die
        self.missing_since: dict[str, float] = {}
        self.last_pid_check = 0.0
        self.dropped, self.last_drop_log = 0, -DROP_LOG_S
        self.gen = 0
        self.ready = False           # optimizer has published parameters of version self.cur
        self.final = job.steps       # the run's last step: earlier when the job stops early (its optimizer says)
        self.init_sent = None        # the optimizer that was sent this generation's init
        self.started = False
        self.cur = 0
        self.descs = {}              # params / grads / batch segment descriptors
        self.loads: dict[tuple, str] = {}
        self.grads: dict[int, tuple] = {}
        self.optimizer_busy = False
        self.writes_pending: dict[int, dict] = {}
        self.writes_inflight: dict[int, tuple] = {}  # step -> (checkpointer id, write fields)
        self.losses: dict[int, float] = {}
        self.role_ms = {"loader": 0.0, "trainer": 0.0, "optimizer": 0.0}
        self.last_step_t = None
        self.restarts = 0
        self.snapshots_asked = set()  # (gen, step): never ask twice (a snapshot segment name is per step)
        self.committed_steps = set()
        self.summary = None
        self.finishing = None  # the thread running job.finish, while the loop keeps answering heartbeats
        self.views = None            # attached segments, once a remote trainer needs them
        self.on_nonfinite = getattr(job.spec, "on_nonfinite", "stop")
        self.suspects: dict[tuple, set] = {}  # (gen, step, k) -> remote trainers whose answer was non-finite
        self.nonfinite_skipped = 0
        self.evicted = 0
        self.stopping = None  # ((step, k, worker, tensor), deadline): a non-finite value stops the run
        self.t_start = time.monotonic()

    # --- wiring ------------------------------------------------------------
    def buffer_limits(self) -> tuple[int, int]:
        """(frames, bytes) after a body: the only message that carries any is a remote trainer's gradient."""
        sizes = [n for _, shape, dtype in self.job.param_layout() for n in chunk_sizes(np_nbytes(shape, dtype))]
        return len(sizes), sum(sizes)

    def run_description(self):
        return {"run_id": self.run_id, "run_dir": os.path.abspath(self.run_dir), "job": self.job.name,
                "spec": to_dict(self.job.spec), "endpoints": self.endpoints.to_wire(), "trainers": self.trainers_wanted,
                "liveness_s": self.liveness.timeout_s}  # the workers give the scheduler as long as it gives them

    def send(self, peer: Peer, kind, step=0, **fields):
        self.router.send(peer.identity, kind, step, **fields)

    def event(self, name, step=None, **detail):
        step = self.cur if step is None else step
        self.pub.publish("event", step, event=name, detail=detail)
        self.metrics.write({"kind": "event", "event": name, "step": step, "detail": detail})
        self.log(f"[scheduler] {name} {json.dumps(detail, default=str)}")

    def role(self, role):
        return [p for p in self.peers.values() if p.role == role]

    def one(self, role):
        peers = self.role(role)
        return peers[0] if peers else None

    # --- the loop ----------------------------------------------------------
    def serve(self) -> dict:
        """Run the plan to the end; -> summary. Raises RunFailed on a failed task."""
        try:
            while self.summary is None:
                got = self.router.recv(20)
                while got is not None:
                    self.handle(*got)
                    got = self.router.recv(0)
                self.check_peers()
                self.pump()
            return self.summary
        finally:
            # No shutdown broadcast: the scheduler must be the FIRST process to exit (honcho then
            # SIGTERMs the rest; `fucina launch` does the same; unsupervised workers notice the
            # missing heartbeats). A worker leaving first would make honcho kill us mid-cleanup.
            time.sleep(0.1)  # let the last events leave
            self.close()

    def close(self):
        if self.views is not None:
            self.views.close()
        self.metrics.close()
        self.router.close()
        self.pub.close()
        self.server.close()

    def check_peers(self):
        """Declare dead the silent and the exited; fail the run when a role stays missing too long."""
        for dead in self.liveness.dead():
            self.lost(dead, "no heartbeat for %.1f s" % self.liveness.timeout_s)
        now = time.monotonic()
        if now - self.last_pid_check > PID_CHECK_S:
            self.last_pid_check = now
            for peer in [p for p in self.by_identity.values() if p.local and process_exited(p.pid)]:
                self.lost(peer.id, f"its process {peer.pid} exited")
        for role in self.ROLES:
            if self.role(role):
                self.missing_since.pop(role, None)
                continue
            since = self.missing_since.setdefault(role, now)
            if now - since > self.role_wait_s:
                raise RunFailed(f"no {role} has been connected for {now - since:.0f} s (the run needs one; "
                                f"`fucina launch` re-spawns lost workers, under honcho start one with "
                                f"python -m workers.{role} --run-dir {self.run_dir})")

    def handle(self, identity: bytes, msg: dict | None):
        if msg is None:  # undecodable (logged by messages.decode), or refused unread for its size
            if self.router.refused:
                self.oversized(identity, self.router.refused)
            return
        kind = msg["kind"]
        if kind == "heartbeat":
            peer = self.by_identity_of(msg["worker"])
            token = msg.get("token", "").encode()  # compare_digest refuses non-ASCII str: compare bytes
            if peer is not None and hmac.compare_digest(peer.token.encode(), token):
                self.liveness.beat(peer.id)
            self.router.send(identity, "heartbeat", worker="scheduler", incarnation=self.incarnation)
            return
        if kind == "hello":
            self.hello(identity, msg)
            return
        peer = self.by_identity.get(identity)
        if peer is None:  # a worker we already declared lost (or never welcomed): tell it to go
            if kind != "bye":
                self.router.send(identity, "shutdown", reason="you were declared lost; start afresh", replace=True)
            return
        if msg.get("worker") != peer.id or kind not in self.RESULTS or peer.role not in self.RESULTS[kind]:
            return self.drop(peer, msg, f"claims to be {msg.get('worker')!r}, or is not a result a {peer.role} sends")
        if self.peers.get(peer.id) is not peer:  # queued behind a live incumbent: it holds no task
            if kind in ("bye", "failed"):
                self.drop_queued(peer, kind)
            return
        self.liveness.beat(peer.id)
        getattr(self, f"on_{kind}")(peer, msg)

    def oversized(self, identity, what):
        """More frames or bytes than any message of this run needs: no honest peer sends that. Evicted at once."""
        peer = self.by_identity.get(identity)
        if peer is None:
            return
        self.log(f"[scheduler] refused {what} from {peer.id}")
        if self.peers.get(peer.id) is peer:
            self.evicted += 1
            self.lost(peer.id, f"evicted: it sent {what}", evict=True)
        else:
            self.drop_queued(peer, f"it sent {what}")

    def by_identity_of(self, wid):
        """The peer (holding or queued) named `wid`, or None."""
        return next((p for p in self.by_identity.values() if p.id == wid), None)

    def hello(self, identity, msg):
        role, wid = msg["role"], msg["worker"]
        known = self.by_identity.get(identity)
        if known is not None:  # a second hello on one connection changes nothing
            return self.drop(known, msg, "a second hello on one connection")
        if role not in self.ROLES:  # e.g. an es_member at a trainer run: it would hold no task ever
            self.router.send(identity, "shutdown", reason=f"this {self.job.name} run has no {role} role", unused=True)
            self.log(f"[scheduler] refused a hello as {wid!r}: this run has no {role} role")
            return
        if self.by_identity_of(wid) is not None:
            self.router.send(identity, "shutdown", reason=f"worker id {wid!r} is taken by a live connection")
            self.log(f"[scheduler] refused a hello as {wid!r} ({role}): that id is taken by a live connection")
            return
        remote = msg.get("remote", False)
        if remote and role != "trainer":
            self.router.send(identity, "shutdown", reason=f"only a trainer can run remote, not a {role}")
            self.log(f"[scheduler] refused a remote {role} {wid!r}: only trainers run remote")
            return
        local = not remote and msg["pid"] > 0 and not process_exited(msg["pid"])
        peer = Peer(wid, role, identity, msg["pid"], token=msg["token"], local=local, remote=remote)
        self.by_identity[identity] = peer
        self.liveness.beat(wid)
        if role in SINGLETONS and self.one(role) is not None:
            self.queued[role].append(peer)
            self.event("worker_queued", worker=wid, role=role, pid=msg["pid"], behind=self.one(role).id)
            return
        self.admit(peer)

    def admit(self, peer):
        self.peers[peer.id] = peer
        self.liveness.beat(peer.id)
        self.send(peer, "welcome", worker=peer.id, run=self.run_description())
        self.event("worker_joined", worker=peer.id, role=peer.role, pid=peer.pid,
                   **({"remote": True} if peer.remote else {}))

    def drop_queued(self, peer, why):
        self.queued[peer.role].remove(peer)
        self.by_identity.pop(peer.identity, None)
        self.liveness.forget(peer.id)
        self.event("worker_lost", worker=peer.id, role=peer.role, reason=f"{why} while queued")

    # --- results -----------------------------------------------------------
    # Each handler accepts a result only for the task its connection was assigned in this
    # generation; `drop` logs the rest (late results of a lost generation land there too).
    def drop(self, peer, msg, why):
        self.dropped += 1
        now = time.monotonic()
        if now - self.last_drop_log >= DROP_LOG_S:
            self.last_drop_log = now
            self.log(f"[scheduler] dropped {msg['kind']!r} (step {msg['step']}) from {peer.id}: {why} "
                     f"({self.dropped} dropped so far)")

    def segment_name(self, role, what):
        return f"{run_prefix(self.run_id)}{role}-{what}"

    def owns(self, peer, desc, what) -> bool:
        """A descriptor names the segment this peer's role creates, and the peer as its owner."""
        return desc["segment"] == self.segment_name(peer.role, what) and desc["owner"] == peer.id

    def on_bye(self, peer, msg):
        if self.summary is None:
            self.lost(peer.id, "left")

    def on_failed(self, peer, msg):
        self.event("task_failed", worker=peer.id, error=msg["error"])
        raise RunFailed(f"task failed on {peer.id}: {msg['error']}")

    def on_ready(self, peer, msg):
        if msg["gen"] != self.gen or self.init_sent != peer.id or self.ready:
            return self.drop(peer, msg, "no init of this generation is outstanding there")
        if msg["step"] > self.job.steps or not (self.owns(peer, msg["params"], "params")
                                                and self.owns(peer, msg["grads"], "grads")):
            return self.drop(peer, msg, "its step or segments are not this run's")
        self.cur, self.ready, self.optimizer_busy = msg["step"], True, False
        if msg.get("stop"):
            self.final = msg["step"]  # the checkpoint resumed is of a run that stopped early there
        self.descs["params"], self.descs["grads"] = msg["params"], msg["grads"]
        self.last_step_t = time.monotonic()
        self.metrics.rewind(msg["step"])  # the steps replayed from this checkpoint are recorded once
        self.event("optimizer_ready", step=msg["step"], resume=msg.get("resume") or None, gen=self.gen)

    def on_loaded(self, peer, msg):
        key = (msg["step"], msg["k"])
        if msg["gen"] != self.gen or self.loads.get(key) != ("issued", peer.id):
            return self.drop(peer, msg, "no such load is outstanding there")
        if msg["slot"] != (msg["step"] % 2) * self.M + msg["k"] or not self.owns(peer, msg["batch"], "batches"):
            return self.drop(peer, msg, "not the slot or segment it was asked to fill")
        self.role_ms["loader"] += msg["ms"]
        self.loads[key] = "done"
        self.descs["batch"] = msg["batch"]

    def on_grad_done(self, peer, msg):
        if peer.task != (msg["gen"], msg["step"], msg["k"]):
            return self.drop(peer, msg, f"it was assigned {peer.task}, not {(msg['gen'], msg['step'], msg['k'])}")
        peer.task = None
        current = msg["gen"] == self.gen and msg["step"] == self.cur
        if not current or msg.get("stale"):
            if current:
                self.grads.pop(msg["k"], None)  # re-queue
            return
        k = msg["k"]
        bad = msg.get("nonfinite") or (None if usable(msg["loss"]) else "loss")
        if peer.remote and bad is None:
            try:
                from_frames(self.router.buffers, self.grad_slot(k))
            except FrameError as e:
                self.grads.pop(k, None)  # re-queue: another trainer runs it
                self.drop(peer, msg, f"its gradient frames do not fit slot {k}: {e}")
                return self.strike(peer, f"gradient frames that do not fit the layout ({e})")
            bad = first_nonfinite(0.0, dict(zip(self.grad_names(), self.grad_slot(k))))  # what it sent, checked here
        if bad is not None:
            return self.nonfinite(peer, k, bad)
        for wid in self.suspects.pop((self.gen, self.cur, k), ()):  # its NaN was the peer's, not the batch's
            if wid in self.peers:
                self.strike(self.peers[wid], f"a non-finite gradient for step {self.cur + 1} micro-batch {k} that "
                                             f"{peer.id} computed finite")
        self.role_ms["trainer"] += msg["ms"]
        self.grads[k] = ("done", msg["loss"], msg["rows"])

    def nonfinite(self, peer, k, tensor):
        """A NaN/inf answer for micro-batch k: never applied. A remote trainer's is first re-run on another
        trainer (a bad peer is not a bad batch); a local trainer's, or one a second trainer confirms, is the
        batch's: stop the run (default) or leave micro-batch k out of the step (--on-nonfinite skip)."""
        key = (self.gen, self.cur, k)
        seen = self.suspects.setdefault(key, set())
        seen.add(peer.id)
        others = [p for p in self.role("trainer") if p.id not in seen]
        if peer.remote and len(seen) == 1 and others:
            self.grads.pop(k, None)
            self.event("nonfinite_recheck", step=self.cur + 1, k=k, worker=peer.id, tensor=tensor)
            return
        self.suspects.pop(key, None)
        if self.on_nonfinite != "skip":  # stop, once the good steps' checkpoints in flight are committed
            self.event("nonfinite", step=self.cur + 1, k=k, worker=peer.id, tensor=tensor)
            if self.stopping is None:
                self.stopping = ((self.cur, k, peer.id, tensor), time.monotonic() + STOP_WAIT_S)
            return
        self.grads[k] = ("skipped", 0.0, 0)
        self.nonfinite_skipped += 1
        self.event("nonfinite_skipped", step=self.cur + 1, k=k, worker=peer.id, tensor=tensor)

    def strike(self, peer, why):
        """One more bad answer from `peer`; at MAX_STRIKES it is evicted (told to go, not to come back)."""
        peer.strikes += 1
        if peer.strikes >= MAX_STRIKES and self.peers.get(peer.id) is peer:
            self.evicted += 1
            self.lost(peer.id, f"evicted after {peer.strikes} bad answers, the last: {why}", evict=True)

    def on_stepped(self, peer, msg):
        if msg["gen"] != self.gen or not self.optimizer_busy or msg["step"] != self.cur + 1:
            return self.drop(peer, msg, "no such step is outstanding")
        self.role_ms["optimizer"] += msg["ms"]
        done = msg["step"]
        now = time.monotonic()
        step_s = now - self.last_step_t
        self.last_step_t = now
        loss = self.losses[done]
        skipped = sorted(k for k, v in self.grads.items() if v[0] == "skipped")
        tokens_per_s = self.job.rows_per_step() * self.job.tokens_per_row() / max(step_s, 1e-9)
        record = {"loss": loss, "lr": msg["lr"], "grad_norm": msg["grad_norm"], "tokens_per_s": tokens_per_s,
                  "step_ms": step_s * 1e3, "roles": {k: round(v, 3) for k, v in self.role_ms.items()}}
        gflops = gflop_rate(self.job, tokens_per_s)
        if gflops is not None:
            record["gflop_per_s"] = gflops
        if "eval" in msg:
            record["eval"], record["eval_name"] = msg["eval"], self.job.eval_name
        if skipped:
            record["skipped"] = skipped
        self.role_ms = dict.fromkeys(self.role_ms, 0.0)
        self.pub.publish("metrics", done, total=self.job.steps, **record)
        self.metrics.write({"kind": "metrics", "step": done, **record})
        self.cur, self.optimizer_busy, self.grads = done, False, {}
        self.loads = {key: v for key, v in self.loads.items() if key[0] >= done}
        self.suspects = {key: v for key, v in self.suspects.items() if key[0] == self.gen and key[1] >= done}
        if msg.get("stop") and done < self.final:
            self.final = done
            self.event("early_stop", step=done)
        if checkpoint_due(self.job, done) or done == self.final:
            self.ask_snapshot(peer, done)
        fault(self.run_dir, "step", done)

    def ask_snapshot(self, optimizer, step):
        self.snapshots_asked.add((self.gen, step))
        self.send(optimizer, "snapshot", step, gen=self.gen)

    def on_snapshot_ready(self, peer, msg):
        step = msg["step"]
        if msg["gen"] != self.gen or (self.gen, step) not in self.snapshots_asked or step in self.writes_pending \
                or step in self.writes_inflight:
            return self.drop(peer, msg, "no such snapshot is outstanding")
        if msg["segment"] != self.segment_name(peer.role, f"snapshot-{step}"):
            return self.drop(peer, msg, f"segment {msg['segment']!r} is not this step's snapshot")
        self.writes_pending[step] = {"segment": msg["segment"], "tensors": msg["tensors"], "meta": msg["meta"],
                                     "dir": checkpoint_dir(os.path.abspath(self.run_dir), step)}

    def on_committed(self, peer, msg):
        step = msg["step"]
        if peer.task != (step,) or self.writes_inflight.get(step, (None,))[0] != peer.id:
            return self.drop(peer, msg, "no such write is outstanding there")
        peer.task = None
        _, fields = self.writes_inflight.pop(step)
        self.committed_steps.add(step)
        self.event("checkpoint_committed", step=step, path=fields["dir"], ms=round(msg["ms"], 1))

    # --- faults ------------------------------------------------------------
    def lost(self, wid, why, evict=False):
        """`evict`: a peer refused for its answers - told to shut down without asking for a replacement."""
        peer = self.peers.pop(wid, None)
        if peer is None:
            queued = self.by_identity_of(wid)
            if queued is not None:
                self.drop_queued(queued, why)
            return
        self.liveness.forget(wid)
        self.by_identity.pop(peer.identity, None)
        if why != "left":  # it may still be running (silent, not dead): tell it to make way
            self.router.send(peer.identity, "shutdown", reason=f"declared lost: {why}", **({} if evict else
                                                                                          {"replace": True}))
        self.event("worker_evicted" if evict else "worker_lost", worker=wid, role=peer.role, reason=why)
        if peer.role == "trainer":
            for k, v in list(self.grads.items()):
                if v[0] == "issued" and v[1] == wid:
                    del self.grads[k]
        elif peer.role == "checkpointer":
            for step, (owner, fields) in list(self.writes_inflight.items()):
                if owner == wid:  # the snapshot segment outlives the writer: re-send the write
                    del self.writes_inflight[step]
                    self.writes_pending[step] = fields
                    self.event("checkpoint_retry", step=step)
        else:
            self.restart_stateful(f"{peer.role} lost")
        if peer.role in SINGLETONS and self.queued[peer.role]:
            self.admit(self.queued[peer.role].pop(0))  # the first in line takes the role

    def restart_stateful(self, why):
        """Rewind to the last committed checkpoint under a new generation."""
        self.gen += 1
        self.restarts += 1
        self.ready = self.optimizer_busy = False
        self.init_sent = None
        self.loads, self.grads = {}, {}
        self.writes_pending = {}
        self.event("run_restarting", reason=why, gen=self.gen, resume=self.resume_point())

    def resume_point(self) -> str:
        latest = ckpt.latest_checkpoint(self.run_dir)
        return latest or (self.resume or "")

    # --- dispatch ----------------------------------------------------------
    def pump(self):
        checkpointer = self.one("checkpointer")
        if checkpointer and checkpointer.task is None and self.writes_pending:
            step = min(self.writes_pending)
            fields = self.writes_pending.pop(step)
            self.writes_inflight[step] = (checkpointer.id, fields)
            checkpointer.task = (step,)
            self.send(checkpointer, "write", step, **fields)
        if self.stopping is not None:
            (step, k, worker, tensor), deadline = self.stopping
            outstanding = [s for g, s in self.snapshots_asked if g == self.gen and s not in self.committed_steps]
            if not outstanding or time.monotonic() > deadline:
                raise RunFailed(nonfinite_message(step, k, worker, tensor, self.run_dir))
            return
        if not self.started:
            have = {r: len(self.role(r)) for r in (*SINGLETONS, "trainer")}
            enough = all(have[r] for r in SINGLETONS) and have["trainer"] >= 1
            waited = time.monotonic() - self.t_start > START_GRACE_S
            if not (enough and (have["trainer"] >= self.trainers_wanted or waited)):
                return
            self.started = True
            self.event("run_started", trainers=have["trainer"], steps=self.job.steps, micro_batches=self.M)
        optimizer = self.one("optimizer")
        if optimizer and self.init_sent is None:
            self.send(optimizer, "init", gen=self.gen, resume=self.resume_point())
            self.init_sent = optimizer.id
        if not self.ready:
            return
        if self.cur >= self.final:
            self.maybe_finish()
            return
        loader = self.one("loader")
        if loader:
            for t in (self.cur, self.cur + 1):
                for k in range(self.M if t < self.final else 0):
                    if (t, k) not in self.loads:
                        self.loads[(t, k)] = ("issued", loader.id)
                        self.send(loader, "load", t, gen=self.gen, k=k, slot=(t % 2) * self.M + k)
        trainers = self.role("trainer")
        if any(p.task is not None and p.task[0] != self.gen for p in trainers):
            return  # an older generation's task may still write a gradient slot: let it drain
        idle = sorted((p for p in trainers if p.task is None), key=lambda p: p.born)
        for k in range(self.M):
            if not idle:
                break
            if k not in self.grads and self.loads.get((self.cur, k)) == "done":
                seen = self.suspects.get((self.gen, self.cur, k), ())
                # a non-finite answer is re-run by another trainer; only when none is left, by the same one
                fresh = [p for p in idle if p.id not in seen]
                if not fresh and any(p.id not in seen for p in trainers):
                    continue
                peer = (fresh or idle)[0]
                idle.remove(peer)
                peer.task = (self.gen, self.cur, k)
                self.grads[k] = ("issued", peer.id)
                self.send_grad(peer, k)
        if (optimizer and not self.optimizer_busy and len(self.grads) == self.M
                and all(v[0] in ("done", "skipped") for v in self.grads.values())):
            loss = 0.0
            skip = [k for k in range(self.M) if self.grads[k][0] == "skipped"]
            for k in range(self.M):  # the step's loss, summed in micro-batch order
                if k not in skip:
                    loss += self.grads[k][1]
            self.losses[self.cur + 1] = None if len(skip) == self.M else loss
            self.optimizer_busy = True
            self.send(optimizer, "step", self.cur, gen=self.gen, micro_batches=self.M,
                      **({"skip": skip} if skip else {}))

    def send_grad(self, peer, k):
        """A grad task: descriptors for a local trainer; for a remote one the frames it cannot map."""
        slot = (self.cur % 2) * self.M + k
        fields = {"gen": self.gen, "k": k, "slot": slot, "batch": self.descs["batch"],
                  "params": self.descs["params"], "grads": self.descs["grads"]}
        if not peer.remote:
            return self.send(peer, "grad", self.cur, **fields)
        if self.views is None:
            self.views = SegmentViews(Registry(self.run_id, "scheduler"))
        if peer.shipped != (self.gen, self.cur):  # parameters travel once per version, not per task
            params = self.views.tensors(self.descs["params"])
            specs = self.descs["params"]["tensors"]
            self.send(peer, "params", self.cur, gen=self.gen, tensors=specs,
                      buffers=to_frames(params[t["name"]] for t in specs))
            peer.shipped = (self.gen, self.cur)
        batch = self.views.tensors(self.descs["batch"])
        names = [t["name"] for t in self.descs["batch"]["tensors"] if t["name"].startswith(f"{slot}/")]
        self.send(peer, "grad", self.cur, buffers=to_frames(batch[n] for n in names), **fields)

    def grad_slot(self, k) -> list:
        """The views of gradient slot k in parameter order (what a remote trainer's frames fill)."""
        grads = self.views.tensors(self.descs["grads"])
        return [grads[f"{k}/{name}"] for name in self.grad_names()]

    def grad_names(self) -> list:
        return [name for name, _, _ in self.job.param_layout()]

    def maybe_finish(self):
        final = self.final
        if final < self.job.steps:
            self.job.end_step = final  # what job.finish publishes
        if final not in self.committed_steps and not ckpt.is_committed(checkpoint_dir(self.run_dir, final)):
            optimizer = self.one("optimizer")
            if optimizer and (self.gen, final) not in self.snapshots_asked:
                # resumed at the last step into a new run dir: save the final state here too
                self.ask_snapshot(optimizer, final)
            return
        if self.writes_inflight or self.writes_pending:
            return
        path = checkpoint_dir(self.run_dir, final)
        if self.finishing is None:
            # job.finish (a sample, model.gguf) may take longer than the workers' liveness: it runs beside
            # the loop, which goes on answering heartbeats, so no worker leaves (and is re-spawned) meanwhile
            params = ckpt.read_params(path, order=[n for n, _, _ in self.job.param_layout()])
            outcome = {}

            def finish():
                try:
                    outcome["extras"] = self.job.finish(self.run_dir, params, log=self.log)
                except BaseException as e:  # noqa: BLE001 - re-raised in the loop's thread below
                    outcome["error"] = e
            self.finishing = (threading.Thread(target=finish, name="job-finish", daemon=True), params, outcome)
            self.finishing[0].start()
            return
        thread, params, outcome = self.finishing
        if thread.is_alive():
            return
        if "error" in outcome:
            raise outcome["error"]
        extras = outcome["extras"]
        self.summary = {"job": self.job.name, "mode": "pipeline", "trainers": self.trainers_wanted,
                        "steps": final, "final_loss": self.losses.get(final),
                        "params_sha256": ckpt.params_sha256(params), "checkpoint": os.path.abspath(path),
                        "run_dir": os.path.abspath(self.run_dir), "restarts": self.restarts,
                        **({"nonfinite_skipped": self.nonfinite_skipped} if self.nonfinite_skipped else {}),
                        **({"evicted": self.evicted} if self.evicted else {}),
                        "elapsed_s": round(time.monotonic() - self.t_start, 3), **extras}
        try:
            self.summary["plot"] = plot_run(self.run_dir)
        except FucinaError:
            pass
        tmp = os.path.join(self.run_dir, "summary.json.tmp")
        with open(tmp, "w") as fh:  # before run_finished: whoever hears it can read the summary
            json.dump(self.summary, fh, indent=1)
        os.replace(tmp, os.path.join(self.run_dir, "summary.json"))
        self.event("run_finished", **{k: v for k, v in self.summary.items() if k != "sample"})
