"""Write Countdown SFT pairs (JSONL) for `fucina sft --data` or `fucina finetune --data`: the ES demo's warm start.

Each line is {"instruction": problem prompt, "response": "<answer>SOLUTION</answer>"} for problems
0..N-1 of the built-in set of --seed (pipeline/es/countdown.py): the same prompts and reference
responses `fucina es-finetune --task countdown` builds. Use a --seed other than the ES run's
--task-seed so the ES problems are not the SFT ones (docs/es_finetune.md, "Countdown").

    python tools/make_countdown_sft.py --out countdown-sft.jsonl --seed 1 --size 256
    python tools/make_countdown_sft.py --out easy-sft.jsonl --seed 1 --size 512 --numbers 2 --max-number 9
    python tools/make_countdown_sft.py --out mid.jsonl --seed 1 --size 4096 --numbers 3 --max-number 20

--numbers and --max-number are `--task-numbers` and `--task-max-number` of es-finetune: pass the same
values to both.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.es.countdown import MAX_NUMBER, N_NUMBERS, problems  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    ap.add_argument("--seed", type=int, default=1, help="problem set seed (default 1; ES uses 0)")
    ap.add_argument("--size", type=int, default=256, help="number of problems")
    ap.add_argument("--numbers", type=int, default=N_NUMBERS, help=f"numbers per problem (default {N_NUMBERS})")
    ap.add_argument("--max-number", type=int, default=MAX_NUMBER, help=f"largest number (default {MAX_NUMBER})")
    args = ap.parse_args(argv)
    tasks = problems(args.seed, args.size, args.numbers, args.max_number)  # a bad knob fails before the file opens
    with open(args.out, "w") as f:
        for p in tasks:
            f.write(json.dumps({"instruction": p.prompt, "response": f"<answer>{p.solution}</answer>"}) + "\n")


if __name__ == "__main__":
    main()
