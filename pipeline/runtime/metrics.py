"""Run metrics: metrics.jsonl (one JSON object per line) and the loss-curve PNG.

The scheduler (or the in-process loop) appends a line per optimizer step and
one per event; `plot_run` redraws the curve from the file alone, so
`fucina plot RUN_DIR` works on a finished, running or crashed run.
"""
from __future__ import annotations

import json
import os
import time

from ..errors import CheckpointError


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


def gflop_rate(job, tokens_per_s):
    """The step's estimated GFLOP/s (job.flops_per_token() x tokens/s; computed once per job), or None."""
    per_token = getattr(job, "_flops_per_token", False)
    if per_token is False:
        estimate = getattr(job, "flops_per_token", None)
        per_token = job._flops_per_token = estimate() if estimate else None
    return None if per_token is None else per_token * tokens_per_s / 1e9


STEP_KINDS = ("metrics", "es_metrics")  # the records a step (or ES iteration) writes once


class MetricsLog:
    """Appends to RUN_DIR/metrics.jsonl (line-buffered: a crash cuts at most the last line), and with
    `tensorboard` = a directory (a job spec's `tensorboard` field, `--tensorboard DIR`) writes every step record's
    scalars to a TensorBoard event file there too (runtime/tensorboard.py): the one place step records are
    written, so every job that has metrics.jsonl (finetune, pretrain, lm, es-*) gets the curves."""

    def __init__(self, run_dir, tensorboard: str = ""):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        if tensorboard:
            from .tensorboard import EventWriter
            self.tb = EventWriter(tensorboard)
        self.fh = open(self.path, "a", buffering=1)

    def write(self, record: dict):
        now = time.time()
        self.fh.write(json.dumps({"time": round(now, 3), **record}) + "\n")
        if self.tb is not None and record.get("kind") in STEP_KINDS and isinstance(record.get("step"), int):
            from .tensorboard import step_scalars
            self.tb.scalars(record["step"], step_scalars(record), now)

    def rewind(self, step: int):
        """Drop the step records after `step`, the step the run (re)starts from, before it writes again.

        A run resumed from checkpoint N (a restarted scheduler, an in-run restart after a lost optimizer,
        `--resume` into the same directory) replays steps N+1.. that the file may already hold; by the
        determinism contract the replayed records carry the same values, so the file is cut back to the
        checkpoint the run resumed from rather than deduplicated on write: it then describes exactly the
        state that run continues (a checkpoint older than the last records is resumed consistently too) and
        every reader sees each step once. Events are kept (they are the run's history, restarts included),
        and so is everything of other kinds; a line cut by a crash is dropped (the next append would
        otherwise be glued to it). The rewrite is a temp file renamed over the old one, streamed line by
        line: a reader sees the old file or the new one, never half of it."""
        self.fh.close()
        tmp = f"{self.path}.tmp-{os.getpid()}"
        changed = made = False
        try:
            with open(self.path, "rb") as src, open(tmp, "wb") as dst:
                made = True
                for line in src:
                    try:
                        r = json.loads(line) if line.strip() else None
                    except (ValueError, RecursionError):
                        r = None
                    if not isinstance(r, dict) or not line.endswith(b"\n") or (
                            r.get("kind") in STEP_KINDS and isinstance(r.get("step"), int) and r["step"] > step):
                        changed = True
                        continue
                    dst.write(line)
                if changed:
                    dst.flush()
                    os.fsync(dst.fileno())
            if changed:
                os.replace(tmp, self.path)
                made = False
        except OSError as e:  # disk full, permissions, a directory in the way: the old file is left whole
            raise CheckpointError(f"{self.path}: cannot rewind the metrics log to step {step}: "
                                  f"{e.strerror or e}") from None
        finally:
            if made and os.path.exists(tmp):
                os.unlink(tmp)
            self.fh = open(self.path, "a", buffering=1)
        return changed

    def close(self):
        self.fh.close()
        if self.tb is not None:
            self.tb.close()


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
    """Draw RUN_DIR/loss.png: train loss (and the eval metric) against step, or for an ES run (es_metrics
    records, no loss) the reward per iteration - its mean, the min..max band and mean +- std - with the
    center's eval metric (es-spirals' training accuracy) on a second axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..errors import UserError
    try:
        records = read_metrics(run_dir)
    except FileNotFoundError:
        raise UserError(f"{run_dir}: no metrics.jsonl (is this a run directory?)") from None
    steps, iterations = {}, {}
    for r in records:  # a replayed step (after a restart) overwrites the earlier record
        if r.get("kind") == "metrics":
            steps[r["step"]] = r
        elif r.get("kind") == "es_metrics":
            iterations[r["step"]] = r
    if not steps and not iterations:
        raise UserError(f"{run_dir}/metrics.jsonl: no step records to plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        _draw_loss(ax, steps)
    else:
        _draw_rewards(ax, iterations)
    ax.set_title(os.path.basename(os.path.abspath(run_dir)))
    ax.grid(alpha=0.3)
    out = out or os.path.join(run_dir, "loss.png")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _evals(records: dict):
    """[(step, eval)] of the records that carry one, and the metric's name."""
    evals = [(s, records[s]["eval"]) for s in sorted(records) if records[s].get("eval") is not None]
    return evals, (records[evals[0][0]].get("eval_name") or "eval") if evals else ""


def _draw_loss(ax, steps):
    xs = sorted(steps)
    ax.plot(xs, [steps[s]["loss"] for s in xs], lw=1, label="train loss")
    evals, name = _evals(steps)
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()


def _draw_rewards(ax, iterations):
    import numpy as np
    xs = sorted(iterations)
    mean, std, low, high = (np.array([iterations[s][f"reward_{k}"] for s in xs]) for k in ("mean", "std", "min", "max"))
    ax.fill_between(xs, low, high, alpha=0.2, label="reward min..max")
    ax.plot(xs, mean - std, "--", lw=0.8, color="C0", label="reward mean +- std")
    ax.plot(xs, mean + std, "--", lw=0.8, color="C0")
    ax.plot(xs, mean, lw=1.2, color="C0", label="reward mean")
    ax.set_xlabel("ES iteration")
    ax.set_ylabel("population reward")
    handles, labels = ax.get_legend_handles_labels()
    evals, name = _evals(iterations)
    if evals:
        twin = ax.twinx()
        twin.plot([s for s, _ in evals], [v for _, v in evals], color="C1", lw=1, label=name)
        twin.set_ylabel(name)
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize="small")
