"""Chaos: 20 runs across the jobs, each with one process SIGKILLed at a random step; the same sha256 every time.

The jobs are the trainer plan's (spirals, lm: `fucina launch`, any role is a victim) and the ES task kind's
(es-spirals, es-finetune: their own commands, the victim is an es_member); in both the scheduler is a victim
too (the launcher restarts it from the last committed checkpoint).

The run, role and moment are drawn from a seeded generator (CHAOS_SEED), so a failure names a run that can
be replayed exactly. After every run: the final digest equals the in-process reference of that job, no
shared-memory segment of the run is left in /dev/shm, and no process of the run outlives the launcher by
more than 5 s.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, alive, env, launch_cmd, run_id, wait_for
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime import shm
from pipeline.runtime.inprocess import run_inprocess
from pipeline.threads import pin_threads

CHAOS_SEED = 20261201
RUNS = 20

# job -> (spec for the in-process reference, the same spec as launch flags)
JOBS = {
    "spirals": {"steps": 40, "batch": 32, "micro_batches": 4, "checkpoint_every": 10, "eval_every": 20},
    "lm": {"steps": 12, "batch": 4, "micro_batches": 2, "seq": 32, "hidden": 32, "layers": 1, "heads": 2,
           "kv_heads": 1, "head_dim": 16, "ffn": 64, "checkpoint_every": 4, "eval_every": 6, "val_batches": 2,
           "sample_tokens": 0},
    "finetune": {"model": os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf"), "steps": 8,
                 "batch_size": 2, "targets": "q,v", "shuffle": True, "dropout": 0.1, "lr": 3e-3,
                 "checkpoint_every": 2, "max_new_tokens": 3},
}
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")
# ES job -> (its command's flags, the JSON field of the final digest, its iteration count)
ES_JOBS = {
    "es-spirals": (["--population", "256", "--model-seed", "1", "--max-iterations", "40", "--progress-every", "0"],
                   "params_sha256", 40),
    "es-finetune": (["--model", FIXTURE, "--population", "8", "--batch", "2", "--max-new-tokens", "2",
                     "--iterations", "12", "--eval-samples", "1"], "adapters_sha256", 12),
}
STEPS = {**{name: spec["steps"] for name, spec in JOBS.items()}, **{name: v[2] for name, v in ES_JOBS.items()}}


def flags(spec: dict) -> list[str]:
    out = []
    for key, value in spec.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def plan():
    """[(run, job, role, kill after this many step records, extra delay s)], a pure function of CHAOS_SEED."""
    rnd = random.Random(CHAOS_SEED)
    names = sorted(STEPS)
    out = []
    for i in range(RUNS):
        job = names[i % len(names)]
        roles = ["es_member"] if job in ES_JOBS else ["trainer", "loader", "optimizer", "checkpointer"]
        role = rnd.choice([*roles, "scheduler"])  # the launcher restarts a killed scheduler from its checkpoint
        out.append((i, job, role, rnd.randrange(1, STEPS[job] // 2), round(rnd.uniform(0, 0.3), 3)))
    return out


def es_cmd(job, *flags):
    return [sys.executable, "-m", "pipeline.cli", job, *ES_JOBS[job][0], "--json", *flags]


def command(job, run_dir, workers):
    if job in ES_JOBS:
        return es_cmd(job, "--workers", str(workers), "--out", str(run_dir), "--liveness", "5")
    return launch_cmd(job, run_dir, "--trainers", str(workers), "--liveness", "2", *flags(JOBS[job]))


def digest(job, summary: dict) -> str:
    return summary[ES_JOBS[job][1]] if job in ES_JOBS else summary["params_sha256"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    pin_threads(1)
    out = {}
    for name, spec in JOBS.items():
        job = get_job(name)
        out[name] = run_inprocess(job(build(job.Spec, spec)), str(tmp_path_factory.mktemp(f"ref-{name}")),
                                  log=lambda m: None)["params_sha256"]
    for name in ES_JOBS:  # the in-process run of the same command
        ref = subprocess.run(es_cmd(name, "--inprocess", "--out", str(tmp_path_factory.mktemp(f"ref-{name}"))),
                             cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert ref.returncode == 0, ref.stderr[-3000:]
        out[name] = digest(name, json.loads(ref.stdout.strip().splitlines()[-1]))
    return out


def step_records(run_dir) -> int:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            return sum('"kind": "metrics"' in line or '"kind": "es_metrics"' in line for line in fh)
    except FileNotFoundError:
        return 0


def read_pids(run_dir) -> dict:
    try:
        with open(os.path.join(run_dir, "pids.json")) as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):  # being replaced: read it again
        return {}


# The slow suite's fixed sample: every job once with any role (runs 0-4) and every job's scheduler killed (6, 8,
# 9, 12, 15); the other ten runs are `soak` (pytest -m soak).
SAMPLE = {0, 1, 2, 3, 4, 6, 8, 9, 12, 15}


def cases():
    return [pytest.param(*p, id="-".join(map(str, p)), marks=pytest.mark.slow if p[0] in SAMPLE else pytest.mark.soak)
            for p in plan()]


@pytest.mark.parametrize("run,job,role,after,delay", cases())
def test_a_worker_killed_at_a_random_moment_changes_no_bit(tmp_path, references, run, job, role, after, delay):
    before = set(os.listdir(shm.SHM_DIR))
    trainers = 2 if run % 2 else 1
    p = subprocess.Popen(command(job, tmp_path, trainers), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    seen = {}
    try:
        wait_for(lambda: step_records(tmp_path) >= after or p.poll() is not None, timeout=240, every=0.02)
        assert p.poll() is None, f"run {run}: the run ended before step {after}"
        seen.update(read_pids(tmp_path))
        victims = sorted(name for name in seen if name.split("-")[0] == role)
        assert victims, f"run {run}: no {role} in {seen}"
        victim = random.Random(run).choice(victims)
        time.sleep(delay)  # between step records, not only on their boundary
        os.kill(seen[victim], signal.SIGKILL)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, f"run {run} ({job}, {victim} killed after step {after}) failed:\n{err[-3000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert digest(job, summary) == references[job], f"run {run}: {victim} killed after step {after}"
    seen.update(read_pids(tmp_path))
    survivors = lambda: {n: pid for n, pid in seen.items() if alive(pid)}  # noqa: E731
    try:
        wait_for(lambda: not survivors(), timeout=5)
    except AssertionError:
        raise AssertionError(f"run {run}: still running 5 s after the launcher exited: {survivors()}") from None
    rid = run_id(tmp_path)  # this run's segments only: other runs on the machine may hold theirs
    assert shm.run_segments(rid) == []
    assert not {n for n in set(os.listdir(shm.SHM_DIR)) - before if n.startswith(f"fucina-{rid}")}
