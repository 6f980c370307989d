"""A real network hop: the scheduler's host and a worker's host are two network namespaces joined by a veth pair.

A spirals trainer (`--remote`: parameters, batches and gradients as frames) and an es-spirals es_member (its
state transfer at the join, then member ids and rewards) each run in the other namespace, are SIGKILLed once
mid-run and restarted, and the run ends with the in-process sha256.

Needs root (`ip netns add`); skips cleanly otherwise. Every socket binds or
connects only to the two addresses the test gives the veth ends; the
namespaces are deleted even when the test fails.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, env, events, first_metric, free_port_pair, wait_for
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime import security, shm
from pipeline.runtime.inprocess import run_inprocess
from pipeline.threads import pin_threads

SPEC = {"steps": 120, "batch": 32, "micro_batches": 4, "checkpoint_every": 40, "eval_every": 40}


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """(scheduler namespace, its address, trainer namespace, its address), torn down afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = os.getpid() % 100000
    ns_s, ns_w = f"fucina-s{tag}", f"fucina-w{tag}"
    net = f"10.{200 + tag % 50}.{tag % 250}"
    addr_s, addr_w = f"{net}.1", f"{net}.2"
    made = []
    try:
        for ns in (ns_s, ns_w):
            out = _ip("netns", "add", ns)
            if out.returncode != 0:
                pytest.skip(f"ip netns add not permitted here: {out.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", f"fs{tag}", "type", "veth", "peer", "name", f"fw{tag}"),
                 ("link", "set", f"fs{tag}", "netns", ns_s), ("link", "set", f"fw{tag}", "netns", ns_w),
                 ("-n", ns_s, "addr", "add", f"{addr_s}/24", "dev", f"fs{tag}"),
                 ("-n", ns_w, "addr", "add", f"{addr_w}/24", "dev", f"fw{tag}"),
                 ("-n", ns_s, "link", "set", f"fs{tag}", "up"), ("-n", ns_w, "link", "set", f"fw{tag}", "up"),
                 ("-n", ns_s, "link", "set", "lo", "up"), ("-n", ns_w, "link", "set", "lo", "up")]
        for step in steps:
            out = _ip(*step)
            if out.returncode != 0:
                pytest.skip(f"ip {' '.join(step)}: {out.stderr.strip()}")
        yield ns_s, addr_s, ns_w, addr_w
    finally:
        for ns in made:  # deleting a namespace deletes the veth end inside it, and so the pair
            _ip("netns", "del", ns)


def _in(ns, *cmd):
    return ["ip", "netns", "exec", ns, *cmd]


