"""Write the two-operand addition task of docs/es_finetune.md ("A real model"): train and held-out JSONL + its checker.

"What is A + B? Answer with just the number." for A, B in 1..--max (seeded, pairs drawn without replacement
per file; the held-out file leaves out every pair of the training file), and `lastint.py`, whose
`reward(prompt, completion, reference)` is 1.0 when the LAST integer of the answer equals A + B, else 0.0.

    python tools/make_addition_task.py --out-dir add50 --train 64 --heldout 128 --max 50
    fucina eval --model M.gguf --data add50/heldout.jsonl --reward add50/lastint.py:reward --n 128 --json
"""
from __future__ import annotations

import argparse
import json
import os
import random

LASTINT = ("import re\n\n\ndef reward(prompt, completion, reference):\n"
           "    \"\"\"1.0 when the last integer of the answer is the reference sum (commas dropped), else 0.0.\"\"\"\n"
           "    found = re.findall(r'-?\\d+', completion.replace(',', ''))\n"
           "    return 1.0 if found and found[-1] == reference.strip() else 0.0\n")


def pairs(seed: int, n: int, top: int, exclude=frozenset()):
    """n distinct (A, B) pairs from 1..top, seeded, none in exclude."""
    pool = [(a, b) for a in range(1, top + 1) for b in range(1, top + 1) if (a, b) not in exclude]
    if n > len(pool):
        raise SystemExit(f"--max {top} has only {len(pool)} pairs left for {n} problems")
    return random.Random(seed).sample(pool, n)


def write(path, items):
    with open(path, "w") as f:
        for a, b in items:
            f.write(json.dumps({"instruction": f"What is {a} + {b}? Answer with just the number.",
                                "response": str(a + b)}) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True, help="directory for train.jsonl, heldout.jsonl and lastint.py")
    ap.add_argument("--train", type=int, default=64, help="training problems (default 64)")
    ap.add_argument("--heldout", type=int, default=128, help="held-out problems (default 128)")
    ap.add_argument("--max", type=int, default=50, help="largest operand (default 50)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the training draw; held-out uses seed+1 (default 1)")
    args = ap.parse_args(argv)
    train = pairs(args.seed, args.train, args.max)
    held = pairs(args.seed + 1, args.heldout, args.max, exclude=frozenset(train))
    os.makedirs(args.out_dir, exist_ok=True)
    write(os.path.join(args.out_dir, "train.jsonl"), train)
    write(os.path.join(args.out_dir, "heldout.jsonl"), held)
    with open(os.path.join(args.out_dir, "lastint.py"), "w") as f:
        f.write(LASTINT)


if __name__ == "__main__":
    main()
