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

from ..errors import ConfigMismatchError, FucinaError
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
        """Forward+backward one micro-batch; gradients into `grads`. -> (loss, rows).

        Overflow warnings are silenced: a NaN/inf is caught by `first_nonfinite` and reported once, by name."""
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return self.job.micro_grad(self.model, batch, grads)


class NonFiniteError(FucinaError):
    """A NaN or inf (or |x| >= 2^64) reached a loss or a gradient: it is never applied to the parameters."""


# A value of magnitude >= 2^64 squares to inf in float32 (a second moment, a norm's sum of squares): as unusable
# as an inf, and out of reach of an honest loss or gradient. It counts as non-finite (a remote trainer's 1e30).
OVERFLOW = 2.0 ** 64


def usable(x: float) -> bool:
    """Finite and of magnitude below OVERFLOW (a NaN compares False)."""
    return -OVERFLOW < x < OVERFLOW


def first_nonfinite(loss, grads: dict) -> str | None:
    """'loss', the name of the first gradient holding a NaN/inf (or a value past OVERFLOW), or None.

    min/max propagate NaN and reach +-inf without a temporary the size of the tensor."""
    if not usable(loss):
        return "loss"
    for name, g in grads.items():
        if g.size and not (usable(float(np.min(g))) and usable(float(np.max(g)))):
            return name
    return None


def nonfinite_message(step, k, worker, tensor, run_dir) -> str:
    """The one line a run stopped by a non-finite value ends with (`step`: the parameters' version)."""
    latest = ckpt.latest_checkpoint(run_dir)
    return (f"optimizer step {step + 1}, micro-batch {k}: {worker} computed a non-finite (NaN, inf or |x| >= 2^64) "
            f"{'loss' if tensor == 'loss' else 'gradient of ' + tensor}; nothing was applied, the latest checkpoint "
            f"is {latest or 'none (the run had not saved one)'}; --on-nonfinite skip leaves such micro-batches out")


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
            self.job.restore_progress(None)
            return 0
        state = ckpt.read_state(resume)
        self.job.restore_progress(state.config)
        if state.config.get("job") != self.job.name:
            raise ConfigMismatchError(f"{resume}: checkpoint of job {state.config.get('job')!r}, "
                                      f"resuming job {self.job.name!r}")
        if state.accum_steps != self.job.micro_batches:
            raise ConfigMismatchError(f"{resume}/trainer_state.json: accum_steps {state.accum_steps} "
                                      "(micro-batches per step) "
                                      f"but the job has micro_batches={self.job.micro_batches}")
        return ckpt.restore(resume, self.named, self.opt)

    def step(self, step: int, slots: list[dict], skip=()) -> dict:
        """Reduce the slots not in `skip` (micro-batches refused as non-finite), check, clip, step.

        The reduced gradient is checked before anything is applied: a NaN/inf in any slot makes its sum
        non-finite, so one pass catches a slot nobody reported (NonFiniteError, parameters untouched)."""
        live = [s for k, s in enumerate(slots) if k not in skip]
        if not live:  # every micro-batch refused: nothing to apply, the schedule still moves on
            self.schedule.apply(self.job.lr_factor(step))
            return {"lr": float(self.opt.lr_holders()[0].lr), "grad_norm": 0.0}
        for name, t in self.named:
            t.grad = reduce_in_order(live, name)
        bad = first_nonfinite(0.0, {name: t.grad for name, t in self.named})
        if bad is not None:
            ks = [k for k, s in enumerate(slots) if k not in skip and first_nonfinite(0.0, {bad: s[bad]})]
            self.opt.zero_grad()
            raise NonFiniteError(f"optimizer step {step + 1}: the gradient of {bad} is not finite (micro-batch(es) "
                                 f"{ks}); nothing was applied")
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
