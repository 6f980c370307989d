"""Loader role: fills micro-batch (step, k) into a shared-memory batch slot.

Owns the loader state (seed, epoch, index) - which, by the data-order contract,
is a pure function of (seed, step), so a restarted loader needs no state file.
Two slots per micro-batch (by step parity) let it prefetch step s+1 while
trainers work on step s.
"""
import sys
import time

from pipeline.runtime.roles import LoaderLogic
from pipeline.runtime.worker import Worker, run_worker


class Loader(Worker):
    role = "loader"

    def setup(self):
        m = self.job.micro_batches
        layout = [(f"{slot}/{name}", shape, dtype)
                  for slot in range(2 * m) for name, shape, dtype in self.job.batch_layout()]
        self.segment = self.registry.create("batches", layout)
        self.descriptor = {"segment": self.segment.name, "tensors": self.segment.layout_wire(), "owner": self.id}
        self.logic = LoaderLogic(self.job)

    def on_load(self, msg):
        step, k, slot = msg["step"], msg["k"], msg["slot"]
        self.fault("load", step)
        t0 = time.perf_counter()
        out = {name: self.segment.tensors[f"{slot}/{name}"] for name, _, _ in self.job.batch_layout()}
        self.logic.fill(step, k, out)
        self.sock.send("loaded", step, worker=self.id, gen=msg["gen"], k=k, slot=slot, batch=self.descriptor,
                       ms=(time.perf_counter() - t0) * 1e3)


def main(argv=None):
    return run_worker(Loader, argv)


if __name__ == "__main__":
    sys.exit(main())
