"""Faults: killed workers are replaced and the run ends on the same bits; nothing leaks in /dev/shm.

Faults are injected with FUCINA_FAULT (the worker SIGKILLs itself at a precise
point, once) or by signalling the pids listed in the run's pids.json.
"""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, env, events, first_metric, launch, launch_cmd, run_id, wait_for, alive
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime import ckpt, shm
from pipeline.runtime.inprocess import run_inprocess
from pipeline.threads import pin_threads

SPEC = {"steps": 60, "batch": 32, "micro_batches": 4, "checkpoint_every": 20, "eval_every": 20}
FLAGS = ["--steps", "60", "--batch", "32", "--micro-batches", "4", "--checkpoint-every", "20",
         "--eval-every", "20", "--liveness", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    pin_threads(1)
    job = get_job("spirals")
    return run_inprocess(job(build(job.Spec, SPEC)), str(tmp_path_factory.mktemp("ref")), log=lambda m: None)


def step_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r.get("kind") == "metrics"]


def test_checkpointer_killed_mid_write_leaves_previous_checkpoint_latest(tmp_path):
    """Unit level: the weights file of step 40 is written, then the writer dies before the sentinel."""
    pin_threads(1)
    job = get_job("spirals")(build(get_job("spirals").Spec, SPEC))
    params = {n: a for n, a in job.init_params()}
    skeleton = {"type": "adamw", "config": {}, "scalars": {}}
    ckpt.write_checkpoint(ckpt.checkpoint_dir(tmp_path, 20), params, skeleton, {}, ckpt.trainer_state(job, 20))

    class Died(Exception):
        pass

    def die(_name):
        raise Died
    with pytest.raises(Died):
        ckpt.write_checkpoint(ckpt.checkpoint_dir(tmp_path, 40), params, skeleton, {}, ckpt.trainer_state(job, 40),
                              on_file=die)
    assert os.path.exists(os.path.join(tmp_path, "checkpoint-step-40", "model.safetensors"))
    assert ckpt.latest_checkpoint(tmp_path).endswith("checkpoint-step-20")
    ckpt.write_checkpoint(ckpt.checkpoint_dir(tmp_path, 40), params, skeleton, {}, ckpt.trainer_state(job, 40))
    assert ckpt.latest_checkpoint(tmp_path).endswith("checkpoint-step-40")


def test_a_killed_writers_temp_files_are_removed_before_the_directory_is_committed(tmp_path):
    pin_threads(1)
    job = get_job("spirals")(build(get_job("spirals").Spec, SPEC))
    params = {n: a for n, a in job.init_params()}
    skeleton = {"type": "adamw", "config": {}, "scalars": {}}
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a writer that was killed: its pid is no process now
    directory = tmp_path / "checkpoint-step-20"
    directory.mkdir()
    (directory / f".model.safetensors.tmp-{gone.pid}").write_bytes(b"half a tensor")
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = directory / f".model.safetensors.tmp-{running.pid}"  # a writer still running: not ours to remove
    live.write_bytes(b"")
    try:
        ckpt.write_checkpoint(str(directory), params, skeleton, {}, ckpt.trainer_state(job, 20))
    finally:
        running.kill()
        running.wait()
    assert ckpt.is_committed(str(directory))
    assert sorted(os.listdir(directory)) == sorted(["model.safetensors", "optimizer.safetensors",
                                                    "trainer_state.json", live.name])


@pytest.mark.slow
def test_killed_trainer_and_checkpointer_are_rerun_to_the_same_bits(tmp_path, reference):
    out = launch("spirals", tmp_path, "--trainers", "2", *FLAGS,
                 FUCINA_FAULT="trainer:grad:5,checkpointer:mid_write:40")
    assert out["params_sha256"] == reference["params_sha256"]
    lost = {e["detail"]["role"] for e in events(tmp_path, "worker_lost")}
    assert {"trainer", "checkpointer"} <= lost
    assert [e["step"] for e in events(tmp_path, "checkpoint_retry")] == [40]
    assert out["restarts"] == 0 and out["respawns"] >= 2
    assert shm.run_segments(run_id(tmp_path)) == []


@pytest.mark.slow
def test_killed_optimizer_and_loader_restart_from_checkpoint_and_replay(tmp_path, reference):
    out = launch("spirals", tmp_path, "--trainers", "1", *FLAGS, FUCINA_FAULT="optimizer:step:30,loader:load:45")
    assert out["params_sha256"] == reference["params_sha256"]
    assert out["restarts"] == 2
    resumes = [e["detail"]["resume"] for e in events(tmp_path, "run_restarting")]
    assert all(r.endswith(("checkpoint-step-20", "checkpoint-step-40")) for r in resumes), resumes
    assert shm.run_segments(run_id(tmp_path)) == []


