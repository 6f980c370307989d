"""`--inprocess`: every role's task executed inline, in plan order, in one process.

This is the reference the multiprocess run must match bit for bit: the same
LoaderLogic/TrainerLogic/OptimizerLogic calls on the same (step, k) keys,
micro-batch gradients reduced in index order, checkpoints written synchronously.
Trade-off: no overlap between loading, compute and checkpoint I/O - simple and
the fastest option for tiny jobs where messaging would dominate.
"""
from __future__ import annotations

import os
import time

import numpy as np

from . import ckpt
from .metrics import MetricsLog, gflop_rate
from .roles import (LoaderLogic, NonFiniteError, OptimizerLogic, TrainerLogic, checkpoint_dir, checkpoint_due,
                    eval_due, first_nonfinite, nonfinite_message, trainer_state)


def _buffers(layout):
    return {name: np.zeros(shape, dtype=dtype) for name, shape, dtype in layout}


def run_inprocess(job, run_dir, resume=None, log=print, on_step=None):
    """Train `job` to its last step; -> summary dict (steps, final_loss, params_sha256, ...)."""
    os.makedirs(run_dir, exist_ok=True)
    params = _buffers(job.param_layout())
    optimizer = OptimizerLogic(job, params)
    start = optimizer.init(ckpt.resolve(resume) if resume else None)
    trainer, loader = TrainerLogic(job, params), LoaderLogic(job)
    batch = _buffers(job.batch_layout())
    slots = [_buffers(job.param_layout()) for _ in range(job.micro_batches)]
    metrics = MetricsLog(run_dir, getattr(job.spec, "tensorboard", ""))
    metrics.rewind(start)  # a resume into the same run dir records the replayed steps once
    metrics.write({"kind": "event", "event": "run_started", "detail": {"mode": "inprocess", "start_step": start}})
    loss, t_run = None, time.perf_counter()
    policy, skipped_total = getattr(job.spec, "on_nonfinite", "stop"), 0
    try:
        end = start if job.stopped() else job.steps  # a resumed run that had stopped early goes no further
        for step in range(start, end):
            t0 = time.perf_counter()
            loss, skip = 0.0, []
            for k in range(job.micro_batches):
                loader.fill(step, k, batch)
                micro_loss, _ = trainer.compute(batch, slots[k])
                bad = first_nonfinite(micro_loss, slots[k])
                if bad is not None:  # never applied: stop, or leave this micro-batch out of the step
                    if policy != "skip":
                        raise NonFiniteError(nonfinite_message(step, k, "inprocess", bad, run_dir))
                    skip.append(k)
                    metrics.write({"kind": "event", "event": "nonfinite_skipped", "step": step + 1,
                                   "detail": {"k": k, "worker": "inprocess", "tensor": bad}})
                    continue
                loss += micro_loss
            skipped_total += len(skip)
            info = optimizer.step(step, slots, skip=skip)
            done = step + 1
            if len(skip) == job.micro_batches:
                loss = None
            step_s = time.perf_counter() - t0
            tokens_per_s = job.rows_per_step() * job.tokens_per_row() / max(step_s, 1e-9)
            record = {"kind": "metrics", "step": done, "loss": loss, **info, **({"skipped": skip} if skip else {}),
                      "step_ms": step_s * 1e3, "tokens_per_s": tokens_per_s}
            gflops = gflop_rate(job, tokens_per_s)
            if gflops is not None:
                record["gflop_per_s"] = gflops
            if eval_due(job, done):
                record["eval"], record["eval_name"] = optimizer.evaluate(), job.eval_name
            optimizer.after_step(done, run_dir)
            metrics.write(record)
            on_step and on_step(record)
            stop = job.stopped()
            if checkpoint_due(job, done) or stop:
                p, skeleton, tensors = optimizer.snapshot()
                path = ckpt.write_checkpoint(checkpoint_dir(run_dir, done), p, skeleton, tensors,
                                             trainer_state(job, done), adapters=job.adapters_only)
                metrics.write({"kind": "event", "event": "checkpoint_committed",
                               "detail": {"path": path, "step": done}})
            if stop:
                end = done
                break
        if end < job.steps:
            job.end_step = end
            metrics.write({"kind": "event", "event": "early_stop", "step": end, "detail": {"step": end}})
        final = {n: a for n, a in params.items()}
        extras = job.finish(run_dir, final, log=log)
        summary = {"job": job.name, "mode": "inprocess", "steps": end, "start_step": start,
                   "final_loss": loss, "params_sha256": ckpt.params_sha256(final),
                   "checkpoint": ckpt.latest_checkpoint(run_dir), "run_dir": run_dir,
                   "elapsed_s": round(time.perf_counter() - t_run, 3), **extras,
                   **({"nonfinite_skipped": skipped_total} if skipped_total else {})}
        metrics.write({"kind": "event", "event": "run_finished", "detail": summary})
        return summary
    finally:
        metrics.close()
