"""`pretrain`: a Qwen3-family GPT trained from scratch on your text with a BPE tokenizer trained on it.

Data (pretrain_data.py): text files, directories, globs or JSONL (`--data`; empty: the built-in corpus of
CPython's docs and stdlib sources), documents separated by <|endoftext|>, a held-out split by document, the
token stream cached memory-mapped per (corpus digest, tokenizer digest) under `cache_dir`.
Tokenizer (pipeline.llm.bpe_train): a byte-level BPE of `vocab_size` tokens trained on the training
documents (cached per corpus digest, vocab size and pre-tokenizer), or `--tokenizer tokenizer.json`.

Model: pipeline.models' qwen3 family, untied head; presets d4/d6/d8 (d6: 6 layers, width 384, 6 heads of
64, seq 512) and `tiny` for tests. Each step sees `batch_tokens` tokens in `micro_batches` micro-batches of
random windows (offsets a pure function of (seed, step, k)); the window length follows seed 004's
`context_at` (seq/4, seq/2, then seq) so a micro-batch holds more, shorter windows early on. Loss: summed
token cross-entropy scaled by 1/batch_tokens. Optimizer: Muon on block matrices + AdamW on embeddings, head
and norms (or AdamW on all); LR warm-up, hold, linear cool-down; global clipping (the pre-clip norm is the
logged grad norm). Validation: mean cross-entropy on fixed held-out windows of the full length; bits per
byte = its summed nats / (ln 2 * the UTF-8 bytes of those target tokens), a fixed ratio of it.
Time-lapse: every `sample_every` steps the optimizer role, which holds the parameters, appends greedy
samples of the prompts to samples.jsonl. At the end: val loss and bpb, plots, model.gguf.

Trade-off: windows are drawn anywhere in the stream (across document boundaries, as nanochat does), so
a step never waits for a shuffle and data order needs no state beyond the step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os

import ml_dtypes
import numpy as np

from pipeline.kernels import rng
from pipeline.kernels.workpool import single_thread_blas

from ..autograd.losses import cross_entropy
from ..autograd.tensor import no_grad
from ..errors import UserError
from ..models.qwen3 import Qwen3, Qwen3Config
from ..optim import context_at, warmup_hold_linear_cooldown
from .base import Job, bind_module, zero_copy_grads
from .lm_export import write_model_gguf
from .recipes import adamw, is_hidden_matrix, muon_adamw
from .spec import field, on_nonfinite_field, tensorboard_field

# preset -> (layers, width, heads, seq, batch_tokens); head width 64 (tiny: 32), ffn ~ 8/3 width
PRESETS = {"tiny": (2, 64, 2, 64, 1024), "d4": (4, 256, 4, 256, 8192), "d6": (6, 384, 6, 512, 16384),
           "d8": (8, 512, 8, 512, 32768)}


def window_at(step, total, seq, warm) -> int:
    """seed 004's context_at, off below seq 256: its 64-token floor would make the first phase longer
    than the second."""
    return context_at(step, total, seq, warm and seq >= 256)


def window_lengths(seq, warm) -> list:
    """Every window length of a run (steps 0, 2 and 9 of 10 sit in context_at's three phases)."""
    return sorted({window_at(s, 10, seq, warm) for s in (0, 2, 9)})


@dataclasses.dataclass
class PretrainSpec:
    preset: str = field("d6", "model size: d4, d6 (6 layers, width 384, 6 heads, seq 512), d8; tiny for tests",
                        choices=tuple(PRESETS))
    data: str = field("", "text files, directories, globs or JSONL, comma-separated (empty: the built-in corpus)")
    text_field: str = field("text", "the string field of each JSONL record")
    tokenizer: str = field("", "an existing tokenizer.json from `fucina tokenizer train` (empty: train one)")
    vocab_size: int = field(8192, "BPE vocabulary size (tokens, ChatML specials included) when training one")
    pre: str = field("qwen2", "the llama.cpp pre-tokenizer of a trained tokenizer", choices=("qwen2", "llama-bpe"))
    steps: int = field(200, "optimizer steps (replaced by ceil(tokens / batch_tokens) when tokens > 0)")
    tokens: int = field(0, "train on this many tokens instead: steps = ceil(tokens / batch_tokens)")
    seq: int = field(0, "full window length in tokens (0: the preset's)")
    batch_tokens: int = field(0, "tokens per optimizer step, reached by micro-batches (0: the preset's)")
    micro_batches: int = field(4, "micro-batches per step (tasks handed to trainers)")
    seq_warmup: bool = field(True, "sequence-length warm-up: seq/4 for the first tenth of the steps, seq/2 until 3/10 "
                                   "(seq >= 256)")
    optimizer: str = field("muon", "muon (Muon on block matrices + AdamW on the rest) or adamw",
                           choices=("muon", "adamw"))
    lr: float = field(3e-3, "peak LR of AdamW (with muon: of embeddings, head and norms)")
    muon_lr: float = field(0.02, "peak LR of Muon")
    weight_decay: float = field(0.0, "decoupled weight decay on matrices")
    warmup: int = field(20, "warm-up steps")
    cooldown: float = field(0.3, "share of the run spent cooling the LR linearly to 0")
    bf16: bool = field(False, "bf16 block matrices in forward/backward through f32 masters (the optimizer's)")
    clip: float = field(1.0, "clip the global gradient norm to this (0: off); the pre-clip norm is logged")
    checkpoint_every: int = field(50, "checkpoint cadence in steps (each checkpoint gets a sample at the end)")
    eval_every: int = field(25, "validation loss every N steps (0: off)")
    val_windows: int = field(8, "held-out windows of `seq` tokens for the validation loss")
    val_share: float = field(0.02, "share of the corpus bytes held out (whole documents)")
    sample_tokens: int = field(48, "greedy sample length per prompt (0: no samples)")
    sample_every: int = field(50, "greedy samples of the prompts every N steps and at the last (the time-lapse)")
    prompts: str = field("The|def|class|import", "greedy-sample prompts, separated by | (a trailing space is a "
                                                  "token of its own to a BPE, which words seldom follow)")
    gguf_dtype: str = field("F32", "model.gguf tensor type: F32 or F16", choices=("F32", "F16"))
    cache_dir: str = field("runs/cache", "where trained tokenizers and token streams are cached")
    seed: int = field(0, "seed for init and data order")
    on_nonfinite: str = on_nonfinite_field()
    tensorboard: str = tensorboard_field()

    def validate(self):
        if self.steps < 1 and self.tokens < 1:
            raise UserError("pretrain: steps (or tokens) must be >= 1")
        if min(self.micro_batches, self.val_windows) < 1 or min(self.seq, self.batch_tokens, self.sample_every) < 0:
            raise UserError("pretrain: micro_batches and val_windows must be >= 1, seq, batch_tokens and "
                            "sample_every >= 0")
        if not 0 < self.val_share < 1:
            raise UserError(f"pretrain: val_share must be in (0, 1), got {self.val_share}")
        seq, batch_tokens = self.shape()[3:]
        micro = batch_tokens // self.micro_batches
        windows = window_lengths(seq, self.seq_warmup)
        if batch_tokens % self.micro_batches or micro < seq or any(micro % w for w in windows):
            raise UserError(f"pretrain: batch_tokens {batch_tokens} must split into {self.micro_batches} "
                            f"micro-batches whose size is a multiple of every window length {windows}")
        if self.tokens > 0:  # resolved here, so every process (and the progress bar) sees the same step count
            self.steps = -(-self.tokens // batch_tokens)

    def shape(self):
        layers, width, heads, seq, batch_tokens = PRESETS[self.preset]
        return layers, width, heads, self.seq or seq, self.batch_tokens or batch_tokens


class Pretrain(Job):
    name = "pretrain"
    Spec = PretrainSpec
    eval_name = "val_loss"

    def __init__(self, spec):
        super().__init__(spec)
        from ..llm import bpe_train
        from .pretrain_data import load_corpus, token_stream
        s = spec
        self.corpus = load_corpus(s.data, s.text_field, s.val_share)
        self.tok, self.pre, self.tok_digest, self.tokenizer_path = self._tokenizer()
        self.eot_id = self.tok.token_to_id(bpe_train.END_OF_TEXT)
        if self.eot_id is None:
            raise UserError(f"{self.tokenizer_path}: the tokenizer has no {bpe_train.END_OF_TEXT} token")
        self.train = token_stream(s.cache_dir, self.corpus.digest, self.tok_digest, "train", self.tok,
                                  self.corpus.train_docs, self.eot_id)
        self.val = token_stream(s.cache_dir, self.corpus.digest, self.tok_digest, "val", self.tok,
                                self.corpus.val_docs, self.eot_id)
        self.seq, self.batch_tokens = s.shape()[3:]
        if len(self.train) <= self.seq + 1:
            raise UserError(f"pretrain: the corpus has {len(self.train)} training tokens; a window needs "
                            f"{self.seq + 1} (give more text or a smaller --seq)")
        self.config = model_config(s, self.tok.get_vocab_size())
        self.val_rows = self._val_rows()
        lengths = np.array(bpe_train.token_byte_lengths(self.tok), np.int64)
        self.val_bytes = int(lengths[self.val_rows[:, 1:]].sum())
        self.bpb_per_nat = self.val_rows[:, 1:].size / (math.log(2) * max(self.val_bytes, 1))

    def _tokenizer(self):
        """(HF tokenizer, pre name, digest, path): the given tokenizer.json, or one trained and cached."""
        from ..llm import bpe_train
        from .pretrain_data import cached
        s = self.spec
        if s.tokenizer:
            return (*bpe_train.load_tokenizer(s.tokenizer), s.tokenizer)
        path = tokenizer_cache_path(s, self.corpus.digest)
        cached(path, lambda tmp: bpe_train.save_tokenizer(
            bpe_train.train_bpe(self.corpus.train_docs, s.vocab_size, s.pre), tmp))
        return (*bpe_train.load_tokenizer(path), path)

    def _val_rows(self):
        """Fixed held-out windows of seq+1 tokens, evenly spaced (repeating the stream if it is short)."""
        n, need = self.spec.val_windows, self.seq + 1
        val = np.asarray(self.val, np.int64)
        if len(val) < need:
            val = np.resize(val, need)
        stride = max((len(val) - need) // max(n - 1, 1), 1) if n > 1 else 0
        return np.stack([val[min(i * stride, len(val) - need):][:need] for i in range(n)])

    # --- the schedule ----------------------------------------------------------------
    def window(self, step):
        return window_at(step, self.steps, self.seq, self.spec.seq_warmup)

    def rows_per_step(self):
        return self.batch_tokens  # tokens per row is 1: tokens/s is then batch tokens / step time

    def lr_factor(self, step):
        return warmup_hold_linear_cooldown(step, self.steps, self.spec.warmup, self.spec.cooldown)

    def schedule_fields(self):
        s = self.spec
        return {"name": "warmup_hold_linear_cooldown", "warmup": s.warmup, "cooldown": s.cooldown,
                "seq_warmup": s.seq_warmup, "corpus": self.corpus.digest, "tokenizer": self.tok_digest}

    # --- the model -------------------------------------------------------------------
    def init_params(self):
        model = Qwen3.init_random(self.config, seed=self.spec.seed)
        return [(n, t.data) for n, t in model.named_parameters()]

    def bind(self, params):
        return bind_module(Qwen3.init_random(self.config, seed=self.spec.seed), params)

    def make_optimizer(self, named):
        s = self.spec
        if s.optimizer == "muon":
            return muon_adamw(named, lr=s.muon_lr, adamw_lr=s.lr, weight_decay=s.weight_decay)
        return adamw(named, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95))

    # --- data ------------------------------------------------------------------------
    def micro_tokens(self):
        return self.batch_tokens // self.spec.micro_batches

    def batch_layout(self):
        shortest = window_lengths(self.seq, self.spec.seq_warmup)[0]
        m = self.micro_tokens()
        return [("tokens", (m + m // shortest,), np.int64), ("window", (1,), np.int64)]

    def fill_batch(self, step, k, out):
        t = self.window(step)
        rows = self.micro_tokens() // t
        draws = rng.at_values(rng.derive_seed(rng.derive_seed(self.spec.seed, 11), step * self.micro_batches + k),
                              np.arange(rows))
        starts = (draws % np.uint64(len(self.train) - t)).astype(np.int64)
        windows = out["tokens"][: rows * (t + 1)].reshape(rows, t + 1)
        for j, start in enumerate(starts):
            windows[j] = self.train[start: start + t + 1]
        out["window"][0] = t

    # --- compute ---------------------------------------------------------------------
    def micro_grad(self, model, batch, grads):
        t = int(batch["window"][0])
        rows = self.micro_tokens() // t
        tokens = batch["tokens"][: rows * (t + 1)].reshape(rows, t + 1)
        with single_thread_blas(), bf16_hidden_matrices(model, self.spec.bf16):  # one threadpoolctl trip, not per op
            logits = model(tokens[:, :-1])
            loss = cross_entropy(logits, tokens[:, 1:], reduction="sum") * np.float32(1.0 / self.batch_tokens)
            loss.backward()
        zero_copy_grads(model, grads)
        return float(loss.data), rows

    def validate(self, model):
        """Mean next-token cross-entropy (nats) on the fixed held-out windows."""
        with no_grad():
            return float(cross_entropy(model(self.val_rows[:, :-1]), self.val_rows[:, 1:]).data)

    # --- the time-lapse -------------------------------------------------------------
    def greedy(self, model, prompt: str, n: int) -> str:
        ids = ([self.eot_id] + self.tok.encode(prompt, add_special_tokens=False).ids)[-self.config.context_length:]
        cache = model.new_cache(self.config.context_length)
        logits, out = model.infer(np.array(ids, np.int64), cache), []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            if cache.length >= self.config.context_length or out[-1] == self.eot_id:
                break
            logits = model.infer(np.array(out[-1:], np.int64), cache)
        return prompt + self.tok.decode(out, skip_special_tokens=False)

    def samples_prompts(self) -> list:
        return [p for p in self.spec.prompts.split("|") if p]

    def samples(self, model) -> dict:
        return {p: self.greedy(model, p, self.spec.sample_tokens) for p in self.samples_prompts()}

    def sample_due(self, step) -> bool:
        every = self.spec.sample_every
        return self.spec.sample_tokens > 0 and (step == self.steps or (every > 0 and step % every == 0))

    def after_step(self, step, model, run_dir):
        if self.sample_due(step):
            append_samples(os.path.join(run_dir, "samples.jsonl"), step, self.samples(model))

    # --- the end of a run ------------------------------------------------------------
    def finish(self, run_dir, params, log=print):
        run_dir = os.path.abspath(run_dir)
        model = self.bind(list(params.items()))
        val_loss = self.validate(model)
        extras = {"val_loss": val_loss, "val_bpb": val_loss * self.bpb_per_nat, "tokenizer": self.tokenizer_path,
                  "corpus": self.corpus.digest, "train_tokens": int(len(self.train)),
                  "tokens_seen": self.steps * self.batch_tokens}
        samples = os.path.join(run_dir, "samples.jsonl")
        if self.spec.sample_tokens > 0 and os.path.exists(samples):
            extras["samples"] = samples
            for record in read_samples(samples):
                if record["step"] == self.steps:
                    log(f"pretrain: greedy sample: {record['text']!r}")
        path = write_gguf(os.path.join(run_dir, "model.gguf"), model, self.spec.gguf_dtype, self.spec,
                          self.tok, self.pre, self.corpus.digest, self.tok_digest, self.steps)
        extras["gguf"] = path
        from .pretrain_plot import plot_pretrain
        extras["pretrain_plot"] = plot_pretrain(run_dir, self)
        extras["pretrain_plot_log"] = plot_pretrain(run_dir, self, log_steps=True,
                                                    out=os.path.join(run_dir, "pretrain-log.png"))
        log(f"pretrain: val loss {val_loss:.4f} nats, {extras['val_bpb']:.4f} bits per byte; wrote {path}")
        with open(os.path.join(run_dir, "pretrain.json"), "w") as fh:
            json.dump({"bpb_per_nat": self.bpb_per_nat, "val_bytes": self.val_bytes, **extras}, fh, indent=1)
        return extras


@contextlib.contextmanager
def bf16_hidden_matrices(model, on=True):
    """The block matrices as bf16 for one forward/backward, their f32 masters put back after. linear takes
    the bf16 values (multiplied in f32: numpy has no bf16 GEMM, so this is bf16 storage with f32
    accumulation) and hands an f32 gradient to the same Tensor - the straight-through gradient of mixed
    precision - which the optimizer applies to the f32 master. The rounding is elementwise (round to
    nearest even), so the bits stay independent of threads and trainers."""
    tensors = [t for n, t in model.named_parameters() if on and is_hidden_matrix(n, t.data)]
    masters = [t.data for t in tensors]
    for t in tensors:
        t.data = t.data.astype(ml_dtypes.bfloat16)
    try:
        yield
    finally:
        for t, master in zip(tensors, masters):
            t.data = master


def model_config(spec, vocab_size) -> Qwen3Config:
    layers, width, heads, seq, _ = spec.shape()
    return Qwen3Config(vocab_size=vocab_size, hidden=width, layers=layers, heads=heads, kv_heads=heads,
                       head_dim=32 if spec.preset == "tiny" else 64, ffn=(8 * width // 3 + 63) // 64 * 64,
                       context_length=seq, rope_base=10_000.0, tied_output=False)


def tokenizer_cache_path(spec, corpus_digest) -> str:
    return os.path.join(spec.cache_dir, f"tokenizer-{corpus_digest}-{spec.vocab_size}-{spec.pre}.json")


def write_gguf(path, model, dtype, spec, tok, pre, corpus_digest, tok_digest, steps) -> str:
    """model.gguf of a pretrain model: qwen3 arch, the trained tokenizer embedded."""
    from ..llm.bpe_train import gguf_vocab
    weights = {n: (w.data if hasattr(w, "data") else w) for n, w in model.named_weights().items()}
    return write_model_gguf(path, model.config, weights, dtype=dtype, name="fucina-pretrain",
                            description=f"fucina pretrain {spec.preset}; corpus {corpus_digest}; "
                                        f"tokenizer {tok_digest}; steps {steps}",
                            vocab=gguf_vocab(tok), pre=pre)


def gguf_from_checkpoint(ckpt_dir, state, out, dtype=None) -> str:
    """`fucina export-gguf --from-checkpoint`: the checkpoint's weights with the run's tokenizer (the given
    --tokenizer, or the cached one of the recorded corpus digest), checked against the recorded digest."""
    from ..llm import bpe_train
    from ..runtime import ckpt
    from .spec import build
    spec = build(PretrainSpec, state.config["spec"])
    corpus_digest, tok_digest = state.schedule.get("corpus"), state.schedule.get("tokenizer")
    path = spec.tokenizer or tokenizer_cache_path(spec, corpus_digest)
    tok, pre, digest = bpe_train.load_tokenizer(path)
    if digest != tok_digest:
        raise UserError(f"{path}: tokenizer sha256 {digest} but {ckpt_dir}/trainer_state.json records "
                        f"schedule.tokenizer {tok_digest} (the tokenizer changed since the run)")
    config = model_config(spec, tok.get_vocab_size())
    model = Qwen3.init_random(config, seed=spec.seed)
    bind_module(model, ckpt.read_params(ckpt_dir, order=[n for n, _ in model.named_parameters()]))
    return write_gguf(out, model, dtype or spec.gguf_dtype, spec, tok, pre, corpus_digest, tok_digest,
                      state.step // state.accum_steps)


def read_samples(path) -> list:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def append_samples(path, step, samples: dict):
    """Add the lines of `step` to samples.jsonl, dropping any of this step or later first: a resumed or
    replayed step rewrites its lines instead of duplicating them. Whole-file temp + rename (the file is
    small), so a crash leaves the previous version."""
    kept = [r for r in read_samples(path) if r["step"] < step] if os.path.exists(path) else []
    kept += [{"step": step, "prompt": p, "text": t} for p, t in samples.items()]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    os.replace(tmp, path)


JOB = Pretrain
