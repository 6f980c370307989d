"""The fine-tune jobs' specs: one dataclass per job, whose fields ARE the flags.

`fucina launch finetune` / `launch es-finetune` add one flag per field (pipeline/jobs/spec.add_flags), and
`fucina finetune` / `fucina es-finetune` take theirs from the same fields (spec.add_field_flags): a knob is
written once, here, with its help. Every process of a run builds what it needs from the spec alone
(pipeline/finetune/build.py).
"""
from __future__ import annotations

import dataclasses

from ..errors import UserError
from ..es.countdown import MAX_NUMBER, N_NUMBERS
from ..jobs.spec import field, on_nonfinite_field, tensorboard_field
from ..llm import data as sft
from .schedule import DECAYS

OPTIMIZERS = ("adamw", "adam", "lion", "sgd", "muon")
DEFAULT_STEPS = 30  # a run given neither --steps nor --epochs
SMALL_LR, REAL_LR, REAL_HIDDEN = 1e-2, 2e-4, 512


def _chat_template_help():
    from ..llm.chat import CHAT_FORMATS
    return (f"render conversations with this turn format ({', '.join(CHAT_FORMATS)}) or jinja file instead of the "
            "GGUF's template (empty: the GGUF's, else its family's format)")


@dataclasses.dataclass
class _ModelAndData:
    """The fields both jobs read their model and data by (defined once: a flag means the same in both)."""

    model: str = field("", "GGUF model to fine-tune: llama, qwen2, qwen3 or gemma3 architecture, any quant type "
                           "(for a first run, the model.gguf `fucina launch lm` saves)")
    data: str = field("", "JSONL file of samples (empty: the built-in pirate pairs); formats in --format")
    format: str = field("auto", "the --data format: instruction/response pairs, alpaca (instruction, input, output), "
                                "chat messages or ShareGPT conversations; auto = read from the first record's fields",
                        choices=("auto",) + sft.FORMATS)
    instruction_key: str = field("instruction", "JSONL key holding the instruction (pairs)")
    response_key: str = field("response", "JSONL key holding the response (pairs)")
    max_record_bytes: int = field(sft.MAX_RECORD_BYTES, "refuse a JSONL line over N bytes before parsing it",
                                  metavar="N")
    chat_template: str = field("", _chat_template_help(), metavar="NAME|FILE")

    def target_tuple(self):
        """The `targets` field of the job (every fine-tune spec has one) as a tuple of projection names."""
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())


def _shuffle():
    return field(False, "shuffled sample order (Fisher-Yates per epoch, seeded by --data-seed)")


