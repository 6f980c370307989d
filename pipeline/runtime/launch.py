"""`fucina launch`: start every role as a subprocess and supervise them.

The launcher is not on the wire: it spawns the scheduler and the workers,
keeps `pids.json` (role -> pid of the live process) current, re-spawns a
worker that died while the scheduler lives (the scheduler re-queues or rewinds
its work), and ends the run when the scheduler exits. Whatever happens - normal
end, Ctrl-C, SIGTERM, a crash - it terminates the children and then removes
every shared-memory segment carrying the run's prefix, including those of
SIGKILLed workers that could not clean up after themselves.

With `ray` (an address, or "" for a local or RAY_ADDRESS cluster) the
trainers - or an ES job's es_members - are Ray actors instead of children
(ray_place.py); the other roles stay here.

Trade-off: re-spawning lives here rather than in the scheduler so the scheduler
also runs unsupervised under honcho (Procfile), where nobody re-spawns.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

from ..errors import FucinaError
from ..threads import pin_env
from . import shm

MAX_RESPAWNS = 10
MAX_SCHEDULER_RESTARTS = 3  # a scheduler killed by a signal is restarted from the last checkpoint this often


class Supervisor:
    def __init__(self, job_name, spec: dict, run_dir, trainers=1, resume=None, threads=1, port=None,
                 host="127.0.0.1", liveness=5.0, env=None, quiet=False, remote_trainers=0, ray=None,
                 local_workers=None):
        """trainers: the trainers (es_members for an ES job) the run waits for; local_workers: how many of
        them to spawn here (default all; the rest connect from elsewhere); remote_trainers: how many of the
        spawned trainers take their tensors as frames instead of shared memory; ray: place the local_workers
        trainers (es_members) as Ray actors instead."""
        self.run_dir = os.path.abspath(run_dir)
        self.run_id = uuid.uuid4().hex[:10]
        self.trainers, self.threads, self.quiet = trainers, threads, quiet
        os.makedirs(self.run_dir, exist_ok=True)
        self.env = pin_env(threads, dict(os.environ if env is None else env))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, self.env.get("PYTHONPATH")]))
        self.env["PYTHONUNBUFFERED"] = "1"
        from . import security
        from .transport import ipc_endpoints, tcp_endpoints
        endpoints = tcp_endpoints(port, host) if port else ipc_endpoints(self.run_dir)
        self.events_endpoint = endpoints.events
        self.client_key = None
        conn = ["--connect", endpoints.control]
        if port:  # fresh keys for this run, before any process starts: nobody reads a stale one
            server_key, client_key = security.create_run_keys(self.run_dir)
            self.client_key = security.load_client_key(client_key)
            conn += ["--key", client_key]
        sched = [sys.executable, "-m", "workers.scheduler", "--job", job_name, "--spec-json", json.dumps(spec),
                 "--run-dir", self.run_dir, "--run-id", self.run_id, "--trainers", str(trainers),
                 "--threads", str(threads), "--liveness", str(liveness)]
        if resume:
            sched += ["--resume", resume]
        if port:
            sched += ["--port", str(port), "--host", host, "--key", server_key]
        worker = lambda role: [sys.executable, "-m", f"workers.{role}", *conn, "--threads", str(threads)]
        from ..jobs import ES_JOBS
        local = trainers if local_workers is None else local_workers
        if remote_trainers and not port:
            raise FucinaError("launch: remote trainers talk tcp:// (CURVE): give --port")
        if ray is not None and not port:
            raise FucinaError("launch: Ray trainers connect back over tcp:// (CURVE): give --port")
        self.ray, self.ray_workers, self.ray_count = ray, None, local
        # an es_member maps no shared memory (its state transfer is message bytes): no --remote for it
        placed = ["workers.es_member"] if job_name in ES_JOBS else ["workers.trainer", "--remote"]
        self.ray_command = [sys.executable, "-m", placed[0], "--connect", endpoints.control, "--threads", str(threads),
                            *placed[1:]]
        self.client_key_path = client_key if port else None
        spawned = 0 if ray is not None else local  # Ray starts the `local` ones itself
        if job_name in ES_JOBS:  # the ES task kind: es_members only
            self.commands = {"scheduler": sched}
            self.commands.update({f"es_member-{i}": worker("es_member") for i in range(spawned)})
        else:
            self.commands = {"scheduler": sched, "loader": worker("loader"), "optimizer": worker("optimizer"),
                             "checkpointer": worker("checkpointer")}
            for i in range(spawned):  # the last `remote_trainers` are fed by frames
                remote = ["--remote"] if i >= local - remote_trainers else []
                self.commands[f"trainer-{i}"] = [*worker("trainer"), *remote]
        self.resume = resume
        self.procs: dict[str, subprocess.Popen] = {}
        self.respawns = 0
        self.scheduler_restarts = 0
        self.log_path = os.path.join(self.run_dir, "workers.log")

    def spawn(self, name):
        log = open(self.log_path, "ab")
        self.procs[name] = subprocess.Popen(self.commands[name], env=self.env, stdout=log, stderr=log)
        log.close()
        self.write_pids()

    def write_pids(self):
        pids = {name: p.pid for name, p in self.procs.items() if p.poll() is None}
        tmp = os.path.join(self.run_dir, "pids.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(pids, fh, indent=1)
        os.replace(tmp, os.path.join(self.run_dir, "pids.json"))

    def run(self) -> dict:
        """Start everything, supervise until the scheduler exits; -> summary (raises on failure)."""
        # A stop signal only sets a flag that the loop reads between its steps. Raising KeyboardInterrupt from
        # the handler could land inside Popen.poll() after it took its waitpid lock and before its try: the
        # lock stays held and shutdown's p.wait() hangs on it (a SIGINT after a respawn hung a launcher 60 s).
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
        stopping = []

        def stop(signum, _frame):
            stopping.append(signum)
        for s in previous:
            signal.signal(s, stop)
        try:
            for name in self.commands:
                if stopping:
                    raise KeyboardInterrupt
                self.spawn(name)
            if self.ray is not None and not stopping:
                from .ray_place import RayWorkers
                self.ray_workers = RayWorkers(self.ray, self.ray_count, self.ray_command, self.client_key_path,
                                              self.env)
            while True:
                if stopping:
                    raise KeyboardInterrupt  # at a safe point: the CLI prints "interrupted", exit status 130
                code = self.procs["scheduler"].poll()
                if code is not None and code < 0 and self.scheduler_restarts < MAX_SCHEDULER_RESTARTS:
                    self.restart_scheduler(code)  # killed, not failed: the run goes on from its checkpoint
                    continue
                if code is not None:
                    break
                for name, p in list(self.procs.items()):
                    if name != "scheduler" and p.poll() not in (None, 0):  # exit 0 = told to stop
                        if self.respawns >= MAX_RESPAWNS:
                            raise FucinaError(f"launch: workers died {self.respawns} times; see {self.log_path}")
                        self.respawns += 1
                        self.spawn(name)
                if self.ray_workers is not None:
                    self.respawns += self.ray_workers.poll()
                time.sleep(0.05)
            if code != 0:
                raise FucinaError(f"launch: the scheduler exited with status {code}{self._scheduler_said()}; "
                                  f"see {self.log_path}")
            with open(os.path.join(self.run_dir, "summary.json")) as fh:
                summary = json.load(fh)
            summary["respawns"] = self.respawns
            summary["scheduler_restarts"] = self.scheduler_restarts
            return summary
        finally:
            self.shutdown()
            for s, h in previous.items():
                signal.signal(s, h)

    def restart_scheduler(self, code):
        """The scheduler died of a signal: stop every local worker (their state is the scheduler's plan's),
        clear the run's segments, start a scheduler resuming from the latest committed checkpoint (or where
        the run began) under the same run id, keys and endpoints, then the workers again, which join it
        (Ray-placed ones: RayWorkers.restart). Resuming is bit-exact, so the run ends on the bits of an
        uninterrupted one. Workers started elsewhere by hand are the operator's to restart (docs/cluster.md)."""
        from . import ckpt
        self.scheduler_restarts += 1
        resume = ckpt.latest_checkpoint(self.run_dir) or self.resume
        with open(self.log_path, "a") as fh:
            fh.write(f"launch: the scheduler exited with status {code}; restarting it (restart "
                     f"{self.scheduler_restarts} of at most {MAX_SCHEDULER_RESTARTS}) from "
                     f"{resume or 'the start'}\n")
        self.stop_children(exclude=("scheduler",))
        shm.unlink_run(self.run_id)
        cmd = self.commands["scheduler"]
        if "--resume" in cmd:
            i = cmd.index("--resume")
            cmd = cmd[:i] + cmd[i + 2:]
        self.commands["scheduler"] = cmd + (["--resume", resume] if resume else [])
        for name in self.commands:
            self.spawn(name)
        if self.ray_workers is not None:
            self.ray_workers.restart()

    def stop_children(self, grace_s=5.0, exclude=()):
        """SIGTERM every live child (but `exclude`), wait up to grace_s, then SIGKILL the rest."""
        procs = [p for name, p in self.procs.items() if name not in exclude]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _scheduler_said(self) -> str:
        """The scheduler's own one-line error, if it left one in the log."""
        try:
            with open(self.log_path, errors="replace") as fh:
                lines = [ln.strip() for ln in fh if ln.startswith("scheduler:")]
        except OSError:
            return ""
        return f" ({lines[-1]})" if lines else ""

    def shutdown(self, grace_s=5.0):
        if self.ray_workers is not None:
            self.ray_workers.close()
        self.stop_children(grace_s)
        self.write_pids()
        shm.unlink_run(self.run_id)
