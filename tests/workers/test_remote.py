"""Remote trainers (--remote: parameters, batches and gradients as frames over tcp) give the in-process bits."""
import pytest

from helpers import LM, SPIRALS, free_port_pair, launch
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
    import subprocess

    from helpers import env, launch_cmd, ROOT
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
