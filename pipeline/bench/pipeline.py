"""`fucina bench pipeline`: the lm job's time per optimizer step, in-process vs 1 vs 2 trainers.

Each case is a real `fucina launch lm` subprocess (default model and batch)
run for a few steps; `ms` is the median of the per-step wall times the run
records in metrics.jsonl, after dropping warm-up steps. Cases:

  lm/inprocess            every task inline, 1 compute thread
  lm/trainers-1           the pipeline with one trainer (1 thread each)   baseline: inprocess
  lm/trainers-2           two trainers, 1 thread each                     baseline: trainers-1
  lm/trainers-1x2threads  one trainer with 2 BLAS/numba threads           baseline: trainers-1
  lm/messaging            per-step time not spent computing in trainers/optimizer (1 trainer)

Targets (issue 6): trainers-2 >= 1.6x trainers-1 on 2 cores; trainers-1 >= 0.9x inprocess.
Trade-off: whole runs, not micro-benchmarks - startup is excluded, but
everything a user pays per step (messages, shared memory, scheduling) is in.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

NAME = "pipeline"
HELP = "lm job step time: --inprocess vs --trainers 1 vs --trainers 2 vs 1 trainer x 2 threads"


def add_arguments(parser):
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per case")
    parser.add_argument("--warmup", type=int, default=4, help="leading steps left out of the median")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed in notes)")
    parser.add_argument("--cases", default="inprocess,trainers-1,trainers-2,trainers-1x2threads",
                        help="comma-separated subset of the cases to run")


def _config():
    from ..jobs import get_job
    from ..jobs.spec import build
    job = get_job("lm")
    s = build(job.Spec, {})
    from ..jobs.lm_export import VOCAB_SIZE
    return {"vocab": VOCAB_SIZE, "hidden": s.hidden, "layers": s.layers, "heads": s.heads, "kv_heads": s.kv_heads,
            "head_dim": s.head_dim, "ffn": s.ffn, "seq": s.seq, "batch": s.batch, "micro_batches": s.micro_batches}


def _run(root, name, steps, *flags):
    run_dir = os.path.join(root, name)
    cmd = [sys.executable, "-m", "pipeline.cli", "launch", "lm", "--run-dir", run_dir, "--json", "--steps", str(steps),
           "--eval-every", "0", "--checkpoint-every", "0", "--sample-tokens", "0", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        from ..errors import FucinaError
        raise FucinaError(f"bench pipeline: case {name} failed:\n{out.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    return [r for r in records if r.get("kind") == "metrics"], run_dir


def run(args):
    config = _config()
    root = tempfile.mkdtemp(prefix="fucina-bench-pipeline-")
    every = {"inprocess": ["--inprocess", "--threads", "1"], "trainers-1": ["--trainers", "1", "--threads", "1"],
             "trainers-2": ["--trainers", "2", "--threads", "1"],
             "trainers-1x2threads": ["--trainers", "1", "--threads", "2"]}
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in every]
    if unknown:
        from ..errors import UserError
        raise UserError(f"bench pipeline: unknown case(s) {unknown}; cases: {', '.join(every)}")
    cases = {name: every[name] for name in wanted}
    steps, ms, dirs, load = {}, {}, {}, {}
    for name, flags in cases.items():
        records, dirs[name] = _run(root, name, args.steps, *flags)
        load[name] = os.getloadavg()[0]  # other jobs on the machine skew the ratios: say so
        steps[name] = records[args.warmup:] or records
        ms[name] = statistics.median(r["step_ms"] for r in steps[name])
    against = {"trainers-1": "inprocess", "trainers-2": "trainers-1", "trainers-1x2threads": "trainers-1"}
    baseline = {name: ({against[name]: ms[against[name]]} if against.get(name) in ms else {}) for name in cases}
    tokens = config["batch"] * config["seq"]
    rows = []
    for name in cases:
        rows.append({"case": f"lm/{name}", "ms": round(ms[name], 2), "baselines": baseline[name], "config": config,
                     "notes": f"{tokens * 1e3 / ms[name]:.0f} tokens/s; load avg {load[name]:.1f}"
                              + (f"; {dirs[name]}" if args.keep else "")})
    if "trainers-1" in steps:
        one = steps["trainers-1"]
        overhead = statistics.median(r["step_ms"] - r["roles"]["trainer"] - r["roles"]["optimizer"] for r in one)
        rows.append({"case": "lm/messaging", "ms": round(overhead, 2), "baselines": {}, "config": config,
                     "notes": "median per-step wall time minus trainer and optimizer compute (1 trainer)"})
    if not args.keep:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return rows
