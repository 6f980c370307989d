"""Watch a run: subscribe to its PUB socket and show metrics and events.

Any number of monitors can attach and leave at any time: a SUB socket is
invisible to the scheduler (PUB never blocks on slow or absent subscribers),
so detaching - Ctrl-C, closing the terminal - cannot disturb the run.
Trade-off: PUB/SUB drops messages sent before we subscribed ("slow joiner");
the live view starts from the next step, and metrics.jsonl holds the history.
A socket cannot tell "nothing yet" from "nobody there", so when the run stays
silent the run directory is asked instead: metrics.jsonl ending in
run_finished means finished, run.json's scheduler_pid tells a live run.
"""
from __future__ import annotations

import glob
import json
import os
import time

from ..errors import UserError
from .metrics import read_metrics
from .transport import Subscriber, ipc_endpoints


def newest_run_dir() -> str:
    """The run directory under ./runs whose run.json is the newest (by its own name, not a <job>-latest link)."""
    candidates = sorted((p for p in glob.glob(os.path.join("runs", "*", "run.json"))
                         if not os.path.islink(os.path.dirname(p))), key=os.path.getmtime)
    if not candidates:
        raise UserError("monitor: no run found under ./runs; give --run-dir DIR or --connect ENDPOINT")
    return os.path.dirname(candidates[-1])


def find_events_endpoint(run_dir=None, connect=None) -> str:
    """--connect wins; else the run dir's run.json (or its ipc socket); else the newest run under ./runs."""
    if connect:
        return connect
    run_dir = run_dir or newest_run_dir()
    try:
        with open(os.path.join(run_dir, "run.json")) as fh:
            return json.load(fh)["endpoints"]["events"]
    except FileNotFoundError:  # not started yet (Procfile): the default ipc socket will appear there
        try:
            return ipc_endpoints(run_dir).events
        except ValueError as e:  # a path too long for an ipc:// socket
            raise UserError(f"monitor: {e}") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise UserError(f"monitor: {run_dir}/run.json is unreadable") from None


def finished_record(run_dir):
    """The run_finished event when it is the last event in RUN_DIR/metrics.jsonl, else None
    (a resumed run appends run_started after it, so an earlier finish does not count)."""
    try:
        events = [r for r in read_metrics(run_dir) if r.get("kind") == "event"]
    except FileNotFoundError:
        return None
    return events[-1] if events and events[-1].get("event") == "run_finished" else None


def events_key(endpoint, run_dir=None, key_path=None):
    """The CURVE client key a tcp:// events socket needs: --key FILE, else the worker.key run.json names; None
    for ipc://."""
    from . import security
    if not security.is_tcp(endpoint):
        return None
    if key_path is None and run_dir is not None:
        try:
            with open(os.path.join(run_dir, "run.json")) as fh:
                key_path = json.load(fh).get("worker_key")
        except (OSError, ValueError, AttributeError, RecursionError):
            key_path = None
    if not isinstance(key_path, str):
        raise UserError(f"{endpoint} is a tcp:// run: its events are CURVE-authenticated; pass --key "
                        f"RUN_DIR/{security.CLIENT_FILE} (or --run-dir of a run whose run.json names it)")
    return security.load_client_key(key_path)


