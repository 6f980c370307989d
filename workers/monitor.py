"""Monitor role: attach to a run's PUB socket and show it (rich live view, plain lines or JSON lines).

Holds nothing and talks to no one: attach, detach (Ctrl-C) or run several at
once without disturbing the run.
"""
import argparse
import json
import os
import sys

from pipeline.errors import FucinaError, UserError
from pipeline.runtime.monitor import Watch, events_key, find_events_endpoint, live_view, newest_run_dir, plain_view
from pipeline.runtime.shm import exit_on_signals

WAIT_S = 5.0


def add_arguments(p):
    p.add_argument("--connect", metavar="ENDPOINT", help="events endpoint (ipc://.../events.sock or tcp://host:port)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="run directory (its run.json names the endpoint; default: the newest under ./runs)")
    p.add_argument("--key", metavar="FILE",
                   help="a tcp:// run's worker.key (CURVE); default: the one the run dir's run.json names")
    p.add_argument("--jsonl", action="store_true", help="print each message as one JSON line")
    p.add_argument("--wait", type=float, default=WAIT_S, metavar="S",
                   help="seconds to wait for a message before reporting a finished or absent run and exiting 1 "
                        "(a run whose scheduler is alive is waited for; inf = wait for ever)")
    p.add_argument("--timeout", type=float, default=None, help="stop watching after this many seconds")
    p.add_argument("--idle", type=float, default=None, help="stop after this many seconds without a message")
    p.add_argument("--follow", action="store_true",
                   help="keep watching whatever the run does, before it starts and after run_finished "
                        "(for Procfiles: never be the first process to exit)")


def watch(args, out=None) -> int:
    """Show the run on `out` (stdout): a live view on a terminal, else one plain line per message (or
    --jsonl). 0 when the run was watched, 1 (with the reason on stderr) when there was nothing to watch."""
    out = out or sys.stdout
    run_dir = args.run_dir if args.run_dir or args.connect else newest_run_dir()
    endpoint = find_events_endpoint(run_dir, args.connect)
    if args.wait < 0:
        raise UserError(f"--wait must be >= 0 seconds, got {args.wait}")
    seen = Watch(endpoint, run_dir, wait_s=args.wait, timeout_s=args.timeout, idle_s=args.idle, follow=args.follow,
                 key=events_key(endpoint, run_dir, args.key))
    print(f"watching {endpoint} (Ctrl-C detaches; the run goes on)", file=sys.stderr, flush=True)
    try:
        if args.jsonl:
            for msg in seen:
                print(json.dumps(msg), file=out, flush=True)
        elif out.isatty():
            live_view(seen)
        else:
            plain_view(seen, out)
    except KeyboardInterrupt:  # detach: the run goes on
        return 0
    where = run_dir or endpoint
    if seen.ended == "was_finished":
        detail = seen.finish or {}
        print(f"monitor: {where}: the run has finished (step {detail.get('steps', '?')}, final loss "
              f"{detail.get('final_loss', '?')}); nothing more will be published. Its history is "
              f"{where}/metrics.jsonl (`fucina plot {where}` redraws the curve)", file=sys.stderr)
        return 1
    if seen.ended == "silent":
        if run_dir and not os.path.isdir(run_dir):
            why = f"there is no run directory {run_dir}"
        else:
            why = f"no scheduler of {run_dir} is running" if run_dir else "nothing is publishing there"
        print(f"monitor: nothing published on {endpoint} for {args.wait:g} s and {why}: no run to watch "
              f"(--wait S waits longer)", file=sys.stderr)
        return 1
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
