"""Plot the validation curves of pretrain runs that differ only in their optimizer (docs/pretrain.md's A/B).

    .venv/bin/python tools/plot_pretrain_ab.py --out docs/pretrain-ab.png adamw=DIR muon-0.02=DIR muon-0.04=DIR

Reads each run's metrics.jsonl (through pipeline.runtime.metrics.read_metrics, as pretrain.png does) and its
pretrain.json (bits per byte per nat: the held-out windows are fixed, so bpb is a constant multiple of the
validation loss), draws validation loss and bpb against the step, and prints the Markdown table of both at
each evaluation.
"""
from __future__ import annotations

import argparse
import json
import os

from pipeline.runtime.metrics import read_metrics


def val_curve(run_dir):
    """[(step, val loss)] of a run, a replayed step's later record winning (as pretrain.png reads it)."""
    steps = {r["step"]: r for r in read_metrics(run_dir) if r.get("kind") == "metrics"}
    return [(s, steps[s]["eval"]) for s in sorted(steps) if steps[s].get("eval") is not None]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    parser.add_argument("--out", default="docs/pretrain-ab.png")
    args = parser.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for item in args.runs:
        label, _, run_dir = item.partition("=")
        with open(os.path.join(run_dir, "pretrain.json")) as fh:
            runs.append((label, val_curve(run_dir), json.load(fh)["bpb_per_nat"]))
    fig, (loss, bpb) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, curve, per_nat in runs:
        loss.plot([s for s, _ in curve], [v for _, v in curve], "o-", ms=3, label=label)
        bpb.plot([s for s, _ in curve], [v * per_nat for _, v in curve], "o-", ms=3, label=label)
    loss.set_ylabel("val loss (nats / token)")
    bpb.set_ylabel("val bits per byte")
    for ax in (loss, bpb):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    plt.close(fig)
    steps = [s for s, _ in runs[0][1]]
    print("| step | " + " | ".join(str(s) for s in steps) + " |")
    print("| --- |" + " --- |" * len(steps))
    for label, curve, per_nat in runs:
        print(f"| {label} val loss | " + " | ".join(f"{v:.3f}" for _, v in curve) + " |")
        print(f"| {label} val bpb | " + " | ".join(f"{v * per_nat:.3f}" for _, v in curve) + " |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
