"""Remote trainers (--remote: parameters, batches and gradients as frames over tcp) give the in-process bits."""
import json
import subprocess
import sys

import pytest

from helpers import LM, ROOT, SPIRALS, env, events, free_port_pair, launch, wait_for
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime.inprocess import run_inprocess
from pipeline.threads import pin_threads

SPIRALS_SPEC = {"steps": 40, "batch": 32, "micro_batches": 4, "checkpoint_every": 20, "eval_every": 20}  # = SPIRALS


def _inprocess(run_dir):
    pin_threads(1)
    job = get_job("spirals")
    return run_inprocess(job(build(job.Spec, SPIRALS_SPEC)), str(run_dir), log=lambda m: None)


def test_a_run_whose_only_trainer_is_remote_equals_inprocess(tmp_path):
    """Every gradient of the run crosses the wire as frames: the bits are still the in-process ones."""
    inproc = _inprocess(tmp_path / "inproc")
    remote = launch("spirals", tmp_path / "remote", "--port", str(free_port_pair()), "--trainers", "1",
                    "--remote-trainers", "1", *SPIRALS)
    assert remote["params_sha256"] == inproc["params_sha256"]
    assert remote["final_loss"] == inproc["final_loss"]


def test_remote_trainers_need_tcp(tmp_path):
    from helpers import launch_cmd
    out = subprocess.run(launch_cmd("spirals", tmp_path / "r", "--trainers", "1", "--remote-trainers", "1"),
                         capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    assert out.returncode != 0 and "--remote-trainers needs --port" in out.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_mixed_local_and_remote_lm_equals_inprocess(tmp_path):
    inproc = launch("lm", tmp_path / "inproc", "--inprocess", *LM)
    mixed = launch("lm", tmp_path / "mixed", "--port", str(free_port_pair()), "--trainers", "2",
                   "--remote-trainers", "1", *LM)
    assert mixed["params_sha256"] == inproc["params_sha256"]


def _es_spirals(run_dir, *flags):
    return [sys.executable, "-m", "pipeline.cli", "es-spirals", "--population", "16", "--model-seed", "2",
            "--max-iterations", "4", "--progress-every", "0", "--out", str(run_dir), "--json", *flags]


def test_an_es_member_joining_over_tcp_with_the_key_gives_the_inprocess_bits(tmp_path):
    """A local member and one started by hand (`python -m workers.es_member --connect tcp:// --key`): the
    parameters cross once per member, as its state transfer at the join; then only ids and rewards."""
    ref = subprocess.run(_es_spirals(tmp_path / "ref", "--inprocess"), capture_output=True, text=True, env=env(),
                         cwd=ROOT, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir, port = tmp_path / "tcp", free_port_pair()
    run = subprocess.Popen(_es_spirals(run_dir, "--workers", "1", "--remote-workers", "1", "--bind",
                                       f"tcp://127.0.0.1:{port}"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env(), cwd=ROOT)
    member = None
    try:
        wait_for(lambda: (run_dir / "worker.key").exists() or run.poll() is not None, timeout=120)
        member = subprocess.Popen([sys.executable, "-m", "workers.es_member", "--connect", f"tcp://127.0.0.1:{port}",
                                   "--key", str(run_dir / "worker.key")], env=env(), cwd=ROOT)
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        assert member.wait(timeout=60) == 0  # told to stop at the end, like a local member
    finally:
        for p in (run, member):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    result, reference = json.loads(out.strip().splitlines()[-1]), json.loads(ref.stdout.strip().splitlines()[-1])
    assert result["sha256"] == reference["sha256"] and result["replicas_checked"] == 2
    joined = [e["detail"]["worker"] for e in events(str(run_dir), "worker_joined")]
    transfers = [e["detail"]["worker"] for e in events(str(run_dir), "state_transfer")]
    assert f"es_member-{member.pid}" in joined and sorted(transfers) == sorted(joined)  # once each, at the join


@pytest.mark.slow
def test_the_remote_bench_times_es_iterations_over_tcp_and_ipc():
    from pipeline.bench.pipeline import _es_rows
    rows = _es_rows(3, population=16)
    assert [r["case"] for r in rows] == ["remote/es-members-ipc", "remote/es-members-tcp"]
    assert all(r["ms"] > 0 and r["config"]["iterations"] == 3 for r in rows)
    assert rows[1]["baselines"]["ipc"] == pytest.approx(rows[0]["ms"], abs=0.005)  # tcp is read against ipc
