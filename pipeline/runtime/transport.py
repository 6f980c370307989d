"""ZeroMQ transport: ROUTER (scheduler) <-> DEALER (workers), PUB/SUB for metrics.

Endpoints default to `ipc://` sockets in RUN_DIR/sockets/, a 0700 directory
(only the run's user can connect). `tcp://` is available for several hosts; a
tcp endpoint given as a bare port binds the loopback interface unless a host
is named explicitly, and every tcp socket speaks CURVE with the run's keys
(security.py): a peer without worker.key cannot complete the handshake.

Each message is one frame of msgpack (messages.py). A DEALER does not choose
its identity: the ROUTER assigns each connection one, so the scheduler can
match a result to the connection that was assigned the task - a peer cannot
speak under another's name. Heartbeats run on a separate DEALER socket owned
by a background thread (ZeroMQ sockets are not thread-safe, and a worker busy
in a long backward pass must keep beating); they carry a secret token the
worker sent in its hello, so only that worker's heartbeats keep it alive.

Trade-off: the scheduler is a single hub (star topology). Every result passes
through it, which costs one hop per task (~0.1 ms on ipc) but makes the commit
order - and therefore determinism - a property of one loop in one process.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import zmq

from ..errors import UserError
from . import messages, security

log = logging.getLogger("fucina.transport")

SOCKET_DIR = "sockets"   # RUN_DIR/sockets/: the binder makes it 0700
HEARTBEAT_S = 0.25       # how often both sides beat
LIVENESS_S = 5.0         # silence after which a peer is declared dead
RCVHWM = 64              # complete messages queued per connection at the ROUTER before ZeroMQ stops reading it


@dataclass(frozen=True)
class Endpoints:
    control: str   # scheduler ROUTER binds, workers' DEALERs connect
    events: str    # scheduler PUB binds, monitors' SUBs connect

    def to_wire(self):
        return {"control": self.control, "events": self.events}


def ipc_endpoints(run_dir: str) -> Endpoints:
    sockets = os.path.join(os.path.abspath(run_dir), SOCKET_DIR)
    ctl, ev = os.path.join(sockets, "control.sock"), os.path.join(sockets, "events.sock")
    if len(ctl) > 100:  # sun_path limit is 108 bytes
        raise ValueError(f"transport: run directory path too long for an ipc:// socket ({len(ctl)} > 100 chars): "
                         f"{run_dir}; use a shorter --run-dir, or tcp (--port)")
    return Endpoints(f"ipc://{ctl}", f"ipc://{ev}")


def tcp_endpoints(port: int, host: str = "127.0.0.1") -> Endpoints:
    return Endpoints(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}")


def _socket(ctx, kind):
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, messages.MAX_FRAME_BYTES)  # a longer frame closes that connection unread
    return s


def _bind(sock, endpoint: str, key):
    """Bind a server socket: CURVE on tcp:// (required), a private socket directory on ipc://."""
    if security.is_tcp(endpoint):
        if key is None:
            raise UserError(f"transport: {endpoint} is tcp:// and needs the run's CURVE key (scheduler.key)")
        security.secure_server(sock, key)
    elif endpoint.startswith("ipc://"):
        directory = os.path.dirname(endpoint[len("ipc://"):])
        if os.path.basename(directory) == SOCKET_DIR:  # ours: never chmod a directory the user named
            security.private_dir(directory)
    sock.bind(endpoint)


def _connect(sock, endpoint: str, key):
    if security.is_tcp(endpoint):
        if key is None:
            raise UserError(f"transport: {endpoint} is tcp:// (CURVE): give the run's worker.key with --key FILE")
        security.secure_client(sock, key)
    sock.connect(endpoint)


