"""Trainer role (x N): forward + backward of one micro-batch per task.

Reads parameters of the version it is told from the optimizer's segment and the
batch from the loader's, writes the gradient into grads slot k. Holds nothing
persistent: a task re-run anywhere gives the same bits, which is what makes a
SIGKILLed trainer harmless. The backward pass fills a private buffer that is
copied into the shared slot only if the parameters are still of the task's
version: a trainer paused mid-task (and re-run elsewhere meanwhile) that
wakes after the step has moved on answers `stale` instead of writing into a
slot a later step now owns - the window left is the copy itself.

With --remote (another host, a Ray actor: no access to the scheduler host's
shared memory) the same computation runs on private arrays: parameters of
version v arrive as buffer frames in a `params` message when v changes, the
batch as frames after each `grad`, and the gradient goes back as frames after
`grad_done` (pipeline/runtime/remote.py). The bits are the same as a local
trainer's: the same function of the same bytes, with the same thread pinning.
"""
import os
import socket
import sys
import time

import numpy as np

from pipeline.runtime import remote
from pipeline.runtime.roles import TrainerLogic, first_nonfinite
from pipeline.runtime.worker import Worker, run_worker


class Trainer(Worker):
    role = "trainer"

    def setup(self):
        self.owners = {}         # segment name -> the worker that created the mapping we hold
        self.params_name = None
        self.logic = None
        self.private = {}        # parameter name -> this process's gradient buffer

    def _attach(self, desc):
        """Attach a segment; re-attach when its owner changed (a restarted role re-creates
        a segment under the same name, and our old mapping points at the unlinked one)."""
        name = desc["segment"]
        if self.owners.get(name) not in (None, desc["owner"]):
            self.registry.detach(name)
            if name == self.params_name:
                self.logic = None
        self.owners[name] = desc["owner"]
        return self.registry.attach(name, desc["tensors"])

    def _rebind(self, params_desc):
        self.params_name = params_desc["segment"]
        self.params_seg = self._attach(params_desc)
        if self.logic is None:
            self.logic = TrainerLogic(self.job, dict(self.params_seg.tensors))

    def on_grad(self, msg):
        step, k, slot = msg["step"], msg["k"], msg["slot"]
        self.fault("grad", step)
        t0 = time.perf_counter()
        if not self.owners:  # the first task: can this host map the run's segments at all?
            try:
                self._rebind(msg["params"])
            except FileNotFoundError:  # leave (bye: the task is re-queued) instead of failing the run
                raise SystemExit(f"{self.id}: this host cannot map the run's shared memory "
                                 f"({msg['params']['segment']}); start the trainer with --remote") from None
        self._rebind(msg["params"])
        if self.params_seg.version != step:  # a task from before a restart: refuse, the scheduler re-queues
            self.sock.send("grad_done", step, worker=self.id, gen=msg["gen"], k=k, loss=0.0, rows=0, ms=0.0, stale=True)
            return
        batch_seg = self._attach(msg["batch"])
        batch = {name: batch_seg.tensors[f"{slot}/{name}"] for name, _, _ in self.job.batch_layout()}
        grads_seg = self._attach(msg["grads"])
        grads = {name: grads_seg.tensors[f"{k}/{name}"] for name in self.params_seg.tensors}
        for name, slot_view in grads.items():
            if self.private.get(name) is None or self.private[name].shape != slot_view.shape:
                self.private[name] = np.empty_like(slot_view)
        loss, rows = self.logic.compute(batch, self.private)
        bad = first_nonfinite(loss, self.private)
        if bad is not None:  # never copied into the slot: the scheduler stops the run or skips the micro-batch
            self.sock.send("grad_done", step, worker=self.id, gen=msg["gen"], k=k, loss=0.0, rows=rows,
                           ms=(time.perf_counter() - t0) * 1e3, nonfinite=bad)
            return
        if self.params_seg.version != step:  # we were paused and the run moved on: the slot is not ours now
            self.sock.send("grad_done", step, worker=self.id, gen=msg["gen"], k=k, loss=0.0, rows=0, ms=0.0, stale=True)
            return
        for name, slot_view in grads.items():
            slot_view[...] = self.private[name]
        self.sock.send("grad_done", step, worker=self.id, gen=msg["gen"], k=k, loss=loss, rows=rows,
                       ms=(time.perf_counter() - t0) * 1e3)


class RemoteTrainer(Trainer):
    """A trainer fed by buffer frames instead of shared memory (see the module docstring)."""

    remote = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.id = f"{self.role}-{socket.gethostname()}-{os.getpid()}"  # pids repeat across hosts

    def setup(self):
        layout = self.job.param_layout()
        self.names = [n for n, _, _ in layout]
        self.params = {n: np.empty(shape, dtype=dtype) for n, shape, dtype in layout}
        self.version = None      # (gen, step) of the parameters in self.params
        self.logic = TrainerLogic(self.job, self.params)
        self.private = {n: np.empty_like(a) for n, a in self.params.items()}
        self.batch = {}
        self.in_flight = None    # the tracker of our last gradient frames: ZeroMQ may still read them

    def on_params(self, msg):
        specs = [(t["name"], tuple(t["shape"]), t["dtype"]) for t in msg["tensors"]]
        mine = [(n, tuple(a.shape), a.dtype.name) for n, a in self.params.items()]
        if specs != mine:
            raise ValueError(f"the run's parameter layout {specs} is not this job's {mine}")
        self.version = None  # until every frame is in: a refused message leaves no half-new version behind
        remote.from_frames(self.sock.buffers, [self.params[n] for n in self.names])
        self.version = (msg["gen"], msg["step"])

    def on_grad(self, msg):
        step, k, slot = msg["step"], msg["k"], msg["slot"]
        self.fault("grad", step)
        t0 = time.perf_counter()
        if self.version != (msg["gen"], step):  # parameters of another version: the scheduler re-ships
            self.sock.send("grad_done", step, worker=self.id, gen=msg["gen"], k=k, loss=0.0, rows=0, ms=0.0, stale=True)
            return
        prefix = f"{slot}/"
        specs = [t for t in msg["batch"]["tensors"] if t["name"].startswith(prefix)]
        arrays = remote.arrays_for(specs)
        remote.from_frames(self.sock.buffers, [arrays[t["name"]] for t in specs])
        batch = {name[len(prefix):]: a for name, a in arrays.items()}
        if self.in_flight is not None:
            self.in_flight.wait()  # our previous gradient frames are views of self.private
        loss, rows = self.logic.compute(batch, self.private)
        bad = first_nonfinite(loss, self.private)
        if bad is not None:  # no frames: nothing of it can reach the slot
            self.sock.send("grad_done", step, worker=self.id, gen=msg["gen"], k=k, loss=0.0, rows=rows,
                           ms=(time.perf_counter() - t0) * 1e3, nonfinite=bad)
            return
        self.in_flight = self.sock.send("grad_done", step, worker=self.id, gen=msg["gen"], k=k, loss=loss, rows=rows,
                                        ms=(time.perf_counter() - t0) * 1e3,
                                        buffers=remote.to_frames(self.private[n] for n in self.names))


def main(argv=None):
    return run_worker(Trainer, argv, remote_cls=RemoteTrainer)


if __name__ == "__main__":
    sys.exit(main())
