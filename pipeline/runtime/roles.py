"""The work of each role, as plain objects usable inline or inside a worker.

`--inprocess` calls these directly in one loop; the workers/ processes call the
same methods on arrays that live in shared memory. Because a role's output is a
pure function of its inputs (parameters of version v, micro-batch (step, k)),
where it runs cannot change the bits - that is the determinism guarantee.

Trade-off: the optimizer owns the parameter buffer and updates it in place; the
scheduler guarantees no trainer reads it during the update (a step's update
starts only after all its micro-batch gradients are in).
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigMismatchError
from ..jobs.base import bind_tensors
from ..optim import LrSchedule, grad_norm
from . import ckpt
from .ckpt import checkpoint_dir, trainer_state  # noqa: F401 - re-exported for the roles


class LoaderLogic:
    def __init__(self, job):
        self.job = job

    def fill(self, step, k, out: dict):
        self.job.fill_batch(step, k, out)


class TrainerLogic:
    def __init__(self, job, params: dict):
        self.job = job
        self.model = job.bind(list(params.items()))

    def compute(self, batch: dict, grads: dict):
        """Forward+backward one micro-batch; gradients into `grads`. -> (loss, rows)."""
        return self.job.micro_grad(self.model, batch, grads)


def reduce_in_order(slots: list[dict], name: str) -> np.ndarray:
    """Sum micro-batch gradients in micro-batch index order (DESIGN.md 3.4)."""
    g = np.array(slots[0][name], dtype=np.float32, copy=True)
    for s in slots[1:]:
        g += s[name]
    return g


class OptimizerLogic:
    def __init__(self, job, params: dict):
        self.job, self.params = job, params
        self.named = bind_tensors(list(params.items()))
        self.trainer_view = None  # for validation, a model over the same arrays
        self.opt = self.schedule = None

    def init(self, resume: str | None) -> int:
        """Fresh parameters (step 0) or the state of a committed checkpoint -> its step."""
        self.opt = self.job.make_optimizer(self.named)
        self.schedule = LrSchedule(self.opt)
        if not resume:
            for name, arr in self.job.init_params():
                self.params[name][...] = arr
            return 0
        state = ckpt.read_state(resume)
        if state.config.get("job") != self.job.name:
            raise ConfigMismatchError(f"{resume}: checkpoint of job {state.config.get('job')!r}, "
                                      f"resuming job {self.job.name!r}")
        if state.accum_steps != self.job.micro_batches:
            raise ConfigMismatchError(f"{resume}/trainer_state.json: accum_steps {state.accum_steps} "
                                      "(micro-batches per step) "
                                      f"but the job has micro_batches={self.job.micro_batches}")
        return ckpt.restore(resume, self.named, self.opt)

    def step(self, step: int, slots: list[dict]) -> dict:
        for name, t in self.named:
            t.grad = reduce_in_order(slots, name)
        clip = getattr(self.job.spec, "clip", 0.0)
        norm = self.opt.clip_grad_norm(clip) if clip > 0 else grad_norm(self.opt)
        self.schedule.apply(self.job.lr_factor(step))
        self.opt.step()
        self.opt.zero_grad()
        return {"lr": float(self.opt.lr_holders()[0].lr), "grad_norm": float(norm)}

    def _view(self):
        if self.trainer_view is None:
            self.trainer_view = self.job.bind(list(self.params.items()))
        return self.trainer_view

    def evaluate(self):
        return self.job.validate(self._view())

    def after_step(self, step: int, run_dir: str):
        """The job's hook on the parameters of version `step` (the optimizer holds them)."""
        self.job.after_step(step, self._view(), run_dir)

    def snapshot(self):
        """(param copies, optimizer skeleton, optimizer tensors) - what a checkpoint holds."""
        sd = self.opt.state_dict()
        skeleton = {k: v for k, v in sd.items() if k != "tensors"}
        return {n: np.array(a, copy=True) for n, a in self.params.items()}, skeleton, sd["tensors"]


def checkpoint_due(job, step: int) -> bool:
    every = getattr(job.spec, "checkpoint_every", 0)
    return step == job.steps or (every > 0 and step % every == 0)


def eval_due(job, step: int) -> bool:
    every = getattr(job.spec, "eval_every", 0)
    return every > 0 and (step % every == 0 or step == job.steps)
