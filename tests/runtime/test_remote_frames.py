"""Remote trainers: tensors as buffer frames, and the scheduler's rules for them (real segments, mock peers)."""
import numpy as np
import pytest

from test_scheduler import RUN_ID, Fake, spin

from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime import remote
from pipeline.runtime.scheduler import Scheduler
from pipeline.runtime.shm import Registry
from pipeline.runtime.transport import DealerSocket, ipc_endpoints

M = 4


def test_frames_round_trip_in_chunks_without_copying_on_send(monkeypatch):
    monkeypatch.setattr(remote, "CHUNK_BYTES", 64)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((5, 7)).astype(np.float32), np.zeros((0,), np.float32),
              rng.integers(0, 255, (3, 33), dtype=np.uint16)]
    frames = remote.to_frames(arrays)
    # 140 bytes of float32, an empty tensor (one empty frame), 198 bytes of uint16, in 64-byte chunks
    assert [len(f) for f in frames] == [64, 64, 12, 0, 64, 64, 64, 6]
    assert np.shares_memory(np.frombuffer(frames[0], np.uint8), arrays[0])  # a view, not a copy
    out = [np.empty_like(a) for a in arrays]
    remote.from_frames(frames, out)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, out))


@pytest.mark.parametrize("mangle", [lambda f: f[:-1], lambda f: f + [b"x"], lambda f: [f[0][:-4], *f[1:]]],
                         ids=["a frame missing", "an extra frame", "a short frame"])
def test_frames_that_do_not_fit_the_layout_write_nothing(mangle):
    src = [np.arange(6, dtype=np.float32), np.arange(4, dtype=np.float64)]
    dst = [np.full(6, -1, np.float32), np.full(4, -1, np.float64)]
    with pytest.raises(remote.FrameError):
        remote.from_frames(mangle([bytes(f) for f in remote.to_frames(src)]), dst)
    assert (dst[0] == -1).all() and (dst[1] == -1).all()


class RemoteFake(Fake):
    """A mock trainer that says `remote` in its hello and keeps the frames after each message."""

    def __init__(self, ep, name):
        self.id, self.role = name, "trainer"
        self.sock = DealerSocket(ep.control)
        self.token = f"token-of-{name}"
        self.sock.send("hello", role="trainer", worker=name, pid=0, token=self.token, remote=True)
        self.inbox = []
        self.silent = False

    def drain(self):
        while (msg := self.sock.recv(0)) is not None:
            if msg and msg["kind"] != "heartbeat":
                msg["frames"] = [bytes(b) for b in self.sock.buffers]
                self.inbox.append(msg)


@pytest.fixture
def remote_rig(tmp_path):
    job_cls = get_job("spirals")
    job = job_cls(build(job_cls.Spec, {"steps": 3, "batch": 8, "micro_batches": M, "checkpoint_every": 0,
                                       "eval_every": 0}))
    rng = np.random.default_rng(1)
    opt, loader = Registry(RUN_ID, "optimizer"), Registry(RUN_ID, "loader")
    layout = job.param_layout()
    params = opt.create("params", layout)
    grads = opt.create("grads", [(f"{k}/{n}", s, d) for k in range(M) for n, s, d in layout])
    batches = loader.create("batches", [(f"{slot}/{n}", s, d) for slot in range(2 * M)
                                        for n, s, d in job.batch_layout()])
    for seg in (params, batches):
        for a in seg.tensors.values():
            a[...] = rng.standard_normal(a.shape) if a.dtype.kind == "f" else rng.integers(0, 2, a.shape)
    ep = ipc_endpoints(str(tmp_path))
    sched = Scheduler(job, str(tmp_path), RUN_ID, ep, trainers=2, log=lambda m: None, liveness_s=1.0)
    fakes = {n: Fake(ep, n, n) for n in ("loader", "optimizer", "checkpointer")}
    fakes.update({n: RemoteFake(ep, n) for n in ("r1", "r2")})
    yield sched, fakes, job, {"params": params, "grads": grads, "batches": batches}
    for f in fakes.values():
        f.sock.close()
    sched.close()
    opt.close()
    loader.close()


def _desc(seg, owner):
    return {"segment": seg.name, "tensors": seg.layout_wire(), "owner": owner}


def _start(sched, fakes, segs):
    spin(sched, fakes)
    fakes["optimizer"].take("init")
    fakes["optimizer"].send("ready", 0, gen=0, params=_desc(segs["params"], "optimizer"),
                            grads=_desc(segs["grads"], "optimizer"))
    spin(sched, fakes)
    for m in fakes["loader"].take("load"):
        fakes["loader"].send("loaded", m["step"], gen=0, k=m["k"], slot=m["slot"],
                             batch=_desc(segs["batches"], "loader"), ms=0.1)
    spin(sched, fakes)


