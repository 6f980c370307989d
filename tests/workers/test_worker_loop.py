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
