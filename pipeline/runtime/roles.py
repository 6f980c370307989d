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

import os

import numpy as np

from ..errors import ConfigMismatchError
from ..jobs.base import bind_tensors
from ..jobs.recipes import clip_grad_norm
from ..jobs.spec import to_dict
from . import ckpt


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
        self.opt = job.make_optimizer(self.named)

    def init(self, resume: str | None) -> int:
        """Fresh parameters (step 0) or the state of a committed checkpoint -> its step."""
        self.opt = self.job.make_optimizer(self.named)
        if not resume:
            for name, arr in self.job.init_params():
                self.params[name][...] = arr
            return 0
        params, optim, meta, state = ckpt.read_checkpoint(resume)
        if state.get("job") != self.job.name:
            raise ConfigMismatchError(f"{resume}: checkpoint of job {state.get('job')!r}, resuming job {self.job.name!r}")
        for name, dst in self.params.items():
            if name not in params:
                raise ConfigMismatchError(f"{resume}/model.safetensors: tensor {name!r} missing")
            src = params[name]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ConfigMismatchError(f"{resume}/model.safetensors: {name!r} is {src.dtype}{list(src.shape)}, "
                                          f"the job needs {dst.dtype}{list(dst.shape)}")
            dst[...] = src
        self.opt.load_state_dict(optim, meta)
        return int(state["step"])

    def step(self, step: int, slots: list[dict]) -> dict:
        for name, t in self.named:
            t.grad = reduce_in_order(slots, name)
        norm = clip_grad_norm(self.named, getattr(self.job.spec, "clip", 0.0))
        lr = self.job.lr_at(step)
        self.opt.step(lr)
        for _, t in self.named:
            t.grad = None
        return {"lr": float(lr), "grad_norm": float(norm)}

    def evaluate(self):
        if self.trainer_view is None:
            self.trainer_view = self.job.bind(list(self.params.items()))
        return self.job.validate(self.trainer_view)

    def snapshot(self):
        """(param copies, optimizer tensors, optimizer meta) - what a checkpoint holds."""
        tensors, meta = self.opt.state_dict()
        return ({n: np.array(a, copy=True) for n, a in self.params.items()},
                {n: np.array(a, copy=True) for n, a in tensors.items()}, meta)


def trainer_state(job, step: int) -> dict:
    """The sentinel's content: enough to resume (loader position is pure in the step)."""
    rows = step * job.rows_per_step()
    return {"step": step, "job": job.name, "spec": to_dict(job.spec), "seed": job.spec.seed,
            "loader": {"seed": job.spec.seed, "rows_consumed": rows}}


def checkpoint_dir(run_dir, step) -> str:
    return os.path.join(run_dir, f"checkpoint-step-{step}")


def checkpoint_due(job, step: int) -> bool:
    every = getattr(job.spec, "checkpoint_every", 0)
    return step == job.steps or (every > 0 and step % every == 0)


def eval_due(job, step: int) -> bool:
    every = getattr(job.spec, "eval_every", 0)
    return every > 0 and (step % every == 0 or step == job.steps)
