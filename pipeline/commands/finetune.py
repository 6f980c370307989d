"""`fucina finetune`: LoRA fine-tuning of a frozen GGUF model on SFT data.

Prints the config, a BEFORE greedy answer to a held prompt, one line per
optimizer step (loss, tokens/s, a progress bar), then the AFTER answer; saves a
checkpoint directory (adapters.safetensors, optimizer.safetensors,
trainer_state.json written last). `--verify-grads` replaces the run with the
gradient checks on the real model and exits non-zero if one fails.
"""
from __future__ import annotations

import json

from ..errors import UserError
from ._args import InputFile, add_threads_flag, progress_log

NAME = "finetune"
HELP = "LoRA fine-tune a frozen (quantized) GGUF model on SFT data (pairs, alpaca, chat messages, ShareGPT)"
DESCRIPTION = (HELP + ". With no --data it trains the built-in five-pair pirate dataset "
               "(\"Ahoy! ... matey.\"); watch the loss fall and the AFTER answer change style.")


# the fields of FinetuneSpec this command's flags stand for (jobs/spec.add_field_flags: their help, type and
# choices come from the spec, as `fucina launch finetune`'s do); None where "not given" differs from a value
_UNSET = ("data", "val_data", "lr")


def add_arguments(p):
    from ..finetune.spec import FinetuneSpec
    from ..jobs.spec import add_field_flags
    files = {"model": dict(required=True, type=InputFile("GGUF file")), "data": dict(type=InputFile("JSONL file")),
             "val_data": dict(type=InputFile("JSONL file"))}
    add_field_flags(p, FinetuneSpec, dest="{}", defaults=True, unset=_UNSET, overrides=files)
    p.add_argument("--save", metavar="DIR", help="the run directory: the final checkpoint is committed here "
                   "(default: runs/finetune-<time>)")
    p.add_argument("--load", metavar="DIR", help="the older spelling of --resume DIR")
    p.add_argument("--trainers", type=int, default=0, metavar="N",
                   help="run the job on the multiprocess runtime with N trainer processes (they map the GGUF "
                        "read-only); 0 = every task in this process, the quickest for small models; same bits")
    p.add_argument("--inprocess", action="store_true", help="run every task inline in this process (the default "
                   "unless --trainers N)")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint dir or a run dir's newest checkpoint "
                   "(adapters, optimizer, step; the checkpoint's batch size, lr, warm-up, decay and --pack win over "
                   "the flags)")
    add_threads_flag(p, 0, "this process and of each trainer process (0: each trainer takes one)")
    p.add_argument("--verify-grads", action="store_true", help="instead of training: zero-structure, grad-norm audit, "
                                                               "Taylor and frozen-base checks; exit 1 on failure")
    p.add_argument("--json", action="store_true", help="print one JSON summary line on stdout (progress goes to "
                                                       "stderr)")


def add_data_arguments(p, data_help="JSONL file of samples (default: the built-in pirate pairs); formats in --format"):
    """The --data flags, shared with es-finetune and eval."""
    from ..llm.data import FORMATS, MAX_RECORD_BYTES
    p.add_argument("--data", type=InputFile("JSONL file"), help=data_help)
    p.add_argument("--format", choices=("auto",) + FORMATS, default="auto",
                   help="the --data format: instruction/response pairs, alpaca (instruction, input, output), chat "
                        "messages or ShareGPT conversations; auto = read from the first record's fields")
    p.add_argument("--instruction-key", default="instruction", help="JSONL key holding the instruction (pairs)")
    p.add_argument("--response-key", default="response", help="JSONL key holding the response (pairs)")
    p.add_argument("--max-record-bytes", type=int, default=MAX_RECORD_BYTES, metavar="N",
                   help="refuse a JSONL line over N bytes before parsing it")


def load_data(args):
    from ..llm.data import load_jsonl
    return load_jsonl(args.data, args.instruction_key, args.response_key, format=args.format,
                      max_record_bytes=args.max_record_bytes)


def _targets(text):
    return tuple(t.strip() for t in text.split(",") if t.strip())


