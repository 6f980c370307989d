"""Ray places the workers: `fucina launch --ray ADDRESS` (trainers) and `fucina es-spirals --ray ADDRESS`
(es_members) on a local head give the in-process bits, also after an actor is SIGKILLed mid-run (Ray
restarts it, the scheduler re-runs its task)."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from helpers import ROOT, SPIRALS, env, events, first_metric, free_port_pair, launch_cmd, wait_for
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime.inprocess import run_inprocess
from pipeline.threads import pin_threads

STEPS = SPIRALS.index("--steps") + 1
# ~15 s of steps after the kill: Ray's restart of the actor and its trainer's start (~2 s here, longer on a loaded
# 2-core CI machine, where 240 steps once ended first) land well before the end
FLAGS = [*SPIRALS[:STEPS], "1200", *SPIRALS[STEPS + 1:], "--liveness", "2"]
SPEC = {"steps": 1200, "batch": 32, "micro_batches": 4, "checkpoint_every": 20, "eval_every": 20}  # = FLAGS


def test_without_ray_the_flag_is_one_error_naming_the_extra(tmp_path):
    hide = tmp_path / "no-ray" / "ray"  # a `ray` that fails to import, first on the path: Ray is "not installed"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = subprocess.run(launch_cmd("spirals", tmp_path / "r", "--ray", "--trainers", "2"), capture_output=True,
                         text=True, env=env(PYTHONPATH=f"{hide.parent}{os.pathsep}{ROOT}"), cwd=ROOT, timeout=120)
    assert out.returncode != 0 and "pip install 'fucina[ray]'" in out.stderr
    assert f"pip install -e '.[ray]' in the source checkout {ROOT}" in out.stderr  # this run is from a checkout
    assert not (tmp_path / "r").exists()


def test_the_ray_hint_names_the_checkout_install_only_in_a_checkout(tmp_path):
    from pipeline.runtime.ray_place import install_hint
    assert install_hint("ray", str(tmp_path)) == "pip install 'fucina[ray]'"  # an installed package: the index
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'fucina'\n")
    hint = install_hint("ray", str(tmp_path))
    assert hint.startswith(f"pip install -e '.[ray]' in the source checkout {tmp_path}")
    assert "pip install 'fucina[ray]'" in hint


def test_es_without_ray_the_flag_is_one_error_naming_the_extra(tmp_path):
    hide = tmp_path / "no-ray" / "ray"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = subprocess.run(_es_spirals(tmp_path / "r", "--ray", "--members", "2"), capture_output=True, text=True,
                         env=env(PYTHONPATH=f"{hide.parent}{os.pathsep}{ROOT}"), cwd=ROOT, timeout=120)
    assert out.returncode != 0 and "pip install 'fucina[ray]'" in out.stderr
    assert not (tmp_path / "r").exists()


# ~15 s at ~10 ms an iteration: the kill lands mid-run, and Ray (~2 s) restarts the actor well before the end
ES_ITERATIONS = 1500


def _es_spirals(run_dir, *flags):
    return [sys.executable, "-m", "pipeline.cli", "es-spirals", "--population", "16", "--model-seed", "2",
            "--max-iterations", str(ES_ITERATIONS), "--progress-every", "0", "--out", str(run_dir), "--json", *flags]


def _has_ray():
    import importlib.util
    return importlib.util.find_spec("ray") is not None


@pytest.fixture
def ray_head():
    """A local Ray head on loopback (its own process group, ended by id afterwards) -> its address."""
    if not _has_ray():
        pytest.skip("ray is not installed (pip install 'fucina[ray]')")
    port = free_port_pair()
    temp = tempfile.mkdtemp(prefix="fray-")  # short: Ray's unix sockets live under it (108-byte paths)
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--num-cpus", "2", "--port", str(port),
                             "--node-ip-address", "127.0.0.1", "--include-dashboard=false",
                             "--disable-usage-stats", "--temp-dir", temp],
                            env=env(RAY_USAGE_STATS_ENABLED="0"), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
            try:
                os.killpg(head.pid, sig)  # the head and the daemons it started share its group
            except ProcessLookupError:
                break
            time.sleep(wait)
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _parent(pid):
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
def test_ray_placed_trainers_killed_once_give_the_inprocess_bits(tmp_path, ray_head):
    pin_threads(1)
    job_cls = get_job("spirals")
    reference = run_inprocess(job_cls(build(job_cls.Spec, SPEC)), str(tmp_path / "ref"), log=lambda m: None)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(launch_cmd("spirals", run_dir, "--ray", ray_head, "--trainers", "2", *FLAGS),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    try:
        wait_for(lambda: first_metric(str(run_dir)), timeout=400)
        joined = [e for e in events(str(run_dir), "worker_joined") if e["detail"].get("remote")]
        assert len(joined) == 2
        actor = _parent(joined[0]["detail"]["pid"])  # the trainer's parent is the Ray actor's process
        os.kill(actor, signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["params_sha256"] == reference["params_sha256"]
        killed = joined[0]["detail"]["worker"]
        lost = [e for e in events(str(run_dir), "worker_lost") if e["detail"]["worker"] == killed]
        assert lost and lost[0]["step"] < SPEC["steps"]  # the kill landed mid-run
        rejoined = [e for e in events(str(run_dir), "worker_joined") if e["detail"].get("remote")]
        assert len(rejoined) == 3  # Ray restarted the actor and its trainer joined again
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _es_iterations(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as fh:
        return sum('"kind": "es_metrics"' in line for line in fh)


@contextlib.contextmanager
def _es_ray_run(tmp_path, ray_head):
    """es-spirals in-process (the reference), then on 2 Ray-placed members until its second iteration: yields
    (the reference's summary, run_dir, the launcher's Popen), which is killed on the way out if still running."""
    ref = subprocess.run(_es_spirals(tmp_path / "ref", "--inprocess"), capture_output=True, text=True, env=env(),
                         cwd=ROOT, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen(_es_spirals(run_dir, "--ray", ray_head, "--members", "2", "--liveness", "5"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    try:
        wait_for(lambda: _es_iterations(run_dir) >= 2, timeout=400)
        yield json.loads(ref.stdout.strip().splitlines()[-1]), run_dir, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _es_members_joined(run_dir):
    return [e for e in events(run_dir, "worker_joined") if e["detail"]["role"] == "es_member"]


def _ends_on(proc, reference):
    """The launcher exits 0 with the reference's parameter sha256."""
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["sha256"] == reference["sha256"]


