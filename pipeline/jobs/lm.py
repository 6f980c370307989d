"""`lm`: a small Qwen3-family transformer trained from scratch on CPython's docs, byte level.

Data: the built-in corpus (corpus.py) as bytes; the last `val_share` of it is
held out. The training part is cut into non-overlapping windows of seq+1
bytes; each epoch visits them in a permutation that is a pure function of
(seed, epoch), and global row i of the run is window perm(i // n)[i % n].

Model: pipeline.models.qwen3 (tied embeddings), vocab = 256 bytes + ChatML
specials. Loss: summed token cross-entropy scaled by 1/(batch*seq), so the
in-order sum of micro-batch gradients is the gradient of the step's mean.
Optimizer: AdamW, or Muon on hidden matrices + AdamW on the rest; LR warm-up,
hold, linear cool-down. At the end: a greedy sample and `model.gguf`.

Trade-off: bytes, not BPE - a 261-token vocab keeps the model and the softmax
tiny, at the cost of ~4x longer sequences for the same text.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from pipeline.kernels import rng
from pipeline.kernels.workpool import single_thread_blas

from ..autograd.losses import cross_entropy
from ..autograd.tensor import no_grad
from ..models.qwen3 import Qwen3, Qwen3Config
from ..optim import warmup_hold_linear_cooldown
from .base import Job, bind_module, zero_copy_grads
from .corpus import corpus_bytes, corpus_digest
from .lm_export import VOCAB_SIZE, write_model_gguf
from .recipes import adamw, muon_adamw
from .spec import field, on_nonfinite_field, tensorboard_field


@dataclasses.dataclass
class LMSpec:
    steps: int = field(300, "optimizer steps")
    batch: int = field(16, "sequences per optimizer step (split into micro-batches)")
    micro_batches: int = field(4, "micro-batches per step (tasks handed to trainers)")
    seq: int = field(128, "tokens (bytes) per training sequence")
    hidden: int = field(128, "model width")
    layers: int = field(2, "transformer blocks")
    heads: int = field(4, "query heads")
    kv_heads: int = field(2, "key/value heads (grouped-query attention)")
    head_dim: int = field(32, "width of one head")
    ffn: int = field(384, "SwiGLU hidden width")
    optimizer: str = field("adamw", "adamw, or muon (Muon on hidden matrices + AdamW on the rest)",
                           choices=("adamw", "muon"))
    lr: float = field(3e-3, "peak LR (AdamW; with muon: the AdamW part)")
    muon_lr: float = field(0.02, "peak LR of Muon (optimizer = muon)")
    weight_decay: float = field(0.0, "decoupled weight decay on matrices")
    warmup: int = field(30, "warm-up steps")
    cooldown: float = field(0.3, "share of the run spent cooling the LR linearly to 0")
    clip: float = field(1.0, "clip the global gradient norm to this (0: off)")
    checkpoint_every: int = field(100, "checkpoint cadence in steps (the final step is always saved)")
    eval_every: int = field(50, "validation loss every N steps (0: off)")
    val_batches: int = field(4, "held-out sequences for the validation loss")
    val_share: float = field(0.02, "share of the corpus held out for validation")
    sample_tokens: int = field(120, "greedy sample length at the end (0: none)")
    prompt: str = field("The for statement", "prompt of the final greedy sample")
    gguf_dtype: str = field("F32", "model.gguf tensor type: F32 or F16", choices=("F32", "F16"))
    seed: int = field(0, "seed for init, data order and held-out windows")
    on_nonfinite: str = on_nonfinite_field()
    tensorboard: str = tensorboard_field()

    def validate(self):
        from ..errors import UserError
        if min(self.steps, self.batch, self.micro_batches, self.seq, self.layers) < 1:
            raise UserError("lm: steps, batch, micro_batches, seq and layers must be >= 1")
        if self.batch % self.micro_batches:
            raise UserError(f"lm: batch {self.batch} is not divisible by micro_batches {self.micro_batches}")
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise UserError(f"lm: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}) "
                            f"and head_dim ({self.head_dim}) even")


class LM(Job):
    name = "lm"
    Spec = LMSpec
    eval_name = "val_loss"

    def __init__(self, spec):
        super().__init__(spec)
        data = np.frombuffer(corpus_bytes(), dtype=np.uint8)
        n_val = max(int(len(data) * spec.val_share), (spec.seq + 1) * spec.val_batches)
        self.train, self.val = data[:-n_val], data[-n_val:]
        self.windows = (len(self.train) - 1) // spec.seq
        self.config = Qwen3Config(vocab_size=VOCAB_SIZE, hidden=spec.hidden, layers=spec.layers, heads=spec.heads,
                                  kv_heads=spec.kv_heads, head_dim=spec.head_dim, ffn=spec.ffn,
                                  context_length=max(256, spec.seq), rope_base=10_000.0)
        self._perm = (None, None)

    def tokens_per_row(self):
        return self.spec.seq

    def init_params(self):
        """Qwen3.init_random, with the (tied) embedding scaled to std 0.02 as in GPT-2.

        At std 1 the tied head starts with logits of std ~sqrt(hidden): a loss
        near 70 nats and a softmax gradient full of float32 denormals, which
        make the head's backward GEMM ~100x slower."""
        model = Qwen3.init_random(self.config, seed=self.spec.seed)
        return [(n, t.data * np.float32(0.02) if n == "embed" else t.data)
                for n, t in model.named_parameters()]

    def bind(self, params):
        return bind_module(Qwen3.init_random(self.config, seed=self.spec.seed), params)

    # --- data -----------------------------------------------------------------------
    def batch_layout(self):
        return [("tokens", (self.rows_per_micro(), self.spec.seq + 1), np.int64)]

    def _permutation(self, epoch):
        if self._perm[0] != epoch:
            keys = rng.uniform(rng.derive_seed(rng.derive_seed(self.spec.seed, 7), epoch), (self.windows,),
                               dtype=np.float64)
            self._perm = (epoch, np.argsort(keys, kind="stable"))
        return self._perm[1]

    def fill_batch(self, step, k, out):
        m, s = self.rows_per_micro(), self.spec.seq
        start = step * self.spec.batch + k * m
        for j, i in enumerate(range(start, start + m)):
            w = int(self._permutation(i // self.windows)[i % self.windows])
            out["tokens"][j] = self.train[w * s: w * s + s + 1]

    # --- compute --------------------------------------------------------------------
    def micro_grad(self, model, batch, grads):
        tokens = batch["tokens"]
        scale = np.float32(1.0 / (self.spec.batch * self.spec.seq))
        with single_thread_blas():  # one threadpoolctl round trip per micro-batch, not one per op
            logits = model(tokens[:, :-1])
            loss = cross_entropy(logits, tokens[:, 1:], reduction="sum") * scale
            loss.backward()
        zero_copy_grads(model, grads)
        return float(loss.data), len(tokens)

    def validate(self, model):
        """Mean next-byte cross-entropy (nats) on fixed held-out windows."""
        s, n = self.spec.seq, self.spec.val_batches
        stride = max((len(self.val) - s - 1) // max(n, 1), 1)
        rows = np.stack([self.val[i * stride: i * stride + s + 1] for i in range(n)]).astype(np.int64)
        with no_grad():
            return float(cross_entropy(model(rows[:, :-1]), rows[:, 1:]).data)

    def make_optimizer(self, named):
        s = self.spec
        if s.optimizer == "muon":
            return muon_adamw(named, lr=s.muon_lr, adamw_lr=s.lr, weight_decay=s.weight_decay)
        return adamw(named, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95))

    def lr_factor(self, step):
        s = self.spec
        return warmup_hold_linear_cooldown(step, s.steps, s.warmup, s.cooldown)

    def schedule_fields(self):
        return {"name": "warmup_hold_linear_cooldown", "warmup": self.spec.warmup, "cooldown": self.spec.cooldown,
                "corpus": corpus_digest()}

    # --- the end of a run -----------------------------------------------------------
    def greedy(self, model, prompt: bytes, n: int) -> bytes:
        cache = model.new_cache(len(prompt) + n)
        logits = model.infer(np.frombuffer(prompt, np.uint8).astype(np.int64), cache)
        out = []
        for _ in range(n):
            nxt = int(np.argmax(logits[:256]))  # bytes only: the specials were never trained
            out.append(nxt)
            if cache.length >= self.config.context_length:
                break
            logits = model.infer(np.array([nxt], np.int64), cache)
        return bytes(out)

    def finish(self, run_dir, params, log=print):
        model = self.bind(list(params.items()))
        extras = {"val_loss": self.validate(model)}
        if self.spec.sample_tokens > 0:
            prompt = self.spec.prompt.encode()
            text = (prompt + self.greedy(model, prompt, self.spec.sample_tokens)).decode("utf-8", "replace")
            extras["sample"] = text
            log(f"lm: greedy sample:\n{text}")
        weights = {n: (w.data if hasattr(w, "data") else w) for n, w in model.named_weights().items()}
        path = os.path.join(os.path.abspath(run_dir), "model.gguf")
        write_model_gguf(path, self.config, weights, dtype=self.spec.gguf_dtype,
                         description=f"fucina lm job; corpus {corpus_digest()}; steps {self.steps}")
        extras["gguf"] = path
        log(f"lm: wrote {path}")
        return extras


JOB = LM
