"""Accumulation windows of a LoraModel in this process (Session), and the gradient checks of
`fucina finetune --verify-grads` (verify_grads) that run on it.

A training run is the `finetune` job on pipeline/runtime (pipeline/finetune/job.py), which computes the same
bits; a Session is the probes' and the benchmarks' loop: no checkpoints, no workers.
"""
from __future__ import annotations

import numpy as np

from pipeline.kernels import workpool
from pipeline.kernels.workpool import single_thread_blas
from pipeline.autograd.tensor import Tensor
from pipeline.errors import UserError

from .model import TARGETS, keep_freed_memory
from .schedule import lr_factor


class Session:
    """Accumulation windows in this process, for the probes of `--verify-grads` and the benchmarks (a
    training run is the `finetune` job on pipeline/runtime, which computes the same bits).

    A macro step is one accumulation window of `accum_steps` micro-batches:
    token-weighted normalisation (reduction='sum', scale 1/total_valid over
    the window), ONE clip, ONE optimizer step; backward passes accumulate the
    micro-batch gradients in window-index order.
    """

    def __init__(self, trainer, optimizer, samples, loader, accum_steps=1, clip=1.0, lr=1e-3, warmup=0,
                 decay="constant", total=0):
        if accum_steps < 1:
            raise UserError(f"accum_steps must be >= 1, got {accum_steps}")
        self.trainer, self.optimizer, self.samples, self.loader = trainer, optimizer, samples, loader
        self.accum_steps, self.clip, self.base_lr, self.warmup = int(accum_steps), clip, float(lr), int(warmup)
        self.decay, self.total = decay, int(total)
        keep_freed_memory()

    @property
    def macro_step(self):
        return self.trainer.step // self.accum_steps

    def lr_at(self, macro_step):
        """The job's schedule (schedule.lr_factor): a pure function of the MACRO step."""
        return self.base_lr * lr_factor(macro_step, self.warmup, self.total, self.decay)

    def window(self):
        """Run one accumulation window; returns (mean loss over its supervised tokens, tokens seen, supervised)."""
        idx = [self.loader.next() for _ in range(self.accum_steps)]
        total_valid = sum(self.samples[i].n_valid for i in idx)
        if total_valid == 0:
            raise UserError(f"window of samples {idx} has no supervised token")
        scale = 1.0 / total_valid
        first_step = self.trainer.step
        losses = []
        for i in idx:
            s = self.samples[i]
            # small GEMMs on one BLAS thread, big ones tile on our threads (pipeline/kernels/nn.py), which stay spinning
            with single_thread_blas(), workpool.hold():
                loss = self.trainer.loss(s.inputs, s.labels, reduction="sum", loss_scale=scale)
                loss.backward()
            losses.append(loss.item())
        self.optimizer.lr = self.lr_at(first_step // self.accum_steps)
        if self.clip:
            self.optimizer.clip_grad_norm(self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        window_loss = 0.0
        for v in losses:  # the sum of the scaled sums IS the window's mean CE
            window_loss += v
        return window_loss, sum(len(self.samples[i].inputs) for i in idx), total_valid


# --- gradient verification on a real model ----------------------------------------
def verify_grads(session, log, warmup_steps=3, taylor_lrs=(1e-4, 3e-4, 1e-3)):
    """The causal checks of `fucina finetune --verify-grads`; True when all pass.

    1. zero structure at init: B == 0 => dL/dA == 0 exactly while dL/dB != 0;
    2. frozen base: no base tensor holds a gradient, parameters are adapters only,
       and the loss is bitwise repeatable;
    3. grad-norm audit (after a few warm-up steps so B != 0): every adapter
       gradient finite and non-zero;
    4. first-order Taylor check: stepping against the gradient by lr lowers the
       loss by R * lr * |g|^2 with R in [0.7, 1.1] (for at least one lr whose
       predicted drop clears 3x the measured noise floor).
    """
    from pipeline.autograd.module import named_parameters as walk

    trainer, sample = session.trainer, session.samples[0]
    params = trainer.named_parameters()
    results = []

    def check(name, ok, detail):
        results.append(ok)
        log(f"  [{'PASS' if ok else 'FAIL'}] {name}: {detail}")

    def loss_and_grads():
        trainer.zero_grad()
        saved = trainer.step
        loss = trainer.loss(sample.inputs, sample.labels)
        loss.backward()
        trainer.step = saved  # probes do not advance the dropout stream
        return float(loss.item()), {n: p.grad.astype(np.float64) for n, p in params}

    log("verify-grads:")
    with_dropout, trainer.dropout = trainer.dropout, 0.0  # probes need a deterministic loss
    try:
        l0, grads = loss_and_grads()
        if all(not np.any(p.data) for n, p in params if n.endswith("lora_b")):
            a_zero = all(not np.any(g) for n, g in grads.items() if n.endswith("lora_a"))
            b_live = all(np.any(g) for n, g in grads.items() if n.endswith("lora_b"))
            check("zero structure at init", a_zero and b_live, f"B == 0: every dL/dA == 0: {a_zero}; every dL/dB != "
                                                               f"0: {b_live}")
        else:
            log("  [SKIP] zero structure at init: the adapters were loaded with B != 0")

        base = walk(trainer.model, trainable_only=False)  # the norm vectors; projections are not even Tensors
        no_base_grad = all(t.grad is None for _, t in base)
        frozen = [layer[t] for layer in trainer._layers for t in TARGETS]
        constants = all(not isinstance(f.weight, Tensor) for f in frozen)
        only_adapters = all(n.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for n, _ in params)
        l_again, _ = loss_and_grads()
        check("frozen base", no_base_grad and constants and only_adapters and l_again == l0,
              f"{len(frozen)} projections are constants: {constants}; {len(base)} base tensors hold no gradient: "
              f"{no_base_grad}; parameters are adapters only: {only_adapters}; repeated loss bitwise equal: "
              f"{l_again == l0}")

        for _ in range(warmup_steps):
            session.window()
        l0, grads = loss_and_grads()
        norms = np.array([np.linalg.norm(g) for g in grads.values()])
        finite = bool(np.all(np.isfinite(norms)))
        check("grad-norm audit", finite and bool(np.all(norms > 0)),
              f"{len(norms)} adapter gradients after {warmup_steps} warm-up steps: min {norms.min():.3g} / "
              f"median {np.median(norms):.3g} / max {norms.max():.3g}; finite: {finite}")

        g2 = sum(float((g * g).sum()) for g in grads.values())
        originals = {n: p.data.copy() for n, p in params}
        rng = np.random.default_rng(0)
        for n, p in params:  # the noise floor: how much a tiny random nudge moves the f32 loss
            p.data += (1e-7 * rng.standard_normal(p.shape)).astype(np.float32)
        floor = abs(loss_and_grads()[0] - l0)
        for n, p in params:
            p.data[...] = originals[n]
        verdicts = []
        for lr in taylor_lrs:
            for n, p in params:
                p.data[...] = originals[n] - (lr * grads[n]).astype(np.float32)
            l1 = loss_and_grads()[0]
            predicted = lr * g2
            ratio = (l0 - l1) / predicted
            verdicts.append((lr, ratio, predicted > 3 * max(floor, 1e-7 * abs(l0))))
        for n, p in params:
            p.data[...] = originals[n]
        judged = [(lr, r) for lr, r, clear in verdicts if clear]
        ok = any(0.7 <= r <= 1.1 for _, r in judged)
        check("first-order Taylor", ok, "R = (L0 - L1) / (lr |g|^2): " + ", ".join(
            f"lr {lr:g}: R {r:.3f}{'' if clear else ' (below noise floor)'}" for lr, r, clear in verdicts))
        trainer.zero_grad()
    finally:
        trainer.dropout = with_dropout
    ok = all(results)
    log(f"verify-grads: {'all checks passed' if ok else 'FAILED'}")
    return ok