def default_lr(model_path):
    """--lr's default for this GGUF (finetune/spec.default_lr)."""
    from ..finetune.spec import default_lr as by_width
    from ..llm.gguf import open_gguf
    return by_width(open_gguf(model_path))


def _check_args(args):
    for flag, value, low in (("--steps", args.steps, 0), ("--batch-size", args.batch_size, 1),
                             ("--seq-max", args.seq_max, 1), ("--trainers", args.trainers, 0),
                             ("--save-every", args.checkpoint_every, 0), ("--max-new-tokens", args.max_new_tokens, 0)):
        if value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    if args.checkpoint_every and not args.save:
        raise UserError("--save-every needs --save DIR (the periodic checkpoints go to DIR/checkpoint-step-N)")
    if not args.lr:  # not given, or 0: by the model's width (the spec's 0)
        args.lr = default_lr(args.model)
    if args.lr < 0:
        raise UserError(f"--lr must be positive (or 0: by the model's width), got {args.lr}")
    if args.inprocess and args.trainers:
        raise UserError(f"--inprocess runs every task in this process; it cannot have --trainers {args.trainers}")
    if args.load and args.resume and args.load != args.resume:
        raise UserError("--load is the older spelling of --resume: give one of them")
    from ._args import check_tensorboard
    check_tensorboard(args)


def _resume_point(path, flag="--resume"):
    """The checkpoint to resume from: a checkpoint dir, or a run dir's newest committed one (its
    checkpoint-step-N/ or, if it has none, the run dir itself, where a finished run commits its final state)."""
    import os

    from ..runtime import ckpt
    if not os.path.exists(path):
        raise UserError(f"{flag} {path}: no such directory")
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path}: not a directory (pass a checkpoint directory or a run directory)")
    latest = ckpt.latest_checkpoint(path)
    return latest if latest is not None else ckpt.resolve(path)


def spec_of(args, resume=None):
    """The finetune job's spec from the flags; a resumed run keeps the checkpoint's window, lr and warm-up."""
    import dataclasses
    import os

    from ..finetune.spec import FinetuneSpec
    from ..jobs.spec import build
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(FinetuneSpec)}
    fields.update(model=os.path.abspath(args.model), data=os.path.abspath(args.data) if args.data else "",
                  val_data=os.path.abspath(args.val_data) if args.val_data else "",
                  lr=args.lr if args.lr is not None else default_lr(args.model))
    if resume is not None:
        from ..runtime import ckpt
        stored = ckpt.read_state(resume).config.get("spec") or {}
        stored.setdefault("batch_size", stored.get("micro_batches"))  # the field's name before `batch_size`
        for name in ("batch_size", "lr", "warmup", "decay", "pack"):  # the checkpoint's batch and schedule win
            if stored.get(name) is not None:
                fields[name] = stored[name]
    return build(FinetuneSpec, fields, where="flags")


def build(args, log):
    """Session, tokenizer and the rest from the flags, for --verify-grads (which probes one process's trainer)."""
    from ..finetune.build import loader_of
    from ..finetune.job import Finetune
    from ..finetune.session import Session
    job = Finetune(spec_of(args))
    trainer = job.trainer()
    optimizer = job.make_optimizer(trainer.named_parameters())
    loader = loader_of(job.spec, len(job.samples))
    session = Session(trainer, optimizer, job.samples, loader, accum_steps=job.spec.batch_size, clip=args.clip,
                      lr=job.spec.lr, warmup=args.warmup, decay=job.spec.decay, total=job.steps)
    return session, job



def _default_run_dir():
    from ._args import default_run_dir
    return default_run_dir("finetune")


