"""ES as a job of the one runtime: the spec, the replica, and the iteration logic both ways of running share.

An ES iteration t is: score the center theta_t (stop if it reached 100%
training accuracy or t == iterations), score every member (iteration t,
member m) - the tasks -, apply the update from the rewards (theta_{t+1}) and,
every save_every iterations, write checkpoint-step-{t+1}. `ESRun` holds the
replica of the process that drives the run and does every step but the member
scoring; `run_es_inprocess` scores the members inline with the same batched
code the es_member workers run (pipeline/runtime/es_scheduler.py hands them
out), so in-process, 1 member, N members, a resumed run and a run that lost a
member produce the same bits (tests pin the final sha256 across all of them).

Trade-off: the driver keeps a replica of its own and applies every update
itself (one extra update per iteration, in parallel with the members'), so a
checkpoint and the final digest need no parameter transfer: parameters cross
the wire only to a member that joins or lags (es_state), and at the end every
member's sha256 is compared with the driver's.
"""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from ..errors import UserError
from ..jobs.spec import field, tensorboard_field
from ..runtime.ckpt import checkpoint_dir, latest_checkpoint, params_sha256
from ..runtime.metrics import MetricsLog, plot_run
from .checkpoint import load_es_checkpoint, save_es_checkpoint
from .spirals import ALPHA, SIGMA, SpiralsTask, spirals_config


@dataclasses.dataclass
class ESSpiralsSpec:
    iterations: int = field(0, "stop after this many iterations, an absolute count (0: when the center "
                               "reaches 100% training accuracy)")
    population: int = field(128, "ES population")
    sigma: float = field(SIGMA, "perturbation scale (tuned, see docs/es.md)")
    alpha: float = field(ALPHA, "step size (tuned, see docs/es.md)")
    seed: int = field(0, "ES noise seed")
    model_seed: int = field(0, "SpiralsMLP init seed")
    data_seed: int = field(0, "spirals data noise seed")
    reward: str = field("nll", "nll: -mean CE; acc: accuracy + 0.1*exp(-CE), bounded", choices=SpiralsTask.REWARDS)
    antithetic: bool = field(True, "(+eps, -eps) member pairs")
    shaping: str = field("z_score", "fitness shaping", choices=("z_score", "centered_ranks"))
    noise: str = field("iid", "noise scheme", choices=("iid", "correlated"))
    save_every: int = field(0, "checkpoint every N iterations (0: only the final one)")
    tensorboard: str = tensorboard_field()


class ESJob:
    """What every ES job shares: the es task kind, steps = iterations, a population; no micro-batch plan
    (an iteration's tasks are its members). Subclasses add Spec, make_task, save and load."""

    kind = "es"
    micro_batches = 0
    center_scored = True  # the stop test scores theta itself (False: it stops at `iterations` only)

    @property
    def steps(self):
        return self.spec.iterations

    @property
    def population(self):
        return self.spec.population


class ESSpiralsJob(ESJob):
    """`es-spirals`: the spirals MLP from random init by pure ES; a task is one (iteration, member)."""

    name = "es-spirals"
    Spec = ESSpiralsSpec
    eval_name = "center accuracy"

    def __init__(self, spec: ESSpiralsSpec):
        self.spec = spec
        if spec.population < 1 or spec.iterations < 0 or spec.save_every < 0:
            raise UserError("es-spirals: population must be >= 1, iterations and save_every >= 0")

    def make_task(self) -> SpiralsTask:
        s = self.spec
        es = spirals_config(population=s.population, sigma=s.sigma, alpha=s.alpha, seed=s.seed,
                            antithetic=s.antithetic, shaping=s.shaping, noise=s.noise)
        return SpiralsTask(es, model_seed=s.model_seed, data_seed=s.data_seed, reward=s.reward)

    def save(self, task: SpiralsTask, path):
        save_es_checkpoint(path, task.trainer, run_config=task.run_config)

    def load(self, task: SpiralsTask, path):
        load_es_checkpoint(path, task.trainer)


JOB = ESSpiralsJob


def load_state(trainer, tensors: list[dict], data: list[bytes], iteration: int, source: str):
    """Copy a state transfer (es_state) into the replica after checking every name, dtype and shape."""
    named = trainer.named_arrays()
    if len(tensors) != len(named) or len(data) != len(named):
        raise UserError(f"{source}: {len(tensors)} tensor(s)/{len(data)} buffer(s), the replica has {len(named)}")
    for (name, arr), spec, raw in zip(named, tensors, data):
        if (spec["name"] != name or spec["dtype"] != arr.dtype.str or list(spec["shape"]) != list(arr.shape)
                or len(raw) != arr.nbytes):
            raise UserError(f"{source}: tensor {spec['name']!r} {spec['dtype']} {spec['shape']} does not match "
                            f"the replica's {name!r} {arr.dtype.str} {list(arr.shape)}")
    for (name, arr), raw in zip(named, data):
        np.copyto(arr, np.frombuffer(raw, dtype=arr.dtype).reshape(arr.shape))
    trainer.iteration = iteration


