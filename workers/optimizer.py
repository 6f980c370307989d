"""Optimizer role: owns the parameters and the optimizer state.

Publishes parameters in its `params` segment (the header's version = steps
applied), owns the `grads` segment trainers write into, reduces micro-batch
gradients in index order, clips, steps, evaluates when due, and copies a
snapshot to a fresh segment for the checkpointer - then keeps going.
"""
import os
import sys
import time

from pipeline.runtime.roles import OptimizerLogic, eval_due, trainer_state
from pipeline.runtime.shm import SHM_DIR
from pipeline.runtime.worker import Worker, run_worker


class Optimizer(Worker):
    role = "optimizer"

    def setup(self):
        layout = self.job.param_layout()
        self.params_seg = self.registry.create("params", layout)
        m = self.job.micro_batches
        self.grads_seg = self.registry.create("grads", [(f"{k}/{n}", s, d) for k in range(m) for n, s, d in layout])
        self.logic = OptimizerLogic(self.job, dict(self.params_seg.tensors))
        self.names = [n for n, _, _ in layout]

    def _desc(self, seg):
        return {"segment": seg.name, "tensors": seg.layout_wire(), "owner": self.id}

    def on_init(self, msg):
        step = self.logic.init(msg["resume"] or None)
        self.params_seg.version = step
        self.sock.send("ready", step, worker=self.id, gen=msg["gen"], params=self._desc(self.params_seg),
                       grads=self._desc(self.grads_seg), resume=msg["resume"],
                       **({"stop": True} if self.job.stopped() else {}))  # a resumed run that had stopped early

    def on_step(self, msg):
        step = msg["step"]
        self.fault("step", step)
        t0 = time.perf_counter()
        slots = [{n: self.grads_seg.tensors[f"{k}/{n}"] for n in self.names} for k in range(msg["micro_batches"])]
        info = self.logic.step(step, slots, skip=set(msg.get("skip", ())))
        self.params_seg.version = step + 1
        extra = {}
        if eval_due(self.job, step + 1):
            extra["eval"] = self.logic.evaluate()
        self.logic.after_step(step + 1, self.run_dir)
        if self.job.stopped():
            extra["stop"] = True  # an early stop: the run ends at this step
        self.sock.send("stepped", step + 1, worker=self.id, gen=msg["gen"], ms=(time.perf_counter() - t0) * 1e3,
                       **info, **extra)

    def on_snapshot(self, msg):
        step = msg["step"]
        for name in [n for n in self.registry.created if "-snapshot-" in n]:  # written by the checkpointer
            if not os.path.exists(os.path.join(SHM_DIR, name)):
                self.registry.created.pop(name).close()
        params, skeleton, optim = self.logic.snapshot()
        layout = [(f"model/{n}", a.shape, a.dtype) for n, a in params.items()]
        layout += [(f"optim/{n}", a.shape, a.dtype) for n, a in optim.items()]
        seg = self.registry.create(f"snapshot-{step}", layout)
        for n, a in params.items():
            seg.tensors[f"model/{n}"][...] = a
        for n, a in optim.items():
            seg.tensors[f"optim/{n}"][...] = a
        seg.version = step
        self.sock.send("snapshot_ready", step, worker=self.id, gen=msg["gen"], segment=seg.name,
                       tensors=seg.layout_wire(),
                       meta={"optim": skeleton, "state": trainer_state(self.job, step).to_json()})


def main(argv=None):
    return run_worker(Optimizer, argv)


if __name__ == "__main__":
    sys.exit(main())