@dataclasses.dataclass
class FinetuneSpec(_ModelAndData):
    """The `finetune` job: `fucina finetune`'s and `fucina launch finetune`'s flags (add_field_flags)."""

    val_data: str = field("", "held-out JSONL samples (same formats as --data): the validation loss every "
                              "--eval-every steps in the progress line and metrics.jsonl")
    val_split: float = field(0.0, "instead of --val-data: hold out this fraction of --data's records (whole "
                                  "documents, picked by --seed: the same split every run); 0: none", metavar="F")
    eval_every: int = field(0, "validation loss every N optimizer steps and at the last (0: off; with a validation "
                               "set: 10)", metavar="N")
    patience: int = field(0, "stop early after N evaluations in a row without a lower validation loss (needs a "
                             "validation set; the stop step's checkpoint is the run's last); 0: off", metavar="N")
    keep: str = field("last", "best: also keep the adapters of the lowest validation loss in RUN_DIR/best (a "
                              "directory --lora and export-gguf --adapters take)", choices=("last", "best"))
    shuffle: bool = _shuffle()
    seed: int = field(42, "seed of the adapter init and dropout streams")
    data_seed: int = field(-1, "seed of the shuffled order (-1: --seed)")
    steps: int = field(0, f"train until this many optimizer steps in total (a resumed run continues from its "
                          f"checkpoint); 0: {DEFAULT_STEPS}, or --epochs' worth; excludes --epochs", metavar="N")
    epochs: float = field(0.0, "instead of --steps: ceil(E x training samples / --batch-size) optimizer steps (the "
                               "last batch is topped up from the next epoch's order, as every epoch boundary is); "
                               "0: off", metavar="E")
    rank: int = field(8, "LoRA rank r")
    alpha: float = field(16.0, "LoRA alpha (the delta is scaled by alpha/rank)")
    lr: float = field(0.0, f"peak learning rate (a resumed run keeps the checkpoint's); 0: by the model's width, "
                           f"{SMALL_LR:g} on a small model (hidden < {REAL_HIDDEN}: the one `fucina launch lm` trains, "
                           f"the pirate demo's), {REAL_LR:g} on a real one (SmolLM2, Qwen, Gemma: PEFT's usual LoRA "
                           "rate; 1e-2 garbles them)")
    warmup: int = field(0, "linear learning-rate warm-up over this many optimizer steps")
    decay: str = field("constant", "the lr after the warm-up: constant (the peak), linear or cosine (down to 0 at the "
                                   "run's last step along a line or a half cosine); a resumed run keeps the "
                                   "checkpoint's", choices=DECAYS, metavar="|".join(DECAYS))
    clip: float = field(1.0, "global gradient-norm clip, once per step (0: off)")
    targets: str = field("q,k,v,o,gate,up,down", "comma-separated projections to adapt, any of q,k,v,o,gate,up,down "
                                                 "(q,v is the classic choice for large models)")
    batch_size: int = field(5, "samples per optimizer step, token-weighted (5: the whole pirate set per step; a "
                               "resumed run keeps the checkpoint's)", aliases=("--accum-steps",), metavar="N")
    seq_max: int = field(256, "truncate samples to this many input tokens (with --pack: also the length of "
                              "a window)")
    pack: bool = field(False, "pack each step's samples into windows of up to --seq-max tokens (attention and "
                              "positions restart at every sample: the same loss and gradients, fewer, larger "
                              "products; a resumed run keeps the checkpoint's)")
    dropout: float = field(0.0, "LoRA dropout probability on the adapter input, in [0, 1)")
    optimizer: str = field("adamw", "optimizer of the adapters", choices=OPTIMIZERS)
    state_dtype: str = field("f32", "dtype of the AdamW/Lion moments", choices=("f32", "bf16"))
    checkpoint_layers: bool = field(False, "recompute each layer in backward (less memory, same bits)")
    checkpoint_every: int = field(0, "also checkpoint every N optimizer steps, RUN_DIR/checkpoint-step-N (0: only "
                                     "the final step)", aliases=("--save-every",), metavar="N")
    on_nonfinite: str = on_nonfinite_field()
    tensorboard: str = tensorboard_field()
    prompt: str = field("", "held prompt of the BEFORE/AFTER answers (empty: the first training instruction)")
    max_new_tokens: int = field(48, "length of the BEFORE/AFTER greedy answers (tokens; bytes on a byte-level "
                                    "model)")

    def validate(self):
        if not self.model:
            raise UserError("finetune: --model (a GGUF file) is required")
        for name in ("batch_size", "seq_max", "rank", "max_record_bytes"):
            if getattr(self, name) < 1:
                raise UserError(f"finetune: {name} must be >= 1, got {getattr(self, name)}")
        if self.steps and self.epochs:
            raise UserError(f"finetune: --steps {self.steps} and --epochs {self.epochs:g} exclude each other: give one "
                            "(--epochs E trains ceil(E x samples / --batch-size) steps)")
        for name in ("steps", "epochs", "warmup", "checkpoint_every", "max_new_tokens"):
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
        if self.patience < 0:
            raise UserError(f"finetune: patience must be >= 0, got {self.patience}")
        if self.patience and not (self.val_data or self.val_split):
            raise UserError("finetune: patience stops on the validation loss: it needs a validation set (--val-data "
                            "FILE or --val-split F, measured every --eval-every N steps)")
        if self.keep == "best" and not (self.val_data or self.val_split):
            raise UserError("finetune: keep = best needs a validation set (val_data or val_split)")



def default_lr(gg) -> float:
    """The lr of a spec that gives none: SMALL_LR for a model narrower than REAL_HIDDEN (the one `fucina launch lm`
    trains, where the pirate demo's recipe was tuned), REAL_LR for a real one (PEFT's usual LoRA rate; at 1e-2 on
    all seven projections SmolLM2-135M garbles its answers in 3 steps)."""
    hidden = gg.get(f"{gg.architecture}.embedding_length")
    return SMALL_LR if isinstance(hidden, int) and hidden < REAL_HIDDEN else REAL_LR