def state_fields(trainer) -> dict:
    """The es_state fields of a replica: tensor specs and their bytes, registration order."""
    named = trainer.named_arrays()
    return {"tensors": [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape), "offset": 0} for n, a in named],
            "data": [np.ascontiguousarray(a).tobytes() for _, a in named]}


class ESRun:
    """The driving replica: resume, stop test, update, checkpoints, metrics and the summary."""

    def __init__(self, job, run_dir, resume=None, log=print):
        self.job, self.run_dir, self.log = job, run_dir, log
        self.task = job.make_task()
        self.trainer = self.task.trainer
        self.resumed_from = None
        if resume:
            path = latest_checkpoint(resume) or resume
            job.load(self.task, path)
            self.resumed_from = os.path.abspath(path)
            log(f"resumed from {path} at iteration {self.trainer.iteration}")
        self.start = self.trainer.iteration
        self.center = None
        os.makedirs(run_dir, exist_ok=True)
        self.metrics = MetricsLog(run_dir, getattr(job.spec, "tensorboard", ""))
        self.metrics.rewind(self.start)  # iterations replayed from the checkpoint are recorded once
        self.durations = []  # seconds per committed iteration
        self.begin()

    def begin(self):
        """The clock starts (again) here: when the members are in, not while processes start."""
        self.t0 = self.last_t = time.perf_counter()

    @property
    def iteration(self) -> int:
        return self.trainer.iteration

    def finished(self) -> bool:
        """Score the center theta_t (a job without a center score: None); True when the run stops here."""
        self.center = self.task.center()
        converged = self.center is not None and self.center[1] == 1.0
        return converged or (self.job.steps > 0 and self.iteration >= self.job.steps)

    def commit(self, rewards) -> dict:
        """Apply iteration t's rewards (member order) -> the es_metrics record of iteration t+1."""
        rewards = np.asarray(rewards, dtype=np.float64)
        self.trainer.update(rewards)
        done = self.iteration
        now = time.perf_counter()
        step_s, self.last_t = now - self.last_t, now
        self.durations.append(step_s)
        record = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                  "reward_min": float(rewards.min()), "reward_max": float(rewards.max()),
                  "evals_per_s": len(rewards) / max(step_s, 1e-9), "step_ms": step_s * 1e3,
                  **({"eval": self.center[1], "eval_name": self.job.eval_name} if self.center else {})}
        if record["reward_min"] == record["reward_max"]:  # no signal: z-scores are all 0, ES took no step
            record["tied"] = True
        self.metrics.write({"kind": "es_metrics", "step": done, **record})
        every = self.job.spec.save_every
        if every and done % every == 0:
            self.save()
        return record

    def save(self):
        path = checkpoint_dir(self.run_dir, self.iteration)
        self.job.save(self.task, path)
        self.metrics.write({"kind": "event", "event": "checkpoint_committed", "step": self.iteration,
                            "detail": {"path": path}})
        return path

    def digest(self) -> str:
        return params_sha256(self.trainer.named_arrays())

    def summary(self, mode, members, replicas_checked=0) -> dict:
        """The final checkpoint and loss.png are written here; -> the run's summary."""
        path = self.save()
        wall = time.perf_counter() - self.t0
        done = self.iteration - self.start
        scored = {} if self.center is None else {"accuracy": self.center[1], "ce": self.center[0],
                                                 "converged": self.center[1] == 1.0}
        try:
            plot = plot_run(self.run_dir)  # loss.png: the reward per iteration
        except UserError:  # no iteration recorded yet (a resumed run that had nothing to do)
            plot = None
        return {"job": self.job.name, "mode": mode, "iterations": self.iteration, "iterations_this_run": done,
                **scored, "wall_s": round(wall, 3),
                "ms_per_iteration": wall / done * 1e3 if done else 0.0,
                "median_ms_per_iteration": float(np.median(self.durations)) * 1e3 if self.durations else 0.0,
                "member_evals_per_s": done * self.job.population / wall if done and wall > 0 else 0.0,
                "params_sha256": self.digest(), "sha256": self.digest(), "members": members,
                "population": self.job.population, "resumed_from": self.resumed_from,
                "replicas_checked": replicas_checked, "checkpoint": os.path.abspath(path),
                "run_dir": os.path.abspath(self.run_dir), "plot": plot}

    def close(self):
        self.metrics.close()


def run_es_inprocess(job, run_dir, resume=None, log=print, progress_every=0) -> dict:
    """Every member scored inline (BLAS pinned to one thread by the caller); -> summary."""
    run = ESRun(job, run_dir, resume, log)
    try:
        run.metrics.write({"kind": "event", "event": "run_started", "step": run.iteration,
                           "detail": {"mode": "inprocess"}})
        while not run.finished():
            run.commit(run.task.rewards(range(job.population)))
            if progress_every and run.iteration % progress_every == 0:
                log(f"iteration {run.iteration}: center CE {run.center[0]:.4f} acc {run.center[1]:.4f}")
        summary = run.summary("inprocess", members=0)
        run.metrics.write({"kind": "event", "event": "run_finished", "step": run.iteration, "detail": summary})
        return summary
    finally:
        run.close()
