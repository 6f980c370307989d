"""`sft`: full-parameter supervised fine-tuning of a pretrained model.gguf on chat JSONL.

Data: pipeline.llm.data (instruction, alpaca, `messages` or ShareGPT records, auto-detected), rendered by
the model's own chat template and tokenized by its own tokenizer; labels only on the assistant turns (their
end-of-turn token included), every sample truncated to `seq` input positions and padded with masked
positions. Global row i of the run is sample epoch_permutation(n, seed, i // n)[i % n].

Model: every weight of the GGUF (F32/F16, any registered architecture) trainable, the same recipes as
pretrain (Muon on block matrices + AdamW on the rest, or AdamW), warm-up/hold/linear cool-down, global
clipping. Loss: summed cross-entropy over the step's supervised tokens divided by their count (written
into every micro-batch by the loader: a pure function of the step), so the in-order sum of micro-batch
gradients is the gradient of the step's mean. At the end: model.gguf with the source's tokenizer.

Trade-off: fixed-shape padded rows (the runtime's batch layout is fixed) cost compute on short samples.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..autograd.losses import cross_entropy
from ..errors import UserError
from ..llm.data import IGNORE_INDEX, EncodeOptions, RawEncoder, encode_all, epoch_permutation, load_jsonl
from ..optim import warmup_hold_linear_cooldown
from .base import Job, bind_module, zero_copy_grads
from .lm_export import write_model_gguf
from .recipes import adamw, muon_adamw
from .spec import field, on_nonfinite_field, tensorboard_field


@dataclasses.dataclass
class SFTSpec:
    model: str = field("", "the pretrained model.gguf (e.g. runs/pretrain-latest/model.gguf)")
    data: str = field("", "chat JSONL: messages, ShareGPT, alpaca or instruction/response records")
    format: str = field("auto", "the JSONL format", choices=("auto", "instruction", "alpaca", "messages",
                                                             "sharegpt"))
    steps: int = field(100, "optimizer steps")
    batch: int = field(8, "samples per optimizer step (split into micro-batches)")
    micro_batches: int = field(2, "micro-batches per step (tasks handed to trainers)")
    seq: int = field(256, "input positions per sample (longer samples are truncated)")
    optimizer: str = field("muon", "muon (Muon on block matrices + AdamW on the rest) or adamw",
                           choices=("muon", "adamw"))
    lr: float = field(1e-3, "peak LR of AdamW (with muon: of embeddings, head and norms)")
    muon_lr: float = field(0.005, "peak LR of Muon")
    warmup: int = field(10, "warm-up steps")
    cooldown: float = field(0.5, "share of the run spent cooling the LR linearly to 0")
    clip: float = field(1.0, "clip the global gradient norm to this (0: off)")
    checkpoint_every: int = field(50, "checkpoint cadence in steps (the final step is always saved)")
    seed: int = field(0, "seed for the sample order")
    on_nonfinite: str = on_nonfinite_field()
    tensorboard: str = tensorboard_field()

    def validate(self):
        if not self.model or not self.data:
            raise UserError("sft: --model (a model.gguf) and --data (chat JSONL) are required")
        if min(self.steps, self.batch, self.micro_batches, self.seq) < 1 or self.batch % self.micro_batches:
            raise UserError(f"sft: steps, batch, micro_batches and seq must be >= 1 and batch ({self.batch}) "
                            f"divisible by micro_batches ({self.micro_batches})")


class SFT(Job):
    name = "sft"
    Spec = SFTSpec

    def __init__(self, spec):
        super().__init__(spec)
        from ..llm.chat import ChatTemplate
        from ..llm.gguf import GGUFFile
        from ..llm.tokenizer import Tokenizer
        from ..models.registry import load_model
        for flag, path in (("--model", spec.model), ("--data", spec.data)):
            if not os.path.isfile(path):
                raise UserError(f"{flag} {path}: no such file")
        self.gguf = GGUFFile(spec.model)
        self.source = load_model(self.gguf, trainable=True)
        self.config = self.source.config
        if self.config.arch != "qwen3":  # model.gguf is written by lm_export, which writes the qwen3 graph
            raise UserError(f"{spec.model}: sft trains qwen3-architecture models (as `fucina pretrain` writes); "
                            f"this one is {self.config.arch!r}")
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        records = load_jsonl(spec.data, format=spec.format)
        samples = encode_all(RawEncoder(self.tokenizer), ChatTemplate.from_gguf(self.gguf), records,
                             EncodeOptions(seq_max=spec.seq), source=spec.data)
        self.inputs = np.zeros((len(samples), spec.seq), np.int64)
        self.labels = np.full((len(samples), spec.seq), IGNORE_INDEX, np.int64)
        for i, s in enumerate(samples):
            self.inputs[i, :len(s.inputs)], self.labels[i, :len(s.labels)] = s.inputs, s.labels
        self._perm = (None, None)

    def init_params(self):
        return [(n, np.array(t.data, np.float32)) for n, t in self.source.named_parameters()]

    def bind(self, params):
        from ..models.qwen3 import Qwen3
        return bind_module(Qwen3.init_random(self.config, seed=0), params)

    def make_optimizer(self, named):
        s = self.spec
        if s.optimizer == "muon":
            return muon_adamw(named, lr=s.muon_lr, adamw_lr=s.lr)
        return adamw(named, lr=s.lr, betas=(0.9, 0.95))

    def lr_factor(self, step):
        return warmup_hold_linear_cooldown(step, self.spec.steps, self.spec.warmup, self.spec.cooldown)

    def schedule_fields(self):
        return {"name": "warmup_hold_linear_cooldown", "warmup": self.spec.warmup, "cooldown": self.spec.cooldown}

    # --- data ------------------------------------------------------------------------
    def _sample_of_row(self, i):
        n = len(self.inputs)
        if self._perm[0] != i // n:
            self._perm = (i // n, epoch_permutation(n, self.spec.seed, i // n))
        return self._perm[1][i % n]

    def batch_layout(self):
        m, t = self.rows_per_micro(), self.spec.seq
        return [("inputs", (m, t), np.int64), ("labels", (m, t), np.int64), ("scale", (1,), np.float32)]

    def fill_batch(self, step, k, out):
        first = step * self.spec.batch
        step_rows = [self._sample_of_row(i) for i in range(first, first + self.spec.batch)]
        mine = step_rows[k * self.rows_per_micro():(k + 1) * self.rows_per_micro()]
        out["inputs"][...], out["labels"][...] = self.inputs[mine], self.labels[mine]
        out["scale"][0] = 1.0 / np.count_nonzero(self.labels[step_rows] != IGNORE_INDEX)

    def micro_grad(self, model, batch, grads):
        logits = model(batch["inputs"])
        loss = cross_entropy(logits, batch["labels"], ignore_index=IGNORE_INDEX, reduction="sum") * batch["scale"][0]
        loss.backward()
        zero_copy_grads(model, grads)
        return float(loss.data), len(batch["inputs"])

    def finish(self, run_dir, params, log=print):
        path = write_gguf(os.path.join(os.path.abspath(run_dir), "model.gguf"), self.bind(list(params.items())),
                          self.gguf, self.spec, self.spec.steps)
        log(f"sft: wrote {path}")
        return {"gguf": path}


def write_gguf(path, model, source_gguf, spec, steps, dtype="F32") -> str:
    """model.gguf of an SFT model: the source GGUF's tokenizer (tokens, types, merges, pre) embedded."""
    md = source_gguf.metadata
    vocab = (md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], md["tokenizer.ggml.merges"])
    weights = {n: (w.data if hasattr(w, "data") else w) for n, w in model.named_weights().items()}
    return write_model_gguf(path, model.config, weights, dtype=dtype, name="fucina-sft", vocab=vocab,
                            pre=md.get("tokenizer.ggml.pre", "qwen2"),
                            description=f"fucina sft of {os.path.basename(spec.model)}; steps {steps}")


def gguf_from_checkpoint(ckpt_dir, state, out, dtype=None) -> str:
    """`fucina export-gguf --from-checkpoint`: the checkpoint's weights with the source model's tokenizer."""
    from ..llm.gguf import GGUFFile
    from ..models.qwen3 import Qwen3
    from ..models.registry import load_model
    from ..runtime import ckpt
    from .spec import build
    spec = build(SFTSpec, state.config["spec"])
    if not os.path.isfile(spec.model):
        raise UserError(f"{ckpt_dir}/trainer_state.json: config.spec.model {spec.model}: no such file (the "
                        "source model.gguf supplies the tokenizer and config)")
    source = GGUFFile(spec.model)
    model = Qwen3.init_random(load_model(source).config, seed=0)
    bind_module(model, ckpt.read_params(ckpt_dir, order=[n for n, _ in model.named_parameters()]))
    return write_gguf(out, model, source, spec, state.step // state.accum_steps, dtype or "F32")


JOB = SFT
