"""pretrain.png: what a pretrain run shows, from its metrics.jsonl and the job (for bpb and window length).

Four panels against the step: train loss and validation loss (nats/token, log step axis optional),
validation bits per byte, learning rate and window length, and the pre-clip gradient norm with the clip.
"""
from __future__ import annotations

import os

from ..runtime.metrics import read_metrics


def plot_pretrain(run_dir, job, log_steps=False, out=None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = {}
    for r in read_metrics(run_dir):  # a replayed step (after a restart) overwrites the earlier record
        if r.get("kind") == "metrics":
            steps[r["step"]] = r
    xs = sorted(steps)
    evals = [(s, steps[s]["eval"]) for s in xs if steps[s].get("eval") is not None]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    (loss, bpb), (lr, norm) = axes
    loss.plot(xs, [steps[s]["loss"] for s in xs], lw=1, label="train loss")
    if evals:
        loss.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="val loss")
        bpb.plot([s for s, _ in evals], [v * job.bpb_per_nat for _, v in evals], "o-", color="C2")
    loss.set_ylabel("nats / token")
    loss.legend()
    bpb.set_ylabel("val bits per byte")
    lr.plot(xs, [steps[s]["lr"] for s in xs], color="C3")
    lr.set_ylabel("learning rate", color="C3")
    window = lr.twinx()
    window.step(xs, [job.window(s - 1) for s in xs], where="post", color="C4")
    window.set_ylabel("window length (tokens)", color="C4")
    norm.plot(xs, [steps[s]["grad_norm"] for s in xs], lw=1, color="C5", label="grad norm (pre-clip)")
    if job.spec.clip > 0:
        norm.axhline(job.spec.clip, ls="--", color="grey", label="clip")
    norm.set_ylabel("gradient norm")
    norm.legend()
    for ax in (loss, bpb, lr, norm):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if log_steps:
            ax.set_xscale("log")
    fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))}: {job.spec.preset}, "
                 f"{job.steps * job.batch_tokens:,} tokens")
    fig.tight_layout()
    out = out or os.path.join(run_dir, "pretrain.png")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