@dataclasses.dataclass
class ESFinetuneSpec(_ModelAndData):
    """The es-finetune job: `fucina es-finetune`'s flags as fields, with the ES settings resolved (the command's
    spec_of). Every replica builds its LoraModel, data and scorer from them (build.build_es); "" and -1 stand for
    a flag not given."""

    data: str = field("", "JSONL file of samples (empty: the built-in pirate pairs, or the task's problems); formats "
                          "in --format")  # _ModelAndData's, with its help: keeps its place among the fields
    task: str = field("", "a built-in task instead of --data: countdown = reach a target from 4 numbers with + - * / "
                          "(its reward: countdown; empty: none)", choices=("", "countdown"))
    task_size: int = field(64, "problems the built-in task generates", metavar="N")
    task_seed: int = field(0, "seed of the built-in task's problem set")
    task_numbers: int = field(N_NUMBERS, "countdown: numbers per problem, 2..6 (fewer = easier)", metavar="N")
    task_max_number: int = field(MAX_NUMBER, "countdown: the numbers are drawn from 1..M (smaller = easier)",
                                 metavar="M")
    shuffle: bool = _shuffle()
    seed: int = field(42, "run seed: the adapter init (A), the ES noise (unless --es-seed) and the data order "
                          "(unless --data-seed)")
    es_seed: int = field(-1, "seed of the ES noise stream (-1: derived from --seed, independent of the adapter init)")
    data_seed: int = field(-1, "seed of the shuffled order (-1: --seed)")
    iterations: int = field(40, "train until this many ES iterations in total (a resumed run continues from its "
                                "checkpoint)")
    population: int = field(16, "members per iteration (even with --antithetic; a resumed run's is its "
                                "checkpoint's)")
    sigma: float = field(0.05, "perturbation scale")
    alpha: float = field(0.05, "ES step size, no 1/sigma")
    antithetic: bool = field(True, "mirrored (+eps, -eps) member pairs (--no-antithetic: independent members)")
    shaping: str = field("z_score", "fitness shaping", choices=("z_score", "centered_ranks"))
    noise: str = field("iid", "noise scheme", choices=("iid", "correlated"))
    batch: int = field(5, "samples every member scores per iteration (5: the whole pirate set)")
    reward: str = field("", "what a member is scored by: nll, exact, countdown, rule:..., PATH.py:FUNC, each "
                            "optionally @WEIGHT, several newline-separated = their weighted sum (empty: countdown "
                            "for the countdown task, else nll)")
    reward_timeout: float = field(10.0, "seconds one call of a PATH.py:FUNC reward may take before the run stops "
                                        "with an error naming it (0: no limit); its printed output is captured, at "
                                        "most 4096 characters per call passed on to stderr", metavar="S")
    search: str = field("ab", "what ES perturbs: ab = LoRA A and B, b = only B (A stays at its random init), "
                              "lowrank = every projection matrix by rank --noise-rank products sigma * A B^T / "
                              "sqrt(r), members in one batched forward (EGGROLL; dense or --dequantize weights)",
                        choices=("ab", "b", "lowrank"))
    noise_rank: int = field(1, "--search lowrank: the rank r of each member's perturbation of a matrix", metavar="R")
    dequantize: bool = field(False, "with --search full or lowrank on a quantized GGUF: perturb a dequantized f32 "
                                    "copy of each quantized matrix (4 bytes per weight in memory) instead of refusing")
    rank: int = field(8, "LoRA rank r")
    lora_alpha: float = field(16.0, "LoRA alpha (the delta is scaled by lora-alpha/rank)")
    targets: str = field("q,v", "comma-separated projections to adapt, any of q,k,v,o,gate,up,down")
    anchor_decay: str = field("", "anchored weight decay toward the initial adapters after each update: l1, l2 "
                                  "(empty: off)", choices=("", "l1", "l2"))
    anchor_lambda: float = field(0.0, "anchored decay strength lambda (shrink = alpha*lambda)")
    seq_max: int = field(256, "truncate samples to this many input tokens")
    member_batch: int = field(0, "score K members per pass as one batch through the frozen weights (any reward: "
                                 "generation rewards decode in lock-step; LoRA or lowrank search; the same bits as "
                                 "one at a time); 0 = one member at a time", metavar="K")
    max_new_tokens: int = field(48, "greedy tokens generated per answer: the BEFORE/AFTER answers and every "
                                    "generation reward")
    load: str = field("", "resume from a checkpoint (adapters, iteration, loader position; its ES settings win over "
                          "the flags; empty: a fresh run)", metavar="DIR")
    save_every: int = field(0, "also checkpoint every N iterations, checkpoint-step-N (0: only the final one)",
                            metavar="N")
    tensorboard: str = tensorboard_field()

    def validate(self):
        if not self.model:
            raise UserError("es-finetune: field 'model' (a GGUF file) is required")
        if self.task and self.data:
            raise UserError("es-finetune: fields 'task' and 'data' exclude each other (a task brings its prompts)")
        lows = {"iterations": 0, "population": 1, "batch": 1, "task_size": 1, "rank": 1, "noise_rank": 1, "seq_max": 1,
                "member_batch": 0, "max_new_tokens": 0, "save_every": 0, "max_record_bytes": 1}
        for name, low in lows.items():
            if getattr(self, name) < low:
                raise UserError(f"es-finetune: field '{name}' must be >= {low}, got {getattr(self, name)}")
        if self.antithetic and self.population % 2:
            raise UserError(f"es-finetune: field 'population' must be even with antithetic pairs, "
                            f"got {self.population}")
        if self.reward_timeout < 0:
            raise UserError(f"es-finetune: field 'reward_timeout' must be >= 0, got {self.reward_timeout}")
        if self.anchor_lambda < 0:
            raise UserError(f"es-finetune: field 'anchor_lambda' must be >= 0, got {self.anchor_lambda}")
