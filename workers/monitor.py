"""Monitor role: attach to a run's PUB socket and show it (rich live view or JSON lines).

Holds nothing and talks to no one: attach, detach (Ctrl-C) or run several at
once without disturbing the run.
"""
import argparse
import json
import sys

from pipeline.errors import FucinaError
from pipeline.runtime.monitor import find_events_endpoint, live_view, stream
from pipeline.runtime.shm import exit_on_signals


def add_arguments(p):
    p.add_argument("--connect", metavar="ENDPOINT", help="events endpoint (ipc://.../events.sock or tcp://host:port)")
    p.add_argument("--run-dir", metavar="DIR", help="run directory (its run.json names the endpoint; default: newest under ./runs)")
    p.add_argument("--jsonl", action="store_true", help="print each message as one JSON line instead of the live view")
    p.add_argument("--timeout", type=float, default=None, help="stop watching after this many seconds")
    p.add_argument("--idle", type=float, default=None, help="stop after this many seconds without a message")
    p.add_argument("--follow", action="store_true",
                   help="keep watching after run_finished (for Procfiles: never be the first process to exit)")


def watch(args) -> int:
    endpoint = find_events_endpoint(args.run_dir, args.connect)
    if args.jsonl:
        try:
            for msg in stream(endpoint, args.timeout, args.idle, args.follow):
                print(json.dumps(msg), flush=True)
        except KeyboardInterrupt:
            pass
        return 0
    print(f"watching {endpoint} (Ctrl-C detaches; the run goes on)", file=sys.stderr)
    live_view(endpoint, args.timeout, args.idle, args.follow)
    return 0


def main(argv=None):
    exit_on_signals()
    p = argparse.ArgumentParser(prog="python -m workers.monitor", description=__doc__)
    add_arguments(p)
    try:
        return watch(p.parse_args(argv))
    except FucinaError as e:
        print(f"monitor: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM: detach quietly
        return 0


if __name__ == "__main__":
    sys.exit(main())