@pytest.mark.slow
def test_a_trainer_across_a_veth_pair_killed_and_restarted_gives_the_inprocess_bits(tmp_path, two_hosts):
    ns_s, addr_s, ns_w, addr_w = two_hosts
    pin_threads(1)
    job_cls = get_job("spirals")
    reference = run_inprocess(job_cls(build(job_cls.Spec, SPEC)), str(tmp_path / "ref"), log=lambda m: None)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    server_key, client_key = security.create_run_keys(str(run_dir))
    # a hex run id like every run's: test_faults' leak check, running beside this test under xdist, reads
    # fucina-<hex>-... segments as another run's (a "netns<pid>" id failed it once in CI)
    port, run_id = free_port_pair("127.0.0.1"), f"{os.getpid():08x}"
    endpoint = f"tcp://{addr_s}:{port}"
    py = [sys.executable, "-m"]
    log = open(run_dir / "test.log", "ab")
    procs = {}

    def start(name, ns, *cmd):
        procs[name] = subprocess.Popen(_in(ns, *py, *cmd), env=env(), cwd=ROOT, stdout=log, stderr=log)

    try:
        start("scheduler", ns_s, "workers.scheduler", "--job", "spirals", "--spec-json", json.dumps(SPEC),
              "--run-dir", str(run_dir), "--run-id", run_id, "--trainers", "1", "--port", str(port),
              "--host", addr_s, "--key", server_key, "--liveness", "2")
        for role in ("loader", "optimizer", "checkpointer"):
            start(role, ns_s, f"workers.{role}", "--connect", endpoint, "--key", client_key)
        start("trainer", ns_w, "workers.trainer", "--connect", endpoint, "--key", client_key, "--remote")
        wait_for(lambda: first_metric(str(run_dir)), timeout=300)
        procs["trainer"].send_signal(signal.SIGKILL)  # mid-run: its task is re-run by the next trainer
        procs["trainer"].wait()
        start("trainer", ns_w, "workers.trainer", "--connect", endpoint, "--key", client_key, "--remote")
        assert procs["scheduler"].wait(timeout=600) == 0, (run_dir / "test.log").read_text()[-3000:]
        with open(run_dir / "summary.json") as fh:
            summary = json.load(fh)
        with open(run_dir / "metrics.jsonl") as fh:
            records = [json.loads(line) for line in fh]
        lost = [r for r in records if r.get("event") == "worker_lost" and r["detail"]["role"] == "trainer"]
        joined = [r for r in records if r.get("event") == "worker_joined" and r["detail"].get("remote")]
        assert lost and lost[0]["step"] < SPEC["steps"]  # the kill landed mid-run
        assert len(joined) == 2  # the first trainer and its replacement, both from the other namespace
        assert summary["params_sha256"] == reference["params_sha256"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()
        shm.unlink_run(run_id)


ES_ITERATIONS = 150  # long enough that the kill below lands mid-run


def _es_spirals(run_dir, *flags):
    return [sys.executable, "-m", "pipeline.cli", "es-spirals", "--population", "16", "--model-seed", "2",
            "--max-iterations", str(ES_ITERATIONS), "--progress-every", "0", "--out", str(run_dir), "--json", *flags]


def _es_iterations(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as fh:
        return sum('"kind": "es_metrics"' in line for line in fh)


@pytest.mark.slow
def test_an_es_member_across_a_veth_pair_killed_and_restarted_gives_the_inprocess_bits(tmp_path, two_hosts):
    ns_s, addr_s, ns_w, addr_w = two_hosts
    ref = subprocess.run(_es_spirals(tmp_path / "ref", "--inprocess"), capture_output=True, text=True, env=env(),
                         cwd=ROOT, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir, port = tmp_path / "run", free_port_pair("127.0.0.1")
    endpoint = f"tcp://{addr_s}:{port}"
    log = open(tmp_path / "test.log", "ab")
    run = subprocess.Popen(_in(ns_s, *_es_spirals(run_dir, "--workers", "0", "--remote-workers", "1", "--bind",
                                                  endpoint, "--liveness", "2")),
                           env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    members = []

    def member():
        members.append(subprocess.Popen(_in(ns_w, sys.executable, "-m", "workers.es_member", "--connect", endpoint,
                                            "--key", str(run_dir / "worker.key")),
                                        env=env(), cwd=ROOT, stdout=log, stderr=log))
    try:
        wait_for(lambda: (run_dir / "worker.key").exists() or run.poll() is not None, timeout=120)
        member()
        wait_for(lambda: _es_iterations(str(run_dir)) >= 2 or run.poll() is not None, timeout=400)
        members[0].send_signal(signal.SIGKILL)  # mid-run: its members are re-run by the next es_member
        members[0].wait()
        member()
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, (tmp_path / "test.log").read_text()[-3000:]
        result, reference = json.loads(out.strip().splitlines()[-1]), json.loads(ref.stdout.strip().splitlines()[-1])
        assert result["sha256"] == reference["sha256"]
        joined = [e["detail"]["worker"] for e in events(str(run_dir), "worker_joined")]
        lost = [e for e in events(str(run_dir), "worker_lost") if e["detail"]["worker"] == joined[0]]
        transfers = [e["detail"]["worker"] for e in events(str(run_dir), "state_transfer")]
        assert lost and lost[0]["step"] < ES_ITERATIONS  # the kill landed mid-run
        assert [f"es_member-{p.pid}" for p in members] == joined  # both from the other namespace
        assert transfers == joined  # the parameters crossed once per member, at its join
    finally:
        for p in (run, *members):
            if p.poll() is None:
                p.kill()
                p.wait()
        log.close()
