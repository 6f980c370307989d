"""The shared life of a worker process: connect, hello, welcome, tasks, exit.

    hello(role, worker id, pid) -> welcome(run description) -> heartbeat thread
    -> loop: one task message at a time, dispatched to on_<kind>(msg)
    -> shutdown message, SIGTERM, Ctrl-C or a lost scheduler: unlink own
       segments, say bye, exit 0.

A task handler that raises sends `failed` (with the error text) and the worker
exits 1: a deterministic task that failed once would fail again, so retrying
is the scheduler's call, not ours. Unknown or malformed messages are dropped.

Fault injection for tests: FUCINA_FAULT="role:point:step[,role:point:step...]"
makes the worker SIGKILL itself once at that point (a marker file in the run dir records that it
fired, so the replacement process does not die again).
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import time
import traceback

from ..threads import add_threads_flag
from ..errors import FucinaError, UserError
from ..jobs import get_job
from ..threads import pin_threads
from ..jobs.spec import build
from . import security
from .shm import Registry, exit_on_signals
from .transport import LIVENESS_S, DealerSocket, HeartbeatThread, ipc_endpoints

WELCOME_TIMEOUT_S = 60.0
EXIT_REPLACED = 75  # EX_TEMPFAIL: the scheduler declared us lost; a supervisor should start a new one


def _liveness(seconds) -> float:
    """The scheduler's --liveness from the welcome, as this worker's patience with a silent scheduler (never
    less than the default; a scheduler that sent none or nonsense gets the default)."""
    if type(seconds) not in (int, float) or not 0 < seconds < 86_400:
        return LIVENESS_S
    return max(LIVENESS_S, float(seconds))


def worker_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--run-dir", default=None,
                        help="run directory (its sockets/control.sock is the default endpoint)")
    parser.add_argument("--connect", default=None, help="scheduler control endpoint (ipc://... or tcp://host:port)")
    parser.add_argument("--key", default=None, metavar="FILE",
                        help="the run's worker.key, needed for tcp:// (default: RUN_DIR/worker.key with --run-dir)")
    add_threads_flag(parser, 1, "this worker")
    parser.add_argument("--stand-by", action="store_true",
                        help="when the run has no use for this role (a trainer at an ES run, an es_member at a "
                             "training run), wait for SIGTERM instead of exiting: the Procfile starts every role "
                             "for any job, and honcho ends the whole run when the first process exits")
    parser.add_argument("--log-level", default="WARNING", help="logging level")


def control_endpoint(args) -> str:
    if args.connect:
        return args.connect
    if args.run_dir:
        return ipc_endpoints(args.run_dir).control
    sys.exit("worker: give --run-dir DIR or --connect ENDPOINT")


def client_key(args, endpoint: str):
    """The CURVE client key for a tcp:// endpoint (None on ipc://)."""
    if not security.is_tcp(endpoint):
        return None
    path = args.key or (args.run_dir and os.path.join(args.run_dir, security.CLIENT_FILE))
    if not path:
        raise UserError(f"{endpoint} is tcp:// (CURVE): give the run's worker.key with --key FILE")
    return security.load_client_key(path)


class RoleUnused(Exception):
    """The scheduler said this run has no use for the role (raised only for a --stand-by worker)."""


