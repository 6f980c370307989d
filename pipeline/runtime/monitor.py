"""Watch a run: subscribe to its PUB socket and show metrics and events.

Any number of monitors can attach and leave at any time: a SUB socket is
invisible to the scheduler (PUB never blocks on slow or absent subscribers),
so detaching - Ctrl-C, closing the terminal - cannot disturb the run.
Trade-off: PUB/SUB drops messages sent before we subscribed ("slow joiner");
the live view starts from the next step, and metrics.jsonl holds the history.
"""
from __future__ import annotations

import glob
import json
import os
import time

from ..errors import UserError
from .transport import Subscriber, ipc_endpoints


def find_events_endpoint(run_dir=None, connect=None) -> str:
    """--connect wins; else the run dir's run.json (or its ipc socket); else the newest run under ./runs."""
    if connect:
        return connect
    if run_dir is None:
        candidates = sorted(glob.glob(os.path.join("runs", "*", "run.json")), key=os.path.getmtime)
        if not candidates:
            raise UserError("monitor: no run found under ./runs; give --run-dir DIR or --connect ENDPOINT")
        run_dir = os.path.dirname(candidates[-1])
    try:
        with open(os.path.join(run_dir, "run.json")) as fh:
            return json.load(fh)["endpoints"]["events"]
    except FileNotFoundError:  # not started yet (Procfile): the default ipc socket will appear there
        return ipc_endpoints(run_dir).events
    except (OSError, ValueError, KeyError):
        raise UserError(f"monitor: {run_dir}/run.json is unreadable") from None


def stream(endpoint, timeout_s=None, idle_s=None, follow=False):
    """Yield decoded metrics/event messages until run_finished (unless follow), timeout or idleness."""
    sub = Subscriber(endpoint)
    t0 = last = time.monotonic()
    try:
        while True:
            msg = sub.recv(200)
            now = time.monotonic()
            if msg is not None:
                last = now
                yield msg
                if msg["kind"] == "event" and msg["event"] == "run_finished" and not follow:
                    return
            if timeout_s is not None and now - t0 > timeout_s:
                return
            if idle_s is not None and now - last > idle_s:
                return
    finally:
        sub.close()


def _fmt(v, spec=".4g"):
    return "-" if v is None else format(v, spec)


def live_view(endpoint, timeout_s=None, idle_s=None, follow=False):
    """A rich live view: progress bar, latest metrics, per-role time, recent events."""
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    progress = Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(), TimeRemainingColumn())
    task = progress.add_task("run", total=None)
    latest, recent = {}, []

    def render():
        table = Table(show_header=False, box=None)
        for key in ("loss", "eval", "lr", "grad_norm", "tokens_per_s", "step_ms"):
            label = latest.get("eval_name", "eval") if key == "eval" else key
            table.add_row(label, _fmt(latest.get(key)))
        for role, ms in (latest.get("roles") or {}).items():
            table.add_row(f"{role} ms/step", _fmt(ms, ".1f"))
        events = Table(show_header=False, box=None)
        for e in recent[-6:]:
            events.add_row(str(e["step"]), e["event"], json.dumps(e["detail"], default=str)[:80])
        return Group(progress, table, events)

    with Live(render(), refresh_per_second=4) as live:
        try:
            for msg in stream(endpoint, timeout_s, idle_s, follow):
                if msg["kind"] == "metrics":
                    latest = msg
                    progress.update(task, completed=msg["step"], total=msg.get("total"))
                else:
                    recent.append(msg)
                live.update(render())
        except KeyboardInterrupt:  # detach: the run goes on
            pass
    return latest