LONG_LM = ["--steps", "100000", "--batch", "2", "--micro-batches", "2", "--seq", "16", "--hidden", "16",
           "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--ffn", "32",
           "--eval-every", "0", "--checkpoint-every", "5", "--sample-tokens", "0"]


def _start_long_run(tmp_path):
    p = subprocess.Popen(launch_cmd("lm", tmp_path, "--trainers", "2", *LONG_LM), cwd=ROOT, env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: first_metric(tmp_path) or p.poll() is not None, timeout=180)
    assert p.poll() is None, "the run ended early"
    with open(os.path.join(tmp_path, "pids.json")) as fh:
        return p, json.load(fh)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_launch_after_a_sigkill_leaks_no_shared_memory(tmp_path, sig):
    before = set(os.listdir(shm.SHM_DIR))
    p, pids = _start_long_run(tmp_path)
    rid = run_id(tmp_path)
    wait_for(lambda: len(shm.run_segments(rid)) >= 3, timeout=60)
    if sig == signal.SIGTERM:  # a monitor attaches, sees steps, detaches; the run goes on
        mon = subprocess.run([sys.executable, "-m", "pipeline.cli", "monitor", "--run-dir", str(tmp_path), "--jsonl",
                              "--timeout", "15"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
        assert any(json.loads(line)["kind"] == "metrics" for line in mon.stdout.splitlines())
        assert p.poll() is None
    os.kill(pids["optimizer"], signal.SIGKILL)  # it cannot clean up after itself
    wait_for(lambda: not alive(pids["optimizer"]), timeout=10)
    p.send_signal(sig)
    p.wait(60)
    survivors = lambda: {name: pid for name, pid in pids.items() if alive(pid)}  # noqa: E731
    try:  # the contract: no process outlives the run by more than 5 s
        wait_for(lambda: not survivors(), timeout=5)
    except AssertionError:
        raise AssertionError(f"still running 5 s after the launcher exited: {survivors()}") from None
    assert shm.run_segments(rid) == []
    # and no fucina segment outside the run-id naming either; another run's (a test suite running beside this
    # one shares /dev/shm) names its own id and is not this run's leak
    others = re.compile(r"fucina-[0-9a-f]+-")
    assert not {n for n in set(os.listdir(shm.SHM_DIR)) - before if n.startswith("fucina-") and not others.match(n)}


@pytest.mark.slow
def test_workers_exit_within_seconds_when_the_scheduler_dies(tmp_path):
    """Procfile-style (no supervisor): SIGKILL the scheduler, every worker leaves on its own."""
    roles = ["loader", "optimizer", "checkpointer", "trainer", "trainer"]
    sched = subprocess.Popen([sys.executable, "-m", "workers.scheduler", "--job", "lm", "--run-dir", str(tmp_path),
                              "--trainers", "2", "--spec-json", json.dumps(_spec(LONG_LM))],
                             cwd=ROOT, env=env(OMP_NUM_THREADS="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = [subprocess.Popen([sys.executable, "-m", f"workers.{r}", "--run-dir", str(tmp_path)], cwd=ROOT,
                                env=env(OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for r in roles]
    try:
        wait_for(lambda: first_metric(tmp_path), timeout=180)
        rid = run_id(tmp_path)
        sched.kill()
        sched.wait()
        for w in workers:
            w.wait(15)  # heartbeat liveness is 5 s
        assert all(w.returncode == 0 for w in workers), [w.returncode for w in workers]
        assert shm.run_segments(rid) == []
    finally:
        for w in workers + [sched]:
            if w.poll() is None:
                w.kill()


def _spec(flags):
    out, it = {}, iter(flags)
    for flag in it:
        value = next(it)
        out[flag[2:].replace("-", "_")] = int(value) if value.lstrip("-").isdigit() else value
    return out


def test_spec_helper_round_trips():
    assert _spec(["--steps", "3", "--optimizer", "muon"]) == {"steps": 3, "optimizer": "muon"}


@pytest.mark.slow
def test_a_long_job_finish_keeps_the_workers_alive(tmp_path):
    """job.finish (here a 200-token sample and model.gguf) outlasts a 1 s liveness: heartbeats go on meanwhile."""
    flags = dict(zip(LONG_LM[::2], LONG_LM[1::2]))
    flags.update({"--steps": "4", "--checkpoint-every": "2", "--sample-tokens": "200", "--eval-every": "0"})
    out = launch("lm", tmp_path, "--trainers", "1", "--liveness", "1", *[x for kv in flags.items() for x in kv])
    assert out["respawns"] == 0
    with open(os.path.join(tmp_path, "workers.log"), errors="replace") as fh:
        assert "no heartbeat" not in fh.read()


@pytest.mark.slow
def test_a_killed_scheduler_is_restarted_from_the_checkpoint_and_the_run_ends_on_the_same_bits(tmp_path, reference):
    """SIGKILL of the scheduler at step 30 (checkpoint 20 committed): the launcher restarts it resuming
    from checkpoint-step-20, the workers are started again and join it; the bits are the uninterrupted run's."""
    out = launch("spirals", tmp_path, "--trainers", "2", *FLAGS, FUCINA_FAULT="scheduler:step:30")
    assert out["params_sha256"] == reference["params_sha256"]
    assert out["scheduler_restarts"] == 1
    with open(os.path.join(tmp_path, "workers.log"), errors="replace") as fh:
        said = fh.read()
    assert "launch: the scheduler exited with status -9; restarting it" in said
    assert said.split("restarting it", 1)[1].split("\n", 1)[0].endswith("checkpoint-step-20")
    assert len(events(tmp_path, "run_started")) == 2
    assert shm.run_segments(run_id(tmp_path)) == []
    # steps 21..30 were replayed by the restarted scheduler: metrics.jsonl holds each step once, the
    # uninterrupted run's values (bitwise: JSON floats round-trip)
    got, want = (step_records(d) for d in (tmp_path, reference["run_dir"]))
    assert [r["step"] for r in got] == list(range(1, 61))
    assert [[r.get(k) for k in ("loss", "lr", "grad_norm", "eval")] for r in got] == \
        [[r.get(k) for k in ("loss", "lr", "grad_norm", "eval")] for r in want]


@pytest.mark.slow
def test_a_killed_pretrain_scheduler_is_restarted_and_the_run_ends_on_the_inprocess_bits(tmp_path):
    """Issue 32's third job: `launch pretrain --trainers 2` with its scheduler SIGKILLed after step 5 resumes
    from a committed checkpoint (2 or 4: a checkpoint's write may still be in flight at the kill) and ends on
    the in-process digest."""
    from pretrain_helpers import small_documents, write_jsonl
    spec = {"preset": "tiny", "data": write_jsonl(tmp_path / "docs.jsonl", small_documents()), "vocab_size": 320,
            "seq": 256, "batch_tokens": 512, "micro_batches": 2, "steps": 6, "warmup": 1, "checkpoint_every": 2,
            "eval_every": 2, "val_windows": 2, "sample_tokens": 4, "sample_every": 2, "prompts": "The |def ",
            "cache_dir": str(tmp_path / "cache")}
    pin_threads(1)
    job = get_job("pretrain")
    reference = run_inprocess(job(build(job.Spec, spec)), str(tmp_path / "ref"), log=lambda m: None)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in spec.items()]
    out = launch("pretrain", tmp_path / "run", "--trainers", "2", *flags, timeout=900,
                 FUCINA_FAULT="scheduler:step:5")
    assert out["scheduler_restarts"] == 1
    assert out["params_sha256"] == reference["params_sha256"]
    with open(tmp_path / "run" / "workers.log", errors="replace") as fh:
        said = fh.read()
    assert re.search(r"restarting it .* from \S+/checkpoint-step-[24]\n", said)


@pytest.mark.slow
def test_a_killed_finetune_scheduler_with_two_trainers_is_restarted_and_ends_on_the_inprocess_bits(tmp_path):
    """Issue 32: `finetune --trainers 2` with its scheduler SIGKILLed after step 5 resumes from a committed
    checkpoint (2 or 4) and ends on the in-process digest."""
    fixture = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")

    def finetune(run_dir, *flags, **extra_env):
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "finetune", "--model", fixture, "--steps", "6",
                              "--batch-size", "2", "--targets", "q,v", "--checkpoint-every", "2", "--max-new-tokens",
                              "3", "--save", str(run_dir), "--json", *flags], capture_output=True, text=True,
                             timeout=900, env=env(**extra_env), cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    reference = finetune(tmp_path / "ref", "--inprocess")
    out = finetune(tmp_path / "run", "--trainers", "2", FUCINA_FAULT="scheduler:step:5")
    assert out["params_sha256"] == reference["params_sha256"]
    with open(tmp_path / "run" / "workers.log", errors="replace") as fh:
        said = fh.read()
    assert re.search(r"restarting it .* from \S+/checkpoint-step-[24]\n", said)
