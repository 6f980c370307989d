"""Where a GGUF prompt's peak resident memory goes, stage by stage, in one process.

    python tools/rss_breakdown.py MODEL.gguf [--threads 2] [--prompt-tokens 256] [--decode-tokens 16] [--json]

Prints, after each stage (the interpreter alone, numpy, numba + llvmlite, what `fucina generate` imports
before it loads, loading the model + tokenizer + chat template, one token (the first kernel calls: numba's
runtime, the decode kernels; decode reads every weight), the first prompt (the prompt kernels; it packs the
prompt tiles), a second prompt, decoding): VmRSS split into anonymous memory (heap, tiles, activations) and
file pages (the libraries and the touched pages of the mapped GGUF), the stage's own peak (VmHWM, reset
before the stage through /proc/self/clear_refs where the kernel allows it, so each stage's peak is its own),
and the resident MB of the GGUF mapping and of llvmlite's LLVM library (/proc/self/smaps). `fucina bench llm`
reports the whole run's VmHWM: the largest of these peaks. Linux only (/proc).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status() -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in MB."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in _FIELDS:
                out[key] = int(value.split()[0]) / 1024.0
    return out


def mapped_mb(path, suffix=False) -> float:
    """Resident MB of every mapping of `path` (suffix: of every file whose path ends with it) in this process
    (/proc/self/smaps)."""
    path, total, inside = (path if suffix else os.path.realpath(path)), 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) >= 6 and (head[-1].endswith(path) if suffix else head[-1] == path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total / 1024.0


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0; False where not allowed)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)
    rows, resettable = [], reset_peak()

    def stage(name, fn=None):
        reset_peak()
        t0 = time.perf_counter()
        value = fn() if fn else None
        s = status()
        rows.append({"stage": name, "s": time.perf_counter() - t0, "rss": s["VmRSS"], "peak": s["VmHWM"],
                     "anon": s["RssAnon"], "file": s["RssFile"], "gguf": mapped_mb(args.model),
                     "llvm": mapped_mb("/libllvmlite.so", suffix=True)})
        return value

    stage("interpreter")
    stage("import numpy", lambda: __import__("numpy"))
    stage("import numba", lambda: __import__("numba"))

    def cli():
        from pipeline import cli as c
        c.build_parser(c._chosen_module(["generate"]))
        import pipeline.llm.generate  # noqa: F401  (what generate's run imports before it loads)
        import pipeline.models.decoder  # noqa: F401
    stage("`fucina generate`'s imports", cli)
    import numpy as np
    from threadpoolctl import threadpool_limits
    from pipeline.llm.generate import LoadedModel
    from pipeline.llm.quants import FrozenWeight
    from pipeline.threads import pin_threads
    pin_threads(args.threads)
    threadpool_limits(1, user_api="blas")
    lm = stage("load (model + tokenizer)", lambda: LoadedModel(args.model))
    model = lm.model
    ids = (np.arange(args.prompt_tokens, dtype=np.int64) * 7919 + 13) % min(model.config.vocab_size, 500)
    stage("one token (first kernel calls)", lambda: model.infer(ids[:1], model.new_cache(1)))
    stage(f"first prompt ({args.prompt_tokens} tokens, packs tiles)",
          lambda: model.infer(ids, model.new_cache(len(ids))))
    cache = model.new_cache(len(ids) + args.decode_tokens)
    stage(f"second prompt ({args.prompt_tokens} tokens)", lambda: model.infer(ids, cache))

    def decode():
        token = 1
        for _ in range(args.decode_tokens):
            token = int(np.argmax(model.infer(np.array([token]), cache)))
    stage(f"decode {args.decode_tokens} tokens", decode)
    weights = [w for w in model.named_weights().values() if isinstance(w, FrozenWeight)]
    unique = {id(w.raw): w for w in weights}.values()
    summary = {"model": os.path.basename(args.model), "file_mb": os.path.getsize(args.model) / 2 ** 20,
               "weight_mb": sum(w.nbytes for w in unique) / 2 ** 20,
               "tile_mb": sum(w.tile_bytes for w in unique) / 2 ** 20, "threads": args.threads,
               "peak_reset": resettable, "run_peak_mb": max(r["peak"] for r in rows), "stages": rows}
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{summary['model']}: file {summary['file_mb']:.0f} MB, weights {summary['weight_mb']:.0f} MB, "
          f"prompt tiles {summary['tile_mb']:.0f} MB, {args.threads} thread(s)"
          + ("" if resettable else " (VmHWM not resettable here: peaks are cumulative)"))
    print(f"{'stage':44} {'s':>6} {'RSS':>6} {'peak':>6} {'anon':>6} {'file':>6} {'gguf':>6} {'llvm':>6}   (MB)")
    for r in rows:
        print(f"{r['stage']:44} {r['s']:6.2f} {r['rss']:6.0f} {r['peak']:6.0f} {r['anon']:6.0f} {r['file']:6.0f} "
              f"{r['gguf']:6.0f} {r['llvm']:6.0f}")
    print(f"whole run's peak (what bench llm reports): {summary['run_peak_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
