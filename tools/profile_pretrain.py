"""Where a pretrain step's time goes: one `fucina bench pretrain` shape's step under cProfile, in parts.

    python tools/profile_pretrain.py --shape d6 --threads 1 [--batch-tokens 4096] [--steps 2]

Prints one markdown table: the share of the profiled step in the linear layers' GEMMs (forward and both
backward products), attention (its per-(batch, kv head) products and softmax rows), cross-entropy over the
vocabulary, Muon's Newton-Schulz, the rest of the optimizer step (momentum, AdamW on embeddings, head and
vectors, the gradient clip), the elementwise kernels (RMSNorm, SwiGLU, RoPE), and everything else (the
autograd engine's Python per op, reshapes, the embedding). Each part is the cumulative time of its functions,
found from their code objects (their backward closures included), counting only calls from outside the part.
cProfile's own per-call cost inflates the small ops a little: read the shares, not the absolute times.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _codes(fn):
    """fn's code object and its nested `backward` closures (what the autograd engine calls): the part's entry
    points. Helpers nested deeper (the per-head pairs run by the pool) are inside those calls already."""
    return [fn.__code__] + [k for k in fn.__code__.co_consts if hasattr(k, "co_code") and k.co_name == "backward"]


def _key(code):
    return (code.co_filename, code.co_firstlineno, code.co_name)


NS, OPTIMIZER = "Muon Newton-Schulz", "optimizer, the rest (momentum, AdamW, clip)"


def parts():
    from pipeline.autograd import losses as autograd_losses, ops
    from pipeline.kernels import nn
    from pipeline.optim import base, muon
    return {
        "linear GEMMs (forward + backward)": _codes(ops.linear),
        "attention (products + softmax, forward + backward)": _codes(ops.attention),
        "cross-entropy over the vocabulary": _codes(autograd_losses.cross_entropy),
        NS: _codes(muon.newton_schulz5),
        OPTIMIZER: [muon.Muon.step.__code__, base.Optimizer.step.__code__,
                                                        base.Optimizer.clip_grad_norm.__code__],
        "RMSNorm, SwiGLU, RoPE kernels": [f.__code__ for f in (nn.rms_norm_forward, nn.rms_norm_backward,
                                                               nn.swiglu, nn.swiglu_backward, nn.rope_rotate)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="d6", help="a `fucina bench pretrain` shape: d6, lm, tiny")
    ap.add_argument("--threads", type=int, default=1, help="compute threads (numba and the kernel pool)")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="tokens per step")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (after two warm-up steps)")
    args = ap.parse_args(argv)
    from pipeline.bench.pretrain import SHAPES, _ours
    from pipeline.threads import pin_threads
    pin_threads(args.threads)
    shape = SHAPES[args.shape]
    seq = shape[7]
    ids = np.random.default_rng(0).integers(0, shape[6], (args.batch_tokens // seq, seq + 1)).astype(np.int64)
    step = _ours(shape, args.batch_tokens, args.micro_batches, ids)
    step()
    step()
    t = time.perf_counter()
    step()
    plain_ms = (time.perf_counter() - t) * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {key: (cc, nc, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values())
    print(f"{args.shape} step, {args.batch_tokens} tokens in {args.micro_batches} micro-batches, "
          f"{args.threads} thread(s): {plain_ms:.0f} ms unprofiled, {total / args.steps * 1e3:.0f} ms profiled")
    print("\n| part | share |\n| --- | --- |")
    counted, cums = 0.0, {}
    for name, codes in parts().items():
        keys = {_key(c) for c in codes}
        # the cumulative time of the part's outermost calls: entries whose callers are outside the part
        cum = 0.0
        for k, (_cc, _nc, _tt, ct, callers) in stats.items():
            if k in keys:
                cum += sum(c[3] for ck, c in callers.items() if ck not in keys) if callers else ct
        cums[name] = cum
    cums[OPTIMIZER] -= cums[NS]  # Newton-Schulz runs inside Muon.step
    for name, cum in cums.items():
        counted += cum
        print(f"| {name} | {cum / total:.0%} |")
    print(f"| everything else (autograd's Python per op, reshapes, embedding) | {max(0.0, 1 - counted / total):.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