def run(args):
    import os

    from ..finetune.job import Finetune
    from ..finetune.model import check_resume_config
    from ..jobs.spec import to_dict
    from ..runtime import ckpt
    from ..threads import pin_threads
    from .launch import _progress

    _check_args(args)
    pin_threads(args.threads)
    log = progress_log(args)

    if args.verify_grads:
        from ..finetune.session import verify_grads
        session, job = build(args, log)
        log(_banner(args, job, "in-process"))
        return 0 if verify_grads(session, log) else 1
    resume = args.resume or args.load
    resume = str(_resume_point(resume, "--resume" if args.resume else "--load")) if resume else None
    job = Finetune(spec_of(args, resume))
    trainer = job.trainer()
    order = [n for n, _, _ in job.param_layout()]
    start = 0
    if resume:
        state = ckpt.read_state(resume)
        check_resume_config(state.config, trainer, f"{resume}/trainer_state.json")
        trainer.load_adapter_tensors(ckpt.read_params(resume, order=order), source=resume)
        start = state.macro_step
        log(f"resumed {resume}: optimizer step {start}; batch size {job.spec.batch_size}, lr {job.spec.lr:g}, "
            f"warm-up {job.spec.warmup}, decay {job.spec.decay}{', packed' if job.spec.pack else ''} from the "
            "checkpoint")
    in_step_dir = resume and os.path.basename(resume).startswith("checkpoint-step-")
    run_dir = args.save or (os.path.dirname(resume) if in_step_dir else resume) or _default_run_dir()
    if not resume and (ckpt.latest_checkpoint(run_dir) or ckpt.is_committed(run_dir)):
        raise UserError(f"{run_dir} already holds checkpoints: pass --resume {run_dir} or choose another --save DIR")
    mode = "in-process" if not args.trainers else f"trainers {args.trainers}"
    log(_banner(args, job, mode))
    before = job.answer(trainer)
    log(f"BEFORE  {job.prompt()!r} -> {before!r}")
    if start >= job.steps:
        log(f"nothing to do: the run is already at step {start} of {job.steps}")
        summary = {"steps": start, "adapters_sha256": _sha(trainer)}
    else:
        os.makedirs(run_dir, exist_ok=True)
        # only the multiprocess runtime publishes a live view; an in-process run writes metrics.jsonl alone
        log(f"run dir {run_dir}" + (f" (watch it with `fucina monitor --run-dir {run_dir}`)" if args.trainers else ""))
        if not args.trainers:
            from ..runtime.inprocess import run_inprocess
            watch = DivergenceWatch(job.spec, log)
            with _progress(job.steps, args.json) as on_step:
                summary = run_inprocess(job, run_dir, resume=resume, log=log,
                                        on_step=lambda record: (watch(record), on_step(record)))
            from ..runtime.metrics import plot_run
            summary["plot"] = plot_run(run_dir)
        else:
            from ..runtime.launch import Supervisor
            sup = Supervisor("finetune", to_dict(job.spec), run_dir, trainers=args.trainers, resume=resume,
                             threads=max(1, args.threads), quiet=args.json)  # 0: one per trainer, not every core each
            with _progress(job.steps, args.json, sup.events_endpoint, sup.client_key):
                summary = sup.run()
    if summary.get("run_dir"):  # the trained adapters, wherever they were trained
        trainer.load_adapter_tensors(ckpt.read_params(summary["run_dir"], order=order), source=summary["run_dir"])
    after = job.answer(trainer)
    log(f"AFTER   {job.prompt()!r} -> {after!r}")
    losses, elapsed_ms, supervised = _this_run(job, summary.get("run_dir"), start)
    if losses and DivergenceWatch.diverged(losses[0], max(losses)):
        log(DivergenceWatch(job.spec, log).message(losses[0], max(losses)))
    if losses:
        drop = 100.0 * (1.0 - losses[-1] / losses[0]) if losses[0] else 0.0
        log(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({drop:.1f}% lower) in {len(losses)} steps, "
            f"{summary['elapsed_s']:.1f} s, {supervised / max(summary['elapsed_s'], 1e-9):.1f} supervised tok/s")
        log(f"saved {run_dir} (adapters.safetensors, optimizer.safetensors, trainer_state.json; "
            f"checkpoint-step-N/, metrics.jsonl, loss.png)")
    if summary.get("steps", job.steps) < job.steps:
        log(f"early stop at step {summary['steps']} of {job.steps}: {job.spec.patience} evaluations in a row without "
            f"a lower val_loss (--patience {job.spec.patience}); its checkpoint is the run's last")
    best = _best(run_dir)
    if best:
        log(f"best val_loss {best['val_loss']:.4f} at step {best['step']}: its adapters are in "
            f"{os.path.join(run_dir, 'best')}")
    if args.json:
        print(json.dumps({"initial_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
                          "before": before, "after": after, "steps": summary["steps"],
                          "adapters_sha256": summary["adapters_sha256"],
                          "params_sha256": summary.get("params_sha256"), "run_dir": summary.get("run_dir"),
                          "mode": mode, "ms_per_step": elapsed_ms / max(1, len(losses)),
                          "val_loss": _last_eval(summary.get("run_dir")), "best": best,
                          "supervised_tokens_per_s": 1e3 * supervised / elapsed_ms if losses else None}))
    return 0


