"""Run `fucina launch` as a user would (a subprocess) and read what it leaves behind."""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPIRALS = ["--steps", "40", "--batch", "32", "--micro-batches", "4", "--checkpoint-every", "20", "--eval-every", "20"]
LM = ["--steps", "6", "--batch", "4", "--micro-batches", "2", "--seq", "32", "--hidden", "32", "--layers", "1",
      "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--ffn", "64", "--checkpoint-every", "3",
      "--eval-every", "3", "--val-batches", "2", "--sample-tokens", "8"]


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


def launch_cmd(job, run_dir, *flags):
    return [sys.executable, "-m", "pipeline.cli", "launch", job, "--run-dir", str(run_dir), "--json", *flags]


def launch(job, run_dir, *flags, timeout=240, **extra_env):
    out = subprocess.run(launch_cmd(job, run_dir, *flags), capture_output=True, text=True, timeout=timeout,
                         env=env(**extra_env), cwd=ROOT)
    assert out.returncode == 0, f"launch failed ({out.returncode}):\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_id(run_dir):
    with open(os.path.join(run_dir, "run.json")) as fh:
        return json.load(fh)["run_id"]


def events(run_dir, name=None):
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        for line in fh:
            r = json.loads(line)
            if r.get("kind") == "event" and (name is None or r["event"] == name):
                out.append(r)
    return out


def wait_for(pred, timeout=120, every=0.1):
    t_end = time.time() + timeout
    while time.time() < t_end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError("condition not met within %.0f s" % timeout)


def first_metric(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return any('"kind": "metrics"' in line for line in fh)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as dead
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False



def free_port_pair(host="127.0.0.1"):
    """A port P with P and P+1 free on `host` (a tcp run binds control on P, events on P+1)."""
    from pipeline.runtime.transport import free_port_pair as free
    return free(host)
