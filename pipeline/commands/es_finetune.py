"""`fucina es-finetune`: gradient-free (ES) fine-tuning of LoRA adapters over a frozen GGUF model.

The twin of `fucina finetune`: same model loading, pirate dataset / --data JSONL,
--shuffle loader, trainer forward and checkpoint layout; only the learning
signal differs (ES over the adapters or, --search full, every dense matrix;
reward = -mean CE on the iteration's batch or any --reward computed from the
members' greedy answers; no backward anywhere). Prints the config, a BEFORE greedy answer, one
line per iteration (mean reward, spread, ms, member-evals/s, a progress bar)
and the AFTER answer; `--json` prints one summary line.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

from ..errors import UserError
from ..es.countdown import check_difficulty
from ._args import InputFile, add_threads_flag, default_run_dir, progress_log

NAME = "es-finetune"
HELP = "gradient-free ES fine-tune of LoRA adapters on a frozen (quantized) GGUF model"
DESCRIPTION = (HELP + ". With no --data it trains the built-in five-pair pirate dataset. Every population member "
               "scores the same batch; the reward is the negative mean cross-entropy. ES needs many more "
               "forward passes than backprop needs steps: expect a measurable loss drop, not a converged style.")

SEARCHED = {"ab": "A and B", "b": "B only", "full": "every dense weight matrix",
            "lowrank": "every projection matrix by low-rank products"}
# ES defaults when the flags are not given (a resume takes the checkpoint's values instead)
ES_DEFAULTS = {"sigma": 0.05, "alpha": 0.05, "population": 16, "antithetic": True, "shaping": "z_score",
               "noise": "iid", "anchor_decay": None, "anchor_lambda": 0.0, "batch": 5, "search": "ab"}


def add_arguments(p):
    from ..finetune.spec import ESFinetuneSpec
    from ..jobs.spec import add_field_flags
    overrides = {
        "model": dict(required=True, type=InputFile("GGUF file")), "data": dict(type=InputFile("JSONL file")),
        "reward": dict(action="append", metavar="SPEC[@W]", help=_reward_help()),
        "search": dict(choices=("ab", "b", "full", "lowrank"), help="what ES perturbs: ab = LoRA A and B "
                       "(default), b = only B (A stays at its random init), full = every dense (F32/F16/BF16) weight "
                       "matrix of the model, in place (in this process only), lowrank = every projection matrix by "
                       "rank --noise-rank products sigma * A B^T / sqrt(r), all members in one batched forward "
                       "(EGGROLL; F32 or --dequantize weights; docs/es_finetune.md)"),
        "anchor_decay": dict(choices=("l1", "l2"))}
    # ES_DEFAULTS' flags and --es-seed stay None when not given: a resume takes the checkpoint's values instead
    unset = ("data", "es_seed", "reward", *ES_DEFAULTS)
    add_field_flags(p, ESFinetuneSpec, dest="{}", defaults=True, unset=unset, overrides=overrides)
    p.add_argument("--eval-samples", type=int, default=32,
                   help="initial/final loss is measured on the first N training samples (unperturbed adapters)")
    p.add_argument("--save", metavar="DIR", help="write the final checkpoint directory here (--save-every: also "
                   "DIR/checkpoint-step-N)")
    p.add_argument("--workers", "--members", type=int, default=0, metavar="N", dest="workers",
                   help="run as an ES job of the pipeline runtime with N es_member processes, each mapping the GGUF "
                        "read-only and keeping its own replica (0 = score the members in this process); same bits")
    p.add_argument("--inprocess", action="store_true", help="score the members in this process (as --workers 0)")
    p.add_argument("--out", default=None, metavar="RUN_DIR",
                   help="--workers: the run directory (metrics.jsonl, checkpoint-step-N, sockets; "
                        "default runs/es-finetune-<time>); `fucina monitor RUN_DIR` watches it")
    p.add_argument("--liveness", type=float, default=60.0,
                   help="--workers: seconds of silence before a member is declared lost (must exceed one chunk "
                        "of member evaluations, including the first call's numba compilation)")
    add_threads_flag(p, 1, "this process and of each es_member (1: the forwards are small)")
    p.add_argument("--prompt", default=None, help="held prompt for the BEFORE/AFTER answers (default: the first "
                                                  "training instruction)")
    p.add_argument("--json", action="store_true", help="print one JSON summary line on stdout (progress goes to "
                                                       "stderr)")


def _reward_help(default_help="nll (default; -mean CE of the reference responses), ",
                 what="what a member is scored by: "):
    return (what + default_help + "exact (greedy answer == reference after normalisation), countdown (the --task "
            "countdown checker), rule:format, rule:length=LO,HI, rule:regex=PATTERN, or PATH.py:FUNC (your function "
            "reward(prompt, completion, reference) -> float). Generation rewards decode greedily up to "
            "--max-new-tokens, stopping at the GGUF's end-of-generation tokens. Give --reward several times, each "
            "optionally SPEC@WEIGHT (weight 1 when not given), to score the weighted sum, e.g. --reward "
            "'rule:regex=<answer>@0.2' --reward countdown (format credit + correctness)")


def add_reward_arguments(p, default_help="nll (default; -mean CE of the reference responses), ",
                         what="what a member is scored by: "):
    """--reward (repeatable, SPEC[@WEIGHT]) and --reward-timeout for `fucina eval` (es-finetune takes them from
    ESFinetuneSpec's fields)."""
    from ..finetune.spec import ESFinetuneSpec
    from ..jobs.spec import add_field_flags
    p.add_argument("--reward", default=None, metavar="SPEC[@W]", action="append", help=_reward_help(default_help, what))
    add_field_flags(p, ESFinetuneSpec, names=["reward_timeout"], dest="{}", defaults=True)


def _check_args(args):
    for flag, value, low in (("--iterations", args.iterations, 0), ("--seq-max", args.seq_max, 1),
                             ("--save-every", args.save_every, 0), ("--max-new-tokens", args.max_new_tokens, 0),
                             ("--eval-samples", args.eval_samples, 1),
                             ("--workers", args.workers, 0),
                             ("--member-batch", args.member_batch, 0),
                             ("--batch", args.batch if args.batch is not None else 1, 1)):
        if value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    if args.save_every and not args.save:
        raise UserError("--save-every needs --save DIR (the periodic checkpoints go to DIR/checkpoint-step-N)")
    if args.anchor_lambda is not None and args.anchor_decay is None:
        raise UserError("--anchor-lambda needs --anchor-decay l1|l2")
    if args.task and args.data:
        raise UserError("--task and --data exclude each other (a built-in task brings its own prompts)")
    if args.task_size < 1:
        raise UserError(f"--task-size must be >= 1, got {args.task_size}")
    if args.task == "countdown":
        check_difficulty(args.task_numbers, args.task_max_number)
    check_reward_args(args)
    from ._args import check_tensorboard
    check_tensorboard(args)


def check_reward_args(args):
    """The --reward / --task combinations that cannot work, refused before any model is loaded."""
    from ..es.rewards import split_specs
    if getattr(args, "reward_timeout", 0) < 0:
        raise UserError(f"--reward-timeout must be >= 0, got {args.reward_timeout}")
    reward = reward_spec(args)
    names = [part for part, _, _ in split_specs(reward)]
    if "countdown" in names and args.task != "countdown":
        raise UserError("--reward countdown checks Countdown problems: use it with --task countdown")
    if "exact" in names and args.task == "countdown":
        raise UserError("--reward exact compares with reference answers; a Countdown problem has many: "
                        "use --reward countdown")
    if reward != "nll" and args.max_new_tokens < 1:
        raise UserError(f"--reward {reward} generates answers: --max-new-tokens must be >= 1")


def reward_spec(args) -> str:
    """The --reward value(s) as one spec string (several joined by SPEC_SEP), or the task's default."""
    from ..es.rewards import join_specs
    if isinstance(args.reward, (list, tuple)):
        return join_specs(args.reward)
    if args.reward:
        return args.reward
    return "countdown" if args.task == "countdown" else "nll"


def _es_settings(args, state, log):
    """ES config + batch + search: the checkpoint's on resume (explicit flags that differ are reported), else
    flags/defaults."""
    from ..finetune.es import es_run_from_state

    flags = {k: getattr(args, k) for k in ES_DEFAULTS}
    flags["seed"] = args.es_seed
    if flags["seed"] is None and state is None:
        from pipeline.kernels.rng import derive_seed
        flags["seed"] = derive_seed(args.seed, 2)  # the trainer derives streams 0 (adapter init) and 1 (dropout)
    if state is not None:
        source = f"{args.load}/trainer_state.json"
        stored, stored["batch"], stored["search"] = es_run_from_state(state.config, source)
        ignored = [f"--{k.replace('_', '-')} {v}" for k, v in flags.items()
                   if v is not None and k in stored and stored[k] != v]
        if ignored:
            log(f"resume: the checkpoint's ES settings win; ignoring {', '.join(ignored)}")
        return {k: stored[k] for k in list(ES_DEFAULTS) + ["seed", "restore_mode"]}
    settings = {k: (ES_DEFAULTS[k] if v is None else v) for k, v in flags.items() if k != "seed"}
    if settings["anchor_decay"] is not None and args.anchor_lambda is None:
        raise UserError("--anchor-decay needs --anchor-lambda (reference values: l2 10, l1 0.01 at alpha 5e-4)")
    settings.update(seed=flags["seed"], restore_mode="snapshot")
    return settings


def build(args, log):
    """The ES run from the flags (+ --load): the job spec they stand for, built as every es_member builds its
    replica (pipeline/finetune/build.build_es); -> (run, tokenizer, encoder, template, records, options, config)."""
    from ..finetune.build import build_es
    from ..finetune.spec import ESFinetuneSpec
    from ..jobs.spec import build as build_spec
    from ..runtime.ckpt import read_state

    settings = _es_settings(args, read_state(args.load) if args.load else None, log)
    fields = spec_of(args, settings)
    search = fields["search"]
    if search == "full" and args.workers and not getattr(args, "inprocess", False):
        raise UserError("--search full scores members in this process: drop --workers")
    spec = build_spec(ESFinetuneSpec, {**fields, "search": "ab" if search == "full" else search})  # full: in here
    parts = build_es(spec, log, search=search, dequantize=args.dequantize)
    text = parts.text
    return parts.run, text.tokenizer, text.encoder, text.template, parts.records, text.options, parts.run_config


def run(args):
    from ..threads import pin_threads

    _check_args(args)
    pin_threads(args.threads)
    log = progress_log(args)

    if args.inprocess:
        args.workers = 0
    es_run, tokenizer, encoder, template, pairs, options, run_config = build(args, log)
    return _train(args, log, es_run, tokenizer, encoder, template, pairs, options, run_config)


# spec field -> its "not given" value: "" and -1 in a spec are a flag left at None on the command line
_OPTIONAL = {"data": "", "chat_template": "", "task": "", "es_seed": -1, "data_seed": -1, "reward": "",
             "anchor_decay": "", "load": ""}


def spec_of(args, settings=None) -> dict:
    """The es-finetune job's fields from the flags, the ES settings resolved as this run takes them (the
    checkpoint's on --load): what every replica of a runtime run builds from (finetune/build.build_es)."""
    from ..finetune.spec import ESFinetuneSpec
    if settings is None:
        state = None
        if args.load:
            from ..runtime.ckpt import read_state
            state = read_state(args.load)
        settings = _es_settings(args, state, log=lambda m: None)
    fields = {}
    for f in dataclasses.fields(ESFinetuneSpec):
        value = settings[f.name] if f.name in ES_DEFAULTS else getattr(args, f.name)
        fields[f.name] = _OPTIONAL[f.name] if f.name in _OPTIONAL and value is None else value
    fields["reward"] = reward_spec(args) if args.reward else ""  # several --reward flags travel as one string
    fields["es_seed"] = settings["seed"]  # the resolved noise seed (settings' "seed"; the spec's seed is the run's)
    fields["anchor_lambda"] = fields["anchor_lambda"] or 0.0
    return fields


def _answer(trainer, tokenizer, encoder, template, prompt, options, max_new):
    from ..llm.data import encode_prompt
    ids = encode_prompt(encoder, template, prompt, options)
    return tokenizer.decode(trainer.generate(ids, max_new, stop_ids=template.stop_ids))


def _bar(done, total, width=20):
    filled = width if total == 0 else int(width * done / total)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _train(args, log, es_run, tokenizer, encoder, template, pairs, options, run_config):
    from ..finetune.model import adapters_sha256, batch_loss
    from ..es.rewards import describe
    from ..runtime.ckpt import params_sha256

    trainer, cfg = es_run.trainer, es_run.es.config
    eval_set = es_run.samples[:args.eval_samples]
    log(f"fucina es-finetune: {args.model} ({trainer.config.layers} layers, hidden {trainer.config.hidden}); "
        f"LoRA rank {trainer.rank} alpha {trainer.alpha:g} on {','.join(trainer.targets)}; ES searches "
        f"{SEARCHED[es_run.search]}: {es_run.n_searched():,} parameters; population "
        f"{cfg.population}{' antithetic' if cfg.antithetic else ''}, sigma {cfg.sigma:g}, alpha {cfg.alpha:g}, "
        f"{cfg.shaping}, noise {cfg.noise}, seed {cfg.seed}"
        f"{f', anchor {cfg.anchor_decay} lambda {cfg.anchor_lambda:g}' if cfg.anchor_decay else ''}; "
        f"{len(pairs)} {'problems' if args.task else 'pairs'}, batch {es_run.batch}, "
        f"reward {describe(run_config['reward'])}; "
        f"{f'{args.workers} es_member processes on the runtime' if args.workers else 'in-process'}")
    prompt = args.prompt or pairs[0].instruction
    before = _answer(trainer, tokenizer, encoder, template, prompt, options, args.max_new_tokens)
    log(f"BEFORE  {prompt!r} -> {before!r}")
    initial_loss = batch_loss(trainer, eval_set)
    log(f"loss on {len(eval_set)} training samples: {initial_loss:.4f}")
    scorer, center_reward = es_run.scorer, None
    if scorer.kind != "nll":  # the unperturbed adapters' reward: what the run is for
        eval_idx = range(min(args.eval_samples, len(scorer)))
        center_reward = lambda: scorer.score(trainer, eval_idx)  # noqa: E731
        initial_reward = center_reward()
        log(f"reward on {len(eval_idx)} training prompts: {initial_reward:.4f}")
    first, t_start = es_run.iteration, time.perf_counter()
    iterate = _iterate_on_runtime if args.workers else _iterate_inprocess
    rewards, reward_stats = iterate(args, log, es_run, run_config)
    elapsed = time.perf_counter() - t_start
    tied = [first + 1 + i for i, st in enumerate(reward_stats) if st["min"] == st["max"]]
    if tied:
        log(f"{len(tied)} of {len(reward_stats)} iterations had every member tie (iterations "
            f"{_ranges(tied)}): no learning signal in them")
    final_loss = batch_loss(trainer, eval_set)
    after = _answer(trainer, tokenizer, encoder, template, prompt, options, args.max_new_tokens)
    log(f"AFTER   {prompt!r} -> {after!r}")
    rewards_summary = {}
    if center_reward is not None:
        final_reward = center_reward()
        log(f"reward on {len(eval_idx)} training prompts: {initial_reward:.4f} -> {final_reward:.4f}")
        rewards_summary = {"initial_reward": initial_reward, "final_reward": final_reward}
    done = es_run.iteration - first
    if done:
        change = 100.0 * (1.0 - final_loss / initial_loss) if initial_loss else 0.0
        log(f"loss {initial_loss:.4f} -> {final_loss:.4f} ({change:.1f}% lower) in {done} iterations, {elapsed:.1f} s, "
            f"{done * cfg.population / elapsed:.1f} member-evals/s")
    else:
        log(f"nothing to do: the run is already at iteration {es_run.iteration} of --iterations {args.iterations}")
    if args.save:
        es_run.save(args.save, run_config)
        log(f"saved {args.save} (adapters.safetensors, trainer_state.json; ES keeps no optimizer state)")
    if args.json:
        print(json.dumps({"initial_loss": initial_loss, "final_loss": final_loss, "before": before, "after": after,
                          "iterations": es_run.iteration, "adapters_sha256": adapters_sha256(trainer),
                          "searched_sha256": params_sha256(es_run.es.named_arrays()),
                          "reward": run_config["reward"], "reward_means": rewards, "reward_stats": reward_stats,
                          "tied_iterations": tied, **rewards_summary,
                          "ms_per_iteration": 1e3 * elapsed / done if done else None,
                          "member_evals_per_s": done * cfg.population / elapsed if done else None}))
    return 0


def _iteration_line(args, it, first, stats, dt, population):
    return (f"iter {it:4d}/{args.iterations}  reward {stats['reward_mean']:9.4f} (std {stats['reward_std']:.4f}, "
            f"min {stats['reward_min']:9.4f}, max {stats['reward_max']:9.4f})  {dt * 1e3:7.0f} ms  "
            f"{population / dt:6.1f} member-evals/s  {_bar(it - first, args.iterations - first)}")


def _ranges(values) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _report_tie(log, es_run, run_config, it, stats):
    """A population whose members all scored the same gives ES nothing to learn from: say so, and what to try."""
    if stats["reward_min"] != stats["reward_max"]:
        return
    from ..es.rewards import tie_message
    cfg = es_run.es.config
    log(tie_message(run_config["reward"], stats["reward_min"], cfg.population, it, cfg.sigma, cfg.shaping))


def _iterate_inprocess(args, log, es_run, run_config):
    """Every member scored here, one iteration at a time; -> (reward means, reward stats) per iteration. No
    metrics.jsonl in here (no run directory): --tensorboard DIR gets each iteration's es/* scalars directly."""
    first, rewards, reward_stats = es_run.iteration, [], []
    tb = None
    if args.tensorboard and es_run.iteration < args.iterations:
        from ..runtime.tensorboard import EventWriter
        tb = EventWriter(args.tensorboard)
    try:
        while es_run.iteration < args.iterations:
            _one_iteration(args, log, es_run, run_config, first, rewards, reward_stats, tb)
    finally:
        if tb is not None:
            tb.close()
    return rewards, reward_stats


def _one_iteration(args, log, es_run, run_config, first, rewards, reward_stats, tb):
    t0 = time.perf_counter()
    stats = es_run.iteration_step()
    dt = time.perf_counter() - t0
    if tb is not None:
        from ..runtime.tensorboard import step_scalars
        population = es_run.es.config.population
        tb.scalars(es_run.iteration, step_scalars({"kind": "es_metrics", **stats, "step_ms": dt * 1e3,
                                                   "evals_per_s": population / max(dt, 1e-9)}))
    rewards.append(stats["reward_mean"])
    reward_stats.append({k: stats[f"reward_{k}"] for k in ("mean", "std", "min", "max")})
    it = es_run.iteration
    log(_iteration_line(args, it, first, stats, dt, es_run.es.config.population))
    _report_tie(log, es_run, run_config, it, stats)
    if args.save_every and it % args.save_every == 0 and it < args.iterations:
        from ..runtime.ckpt import checkpoint_dir
        es_run.save(checkpoint_dir(args.save, it), run_config)


def _iterate_on_runtime(args, log, es_run, run_config):
    """The es-finetune job on the runtime (args.workers es_members); the final checkpoint is loaded into es_run.

    Every replica builds from these flags (a --load included), so the run
    starts where es_run stands; the per-iteration lines come from the run's
    metrics.jsonl once it is done.
    """
    from ..finetune.es import REWARD_FILES_ENV, ESFinetuneJob
    from ..jobs.spec import build as build_spec
    from ..runtime.launch import Supervisor
    from ..runtime.metrics import read_metrics

    first, population = es_run.iteration, es_run.es.config.population
    if first >= args.iterations:
        return [], []
    run_dir = args.out or default_run_dir("es-finetune")
    spec = spec_of(args)
    log(f"es-finetune: {args.workers} es_member(s) on the runtime, run dir {run_dir}")
    env = dict(os.environ)  # the reward file the user named here is one the members spawned here may import
    env[REWARD_FILES_ENV] = os.pathsep.join(ESFinetuneJob(build_spec(ESFinetuneJob.Spec, spec)).reward_files())
    result = Supervisor("es-finetune", spec, run_dir, trainers=args.workers, liveness=args.liveness,
                        threads=args.threads, quiet=True, env=env).run()
    es_run.load(result["checkpoint"])
    rewards, reward_stats = [], []
    for rec in read_metrics(run_dir):
        if rec.get("kind") == "es_metrics" and rec["step"] > first:
            rewards.append(rec["reward_mean"])
            reward_stats.append({k: rec[f"reward_{k}"] for k in ("mean", "std", "min", "max")})
            log(_iteration_line(args, rec["step"], first, rec, rec["step_ms"] / 1e3, population))
            _report_tie(log, es_run, run_config, rec["step"], rec)
    return rewards, reward_stats