def _banner(args, job, mode):
    t, c = job.trainer(), job.trainer().config
    return (f"fucina finetune: {args.model} ({c.layers} layers, hidden {c.hidden}); LoRA rank {t.rank} alpha "
            f"{t.alpha:g} on {','.join(t.targets)}: {t.n_parameters():,} trainable parameters; {_count(job.pairs)}; "
            f"lr {job.spec.lr:g} ({_schedule(job)}); batch {job.spec.batch_size}{' packed' if job.spec.pack else ''}; "
            f"{job.steps} steps; {job.spec.optimizer}; {mode}")


def _schedule(job):
    s = job.spec
    return f"warm-up {s.warmup}, {s.decay}" if s.warmup else s.decay


class DivergenceWatch:
    """Says loudly, once, when the training loss rises far above where it started (the learning rate is too high
    for this model, or too many projections are adapted): the AFTER answer would be garbage, and a loss curve
    nobody reads is no warning."""

    FACTOR, MARGIN = 2.0, 1.0  # "far above": more than twice the first step's loss and at least a nat more

    def __init__(self, spec, log):
        self.spec, self.log, self.first, self.said = spec, log, None, False

    @classmethod
    def diverged(cls, first, loss):
        return loss > max(cls.FACTOR * first, first + cls.MARGIN)

    def message(self, first, loss):
        s = self.spec
        return (f"WARNING: the training loss rose from {first:.4f} to {loss:.4f}: the run is diverging and the "
                f"adapters will garble the model's answers. Lower the learning rate (--lr {s.lr / 10:g}; 1e-4 to "
                f"2e-4 suits real 135M-1B models) or adapt fewer projections (--targets q,k,v,o; now {s.targets})")

    def __call__(self, record):
        loss = record.get("loss")
        if loss is None:
            return
        if self.first is None:
            self.first = loss
        elif not self.said and self.diverged(self.first, loss):
            self.said = True
            self.log(self.message(self.first, loss))


def _best(run_dir):
    """RUN_DIR/best/best.json of --keep best, or None."""
    import os
    path = os.path.join(run_dir, "best", "best.json")
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def _last_eval(run_dir):
    """The last validation loss of the run's metrics.jsonl, or None."""
    from ..runtime.metrics import read_metrics
    if not run_dir:
        return None
    evals = [r["eval"] for r in read_metrics(run_dir) if r.get("kind") == "metrics" and r.get("eval") is not None]
    return evals[-1] if evals else None


def _count(records):
    """'5 pairs', '12 conversations' or '3 pairs and 9 conversations' (multi-turn records are not pairs)."""
    from ..llm.data import Pair
    pairs = sum(1 for r in records if isinstance(r, Pair))
    parts = [f"{n} {word}{'s' if n != 1 else ''}" for n, word in ((pairs, "pair"), (len(records) - pairs,
                                                                              "conversation")) if n]
    return " and ".join(parts) or "0 samples"


def _sha(trainer):
    from ..finetune.model import adapters_sha256
    return adapters_sha256(trainer)


def _this_run(job, run_dir, start):
    """(losses of the steps this run made, their summed step ms, their supervised tokens) from metrics.jsonl
    (the last record of a step wins: a restarted generation re-logs the steps it re-ran)."""
    from ..runtime.metrics import read_metrics
    if not run_dir:
        return [], 0.0, 0
    records = {r["step"]: r for r in read_metrics(run_dir) if r.get("kind") == "metrics" and r["step"] > start}
    steps = sorted(records)
    supervised = sum(job.supervised_tokens(step - 1) for step in steps)
    return [records[s]["loss"] for s in steps], sum(records[s].get("step_ms", 0.0) for s in steps), supervised
