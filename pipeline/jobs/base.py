"""What a job gives the pipeline: pure functions keyed by (step, micro-batch).

The roles never know what model they train. A job supplies:

  init_params()            -> [(name, float32 array)]       (pure in the seed)
  batch_layout()           -> [(name, shape, dtype)]        (one micro-batch)
  fill_batch(step, k, out)  writes micro-batch (step, k) into `out` arrays
                            (pure in (seed, step, k): the data-order contract)
  bind(params)             -> a model whose parameters view `params` in place
  micro_grad(model, batch, grads) -> (loss, rows): forward+backward, gradients
                            written into `grads`; the loss is pre-scaled by
                            1/rows_per_step, so the in-order SUM of micro-batch
                            gradients is the gradient of the step's mean loss
  make_optimizer(named)    -> a pipeline.optim optimizer (or OptimizerSet) over them
  lr_factor(step)          -> float multiplier of the base lr (pure in the step)
  schedule_fields()        -> dict recorded in the checkpoint sentinel
  validate(model)          -> float or None (run by the optimizer every eval_every)
  after_step(step, model, run_dir)  run by the optimizer on the parameters of
                            version `step` (e.g. the pretrain time-lapse); must
                            be idempotent: a replayed step runs it again
  finish(run_dir, params)  -> dict of extras for the summary (sample, exports)
  checkpoint_config()      -> dict merged into the sentinel's config (what exports read back)
  restore_progress(config)  the job's own progress from a checkpoint's config (None: a fresh run), e.g.
                            the early-stop counters; run by the optimizer's init
  stopped()                -> True once the job wants no more steps (an early stop): the optimizer
                            checks it after each step; the run ends there, that step checkpointed
  adapters_only            True: the weights file is adapters.safetensors (a LoRA job)

Trade-off: jobs hand over flat named arrays rather than a model object, so the
same bytes can live in a numpy array (in-process) or a shared-memory segment.
"""
from __future__ import annotations

import numpy as np

from ..autograd.tensor import Tensor


class Job:
    name = "job"
    Spec = None
    eval_name = "eval"  # what validate() measures, for plots and the live view
    adapters_only = False  # True names the checkpoint's weights adapters.safetensors
    end_step = None  # the step the run ended at when it stopped early (set by the runtime before finish)

    def __init__(self, spec):
        self.spec = spec

    # the fields every spec has
    @property
    def steps(self):
        return self.spec.steps

    @property
    def micro_batches(self):
        return self.spec.micro_batches

    def rows_per_step(self):
        return self.spec.batch

    def rows_per_micro(self):
        return self.spec.batch // self.spec.micro_batches

    def tokens_per_row(self):
        return 1

    def flops_per_token(self):
        """Estimated training FLOPs per token (row) of a step, for the progress line's share of the machine's peak
        and the `gflop_per_s` of metrics.jsonl: the 6N rule (forward 2N, backward 2N for the inputs and 2N for the
        weights), N = every matrix parameter (a tied embedding counted once, as the head; attention's own
        products, a few percent at these sequence lengths, left out). None: no estimate."""
        return 6.0 * sum(int(np.prod(shape)) for _, shape, _ in self.param_layout() if len(shape) == 2)

    def param_layout(self):
        if getattr(self, "_layout", None) is None:
            self._layout = [(n, a.shape, a.dtype) for n, a in self.init_params()]
        return self._layout

    def validate(self, model):
        return None

    def after_step(self, step, model, run_dir):
        pass

    def finish(self, run_dir, params, log=print):
        return {}

    def checkpoint_config(self):
        return {}

    def restore_progress(self, config):
        pass

    def stopped(self):
        return False


def bind_module(model, params):
    """Point every trainable Tensor of `model` at the array of the same name (no copy)."""
    params = dict(params)
    named = model.named_parameters()
    missing = [n for n, _ in named if n not in params]
    if missing or len(named) != len(params):
        raise ValueError(f"bind: model parameters {[n for n, _ in named]} do not match arrays {list(params)}")
    for name, t in named:
        if params[name].shape != t.data.shape:
            raise ValueError(f"bind: {name!r} is {t.data.shape} in the model, {params[name].shape} in the arrays")
        t.data = params[name]
    return model


def bind_tensors(named_arrays):
    """{name: array} -> [(name, Tensor)] whose .data IS the array (no copy)."""
    out = []
    for name, arr in named_arrays:
        t = Tensor.__new__(Tensor)
        Tensor.__init__(t, np.empty(0, np.float32), requires_grad=True, name=name)
        t.data = arr
        out.append((name, t))
    return out


def zero_copy_grads(model, grads: dict):
    """Move each parameter's .grad into `grads[name]` (zeros where no gradient reached)."""
    named = model.named_parameters() if hasattr(model, "named_parameters") else model
    for name, t in named:
        if t.grad is None:
            grads[name][...] = 0
        else:
            grads[name][...] = t.grad
        t.grad = None