@pytest.mark.slow
def test_ray_placed_es_members_killed_once_give_the_inprocess_bits(tmp_path, ray_head):
    with _es_ray_run(tmp_path, ray_head) as (reference, run_dir, proc):
        joined = _es_members_joined(run_dir)
        assert len(joined) == 2
        os.kill(_parent(joined[0]["detail"]["pid"]), signal.SIGKILL)  # the member's parent: its Ray actor
        _ends_on(proc, reference)
        killed = joined[0]["detail"]["worker"]
        lost = [e for e in events(run_dir, "worker_lost") if e["detail"]["worker"] == killed]
        assert lost and lost[0]["step"] < ES_ITERATIONS  # the kill landed mid-run
        rejoined = _es_members_joined(run_dir)
        transfers = {e["detail"]["worker"] for e in events(run_dir, "state_transfer")}
        assert len(rejoined) == 3 and rejoined[2]["detail"]["worker"] in transfers  # restarted, given the state


def _kill_the_scheduler(run_dir):
    """SIGKILL the run's scheduler (pids.json, kept by the launcher) -> its pid."""
    pid = wait_for(lambda: _read_json(os.path.join(run_dir, "pids.json")).get("scheduler"), timeout=60)
    os.kill(pid, signal.SIGKILL)
    return pid


def _read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being replaced
        return {}


SCHED_SPEC = {**SPEC, "steps": 400}  # the kill lands after the first step record; a restart takes a few s


@pytest.mark.slow
@pytest.mark.parity
def test_a_killed_scheduler_of_a_ray_run_restarts_and_its_ray_trainers_rejoin(tmp_path, ray_head):
    pin_threads(1)
    job_cls = get_job("spirals")
    reference = run_inprocess(job_cls(build(job_cls.Spec, SCHED_SPEC)), str(tmp_path / "ref"), log=lambda m: None)
    run_dir = tmp_path / "run"
    flags = [*FLAGS[:STEPS], "400", *FLAGS[STEPS + 1:]]
    proc = subprocess.Popen(launch_cmd("spirals", run_dir, "--ray", ray_head, "--trainers", "2", *flags),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    try:
        wait_for(lambda: first_metric(str(run_dir)), timeout=400)
        _kill_the_scheduler(str(run_dir))
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["scheduler_restarts"] == 1
        assert summary["params_sha256"] == reference["params_sha256"]
        joined = [e for e in events(str(run_dir), "worker_joined") if e["detail"].get("remote")]
        assert len(joined) == 4  # two Ray trainers before the kill, two fresh ones joined the new scheduler
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parity
def test_a_killed_scheduler_of_a_ray_es_run_restarts_and_its_ray_members_rejoin(tmp_path, ray_head):
    with _es_ray_run(tmp_path, ray_head) as (reference, run_dir, proc):
        _kill_the_scheduler(run_dir)
        _ends_on(proc, reference)
        assert len(_es_members_joined(run_dir)) == 4  # two members before the kill, two fresh ones joined the new one
