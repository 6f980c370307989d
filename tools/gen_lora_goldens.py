"""Generate the goldens under tests/goldens/lora/.

    .venv/bin/python tools/gen_lora_goldens.py [--only perm|torch]

perm:  loader_perm.json — shuffled epoch permutations computed by an
       independent pure-Python splitmix64 + Fisher-Yates (the checkpoint
       contract of pipeline/llm/data.py), so a drift in either side fails.
torch: see the torch section below (an independent replica of the LoRA trainer).

Never imported at run time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "goldens", "lora")
MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _at(seed, i):
    return _mix64((seed + (i + 1) * GOLDEN) & MASK)


def _permutation(n, seed, epoch):
    perm = list(range(n))
    state = _at(seed, epoch)
    for i in range(n - 1, 0, -1):
        state = (state + GOLDEN) & MASK
        j = _mix64(state) % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def gen_perm():
    cases = []
    for n, seed, epoch in [(5, 0, 0), (5, 0, 1), (5, 42, 0), (5, 42, 7), (10, 1234, 0), (10, 1234, 1),
                           (37, 0xF0C1AA, 3), (1, 9, 0), (2, 9, 0), (100, 2**63 + 5, 2)]:
        cases.append({"n": n, "seed": seed, "epoch": epoch, "perm": _permutation(n, seed, epoch)})
    doc = {"generator": "tools/gen_lora_goldens.py (pure Python)", "python": platform.python_version(),
           "contract": "Fisher-Yates over splitmix64 stream with state at(seed, epoch); j = next() % (i+1), i from n-1 down to 1",
           "cases": cases}
    with open(os.path.join(OUT, "loader_perm.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print("wrote loader_perm.json")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["perm", "torch"], help="generate one golden family only")
    args = ap.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    if args.only in (None, "perm"):
        gen_perm()
    return 0


if __name__ == "__main__":
    sys.exit(main())
