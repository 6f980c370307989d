"""`fucina eval`: held-out accuracy / mean reward (with standard errors) of a model, optionally with adapters.

Greedy answers through the KV-cache decoder (what ES members are scored by), a
built-in task (--task countdown and its --task-* knobs) or --data JSONL with
any --reward; --workers W splits the items into W contiguous shards scored by
W processes (`fucina eval ... --shard LO:HI`, JSON on a pipe), with the same
numbers as one process. The model (plus --lora's adapters or ES checkpoint) is built by
pipeline/finetune/build.eval_model; the evaluation itself is pipeline/es/evaluate.py.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from ..errors import UserError
from ..es.countdown import MAX_NUMBER, N_NUMBERS, check_difficulty
from ..llm.chat import add_chat_template_argument
from ._args import InputFile, add_threads_flag, progress_log
from .es_finetune import add_reward_arguments, check_reward_args, reward_spec
from .finetune import add_data_arguments, load_data

NAME = "eval"
HELP = "held-out accuracy / mean reward (+- standard error) of a GGUF model, optionally with LoRA or ES adapters"
DESCRIPTION = (HELP + ". Greedy decoding; --task countdown (its --task-* knobs) or --data JSONL with --reward; "
               "--workers W gives the same numbers as one process.")
MAX_ERROR_TAIL = 2000  # characters of a failed shard's stderr shown


def add_arguments(p):
    p.add_argument("--model", required=True, type=InputFile("GGUF file"), help="the GGUF model to evaluate")
    p.add_argument("--lora", metavar="RUN", default=None,
                   help="adapters to apply: an es-finetune or finetune checkpoint directory, or a run directory "
                        "(its latest committed checkpoint-step-N); an es-finetune --search full checkpoint too")
    add_data_arguments(p, "JSONL file of the items to score (or --task); formats in --format; the first --n records")
    add_chat_template_argument(p)
    add_reward_arguments(p, default_help="countdown for --task countdown (default), ",
                         what="what an answer is scored by (needed with --data): ")
    p.add_argument("--task", choices=("countdown",), default=None,
                   help="a built-in task instead of --data: countdown = reach a target from numbers with + - * /")
    p.add_argument("--task-seed", type=int, default=7,
                   help="seed of the built-in task's problem set (default 7, where es-finetune's is 0: "
                        "held-out problems unless you ask for the trained ones)")
    p.add_argument("--task-numbers", type=int, default=N_NUMBERS, metavar="N",
                   help=f"countdown: numbers per problem, 2..6 (default {N_NUMBERS})")
    p.add_argument("--task-max-number", type=int, default=MAX_NUMBER, metavar="M",
                   help=f"countdown: the numbers are drawn from 1..M (default {MAX_NUMBER})")
    p.add_argument("--n", type=int, default=128, metavar="N",
                   help="items to score: the first N problems of the task set, or the first N records of --data")
    p.add_argument("--max-new-tokens", type=int, default=48, help="greedy tokens generated per answer")
    p.add_argument("--seq-max", type=int, default=256, help="refuse a prompt longer than this many tokens")
    p.add_argument("--batch", type=int, default=8, metavar="B",
                   help="items decoded together per pass (memory: B KV caches; the numbers do not depend on it)")
    p.add_argument("--workers", type=int, default=0, metavar="W",
                   help="score the items in W processes (contiguous shards; 0 = this process); same numbers")
    p.add_argument("--shard", default=None, metavar="LO:HI", help=argparse.SUPPRESS)  # a --workers child's part
    add_threads_flag(p, 1, "this process and of each worker")
    p.add_argument("--json", action="store_true", help="print one JSON line on stdout (progress goes to stderr)")


def _check_args(args):
    for flag, value, low in (("--n", args.n, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--seq-max", args.seq_max, 1), ("--batch", args.batch, 1),
                             ("--workers", args.workers, 0)):
        if value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    if bool(args.task) == bool(args.data):
        raise UserError("eval: give --task countdown or --data FILE (with --reward), one of them")
    if args.task == "countdown":
        check_difficulty(args.task_numbers, args.task_max_number)
    if args.data and not args.reward:
        raise UserError("eval --data needs --reward (exact, rule:..., PATH.py:FUNC, ...): what a correct answer is")
    check_reward_args(args)
    if reward_spec(args) == "nll":
        raise UserError("eval scores greedy answers: --reward nll (the teacher-forced loss) is not an answer reward")


def _shard(text, n):
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise UserError(f"--shard takes LO:HI, got {text!r}") from None
    if not 0 <= lo < hi <= n:
        raise UserError(f"--shard {text}: must satisfy 0 <= LO < HI <= {n}")
    return lo, hi


def build_items(args, text):
    """The evaluation items (prompt, prompt ids, reference) of the task or the data file, the first --n."""
    from ..finetune.build import prompt_items
    from ..llm.data import Pair
    if args.task == "countdown":
        from ..es import countdown
        tasks = countdown.problems(args.task_seed, args.n, args.task_numbers, args.task_max_number)
        return prompt_items([Pair(t.prompt, "") for t in tasks], text, tasks)
    pairs = load_data(args)
    if len(pairs) < args.n:
        raise UserError(f"--n {args.n}: {args.data} holds {len(pairs)} records")
    items = prompt_items(pairs[:args.n], text)
    for i, item in enumerate(items):
        if len(item.prompt_ids) > args.seq_max:
            raise UserError(f"{args.data}: record {i + 1}: the prompt is {len(item.prompt_ids)} tokens, over "
                            f"--seq-max {args.seq_max}")
    return items


def _score_here(args, lo, hi, log):
    from ..es.evaluate import item_rewards
    from ..es.rewards import parse_reward
    from ..finetune.build import eval_model, open_text

    text = open_text(args.model, getattr(args, "chat_template", None) or "", args.seq_max)
    items = build_items(args, text)[lo:hi]
    reward = parse_reward(reward_spec(args), timeout=args.reward_timeout)
    trainer = eval_model(text.gguf, args.lora, source=str(args.model))
    t0 = time.perf_counter()

    def progress(done, total):
        log(f"eval: {done}/{total} items scored, {time.perf_counter() - t0:.0f} s")

    return item_rewards(trainer, text.tokenizer.decode, items, reward, args.max_new_tokens, text.template.stop_ids,
                        batch=args.batch, start=lo, progress=progress)


def _child_argv(args, lo, hi):
    argv = [sys.executable, "-m", "pipeline.cli", "eval", "--model", str(args.model), "--n", str(args.n),
            "--max-new-tokens", str(args.max_new_tokens), "--seq-max", str(args.seq_max), "--batch",
            str(args.batch), "--threads", str(args.threads), "--reward-timeout", str(args.reward_timeout),
            "--shard", f"{lo}:{hi}", "--json"]
    if args.lora:
        argv += ["--lora", str(args.lora)]
    if args.chat_template:
        argv += ["--chat-template", str(args.chat_template)]
    for spec in args.reward or []:
        argv += ["--reward", spec]
    if args.task:
        argv += ["--task", args.task, "--task-seed", str(args.task_seed), "--task-numbers", str(args.task_numbers),
                 "--task-max-number", str(args.task_max_number)]
    else:
        argv += ["--data", str(args.data), "--format", args.format, "--instruction-key", args.instruction_key,
                 "--response-key", args.response_key, "--max-record-bytes", str(args.max_record_bytes)]
    return argv


def _score_workers(args, log):
    """The shards in args.workers processes; their rewards concatenated in item order."""
    from ..es.evaluate import shards
    cuts = shards(args.n, args.workers)
    procs = [subprocess.Popen(_child_argv(args, lo, hi), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for lo, hi in cuts]
    rewards, failure = [], None
    for (lo, hi), proc in zip(cuts, procs):
        out, err = proc.communicate()
        if proc.returncode != 0:
            tail = err.strip().splitlines()[-1][-MAX_ERROR_TAIL:] if err.strip() else f"status {proc.returncode}"
            failure = failure or f"eval worker for items {lo}:{hi} failed: {tail}"
            continue
        got = json.loads(out.strip().splitlines()[-1])["rewards"]
        if len(got) != hi - lo:
            failure = failure or f"eval worker for items {lo}:{hi} returned {len(got)} rewards"
        rewards += got
    if failure:
        raise UserError(failure)
    return rewards


def run(args):
    from ..es.evaluate import summarize
    from ..es.rewards import describe
    from ..threads import pin_threads

    _check_args(args)
    pin_threads(args.threads)
    log = progress_log(args)

    if args.shard is not None:  # one worker's part: its rewards, nothing else
        lo, hi = _shard(args.shard, args.n)
        print(json.dumps({"rewards": _score_here(args, lo, hi, lambda m: None)}))
        return 0
    t0 = time.perf_counter()
    what = (f"countdown (numbers {args.task_numbers}, max {args.task_max_number}, seed {args.task_seed})"
            if args.task else str(args.data))
    reward = reward_spec(args)
    log(f"fucina eval: {args.model}{f' + {args.lora}' if args.lora else ''} on {args.n} items of {what}, reward "
        f"{describe(reward)}, greedy, {args.max_new_tokens} new tokens, "
        f"{f'{args.workers} workers' if args.workers else 'in-process'}")
    if args.workers:
        rewards = _score_workers(args, log)
    else:
        rewards = _score_here(args, 0, args.n, log)
    wall = time.perf_counter() - t0
    s = summarize(rewards)
    log(f"mean reward {s['mean_reward']:.4f} +- {s['mean_reward_se']:.4f} (SE); solved {s['solved']}/{s['n']} = "
        f"{s['accuracy']:.4f} +- {s['accuracy_se']:.4f}; {wall:.1f} s")
    if args.json:
        print(json.dumps({**s, "model": str(args.model), "lora": args.lora, "reward": reward,
                          "task": args.task or None, "data": str(args.data) if args.data else None,
                          "workers": args.workers, "wall_s": wall, "rewards": rewards}))
    return 0
