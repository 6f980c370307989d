"""Run metrics: metrics.jsonl (one JSON object per line) and the loss-curve PNG.

The scheduler (or the in-process loop) appends a line per optimizer step and
one per event; `plot_run` redraws the curve from the file alone, so
`fucina plot RUN_DIR` works on a finished, running or crashed run.
"""
from __future__ import annotations

import json
import os
import time


def peak_rss_mb():
    """This process's own peak resident set in MB: VmHWM where /proc exists (ru_maxrss would
    include the parent's after fork+exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class MetricsLog:
    def __init__(self, run_dir):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.fh = open(self.path, "a", buffering=1)

    def write(self, record: dict):
        self.fh.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def close(self):
        self.fh.close()


def read_metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except (ValueError, RecursionError):
                    continue  # a line cut by a crash mid-write (or not ours: nested past the decoder's stack)
    return out


def plot_run(run_dir, out=None) -> str:
    """Draw train loss (and eval metric) against step into RUN_DIR/loss.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..errors import UserError
    try:
        records = read_metrics(run_dir)
    except FileNotFoundError:
        raise UserError(f"{run_dir}: no metrics.jsonl (is this a run directory?)") from None
    steps = {}
    for r in records:  # a replayed step (after a restart) overwrites the earlier record
        if r.get("kind") == "metrics":
            steps[r["step"]] = r
    if not steps:
        raise UserError(f"{run_dir}/metrics.jsonl: no step records to plot")
    xs = sorted(steps)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [steps[s]["loss"] for s in xs], lw=1, label="train loss")
    evals = [(s, steps[s]["eval"]) for s in xs if steps[s].get("eval") is not None]
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label=steps[evals[0][0]].get("eval_name", "eval"))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(os.path.basename(os.path.abspath(run_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    out = out or os.path.join(run_dir, "loss.png")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
