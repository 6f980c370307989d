"""Checkpointer role: writes a checkpoint directory from a shared-memory snapshot.

Asynchronous by construction: the optimizer copied its state into a snapshot
segment and went on stepping. We write model.safetensors, optimizer.safetensors
and trainer_state.json (the sentinel, last), announce the commit, and unlink the
snapshot segment. Killed mid-write, the directory has no sentinel, so the
previous checkpoint stays the latest; the scheduler re-sends the write.
"""
import os
import sys
import time

from pipeline.runtime import ckpt
from pipeline.runtime.shm import unlink_name
from pipeline.runtime.worker import Worker, run_worker
from pipeline.train.trainer_state import TrainerState


class Checkpointer(Worker):
    role = "checkpointer"

    def on_write(self, msg):
        step = msg["step"]
        t0 = time.perf_counter()
        seg = self.registry.attach(msg["segment"], msg["tensors"])
        params = {n[len("model/"):]: a for n, a in seg.tensors.items() if n.startswith("model/")}
        optim = {n[len("optim/"):]: a for n, a in seg.tensors.items() if n.startswith("optim/")}

        def after_weights(_name):
            self.fault("mid_write", step)

        faulty = "checkpointer:" in os.environ.get("FUCINA_FAULT", "")
        state = TrainerState.from_json(msg["meta"]["state"], source=f"snapshot {msg['segment']}")
        path = ckpt.write_checkpoint(msg["dir"], params, msg["meta"]["optim"], optim, state,
                                     on_file=after_weights if faulty else None, adapters=self.job.adapters_only)
        del params, optim
        self.registry.detach(msg["segment"])
        unlink_name(msg["segment"])
        self.sock.send("committed", step, worker=self.id, path=path, ms=(time.perf_counter() - t0) * 1e3)


def main(argv=None):
    return run_worker(Checkpointer, argv)


if __name__ == "__main__":
    sys.exit(main())
