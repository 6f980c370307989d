"""A real worker process against a fake scheduler: bad frames are dropped, shutdown is clean."""
import subprocess
import sys

import msgpack

from helpers import ROOT, env
from pipeline.jobs import get_job
from pipeline.jobs.spec import build, to_dict
from pipeline.runtime import shm, transport


def test_worker_drops_bad_messages_and_exits_cleanly_on_shutdown(tmp_path):
    ep = transport.ipc_endpoints(str(tmp_path))
    router = transport.RouterSocket(ep.control)
    p = subprocess.Popen([sys.executable, "-m", "workers.loader", "--run-dir", str(tmp_path)], cwd=ROOT, env=env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        identity, hello = None, None
        while hello is None or hello["kind"] != "hello":
            got = router.recv(60000)
            assert got is not None, "no hello from the worker"
            identity, hello = got
        spec = to_dict(build(get_job("spirals").Spec, {}))
        run = {"run_id": "wtest", "run_dir": str(tmp_path), "job": "spirals", "spec": spec,
               "endpoints": ep.to_wire(), "trainers": 1}
        router.send(identity, "welcome", worker=hello["worker"], run=run)
        router.sock.send_multipart([identity, b"\xc1 not msgpack"])
        router.sock.send_multipart([identity, msgpack.packb({"kind": "teleport", "v": 1, "step": 0, "seq": 0})])
        router.sock.send_multipart([identity, msgpack.packb({"kind": "load", "v": 7, "step": 0, "seq": 0})])
        empty = {"segment": "s", "tensors": [], "owner": "o"}
        router.send(identity, "grad", gen=0, k=0, slot=0, batch=empty, params=empty, grads=empty)  # not a loader task
        router.send(identity, "load", 0, gen=0, k=1, slot=1)  # a real task still works afterwards
        loaded = None
        while loaded is None:
            got = router.recv(60000)
            assert got is not None, "the loader stopped answering"
            if got[1] and got[1]["kind"] == "loaded":
                loaded = got[1]
            elif got[1] and got[1]["kind"] == "heartbeat":
                router.send(got[0], "heartbeat", worker="scheduler")
        assert loaded["k"] == 1 and loaded["batch"]["segment"].startswith("fucina-wtest-loader")
        assert shm.run_segments("wtest")
        router.send(identity, "shutdown", reason="test over")
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        for why in ("not msgpack", "unknown kind 'teleport'", "schema version 7", "'grad' message"):
            assert why in out, (why, out)
        assert shm.run_segments("wtest") == []  # the loader unlinked its batches on the way out
    finally:
        router.close()
        if p.poll() is None:
            p.kill()
        shm.unlink_run("wtest")


def test_a_trainer_that_wakes_after_the_step_moved_on_answers_stale_and_leaves_the_slot_alone():
    """Paused mid-backward, re-run elsewhere, woken after the optimizer stepped: no write into slot k."""
    import numpy as np

    from workers.trainer import Trainer
    job = get_job("spirals")(build(get_job("spirals").Spec, {"micro_batches": 2, "batch": 8}))
    owner = shm.Registry("wfence", "optimizer")
    try:
        params = owner.create("params", job.param_layout())
        for name, arr in job.init_params():
            params.tensors[name][...] = arr
        grads = owner.create("grads", [(f"{k}/{n}", s, d) for k in range(2) for n, s, d in job.param_layout()])
        batches = owner.create("batches", [(f"{slot}/{n}", s, d) for slot in range(4)
                                           for n, s, d in job.batch_layout()])
        job.fill_batch(0, 1, {n: batches.tensors[f"1/{n}"] for n, _, _ in job.batch_layout()})
        for t in grads.tensors.values():
            t[...] = 7.0  # what a later step's trainer wrote there
        desc = lambda seg: {"segment": seg.name, "tensors": seg.layout_wire(), "owner": "optimizer-1"}  # noqa: E731
        sent = []
        trainer = Trainer("ipc:///nowhere")
        trainer.job, trainer.registry = job, shm.Registry("wfence", "trainer")
        trainer.sock = type("Sock", (), {"send": lambda self, kind, step, **f: sent.append((kind, step, f))})()
        trainer.setup()
        task = {"step": 0, "gen": 0, "k": 1, "slot": 1, "batch": desc(batches), "params": desc(params),
                "grads": desc(grads)}
        params.version = 0
        trainer._rebind(task["params"])
        compute = trainer.logic.compute

        def paused_while_the_run_moved_on(batch, out):
            result = compute(batch, out)
            params.version = 1  # the optimizer stepped while we were stopped
            return result
        trainer.logic.compute = paused_while_the_run_moved_on
        trainer.on_grad(task)
        assert sent[-1][0] == "grad_done" and sent[-1][2]["stale"] is True
        assert all(np.all(t == 7.0) for t in grads.tensors.values())
        trainer.logic.compute = compute
        params.version = 0
        trainer.on_grad(task)  # the same task, not overtaken: the gradient lands in slot 1 only
        assert "stale" not in sent[-1][2]
        assert any(np.any(grads.tensors[f"1/{n}"] != 7.0) for n, _, _ in job.param_layout())
        assert all(np.all(grads.tensors[f"0/{n}"] == 7.0) for n, _, _ in job.param_layout())
        trainer.registry.close()
    finally:
        owner.close()


def test_a_stand_by_worker_the_run_has_no_use_for_waits_for_sigterm(tmp_path):
    """The Procfile starts every role for any job: an es_member at a spirals run (or a trainer at an ES run)
    must not exit, since honcho ends the whole run when its first process does."""
    import signal
    import time
    ep = transport.ipc_endpoints(str(tmp_path))
    router = transport.RouterSocket(ep.control)
    p = subprocess.Popen([sys.executable, "-m", "workers.es_member", "--run-dir", str(tmp_path), "--stand-by"],
                         cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        got = None
        while got is None or got[1] is None or got[1]["kind"] != "hello":
            got = router.recv(60000)
            assert got is not None, "no hello from the worker"
        router.send(got[0], "shutdown", reason="this spirals run has no es_member role", unused=True)
        time.sleep(1.0)
        assert p.poll() is None, p.communicate()[0]
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and "no es_member role; standing by until SIGTERM" in out, out
    finally:
        router.close()
        if p.poll() is None:
            p.kill()