def scheduler_alive(run_dir) -> bool:
    """True while the process run.json names as the run's scheduler exists (on this host)."""
    try:
        with open(os.path.join(run_dir, "run.json")) as fh:
            pid = int(json.load(fh)["scheduler_pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False
    return True


class Watch:
    """The messages a run publishes, as an iterator; `ended` says why iteration stopped:

    "finished"     run_finished was heard (or, missed by a late join, is the last event in metrics.jsonl)
    "was_finished" nothing was published within wait_s and the run dir says the run had already finished
    "silent"       nothing was published within wait_s and no scheduler of this run is alive
    "timeout" / "idle"  the limits the caller set

    follow=True never ends on the run's state (a Procfile's monitor must not be the first process to exit).
    """

    def __init__(self, endpoint, run_dir=None, wait_s=5.0, timeout_s=None, idle_s=None, follow=False, key=None):
        self.endpoint, self.run_dir, self.wait_s, self.key = endpoint, run_dir, wait_s, key
        self.timeout_s, self.idle_s, self.follow = timeout_s, idle_s, follow
        self.ended = None
        self.heard = 0
        self.finish = None  # the run_finished detail, when known

    def __iter__(self):
        sub = Subscriber(self.endpoint, key=self.key)
        t0 = last = time.monotonic()
        try:
            while True:
                msg = sub.recv(200)
                now = time.monotonic()
                if self.timeout_s is not None and now - t0 > self.timeout_s:  # checked first: a busy run never idles
                    self.ended = "timeout"
                    return
                if msg is not None:
                    last, self.heard = now, self.heard + 1
                    yield msg
                    if msg["kind"] == "event" and msg["event"] == "run_finished" and not self.follow:
                        self.ended, self.finish = "finished", msg.get("detail")
                        return
                elif self.idle_s is not None and now - last > self.idle_s:
                    self.ended = "idle"
                    return
                elif not self.follow and now - last > self.wait_s and self._settled():
                    return
        finally:
            sub.close()

    def _settled(self) -> bool:
        """After wait_s of silence: decide from the run dir whether there is anything left to wait for."""
        record = finished_record(self.run_dir) if self.run_dir else None
        if record is not None:
            self.ended, self.finish = ("finished" if self.heard else "was_finished"), record.get("detail")
            return True
        if self.heard or (self.run_dir and scheduler_alive(self.run_dir)):
            return False  # a live run in a long step (first-call compilation, a checkpoint): keep listening
        self.ended = "silent"
        return True


def _fmt(v, spec=".4g"):
    return "-" if v is None else format(v, spec)


TRAIN_KEYS = ("loss", "eval", "lr", "grad_norm", "tokens_per_s", "step_ms")
ES_KEYS = ("reward_mean", "reward_std", "reward_min", "reward_max", "eval", "evals_per_s", "step_ms")


def metrics_line(msg) -> str:
    """One plain line for a metrics message: step, loss, eval, lr, grad norm, speed (ES: the reward stats)."""
    total = msg.get("total")
    step = f"step {msg['step']}/{total}" if total else f"step {msg['step']}"  # ES: total 0 = until converged
    if msg["kind"] == "es_metrics":
        return "  ".join([step.replace("step", "iteration"),
                          *(f"{k.removeprefix('reward_')} {_fmt(msg.get(k), '.4f')}" for k in ES_KEYS[:4]),
                          f"{msg.get('eval_name', 'eval')} {_fmt(msg.get('eval'), '.4f')}",
                          f"{_fmt(msg.get('evals_per_s'), '.0f')} member-evals/s",
                          f"{_fmt(msg.get('step_ms'), '.1f')} ms/iteration"])
    parts = [step, f"loss {_fmt(msg.get('loss'), '.4f')}"]
    if msg.get("eval") is not None:
        parts.append(f"{msg.get('eval_name', 'eval')} {msg['eval']:.4f}")
    parts += [f"lr {_fmt(msg.get('lr'), '.3g')}", f"|g| {_fmt(msg.get('grad_norm'), '.3f')}",
              f"{_fmt(msg.get('tokens_per_s'), '.0f')} tok/s", f"{_fmt(msg.get('step_ms'), '.1f')} ms/step"]
    if msg.get("skipped"):  # --on-nonfinite skip left these micro-batches out of the step
        parts.append(f"skipped non-finite micro-batches {msg['skipped']}")
    return "  ".join(parts)


def event_line(msg) -> str:
    """One plain line for an event message: its step, name and detail (a generated sample left out)."""
    detail = ", ".join(f"{k}={v}" for k, v in (msg.get("detail") or {}).items() if k != "sample")
    return f"step {msg['step']}: {msg['event']}" + (f" {detail}" if detail else "")


def plain_view(watch, out):
    """One line per message on `out` (for logs, pipes and CI: no terminal control codes)."""
    for msg in watch:
        print(event_line(msg) if msg["kind"] == "event" else metrics_line(msg), file=out, flush=True)


def live_view(watch):
    """A rich live view: progress bar, latest metrics, per-role time, recent events."""
    from rich.console import Group
    from rich.live import Live
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeRemainingColumn())
    task = progress.add_task(f"waiting for the first step from {watch.endpoint}", total=None)
    latest, recent = {}, []

    def render():
        table = Table(show_header=False, box=None)
        for key in ES_KEYS if latest.get("kind") == "es_metrics" else TRAIN_KEYS:
            label = latest.get("eval_name", "eval") if key == "eval" else key
            table.add_row(label, _fmt(latest.get(key)))
        for role, ms in (latest.get("roles") or {}).items():
            table.add_row(f"{role} ms/step", _fmt(ms, ".1f"))
        events = Table(show_header=False, box=None)
        for e in recent[-6:]:
            events.add_row(escape(event_line(e))[:100])
        return Group(progress, table, events)

    with Live(render(), refresh_per_second=4) as live:
        for msg in watch:
            if msg["kind"] != "event":
                latest = msg
                step, total = msg["step"], msg.get("total") or None
                progress.update(task, completed=step, total=total,
                                description=f"step {step}/{total}" if total is not None else f"step {step}")
            else:
                recent.append(msg)
            live.update(render())
    return latest
