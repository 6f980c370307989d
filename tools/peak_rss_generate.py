"""Peak RSS of one generation, Fucina's `generate` command against llama.cpp's, each in a fresh child process.

    python tools/peak_rss_generate.py MODEL.gguf [--threads 2] [--prompt-tokens 256] [--max-tokens 16]
                                                 [--runs 2] [--no-llama] [--json]

Both children get the same prompt ids (a fixed English text encoded by the file's tokenizer, repeated to
--prompt-tokens ids) and generate --max-tokens greedy tokens at --threads threads. Fucina's child is
`python -m pipeline.cli generate` on that text (the command a user runs: its imports, model, tokenizer and
chat template); llama.cpp's is Python with llama_cpp (llama-cpp-python) on the same ids with its defaults
(n_ctx 512, the ids evaluated as one batch, then greedy decoding). The figure is the child's own
ru_maxrss (the parent reads RUSAGE_CHILDREN after each child: the largest child's peak, and every run
here has one child at a time), so both sides are measured the same way, interpreter included: the
`after imports` line gives each side's interpreter share (Python + numpy + numba + llvmlite for Fucina,
Python + numpy + llama_cpp for llama.cpp), measured in a child that only imports.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("The old lighthouse keeper climbed the stairs every evening at dusk. He wound the clockwork, trimmed the "
        "wick and watched the ships pass the rocks below. In winter the storms came from the north, and the "
        "waves rose higher than the harbour wall; in summer the sea was calm and blue. ")

_LLAMA = """
import sys, json
import llama_cpp
ids = json.loads(sys.argv[2])
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_batch=512, n_threads=int(sys.argv[3]),
                      n_threads_batch=int(sys.argv[3]), verbose=False)
llm.eval(ids)
for _ in range(int(sys.argv[4])):
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    llm.eval([tok])
"""
_IMPORTS = {"fucina": "import pipeline.cli as c; m = getattr(c, '_chosen_module', None); "  # older trees: every command
                      "c.build_parser(m(['generate'])) if m else c.build_parser(); "
                      "import pipeline.llm.generate, pipeline.models.decoder",
            "llama.cpp": "import numpy, llama_cpp"}


def _child_peak_mb(cmd, env=None) -> float:
    """ru_maxrss of the child running `cmd` (MB); the parent's RUSAGE_CHILDREN is the largest child's so far,
    so each measurement runs in a fresh parent (this function is called from one)."""
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise RuntimeError(f"{cmd[:4]}... failed: {proc.stderr.strip().splitlines()[-1:]}")
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0


def _measure(kind, args, text, ids):
    """In a fresh parent (python -c): the peak of one child of `kind`."""
    py = sys.executable
    if kind == "fucina":
        cmd = [py, "-m", "pipeline.cli", "generate", "--model", args.model, "--prompt", text,
               "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    elif kind == "llama.cpp":
        cmd = [py, "-c", _LLAMA, args.model, json.dumps(ids), str(args.threads), str(args.max_tokens)]
    else:  # imports only
        cmd = [py, "-c", _IMPORTS[kind.split(":")[1]]]
    call = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import peak_rss_generate as p; " \
           f"print(p._child_peak_mb({cmd!r}))"
    out = subprocess.run([py, "-c", call], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1:])
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2, help="runs per side; every run is printed")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from pipeline.llm.gguf import GGUFFile
    from pipeline.llm.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(GGUFFile(args.model))
    # the text repeated until it encodes to at least prompt_tokens ids, cut at the last whole sentence that fits
    text = TEXT
    while len(tok.encode(text + TEXT)) <= args.prompt_tokens:
        text += TEXT
    ids = tok.encode(text)
    sides = ["fucina"] + ([] if args.no_llama else ["llama.cpp"])
    res = {"model": os.path.basename(args.model), "prompt_tokens": len(ids), "max_tokens": args.max_tokens,
           "threads": args.threads}
    for side in sides:
        res[f"{side} after imports"] = _measure(f"imports:{side}", args, text, ids)
        res[side] = [_measure(side, args, text, ids) for _ in range(args.runs)]
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{res['model']}: {len(ids)} prompt tokens, {args.max_tokens} generated, {args.threads} thread(s); "
          "peak RSS of each child (MB)")
    for side in sides:
        print(f"  {side:10} {' '.join(f'{v:.0f}' for v in res[side])}   "
              f"(after imports {res[side + ' after imports']:.0f})")
    if not args.no_llama:
        print(f"  ratio Fucina / llama.cpp: x{min(res['fucina']) / min(res['llama.cpp']):.2f} (lowest of each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
