"""`finetune`: LoRA fine-tuning of a frozen GGUF model (any registered architecture, quantized or not).

Data: pipeline.llm.data (instruction pairs, alpaca, `messages` or ShareGPT records, auto-detected; no
--data: the built-in pirate pairs), rendered by the model's chat template, labels only on the assistant
turns. One micro-batch is one sample (or, --pack, one window of them); step s of the run takes samples
s*B .. s*B+B-1 (B = --batch-size) of the Loader's order (sequential, or Fisher-Yates per epoch seeded by
data_seed), exactly as `fucina finetune` always did. Loss: summed cross-entropy of the micro-batch scaled
by 1/(supervised tokens of the whole step), so the in-order sum of micro-batch gradients is the gradient
of the step's token-weighted mean.

Model: the frozen GGUF memory-mapped read-only in every process (the OS shares its pages), its weights
constants of the graph; the parameters are the adapters only (`layers.<i>.<target>.lora_{a,b}`, pure in
the seed). Optimizer: AdamW by default (any of adam, lion, sgd, muon), linear warm-up then a constant,
linear or cosine LR (--decay), global clipping. Checkpoints: adapters.safetensors, optimizer.safetensors,
trainer_state.json (last); at the end the final checkpoint is also committed at the run dir itself.

Trade-off: one sample per micro-batch in a slot sized for the longest sample (with its length), so a
short sample moves a few padding bytes but never computes on them. --pack instead puts a step's samples
into windows of seq_max tokens (first fit in order; attention block-diagonal and positions restarting per
sample, so the loss and gradients are the samples' own): fewer, taller products. The runtime needs one
micro-batch count for every step, so a packed run has as many as the data can ever need (_window_bound)
and a step that needs fewer leaves the rest empty (no compute, zero gradients).
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from ..errors import UserError
from ..jobs.base import Job, bind_module, zero_copy_grads
from ..llm import data as sft
from .build import load_records, lora_model, open_text, split_records
from .spec import DEFAULT_STEPS, FinetuneSpec, default_lr


class Finetune(Job):
    name = "finetune"
    Spec = FinetuneSpec
    adapters_only = True

    def __init__(self, spec):
        super().__init__(spec)
        if not os.path.isfile(spec.model):
            raise UserError(f"--model {spec.model}: no such file")
        self.text = text = open_text(spec.model, spec.chat_template, spec.seq_max)
        self.gguf, self.tokenizer, self.encoder, self.template = text.gguf, text.tokenizer, text.encoder, text.template
        self.options = text.options
        if not spec.lr:  # resolved once, recorded in the checkpoint's spec: a resumed run keeps it
            self.spec = spec = dataclasses.replace(spec, lr=default_lr(self.gguf))
        self.pairs, source, _ = load_records(spec)
        val_records, val_source = [], spec.val_data
        if spec.val_data:
            val_records = load_records(dataclasses.replace(spec, data=spec.val_data), "--val-data")[0]
        elif spec.val_split:
            self.pairs, val_records = split_records(self.pairs, spec.val_split, spec.seed, source)
            val_source = source
        self.samples = sft.encode_all(self.encoder, self.template, self.pairs, self.options, source=source)
        self.val_samples = (sft.encode_all(self.encoder, self.template, val_records, self.options, source=val_source)
                            if val_records else [])
        self.last_val = None  # the latest validation loss: what after_step's --keep best compares
        self.restore_progress(None)
        if self.val_samples and not spec.eval_every:  # a validation set is measured every 10 steps by default
            self.spec = spec = dataclasses.replace(spec, eval_every=10)
        self.longest = max(len(s.inputs) for s in self.samples)
        self._steps = spec.steps or (math.ceil(spec.epochs * len(self.samples) / spec.batch_size) if spec.epochs
                                     else DEFAULT_STEPS)
        self._trainer = None
        self._order = (None, None)  # (epoch, its permutation): the Loader's order, one epoch cached
        self._windows = (None, None)  # (step, its packed windows): --pack's plan of one step, cached
        self._pack_slots = self._window_bound() if spec.pack else 0

    # --- the model -------------------------------------------------------------------
    def trainer(self):
        """This process's LoraModel over the memory-mapped GGUF (built once, rebound by bind)."""
        if self._trainer is None:
            s = self.spec
            self._trainer = lora_model(self.gguf, s, alpha=s.alpha, dropout=s.dropout,
                                       checkpoint_layers=s.checkpoint_layers)
        return self._trainer

    def init_params(self):
        return list(self.trainer().adapter_tensors().items())

    def bind(self, params):
        return bind_module(self.trainer(), params)

    def checkpoint_config(self):
        from .model import lora_config
        early = {"early_stop": dict(self.early)} if self.spec.patience else {}
        return {"lora": lora_config(self.trainer()), "model": self.spec.model, **early}

    # --- --patience: the early stop's counters travel in the checkpoint, so a resumed run stops where one
    # --- uninterrupted run stops (the validation losses are the same bits in-process and on N trainers)
    def restore_progress(self, config):
        stored = (config or {}).get("early_stop")
        self.early = dict(stored) if isinstance(stored, dict) else {"step": 0, "best": None, "since": 0}

    def stopped(self):
        return bool(self.spec.patience) and self.early["since"] >= self.spec.patience

    def _observe(self, step):
        """Count the evaluations in a row without a lower validation loss (once per step: a replay is a no-op)."""
        e = self.early
        if step <= e["step"]:
            return
        e["step"] = step
        if e["best"] is None or self.last_val < e["best"]:
            e["best"], e["since"] = self.last_val, 0
        else:
            e["since"] += 1

    def make_optimizer(self, named):
        from .. import optim
        s = self.spec
        if s.optimizer == "adamw":  # what `fucina finetune` always used
            return optim.AdamW(named, lr=s.lr, weight_decay=0.0, state_dtype=s.state_dtype)
        if s.optimizer == "adam":
            return optim.Adam(named, lr=s.lr)
        if s.optimizer == "lion":
            return optim.Lion(named, lr=s.lr, state_dtype=s.state_dtype)
        if s.optimizer == "sgd":
            return optim.SGD(named, lr=s.lr, momentum=0.9)
        return optim.Muon(named, lr=s.lr)  # every adapter factor is a matrix

    def lr_factor(self, step):
        """Linear warm-up then constant, linear or cosine decay to 0 at the run's last step: a pure function of
        the optimizer step and the run's length (schedule.lr_factor)."""
        from .schedule import lr_factor
        return lr_factor(step, self.spec.warmup, self.steps, self.spec.decay)

    def schedule_fields(self):
        return {"name": f"warmup_{self.spec.decay}", "lr": self.spec.lr, "warmup": self.spec.warmup,
                "decay": self.spec.decay}

    @property
    def steps(self):
        """--steps, or --epochs' worth: ceil(E * training samples / batch size), the last batch topped up from
        the next epoch's order (the Loader's stream runs on across epochs)."""
        return self._steps

    @property
    def micro_batches(self):
        """One sample per micro-batch; with --pack, the windows a step can need at most (_window_bound)."""
        return self._pack_slots or self.spec.batch_size

    def _window_bound(self):
        """The most windows of seq_max tokens a step's samples can fill, from the data alone (a resumed run must
        find the same count): first fit leaves any two windows together over seq_max tokens, so k windows hold
        over floor(k / 2) * seq_max tokens, at most S, the sum of the B longest lengths a step can draw (a sample
        recurs up to ceil(B / n) + 1 times in a step that straddles epochs)."""
        b, cap = self.spec.batch_size, self.spec.seq_max
        lengths = [len(s.inputs) for s in self.samples]
        top = sorted(lengths * (-(-b // len(lengths)) + 1), reverse=True)[:b]
        return max(1, min(b, 2 * -(-sum(top) // cap) - 1))

    def windows(self, step):
        """--pack: the step's samples in windows of at most seq_max tokens (model.pack_windows: first fit in the
        Loader's order), as lists of samples; pure in (data seed, step)."""
        from .model import pack_windows
        if self._windows[0] != step:
            samples = self.window(step)
            plan = pack_windows([len(s.inputs) for s in samples], self.spec.seq_max)
            if len(plan) > self._pack_slots:
                raise RuntimeError(f"step {step}: {len(plan)} windows over the bound {self._pack_slots}")
            self._windows = (step, [[samples[i] for i in w] for w in plan])
        return self._windows[1]

    # --- data ------------------------------------------------------------------------
    def rows_per_step(self):
        return self.spec.batch_size

    def rows_per_micro(self):
        return 1

    def tokens_per_row(self):
        return float(np.mean([len(s.inputs) for s in self.samples]))

    def flops_per_token(self):
        """A LoRA step's FLOPs per token: the frozen base's forward (2N) and the backward through it to the
        inputs (2N; no weight gradients), 2N more with --checkpoint-layers (the recompute), plus 6 per adapter
        parameter; N = the GGUF's matrix elements (token_embd counted only as a tied head)."""
        gg = self.gguf
        dims = {n: gg.tensor_dims(n) for n in gg.tensor_names}
        matrices = [n for n, d in dims.items() if len(d) == 2]
        tied = "output.weight" not in dims
        base = sum(int(np.prod(dims[n])) for n in matrices if n != "token_embd.weight" or tied)
        lora = sum(int(np.prod(shape)) for _, shape, _ in self.param_layout())
        return (6.0 if self.spec.checkpoint_layers else 4.0) * base + 6.0 * lora

    def sample_of(self, i):
        """The dataset index of global micro-batch i in the Loader's order (pure in (data seed, i))."""
        n = len(self.samples)
        if not self.spec.shuffle:
            return i % n
        if self._order[0] != i // n:
            seed = self.spec.seed if self.spec.data_seed < 0 else self.spec.data_seed
            self._order = (i // n, sft.epoch_permutation(n, seed, i // n))
        return self._order[1][i % n]

    def window(self, step):
        first = step * self.spec.batch_size
        return [self.samples[self.sample_of(i)] for i in range(first, first + self.spec.batch_size)]

    def supervised_tokens(self, step):
        return sum(s.n_valid for s in self.window(step))

    def batch_layout(self):
        t = self.spec.seq_max if self.spec.pack else self.longest
        packed = [("segments", (t,), np.int64)] if self.spec.pack else []
        return [("inputs", (t,), np.int64), ("labels", (t,), np.int64), *packed, ("length", (1,), np.int64),
                ("micro", (1,), np.int64), ("scale", (1,), np.float64)]

    def fill_batch(self, step, k, out):
        if self.spec.pack:  # window k of the step's packed samples; a step that needs fewer leaves the rest empty
            from .model import packed
            windows = self.windows(step)
            inputs, labels, segments = packed(windows[k]) if k < len(windows) else ((), (), ())
            out["segments"][:len(segments)], out["segments"][len(segments):] = segments, len(segments)
        else:
            s = self.window(step)[k]
            inputs, labels = s.inputs, s.labels
        n = len(inputs)
        out["inputs"][:n], out["labels"][:n] = inputs, labels
        out["inputs"][n:], out["labels"][n:] = 0, sft.IGNORE_INDEX
        # the step's supervised tokens are > 0: encode_all refuses a sample without one
        out["length"][0], out["micro"][0] = n, step * self.spec.batch_size + k
        out["scale"][0] = 1.0 / self.supervised_tokens(step)

    # --- compute ---------------------------------------------------------------------
    def micro_grad(self, model, batch, grads):
        from pipeline.kernels.workpool import hold, single_thread_blas
        n = int(batch["length"][0])
        model.step = int(batch["micro"][0])  # the dropout stream of micro-batch (step, k)
        if n == 0:  # an empty --pack window: no sample, no gradient
            zero_copy_grads(model, grads)
            return 0.0, 0
        segments = batch["segments"][:n] if self.spec.pack else None
        with single_thread_blas(), hold():  # small GEMMs on one BLAS thread; big ones tile on our (spinning) threads
            loss = model.loss(batch["inputs"][:n], batch["labels"][:n], reduction="sum",
                              loss_scale=float(batch["scale"][0]), segments=segments)
            loss.backward()
        zero_copy_grads(model, grads)
        return loss.item(), 1

    # --- validation ------------------------------------------------------------------
    eval_name = "val_loss"

    def validate(self, model):
        """Mean cross-entropy over the validation samples' supervised tokens (token-weighted, dropout off, the
        training forward's f32 numerics). It reads the parameters only and leaves the dropout counter alone, so
        the training bits do not depend on it."""
        if not self.val_samples:
            return None
        from pipeline.kernels.workpool import hold, single_thread_blas
        total, tokens = 0.0, 0
        with single_thread_blas(), hold():
            for s in self.val_samples:
                loss = model.head_loss(model.hidden(s.inputs, None), s.labels, reduction="sum")
                total += float(loss.item())
                tokens += s.n_valid
        value = total / tokens
        self.last_val = value
        return value

    def after_step(self, step, model, run_dir):
        """--keep best: when this step's validation loss is the lowest so far, its adapters (and a sentinel that
        export-gguf and --lora read) go to RUN_DIR/best. Idempotent: a replayed step compares with what is there."""
        if self.last_val is None or not self._eval_due(step):
            return
        self._observe(step)
        if self.spec.keep != "best":
            return
        import json

        from ..runtime.ckpt import trainer_state
        from ..train.state_dict import atomic_write_bytes, save_state_dict
        best = os.path.join(run_dir, "best")
        record = os.path.join(best, "best.json")
        if os.path.isfile(record):
            with open(record) as fh:
                prev = json.load(fh)
            if prev["step"] != step and not self.last_val < prev["val_loss"]:
                return
        os.makedirs(best, exist_ok=True)
        sentinel = os.path.join(best, "trainer_state.json")
        if os.path.exists(sentinel):
            os.remove(sentinel)  # uncommitted while the adapters change
        save_state_dict(os.path.join(best, "adapters.safetensors"),
                        [(n, np.array(p.data, copy=True)) for n, p in model.named_parameters()])
        atomic_write_bytes(record, json.dumps({"step": step, "val_loss": self.last_val}).encode())
        atomic_write_bytes(sentinel, trainer_state(self, step).to_json().encode())

    def _eval_due(self, step):
        every = self.spec.eval_every
        return every > 0 and (step % every == 0 or step == self.steps)

    # --- answers and the end of a run ------------------------------------------------
    def prompt(self):
        return self.spec.prompt or self.pairs[0].instruction

    def answer(self, trainer):
        """The greedy answer of `trainer` to the held prompt."""
        ids = sft.encode_prompt(self.encoder, self.template, self.prompt(), self.options)
        return self.tokenizer.decode(trainer.generate(ids, self.spec.max_new_tokens, stop_ids=self.template.stop_ids))

    def finish(self, run_dir, params, log=print):
        """Commit the final checkpoint at the run dir itself. The AFTER answer is the command's: greedy decoding
        without a KV cache can outlast the workers' patience for the scheduler's heartbeats, which finish holds."""
        from .model import adapters_sha256
        from ..runtime import ckpt
        trainer = self.bind(list(params.items()))
        ckpt.publish(ckpt.checkpoint_dir(run_dir, self.end_step or self.steps), run_dir)
        log(f"finetune: the final checkpoint is also at {os.path.abspath(run_dir)}")
        return {"adapters_sha256": adapters_sha256(trainer)}


JOB = Finetune
