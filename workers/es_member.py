"""es-member worker: a parameter replica that scores the ES members it is assigned.

    python -m workers.es_member --connect tcp://HOST:PORT --key worker.key [--name NAME]

Trade-off: the worker keeps no state worth saving. It learns the run (task,
ES config, parameters) from the coordinator's welcome, then per iteration
receives (iteration, member ids, the previous iteration's rewards), applies
that update to its replica exactly as every other replica does, scores its
members, and sends back float64 rewards. Any worker can die and be replaced;
a new one gets the current parameters in its welcome. One thread per worker
(BLAS and numba pinned): the parallelism is the number of workers.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

# numpy/numba/zmq and the pipeline are imported inside functions on purpose:
# main() must pin the BLAS and numba thread pools before they are first loaded.


def make_task(run: dict):
    """The task object a run config describes (a replica + its batched scorer)."""
    if run.get("task") == "spirals":
        from pipeline.es.spirals import SpiralsTask
        return SpiralsTask.from_run_config(run)
    raise ValueError(f"unknown ES task {run.get('task')!r}")


class Member:
    """The message handler, separate from the socket so tests can drive it directly."""

    def __init__(self):
        self.task = None

    def _reach(self, it, catchup):
        trainer = self.task.trainer
        if catchup is not None and trainer.iteration == it - 1:
            trainer.update(catchup)
        if trainer.iteration != it:
            raise RuntimeError(f"replica is at iteration {trainer.iteration}, asked for {it}")

    def handle(self, msg, frames):
        """-> list of (kind, fields, frames) replies; None means shut down."""
        from pipeline.es import protocol
        from pipeline.es.spirals import params_sha256
        kind = msg["kind"]
        if kind == "shutdown":
            return None
        if kind == "heartbeat":
            return []
        if kind == "welcome":
            self.task = make_task(msg["run"])
            protocol.load_frames(self.task.trainer.named_arrays(), msg["slots"], frames, source="welcome")
            self.task.trainer.iteration = msg["it"]
            return []
        if self.task is None:
            return [("failed", {"error": f"{kind!r} before welcome"}, [])]
        if kind == "iter":
            cpu0 = time.process_time()  # CPU seconds: a load-independent cost measure
            self._reach(msg["it"], msg["catchup"])
            members = [int(m) for m in msg["members"]]
            rewards = self.task.rewards(members).tolist() if members else []
            fields = {"it": msg["it"], "members": members, "rewards": rewards}
            if msg["center"]:
                fields["center"] = list(self.task.center())
            fields["cpu_ms"] = (time.process_time() - cpu0) * 1e3
            return [("rewards", fields, [])]
        if kind == "fetch":
            self._reach(msg["it"], msg["catchup"])
            named = self.task.trainer.named_arrays()
            desc, raw = protocol.slot_frames(named)
            return [("params", {"it": msg["it"], "sha256": params_sha256(named), "slots": desc},
                     raw if msg["frames"] else [])]
        return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.es_member", description=__doc__.splitlines()[0])
    ap.add_argument("--connect", required=True, help="coordinator endpoint, e.g. tcp://10.0.0.5:5555 or ipc:///tmp/x")
    ap.add_argument("--key", default=None, metavar="FILE",
                    help="the run's worker.key (CURVE), required for a tcp:// coordinator")
    ap.add_argument("--name", default=None, help="worker identity (default: hostname-pid)")
    ap.add_argument("--threads", type=int, default=1, help="BLAS/numba threads in this worker (default 1)")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats while idle")
    ap.add_argument("--liveness", type=float, default=10.0,
                    help="exit when the coordinator has been silent this many seconds")
    args = ap.parse_args(argv)

    from pipeline.threads import pin_threads
    pin_threads(args.threads)
    import zmq

    from pipeline.errors import FucinaError
    from pipeline.es import protocol
    from pipeline.runtime import security

    key = None
    if security.is_tcp(args.connect):
        try:
            if args.key is None:
                raise FucinaError(f"{args.connect} is tcp:// (CURVE): give the run's worker.key with --key FILE")
            key = security.load_client_key(args.key)
        except FucinaError as e:
            print(f"es_member: error: {e}", file=sys.stderr)
            return 2
    name = args.name or f"{socket.gethostname()}-{os.getpid()}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.LINGER, 1000)
    if key is not None:
        security.secure_client(sock, key)
    sock.connect(args.connect)
    sock.send(protocol.encode("hello", worker=name, pid=os.getpid(), host=socket.gethostname()))
    member = Member()
    last_heard = last_sent = time.monotonic()
    code = 0
    try:
        while True:
            if sock.poll(int(args.heartbeat * 1000)):
                frames = sock.recv_multipart()
                last_heard = time.monotonic()
                try:
                    msg = protocol.decode(frames[0])
                except protocol.ProtocolError as e:
                    print(f"es_member {name}: dropped a frame: {e}", file=sys.stderr)
                    continue
                try:
                    replies = member.handle(msg, frames[1:])
                except Exception as e:  # report, then stop: a desynced replica must not keep answering
                    sock.send(protocol.encode("failed", error=f"{type(e).__name__}: {e}"))
                    code = 1
                    break
                if replies is None:
                    break
                for kind, fields, raw in replies:
                    sock.send_multipart([protocol.encode(kind, **fields), *raw])
                    last_sent = time.monotonic()
            elif time.monotonic() - last_heard > args.liveness:
                print(f"es_member {name}: coordinator silent for {args.liveness}s, exiting", file=sys.stderr)
                code = 1
                break
            if time.monotonic() - last_sent > args.heartbeat:
                sock.send(protocol.encode("heartbeat"))
                last_sent = time.monotonic()
    except KeyboardInterrupt:
        code = 130
    finally:
        sock.close()
        ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main())