class Worker:
    role = "worker"
    remote = False  # True: fed by buffer frames, maps no shared memory (workers/trainer.py --remote)

    def __init__(self, endpoint: str, threads: int = 1, key=None, stand_by=False):
        self.endpoint, self.threads, self.key, self.stand_by = endpoint, threads, key, stand_by
        self.id = f"{self.role}-{os.getpid()}"
        self.log = logging.getLogger(f"fucina.{self.role}")
        self.registry = None
        self.run = None

    # --- hooks for roles ---------------------------------------------------
    def setup(self):
        """Called once after the welcome: build buffers, attach segments."""

    # --- the life cycle ----------------------------------------------------
    def main(self) -> int:
        exit_on_signals()
        pin_threads(self.threads)
        self.sock = DealerSocket(self.endpoint, key=self.key)
        heartbeat = None
        token = secrets.token_hex(16)  # only heartbeats carrying it keep this worker alive at the scheduler
        try:
            self.sock.send("hello", role=self.role, worker=self.id, pid=os.getpid(), token=token,
                           **({"remote": True} if self.remote else {}))
            heartbeat = HeartbeatThread(self.endpoint, self.id, token, self.key)
            heartbeat.start()
            welcome = self._await_welcome()
            self.run = welcome["run"]
            heartbeat.timeout_s = _liveness(self.run.get("liveness_s"))
            self.run_dir = self.run["run_dir"]
            self.job = get_job(self.run["job"])(build(get_job(self.run["job"]).Spec, self.run["spec"]))
            self.registry = Registry(self.run["run_id"], self.role)
            self.setup()
            return self._serve()
        except RoleUnused as e:
            heartbeat.stop()
            heartbeat = None
            print(f"{self.id}: {e}; standing by until SIGTERM (--stand-by)", file=sys.stderr, flush=True)
            return self._wait_for_a_signal()
        except SystemExit as e:  # SIGTERM / SIGHUP / lost scheduler: a clean exit
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                return 1
            replaced = e.code == EXIT_REPLACED or (heartbeat is not None and heartbeat.replaced)
            return EXIT_REPLACED if replaced else 0
        except KeyboardInterrupt:
            return 0
        finally:
            if heartbeat:
                heartbeat.stop()
            try:
                self.sock.send("bye", worker=self.id)
            except Exception:  # noqa: BLE001 - the context may be gone at exit
                pass
            if self.registry:
                self.registry.close()
            self.sock.close()

    def _await_welcome(self):
        deadline = time.monotonic() + WELCOME_TIMEOUT_S
        while time.monotonic() < deadline:
            msg = self.sock.recv(200)
            if msg and msg["kind"] == "welcome":
                return msg
            if msg and msg["kind"] == "shutdown":
                if msg.get("unused") and self.stand_by:
                    raise RoleUnused(msg["reason"])
                raise SystemExit(EXIT_REPLACED if msg.get("replace") else 0)
        raise SystemExit(f"{self.id}: no welcome from the scheduler at {self.endpoint} within "
                         f"{WELCOME_TIMEOUT_S:.0f} s (none is listening, the key is not this run's, or a live "
                         f"{self.role} holds the role and this one was queued behind it)")

    @staticmethod
    def _wait_for_a_signal() -> int:
        try:
            while True:
                signal.pause()
        except (SystemExit, KeyboardInterrupt):  # SIGTERM / SIGHUP (exit_on_signals) or Ctrl-C: done
            return 0

    def _serve(self) -> int:
        while True:
            msg = self.sock.recv(200)
            if not msg:
                continue
            kind = msg["kind"]
            if kind == "shutdown":  # EXIT_REPLACED asks a supervisor for a fresh process
                return EXIT_REPLACED if msg.get("replace") else 0
            handler = getattr(self, f"on_{kind}", None)
            if handler is None:
                self.log.warning("%s: dropped a %r message (not a task for this role)", self.id, kind)
                continue
            try:
                handler(msg)
            except Exception as e:  # noqa: BLE001 - reported to the scheduler, then we exit
                self.log.error("%s: task %s failed:\n%s", self.id, kind, traceback.format_exc())
                self.sock.send("failed", msg.get("step", 0), worker=self.id, error=f"{self.id} {kind}: {e}")
                return 1

    def fault(self, point: str, step: int):
        """SIGKILL ourselves once if FUCINA_FAULT names this role, point and step."""
        if f"{self.role}:{point}:{step}" not in os.environ.get("FUCINA_FAULT", "").split(","):
            return
        marker = os.path.join(self.run_dir, f"fault-{self.role}-{point}-{step}.fired")
        try:  # created exclusively: of two members at the same point and step at once, only one dies
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def run_worker(cls, argv=None, remote_cls=None) -> int:
    """`remote_cls`: the class a `--remote` worker runs (a role that can run on another host)."""
    parser = argparse.ArgumentParser(prog=f"python -m workers.{cls.role}", description=cls.__doc__)
    worker_arguments(parser)
    if remote_cls is not None:
        parser.add_argument("--remote", action="store_true",
                            help="this host cannot map the scheduler host's shared memory: receive parameters and "
                                 "batches and send gradients as frames over the connection (tcp:// with --key)")
    args = parser.parse_args(argv)
    if getattr(args, "remote", False):
        cls = remote_cls
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    endpoint = control_endpoint(args)
    try:
        key = client_key(args, endpoint)
    except FucinaError as e:
        print(f"{cls.role}: error: {e}", file=sys.stderr)
        return 2
    return cls(endpoint, threads=args.threads, key=key, stand_by=args.stand_by).main()
