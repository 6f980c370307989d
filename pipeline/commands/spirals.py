"""`fucina spirals`: the two-spirals gauntlet (train, checkpoint, bit-exact resume, infer).

Runs pipeline/train/gauntlet.py for each optimizer recipe and exits non-zero
if any resumed run differs from the uninterrupted one by a single bit.
Trade-off: one thread by default; 400 points are too few for a second
thread to pay for its synchronisation.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time

from pipeline.commands._args import add_threads_flag
from pipeline.errors import UserError
from pipeline.threads import pin_threads

NAME = "spirals"
HELP = "two-spirals gauntlet: every optimizer trains, checkpoints halfway, resumes bit-exact, infers"
DESCRIPTION = """For each optimizer: (1) train the 2-64-64-2 tanh MLP full-batch on 400 spiral
points for --steps steps, checkpointing at steps/2; (2) build a fresh model from
another init seed and a fresh optimizer, load the checkpoint, replay the second
half and require max |delta param| == 0; (3) load the final weights into a
gradient-free model and report its accuracy. Exit status 1 if any resume is not
bit-exact."""


def _recipes():
    from pipeline.train.gauntlet import RECIPES
    return RECIPES


def add_arguments(parser):
    parser.add_argument("--optimizer", action="append", metavar="NAME",
                        help="run only these recipes (repeatable or comma-separated): "
                             "sgd, adam, adamw, muon, apollo, apollo-mini, lion, groups (default: all)")
    parser.add_argument("--steps", type=int, default=2000,
                        help="full-batch steps per run; the checkpoint is at steps/2")
    parser.add_argument("--run-dir", default=None,
                        help="directory for the checkpoints (<run-dir>/<optimizer>/checkpoint-step-N); "
                             "default: a temporary directory removed at exit")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data noise and of the phase-1 init")
    parser.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP")
    add_threads_flag(parser, 1)
    parser.add_argument("--min-accuracy", type=float, default=0.0,
                        help="also fail if a non-SGD run ends below this accuracy (fraction, e.g. 0.99)")
    parser.add_argument("--sabotage", choices=["swap-biases", "restart-schedule"], default=None,
                        help="break phase 2 on purpose to watch the bit-exact gate fail: register b1/b2 unnamed "
                             "and swapped, or restart the lr schedule at 0 (only the groups recipe has one)")
    parser.add_argument("--json", action="store_true",
                        help='print {"runs": [{"name", "loss", "accuracy", "resume_max_abs_diff", '
                             '"inference_accuracy", ...}]} instead of text')


def selected(values):
    """--optimizer values (repeated and/or comma lists) -> recipe names in table order."""
    recipes = _recipes()
    if not values:
        return list(recipes)
    names = [n.strip().lower() for v in values for n in v.split(",") if n.strip()]
    unknown = [n for n in names if n not in recipes]
    if unknown:
        raise UserError(f"spirals: unknown --optimizer {', '.join(unknown)} (choose from {', '.join(recipes)})")
    return [n for n in recipes if n in names]


def run(args):
    if args.steps < 2:
        raise UserError(f"spirals: --steps must be >= 2 (the checkpoint is at steps/2), got {args.steps}")
    if args.hidden < 1:
        raise UserError("spirals: --hidden must be >= 1")
    names = selected(args.optimizer)
    pin_threads(args.threads)
    from pipeline.train.gauntlet import run_recipe

    say = (lambda *a: None) if args.json else print
    say(f"two spirals: 400 points, MLP 2-{args.hidden}-{args.hidden}-2 (tanh), full-batch, {args.steps} steps")
    say(f"optimizers: {', '.join(names)}; seed {args.seed}; threads {args.threads}"
        + (f"; SABOTAGE {args.sabotage}" if args.sabotage else ""))
    t0 = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fucina-spirals-") as tmp:
        run_dir = args.run_dir or tmp
        for name in names:
            r = run_recipe(_recipes()[name], run_dir, steps=args.steps, seed=args.seed, hidden=args.hidden,
                           sabotage=args.sabotage)
            runs.append(r)
            verdict = "bit-exact" if r["bit_exact"] else "NOT bit-exact"
            say(f"[{name}] trained {args.steps} steps: loss {r['loss']:.4g}  accuracy {100 * r['accuracy']:.1f}%")
            say(f"[{name}] resume from step {r['resume_from']}: "
                f"max |delta param| = {r['resume_max_abs_diff']:g} ({verdict})")
            say(f"[{name}] inference from checkpoint: accuracy {100 * r['inference_accuracy']:.1f}%")
    seconds = time.perf_counter() - t0
    broken = [r["name"] for r in runs if not r["bit_exact"]]
    weak = [r["name"] for r in runs if r["accuracy"] < args.min_accuracy and not _recipes()[r["name"]].sgd_family]
    if args.json:
        json.dump({"steps": args.steps, "seconds": round(seconds, 2), "runs": runs}, sys.stdout, indent=1)
        print()
    else:
        print(f"{len(runs)} runs in {seconds:.1f} s")
    if broken:
        print(f"spirals: resume NOT bit-exact for {', '.join(broken)}", file=sys.stderr)
    if weak:
        print(f"spirals: accuracy below {args.min_accuracy} for {', '.join(weak)}", file=sys.stderr)
    return 1 if broken or weak else 0
