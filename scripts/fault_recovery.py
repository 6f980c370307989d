"""Measure how long a `fucina launch lm` run takes to notice and recover from each fault.

    python scripts/fault_recovery.py [--port P] [--out runs/faults]

Starts one long lm run (2 trainers, tiny model, a checkpoint every 5 steps),
then, one fault at a time, SIGKILLs a trainer, the loader, the optimizer,
the checkpointer and the scheduler, and SIGSTOPs a trainer (alive but silent:
only the heartbeat liveness can tell). For each it prints, from metrics.jsonl's
timestamps: `detected` (kill -> worker_lost; for the scheduler, kill -> the
launcher's replacement in pids.json) and `recovered` (kill -> the first
optimizer step committed after it). The numbers depend on the machine's load: say so
when you quote them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LM = ["--steps", "100000", "--batch", "2", "--micro-batches", "2", "--seq", "16", "--hidden", "16", "--layers", "1",
      "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--ffn", "32", "--eval-every", "0",
      "--checkpoint-every", "5", "--sample-tokens", "0"]
FAULTS = [("trainer", signal.SIGKILL), ("loader", signal.SIGKILL), ("optimizer", signal.SIGKILL),
          ("checkpointer", signal.SIGKILL), ("scheduler", signal.SIGKILL), ("trainer", signal.SIGSTOP)]


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def wait(pred, timeout=120.0):
    t_end = time.time() + timeout
    while time.time() < t_end:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise SystemExit("fault_recovery: timed out waiting for the run")


def pid_of(run_dir, role):
    with open(os.path.join(run_dir, "pids.json")) as fh:
        pids = json.load(fh)
    return next(pid for name, pid in sorted(pids.items()) if name.split("-")[0] == role)


def measure(run_dir, role, sig):
    pid = pid_of(run_dir, role)
    t_kill = time.time()
    os.kill(pid, sig)
    if role == "scheduler":  # no one reports its loss: the launcher restarts it (and every worker)
        wait(lambda: pid_of(run_dir, role) != pid)
        detected = time.time() - t_kill
        step = wait(lambda: next((r for r in records(run_dir) if r.get("kind") == "metrics" and r["time"] > t_kill),
                                 None), timeout=300)
        return detected, step["time"] - t_kill
    lost = wait(lambda: next((r for r in records(run_dir) if r.get("event") == "worker_lost"
                              and r["detail"]["worker"] == f"{role}-{pid}"), None))
    if sig == signal.SIGSTOP:
        os.kill(pid, signal.SIGCONT)  # it hears it was declared lost, and exits for a fresh one
    step = wait(lambda: next((r for r in records(run_dir) if r.get("kind") == "metrics" and r["time"] > lost["time"]),
                             None))
    wait(lambda: pid_of(run_dir, role) != pid)  # the launcher has re-spawned it
    return lost["time"] - t_kill, step["time"] - t_kill


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("runs", f"faults-{time.strftime('%Y%m%d-%H%M%S')}"))
    ap.add_argument("--port", type=int, default=None, help="run over tcp:// (CURVE) on this port")
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "pipeline.cli", "launch", "lm", "--run-dir", args.out, "--quiet", "--trainers", "2",
           *LM, *(["--port", str(args.port)] if args.port else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    run = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait(lambda: os.path.exists(os.path.join(args.out, "metrics.jsonl"))
             and any(r.get("kind") == "metrics" and r["step"] > 5 for r in records(args.out)), timeout=300)
        print(f"{'fault':<22} {'detected s':>10} {'recovered s':>11}")
        for role, sig in FAULTS:
            detected, recovered = measure(args.out, role, sig)
            print(f"{role + ' ' + sig.name:<22} {detected:>10.2f} {recovered:>11.2f}", flush=True)
            time.sleep(2)  # let the replacement settle before the next fault
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
