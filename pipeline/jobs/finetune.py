"""`finetune`: LoRA fine-tuning of a frozen GGUF model (any registered architecture, quantized or not).

Data: pipeline.llm.data (instruction pairs, alpaca, `messages` or ShareGPT records, auto-detected; no
--data: the built-in pirate pairs), rendered by the model's chat template, labels only on the assistant
turns. One micro-batch is one sample; step s of the run takes samples s*M .. s*M+M-1 of the Loader's
order (sequential, or Fisher-Yates per epoch seeded by data_seed), exactly as `fucina finetune` always
did. Loss: summed cross-entropy of the micro-batch scaled by 1/(supervised tokens of the whole step),
so the in-order sum of micro-batch gradients is the gradient of the step's token-weighted mean.

Model: the frozen GGUF memory-mapped read-only in every process (the OS shares its pages), its weights
constants of the graph; the parameters are the adapters only (`layers.<i>.<target>.lora_{a,b}`, pure in
the seed). Optimizer: AdamW by default (any of adam, lion, sgd, muon), linear warm-up then constant LR,
global clipping. Checkpoints: adapters.safetensors, optimizer.safetensors, trainer_state.json (last);
at the end the final checkpoint is also committed at the run dir itself.

Trade-off: one sample per micro-batch in a slot sized for the longest sample (with its length), so a
short sample moves a few padding bytes but never computes on them.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..errors import UserError
from ..llm import data as sft
from .base import Job, bind_module, zero_copy_grads
from .spec import field, on_nonfinite_field

OPTIMIZERS = ("adamw", "adam", "lion", "sgd", "muon")


@dataclasses.dataclass
class FinetuneSpec:
    model: str = field("", "the frozen GGUF model (llama, qwen2, qwen3 or gemma3; any quant type)")
    data: str = field("", "JSONL samples (empty: the built-in pirate pairs)")
    format: str = field("auto", "the JSONL format", choices=("auto",) + sft.FORMATS)
    instruction_key: str = field("instruction", "JSONL key holding the instruction (pairs)")
    response_key: str = field("response", "JSONL key holding the response (pairs)")
    max_record_bytes: int = field(sft.MAX_RECORD_BYTES, "refuse a JSONL line over this many bytes")
    chat_template: str = field("", "a chat template name or Jinja file (empty: the model's own)")
    steps: int = field(30, "optimizer steps in total (a resumed run continues to it)")
    micro_batches: int = field(5, "samples per optimizer step (= --accum-steps), token-weighted")
    seq_max: int = field(256, "truncate samples to this many input tokens")
    shuffle: bool = field(False, "shuffled sample order (Fisher-Yates per epoch, seeded by data_seed)")
    seed: int = field(42, "seed of the adapter init and dropout streams")
    data_seed: int = field(-1, "seed of the shuffled order (-1: seed)")
    on_nonfinite: str = on_nonfinite_field()
    rank: int = field(8, "LoRA rank r")
    alpha: float = field(16.0, "LoRA alpha (the delta is scaled by alpha/rank)")
    targets: str = field("q,k,v,o,gate,up,down", "comma-separated projections to adapt (q,k,v,o,gate,up,down)")
    dropout: float = field(0.0, "LoRA dropout probability on the adapter input, in [0, 1)")
    checkpoint_layers: bool = field(False, "recompute each layer in backward (less memory, same bits)")
    optimizer: str = field("adamw", "the optimizer of the adapters", choices=OPTIMIZERS)
    lr: float = field(0.0, "peak learning rate (0: by the model's width: 1e-2 below hidden 512, 2e-4 on a "
                           "real model)")
    warmup: int = field(0, "linear learning-rate warm-up over this many optimizer steps")
    clip: float = field(1.0, "global gradient-norm clip, once per step (0: off)")
    state_dtype: str = field("f32", "dtype of the AdamW/Lion moments", choices=("f32", "bf16"))
    checkpoint_every: int = field(0, "also checkpoint every N steps (0: only the final step)")
    val_data: str = field("", "JSONL held-out samples for the validation loss (same formats as data)")
    val_split: float = field(0.0, "hold out this fraction of the data's records (whole documents, chosen by the "
                                  "seed) for the validation loss; 0: none")
    eval_every: int = field(0, "validation loss every N optimizer steps and at the last (0: off; with val_data or "
                               "val_split: 10)")
    keep: str = field("last", "best: also keep the adapters of the lowest validation loss in RUN_DIR/best",
                      choices=("last", "best"))
    prompt: str = field("", "held prompt of the BEFORE/AFTER answers (empty: the first training instruction)")
    max_new_tokens: int = field(48, "length of the BEFORE/AFTER greedy answers in tokens")

    def validate(self):
        if not self.model:
            raise UserError("finetune: --model (a GGUF file) is required")
        for name in ("steps", "micro_batches", "seq_max", "rank", "max_record_bytes"):
            if getattr(self, name) < 1:
                raise UserError(f"finetune: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "checkpoint_every", "max_new_tokens"):
            if getattr(self, name) < 0:
                raise UserError(f"finetune: {name} must be >= 0, got {getattr(self, name)}")
        if not self.lr >= 0:
            raise UserError(f"finetune: lr must be positive (or 0: by the model's width), got {self.lr}")
        if not 0.0 <= self.val_split < 1.0:
            raise UserError(f"finetune: val_split must be in [0, 1), got {self.val_split}")
        if self.val_split and self.val_data:
            raise UserError("finetune: give val_data or val_split, not both")
        if self.eval_every < 0:
            raise UserError(f"finetune: eval_every must be >= 0, got {self.eval_every}")
        if self.keep == "best" and not (self.val_data or self.val_split):
            raise UserError("finetune: keep = best needs a validation set (val_data or val_split)")

    def target_tuple(self):
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())


class Finetune(Job):
    name = "finetune"
    Spec = FinetuneSpec
    adapters_only = True

    def __init__(self, spec):
        super().__init__(spec)
        from ..llm.chat import ChatTemplate
        from ..llm.gguf import open_gguf
        from ..llm.tokenizer import load_tokenizer
        if not os.path.isfile(spec.model):
            raise UserError(f"--model {spec.model}: no such file")
        if spec.data and not os.path.isfile(spec.data):
            raise UserError(f"--data {spec.data}: no such file")
        self.gguf = open_gguf(spec.model)
        if not spec.lr:  # resolved once, recorded in the checkpoint's spec: a resumed run keeps it
            self.spec = spec = dataclasses.replace(spec, lr=default_lr(self.gguf))
        self.tokenizer = load_tokenizer(self.gguf)
        self.encoder = sft.RawEncoder(self.tokenizer)
        self.template = ChatTemplate.from_gguf(self.gguf, spec.chat_template or None)
        if spec.data:
            self.pairs, source = sft.load_jsonl(spec.data, spec.instruction_key, spec.response_key,
                                                format=spec.format, max_record_bytes=spec.max_record_bytes), spec.data
        else:
            self.pairs, source = list(sft.PIRATE_PAIRS), "pirate pair"
        self.options = sft.EncodeOptions(seq_max=spec.seq_max)
        val_records, val_source = [], spec.val_data
        if spec.val_data:
            if not os.path.isfile(spec.val_data):
                raise UserError(f"--val-data {spec.val_data}: no such file")
            val_records = sft.load_jsonl(spec.val_data, spec.instruction_key, spec.response_key, format=spec.format,
                                         max_record_bytes=spec.max_record_bytes)
        elif spec.val_split:
            self.pairs, val_records = split_records(self.pairs, spec.val_split, spec.seed, source)
            val_source = source
        self.samples = sft.encode_all(self.encoder, self.template, self.pairs, self.options, source=source)
        self.val_samples = (sft.encode_all(self.encoder, self.template, val_records, self.options, source=val_source)
                            if val_records else [])
        self.last_val = None  # the latest validation loss: what after_step's --keep best compares
        if self.val_samples and not spec.eval_every:  # a validation set is measured every 10 steps by default
            self.spec = spec = dataclasses.replace(spec, eval_every=10)
        self.longest = max(len(s.inputs) for s in self.samples)
        self._trainer = None
        self._order = (None, None)  # (epoch, its permutation): the Loader's order, one epoch cached

    # --- the model -------------------------------------------------------------------
    def trainer(self):
        """This process's LoraModel over the memory-mapped GGUF (built once, rebound by bind)."""
        if self._trainer is None:
            from ..llm.finetune import LoraModel, keep_freed_memory
            from ..models.registry import load_model
            keep_freed_memory()
            s = self.spec
            self._trainer = LoraModel(load_model(self.gguf), targets=s.target_tuple(), rank=s.rank, alpha=s.alpha,
                                    dropout=s.dropout, seed=s.seed, checkpoint_layers=s.checkpoint_layers)
        return self._trainer

    def init_params(self):
        return list(self.trainer().adapter_tensors().items())

    def bind(self, params):
        return bind_module(self.trainer(), params)

    def checkpoint_config(self):
        from ..llm.finetune import lora_config
        return {"lora": lora_config(self.trainer()), "model": self.spec.model}

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
        """Linear warm-up then constant: a pure function of the optimizer step (llm/finetune.lr_factor)."""
        from ..llm.finetune import lr_factor
        return lr_factor(step, self.spec.warmup)

    def schedule_fields(self):
        return {"name": "warmup_constant", "lr": self.spec.lr, "warmup": self.spec.warmup}

    # --- data ------------------------------------------------------------------------
    def rows_per_step(self):
        return self.spec.micro_batches

    def rows_per_micro(self):
        return 1

    def tokens_per_row(self):
        return float(np.mean([len(s.inputs) for s in self.samples]))

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
        first = step * self.spec.micro_batches
        return [self.samples[self.sample_of(i)] for i in range(first, first + self.spec.micro_batches)]

    def supervised_tokens(self, step):
        return sum(s.n_valid for s in self.window(step))

    def batch_layout(self):
        t = self.longest
        return [("inputs", (t,), np.int64), ("labels", (t,), np.int64), ("length", (1,), np.int64),
                ("micro", (1,), np.int64), ("scale", (1,), np.float64)]

    def fill_batch(self, step, k, out):
        s = self.window(step)[k]
        n = len(s.inputs)
        out["inputs"][:n], out["labels"][:n] = s.inputs, s.labels
        out["inputs"][n:], out["labels"][n:] = 0, sft.IGNORE_INDEX
        # the step's supervised tokens are > 0: encode_all refuses a sample without one
        out["length"][0], out["micro"][0] = n, step * self.spec.micro_batches + k
        out["scale"][0] = 1.0 / self.supervised_tokens(step)

    # --- compute ---------------------------------------------------------------------
    def micro_grad(self, model, batch, grads):
        from kernels.workpool import hold, single_thread_blas
        n = int(batch["length"][0])
        model.step = int(batch["micro"][0])  # the dropout stream of micro-batch (step, k)
        with single_thread_blas(), hold():  # small GEMMs on one BLAS thread; big ones tile on our (spinning) threads
            loss = model.loss(batch["inputs"][:n], batch["labels"][:n], reduction="sum",
                              loss_scale=float(batch["scale"][0]))
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
        from kernels.workpool import hold, single_thread_blas
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
        if self.spec.keep != "best" or self.last_val is None or not self._eval_due(step):
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
        from ..llm.finetune import adapters_sha256
        from ..runtime import ckpt
        trainer = self.bind(list(params.items()))
        ckpt.publish(ckpt.checkpoint_dir(run_dir, self.steps), run_dir)
        log(f"finetune: the final checkpoint is also at {os.path.abspath(run_dir)}")
        return {"adapters_sha256": adapters_sha256(trainer)}