def test_remote_trainers_get_frames_and_only_their_own_gradients_land(remote_rig):
    sched, fakes, job, segs = remote_rig
    _start(sched, fakes, segs)
    names = [n for n, _, _ in job.param_layout()]
    tasks = {}
    for who in ("r1", "r2"):
        (shipped,) = fakes[who].take("params")
        assert shipped["step"] == 0
        got = [np.empty_like(segs["params"].tensors[n]) for n in names]
        remote.from_frames(shipped["frames"], got)
        assert all(np.array_equal(g, segs["params"].tensors[n]) for g, n in zip(got, names))
        (task,) = fakes[who].take("grad")
        slot = task["slot"]
        batch = [np.empty_like(segs["batches"].tensors[f"{slot}/{n}"]) for n, _, _ in job.batch_layout()]
        remote.from_frames(task["frames"], batch)
        assert all(np.array_equal(b, segs["batches"].tensors[f"{slot}/{n}"])
                   for b, (n, _, _) in zip(batch, job.batch_layout()))
        tasks[who] = task
    k1, k2 = tasks["r1"]["k"], tasks["r2"]["k"]

    def gradient(value):
        return remote.to_frames(np.full(segs["params"].tensors[n].shape, value, np.float32) for n in names)

    def slot_is(k, value):
        return all((segs["grads"].tensors[f"{k}/{n}"] == value).all() for n in names)

    # r2 answers r1's task with a gradient: dropped, slot k1 untouched
    fakes["r2"].sock.send("grad_done", 0, gen=0, k=k1, loss=1.0, rows=2, ms=1.0, buffers=gradient(7.0),
                          worker="r2")
    # r1 answers its own task with frames that do not fit the slot: dropped and the task re-queued
    fakes["r1"].sock.send("grad_done", 0, gen=0, k=k1, loss=1.0, rows=2, ms=1.0, buffers=gradient(7.0)[:-1],
                          worker="r1")
    spin(sched, fakes)
    assert slot_is(k1, 0.0)
    assert sched.grads.get(k1, ("issued",))[0] == "issued" and sched.grads[k2] == ("issued", "r2")
    # the right answers land in their slots; a trainer is not sent parameters of a version it holds
    fakes["r2"].sock.send("grad_done", 0, gen=0, k=k2, loss=1.0, rows=2, ms=1.0, buffers=gradient(2.0),
                          worker="r2")
    spin(sched, fakes)
    assert slot_is(k2, 2.0) and sched.grads[k2][0] == "done"
    assert fakes["r2"].take("params", wait_s=0.2) == [] and fakes["r2"].take("grad")


def test_a_trainer_without_remote_that_cannot_map_the_segments_leaves_and_its_task_is_requeued(tmp_path):
    """The segments named in its task do not exist on its host: it exits naming --remote; the run goes on."""
    import os
    import subprocess
    import sys
    import time

    from test_scheduler import _job, start
    ep = ipc_endpoints(str(tmp_path))
    sched = Scheduler(_job(), str(tmp_path), RUN_ID, ep, trainers=1, log=lambda m: None, liveness_s=5.0)
    fakes = {n: Fake(ep, n, n) for n in ("loader", "optimizer", "checkpointer")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trainer = subprocess.Popen([sys.executable, "-m", "workers.trainer", "--connect", ep.control],
                               cwd=root, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": root})
    try:
        t_end = time.monotonic() + 300
        while not sched.role("trainer") and time.monotonic() < t_end:
            spin(sched, fakes, 0.2)
        assert len(sched.role("trainer")) == 1
        start(sched, fakes)  # its first task names segments (desc()) that no host has
        while trainer.poll() is None and time.monotonic() < t_end:
            spin(sched, fakes, 0.2)
        spin(sched, fakes, 0.5)
        assert trainer.wait(timeout=10) == 1
        said = trainer.stderr.read()
        assert "cannot map the run's shared memory" in said and "start the trainer with --remote" in said
        assert not sched.role("trainer") and all(v[0] != "issued" for v in sched.grads.values())
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for f in fakes.values():
            f.sock.close()
        sched.close()


def test_the_remote_bench_counts_the_bytes_a_step_ships():
    from pipeline.bench.pipeline import _ship
    params = [np.zeros((3, 5), np.float32), np.zeros(7, np.float32)]
    batch = [np.zeros(9, np.int64)]
    ms, nbytes = _ship(params, batch, micro_batches=3, steps=2)
    assert nbytes == {"params": 88, "batches": 3 * 72, "grads": 3 * 88}  # parameters once, M batches, M gradients
    assert ms > 0


def test_the_remote_bench_finetune_shape_is_the_adapters_and_one_sample_per_micro_batch():
    import os

    from pipeline.bench.pipeline import _shapes_finetune
    from pipeline.jobs import get_job
    from pipeline.jobs.spec import build
    model = os.path.join(os.path.dirname(__file__), "..", "fixtures", "qwen3-mini-q8_0.gguf")
    params, batch, micro_batches = _shapes_finetune(model)
    job = get_job("finetune")(build(get_job("finetune").Spec, {"model": model}))
    assert [a.shape for a in params] == [shape for _, shape, _ in job.param_layout()]
    assert all(name.endswith(("lora_a", "lora_b")) for name, _, _ in job.param_layout())
    assert micro_batches == job.micro_batches and len(batch) == len(job.batch_layout())
