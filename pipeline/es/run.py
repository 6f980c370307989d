"""The ES-spirals driver: one loop over two interchangeable backends.

Trade-off: the loop (center check, update, checkpoint, progress) is written
once; a backend only answers "rewards and center of iteration t" and
"commit these rewards". The in-process backend scores all members inline
with the same batched code the workers run, so in-process, 1 worker, N
workers, tcp workers, a resumed run and a run that lost a worker all produce
the same bits (tests pin the final sha256 across all of them).

Iteration t: score theta_t (the center) and every member; stop if the center
is at 100% training accuracy or t == max_iterations; else apply the update
(theta_{t+1}) and, every save_every iterations, write checkpoint-step-{t+1}.
"""
from __future__ import annotations

import os
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
from threadpoolctl import threadpool_limits

from ..runtime import security
from ..train.checkpoint import latest_checkpoint, step_dir
from .checkpoint import load_es_checkpoint, save_es_checkpoint
from .coordinator import Coordinator
from .spirals import SpiralsTask, params_sha256


class InProcess:
    """Every member scored inline, in this process, with one BLAS thread."""

    def __init__(self, task: SpiralsTask):
        self.task = task

    def iteration(self, it):
        trainer = self.task.trainer
        assert trainer.iteration == it
        cpu0 = time.process_time()
        center = self.task.center()
        rewards = self.task.rewards(range(trainer.config.population))
        self.busiest_cpu_ms = (time.process_time() - cpu0) * 1e3
        return rewards, center

    def commit(self, rewards):
        cpu0 = time.process_time()
        self.task.trainer.update(rewards)  # a worker does this at the start of its next task
        self.busiest_cpu_ms += (time.process_time() - cpu0) * 1e3

    def sync_replica(self):
        pass

    def close(self):
        pass


@dataclass
class RunOptions:
    workers: int = 0  # 0 = in-process
    remote_workers: int = 0  # extra workers expected to connect to `bind` (e.g. from other hosts)
    bind: str | None = None  # coordinator endpoint (default: a private ipc:// socket)
    max_iterations: int | None = None
    save_every: int = 0
    out: str | None = None
    resume: str | None = None
    progress_every: int = 0
    liveness: float = 10.0
    keys: tuple[str, str] | None = None  # (scheduler.key, worker.key) for a tcp:// bind; made fresh when None
    key_dir: str | None = None  # where fresh keys go (default: out, else a private temp dir)
    kill_worker_at: int | None = None  # fault injection: SIGKILL one local worker at this iteration
    log: object = None
    extra: dict = field(default_factory=dict)


def run_spirals(task: SpiralsTask, opts: RunOptions, on_iteration=None) -> dict:
    """Train to 100% training accuracy (or max_iterations); return the result summary."""
    log = opts.log or (lambda msg: None)
    trainer = task.trainer
    resumed_from = None
    if opts.resume:
        ckpt = latest_checkpoint(opts.resume) or opts.resume
        load_es_checkpoint(ckpt, trainer)
        resumed_from = str(ckpt)
        log(f"resumed from {ckpt} at iteration {trainer.iteration}")
    start = trainer.iteration
    with ExitStack() as stack:
        stack.enter_context(threadpool_limits(1))
        if opts.workers == 0 and opts.remote_workers == 0:
            backend = InProcess(task)
        else:
            keys = opts.keys
            if keys is None and opts.bind and security.is_tcp(opts.bind):  # fresh keys for this run
                key_dir = opts.key_dir or opts.out
                if key_dir:
                    os.makedirs(key_dir, exist_ok=True)
                else:  # workers read the key once, at start: the private dir goes with the run
                    key_dir = security.private_tempdir("fucina-es-keys-")
                    stack.callback(shutil.rmtree, key_dir, True)
                keys = security.create_run_keys(key_dir)
            backend = Coordinator(task, bind=opts.bind, liveness=opts.liveness, log=log, keys=keys)
            stack.callback(backend.close)
            backend.spawn_local(opts.workers)
            if opts.remote_workers:
                key_flag = f" --key {keys[1]}" if keys else ""
                log(f"waiting for {opts.remote_workers} remote worker(s): python -m workers.es_member "
                    f"--connect {backend.endpoint}{key_flag}")
            backend.wait_for_workers(opts.workers + opts.remote_workers)
        t0 = time.perf_counter()
        it = start
        center = None
        durations, cpu = [], []
        while opts.max_iterations is None or it < opts.max_iterations:
            t_it = time.perf_counter()
            if opts.kill_worker_at is not None and it == opts.kill_worker_at and isinstance(backend, Coordinator):
                log(f"fault injection: killed worker {backend.kill_one()} at iteration {it}")
            rewards, center = backend.iteration(it)
            if center[1] == 1.0:
                break
            if isinstance(backend, Coordinator):
                cpu.append(backend.busiest_cpu_ms)  # includes applying the previous update
            backend.commit(rewards)
            if isinstance(backend, InProcess):
                cpu.append(backend.busiest_cpu_ms)
            it += 1
            durations.append(time.perf_counter() - t_it)
            if opts.progress_every and it % opts.progress_every == 0:
                log(f"iteration {it}: center CE {center[0]:.4f} acc {center[1]:.4f} "
                    f"({(time.perf_counter() - t0) / max(1, it - start) * 1e3:.1f} ms/iteration)")
            if opts.save_every and opts.out and it % opts.save_every == 0:
                backend.sync_replica()
                save_es_checkpoint(step_dir(opts.out, it), trainer, run_config=task.run_config)
            if on_iteration is not None:
                on_iteration(it, backend)
        wall = time.perf_counter() - t0
        backend.sync_replica()
        digests = backend.replica_digests() if isinstance(backend, Coordinator) else {}
        ce, acc = task.center()
    sha = params_sha256(trainer.named_arrays())
    if digests and set(digests.values()) != {sha}:
        raise RuntimeError(f"replicas disagree at iteration {it}: {digests} vs coordinator {sha}")
    done = it - start
    pop = trainer.config.population
    return {"iterations": it, "iterations_this_run": done, "accuracy": acc, "ce": ce, "converged": acc == 1.0,
            "wall_s": wall, "ms_per_iteration": wall / done * 1e3 if done else 0.0,
            "median_ms_per_iteration": float(np.median(durations)) * 1e3 if durations else 0.0,
            # CPU time of the busiest scorer per iteration (load-independent: what the wall time
            # would be on otherwise idle cores, messaging aside)
            "median_cpu_ms_per_iteration": float(np.median(cpu)) if cpu else 0.0,
            "member_evals_per_s": done * pop / wall if done and wall > 0 else 0.0,
            "sha256": sha, "workers": opts.workers + opts.remote_workers, "population": pop,
            "resumed_from": resumed_from, "replicas_checked": len(digests)}