JOB = Finetune


SMALL_LR, REAL_LR, REAL_HIDDEN = 1e-2, 2e-4, 512


def default_lr(gg) -> float:
    """The lr of a spec that gives none: SMALL_LR for a model narrower than REAL_HIDDEN (the one `fucina launch lm`
    trains, where the pirate demo's recipe was tuned), REAL_LR for a real one (PEFT's usual LoRA rate; at 1e-2 on
    all seven projections SmolLM2-135M garbles its answers in 3 steps)."""
    hidden = gg.get(f"{gg.architecture}.embedding_length")
    return SMALL_LR if isinstance(hidden, int) and hidden < REAL_HIDDEN else REAL_LR


def split_records(records, fraction, seed, source="record"):
    """(train, validation) records: round(fraction * n) whole records (documents, never a part of one) picked by
    the first positions of the seeded epoch permutation (pure in (n, seed)); both keep the file order."""
    from kernels.rng import derive_seed
    n = len(records)
    k = int(round(fraction * n))
    if k < 1 or k >= n:
        raise UserError(f"--val-split {fraction}: {n} {source}s leave {k} for validation and {n - k} for training; "
                        "both need at least one")
    held = set(int(i) for i in sft.epoch_permutation(n, derive_seed(seed, 0x56414C), 0)[:k])
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]