class RouterSocket:
    """The scheduler's control socket: receive (identity, message), send to identity.

    On tcp:// the caller must also run an authenticator on `ctx` (security.start_authenticator);
    without one CURVE would admit any client that knows the server's public key."""

    def __init__(self, endpoint: str, ctx=None, key=None, max_buffers=None, max_buffer_bytes=None):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = _socket(self.ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.buffers = []
        self.refused = None  # why the last message was refused unread (over the buffer limits), else None
        self.limit(max_buffers, max_buffer_bytes)
        _bind(self.sock, endpoint, key)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def limit(self, max_buffers: int, max_buffer_bytes: int):
        """The most buffer frames (and bytes in them) one message may carry: what the largest legitimate
        message of this run needs (a remote trainer's gradient, remote.py). A message over either is
        refused before anything reads it, and its frames are released at once. None: no limit (benches)."""
        self.max_buffers, self.max_buffer_bytes = max_buffers, max_buffer_bytes

    def send(self, identity: bytes, kind: str, step: int = 0, buffers=(), **fields):
        """`buffers`: tensor frames after the body (remote.py), sent without copying them."""
        self.sock.send_multipart([identity, messages.pack(kind, step, **fields), *buffers], copy=not buffers)

    def recv(self, timeout_ms: int):
        """(identity, message) or None on timeout; undecodable frames come back as (identity, None), logged.

        Frames after the body (a remote trainer's gradient) are left in `self.buffers` until the next recv."""
        self.buffers = []
        if not self.sock.poll(timeout_ms):
            return None
        self.refused = None
        frames = self.sock.recv_multipart(copy=False)
        if len(frames) < 2:
            log.warning("dropped a control message with %d frames (want identity + body)", len(frames))
            return frames[0].bytes, None
        extra = len(frames) - 2
        size = sum(len(f) for f in frames[2:]) if extra else 0  # lengths only: no byte is read
        if self.max_buffers is not None and (extra > self.max_buffers or size > self.max_buffer_bytes):
            self.refused = (f"a message with {extra} buffer frames of {size} bytes (this run's largest "
                            f"needs {self.max_buffers} frames, {self.max_buffer_bytes} bytes)")
            log.warning("dropped %s", self.refused)
            identity = frames[0].bytes
            del frames  # release the message now, not at the next recv
            return identity, None
        self.buffers = [f.buffer for f in frames[2:]]
        return frames[0].bytes, messages.decode(frames[1].bytes)

    def close(self):
        self.sock.close(0)


class DealerSocket:
    """A worker's control socket, connected to the scheduler (which assigns its identity)."""

    def __init__(self, endpoint: str, ctx=None, key=None):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = _socket(self.ctx, zmq.DEALER)
        self.buffers = []
        _connect(self.sock, endpoint, key)

    def send(self, kind: str, step: int = 0, buffers=(), **fields):
        """`buffers`: tensor frames after the body (remote.py); -> a tracker, done once ZeroMQ let go of them."""
        if not buffers:
            self.sock.send(messages.pack(kind, step, **fields))
            return None
        return self.sock.send_multipart([messages.pack(kind, step, **fields), *buffers], copy=False, track=True)

    def recv(self, timeout_ms: int):
        """A message, None on timeout, or False for a dropped (invalid) frame.

        Frames after the body (tensors for a remote trainer) are left in `self.buffers` until the next recv."""
        self.buffers = []
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        self.buffers = [f.buffer for f in frames[1:]]
        msg = messages.decode(frames[0].bytes)
        return msg if msg is not None else False

    def close(self):
        self.sock.close(0)


class Publisher:
    """PUB socket for metrics and events: monitors attach and leave at will (on tcp://, with the key)."""

    def __init__(self, endpoint: str, ctx=None, key=None):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = _socket(self.ctx, zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        _bind(self.sock, endpoint, key)

    def publish(self, kind: str, step: int = 0, **fields) -> dict:
        msg = messages.make(kind, step, **fields)
        self.sock.send(messages.encode(msg))
        return msg

    def close(self):
        self.sock.close(0)


class Subscriber:
    def __init__(self, endpoint: str, ctx=None, key=None):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = _socket(self.ctx, zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        _connect(self.sock, endpoint, key)

    def recv(self, timeout_ms: int):
        if not self.sock.poll(timeout_ms):
            return None
        return messages.decode(self.sock.recv())

    def close(self):
        self.sock.close(0)


class ServerContext:
    """The binding side's own zmq.Context; on tcp:// its ZAP handler admits only the run's client key."""

    def __init__(self, key=None):
        self.ctx = zmq.Context()
        self.key = key
        self.auth = security.start_authenticator(self.ctx, key) if key is not None else None

    def close(self):
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


class Liveness:
    """Scheduler side: when did we last hear from each worker?"""

    def __init__(self, timeout_s: float = LIVENESS_S):
        self.timeout_s = timeout_s
        self.last: dict[str, float] = {}

    def beat(self, worker: str):
        self.last[worker] = time.monotonic()

    def forget(self, worker: str):
        self.last.pop(worker, None)

    def dead(self) -> list[str]:
        now = time.monotonic()
        return [w for w, t in self.last.items() if now - t > self.timeout_s]


def process_exited(pid: int) -> bool:
    """True when no live process has this pid here (a zombie counts as exited)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid is that large
        return True
    except PermissionError:  # another user's process: alive
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class HeartbeatThread(threading.Thread):
    """Worker side: beat every HEARTBEAT_S on a private socket; the scheduler echoes.

    Once the scheduler has answered, silence for `timeout_s` means it is dead:
    the worker is sent SIGTERM (its handler unwinds and unlinks its segments),
    so orphaned workers exit within a few seconds of losing the scheduler.
    Before the first answer the worker waits (the scheduler may start later).
    A worker that was itself paused gives the scheduler a fresh `timeout_s`
    on waking: if the scheduler declared it lost meanwhile, its shutdown
    (replace) arrives, and the worker exits for a supervisor to replace it.
    An echo from another scheduler process than the first one heard (a
    restarted scheduler on the same endpoint, which never welcomed this
    worker and would leave it idle) ends the worker the same way, `replaced`
    set, so it exits 75 and its supervisor starts one that joins afresh.
    """

    def __init__(self, endpoint: str, worker: str, token: str, key=None, timeout_s: float = LIVENESS_S,
                 interval_s: float = HEARTBEAT_S):
        super().__init__(name=f"heartbeat-{worker}", daemon=True)
        self.endpoint, self.worker, self.token, self.key = endpoint, worker, token, key
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self._stop = threading.Event()
        self.lost = False
        self.replaced = False

    def run(self):
        ctx = zmq.Context.instance()
        sock = DealerSocket(self.endpoint, ctx, self.key)
        last_heard = incarnation = None
        try:
            while not self._stop.is_set():
                beat_started = time.monotonic()
                sock.send("heartbeat", worker=self.worker, token=self.token)
                deadline = beat_started + self.interval_s
                while (left := deadline - time.monotonic()) > 0:
                    msg = sock.recv(int(left * 1000) + 1)
                    if msg:
                        last_heard = time.monotonic()
                        incarnation = incarnation or msg.get("incarnation")
                        if msg.get("incarnation") not in (None, incarnation) and not self._stop.is_set():
                            self.replaced = True
                            log.warning("%s: the scheduler was restarted; exiting for a fresh worker to join it",
                                        self.worker)
                            os.kill(os.getpid(), signal.SIGTERM)
                            return
                if last_heard is not None and time.monotonic() - beat_started > self.timeout_s / 2:
                    last_heard = time.monotonic()  # we were paused (SIGSTOP, a frozen VM): the silence was ours
                silent = last_heard is not None and time.monotonic() - last_heard > self.timeout_s
                if silent and not self._stop.is_set():
                    self.lost = True
                    log.warning("%s: no heartbeat from the scheduler for %.1f s; exiting", self.worker, self.timeout_s)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
        finally:
            sock.close()

    def stop(self):
        self._stop.set()


def free_port_pair(host):
    """A port P with P and P+1 free on `host` (control and events)."""
    import socket
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind((host, 0))
            port = a.getsockname()[1]
            try:
                b.bind((host, port + 1))
            except OSError:
                continue
            return port
    raise UserError(f"no free pair of tcp ports on {host}")
