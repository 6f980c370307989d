"""es_member role (x N): a parameter replica that scores the ES members it is assigned.

    python -m workers.es_member --run-dir RUN_DIR           (ipc://, the run's sockets)
    python -m workers.es_member --connect tcp://HOST:PORT --key worker.key

Holds nothing worth saving: it gets the parameters in an es_state (when it
joins or lags), then per es_eval applies the previous iteration's rewards to
its replica exactly as every other replica does, scores its members and sends
back float64 rewards. Any member can die; its members are re-run elsewhere
with the same bits. One thread (BLAS and numba pinned): the parallelism is the
number of members. Messages: pipeline/runtime/es_scheduler.py.
"""
import os
import sys
import time

from pipeline.finetune.es import check_reward_files

from pipeline.es.run import load_state
from pipeline.runtime.ckpt import params_sha256
from pipeline.runtime.worker import Worker, run_worker


class ESMember(Worker):
    role = "es_member"

    def setup(self):
        check_reward_files(self.job, os.environ, where=self.id)
        self.task = self.job.make_task()
        self.at = None  # the iteration the replica is at; None until the first es_state

    def on_es_state(self, msg):
        load_state(self.task.trainer, msg["tensors"], msg["data"], msg["step"], source=f"{self.id}: es_state")
        self.at = msg["step"]

    def reach(self, it, catchup):
        """Apply `catchup` (the rewards of it-1) when the replica is at it-1; then it must be at `it`."""
        if catchup is not None and self.at == it - 1:
            self.task.trainer.update(catchup)
            self.at = it
        if self.at != it:
            raise RuntimeError(f"replica is at iteration {self.at}, asked for {it}")

    def on_es_eval(self, msg):
        t0 = time.perf_counter()
        self.reach(msg["step"], msg["catchup"])
        self.fault("eval", msg["step"])
        members = msg["members"]
        rewards = self.task.rewards(members).tolist() if members else []
        self.sock.send("es_rewards", msg["step"], worker=self.id, members=members, rewards=rewards,
                       ms=(time.perf_counter() - t0) * 1e3)

    def on_es_digest(self, msg):
        self.reach(msg["step"], msg["catchup"])
        self.sock.send("es_digested", msg["step"], worker=self.id,
                       sha256=params_sha256(self.task.trainer.named_arrays()))


if __name__ == "__main__":
    sys.exit(run_worker(ESMember))
