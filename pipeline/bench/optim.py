"""`fucina bench optim`: optimizer step time at Qwen3-0.6B shapes vs memory bandwidth and torch.

Two parameter sets: one transformer block in its real matrix shapes (15.7M
params: q/k/v/o, gate/up/down, four norms) and the token embedding
[151936, 1024]. Each elementwise optimizer's effective GB/s counts the bytes
its fused step must move (param read+write, grad read, state read+write);
the `triad` baseline is a STREAM-style triad timed in the same run over the
same number of bytes, i.e. the machine's bandwidth limit for that step. It is
the in-place form a = a + s*b: like the update loops it reads every array it
writes, so neither side pays a write-allocate read the other does not. And
torch.optim.AdamW (foreach and fused) runs at the same thread count when torch
is installed. Muon/APOLLO route the embedding to their AdamW fallback (as a
real recipe would), and their block rows are GEMM-bound: no GB/s.

Trade-off: few repeats (median of --repeat; at most 3 for torch; one step,
its first, for the seconds-long Muon block) to stay near 2 minutes on 2
cores; numbers wobble with machine load.
"""
from __future__ import annotations

import os

import numpy as np

from ..threads import add_threads_flag
from . import median_ms

NAME = "optim"
HELP = "optimizer step ms and GB/s at Qwen3-0.6B block/embedding shapes vs a STREAM triad and torch AdamW"

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 1024, 16, 8, 128, 3072, 151936
BLOCK = [("q_proj", (HEADS * HEAD_DIM, HIDDEN)), ("k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
         ("v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)), ("o_proj", (HIDDEN, HEADS * HEAD_DIM)),
         ("gate_proj", (FFN, HIDDEN)), ("up_proj", (FFN, HIDDEN)), ("down_proj", (HIDDEN, FFN)),
         ("input_layernorm", (HIDDEN,)), ("post_attention_layernorm", (HIDDEN,)),
         ("q_norm", (HEAD_DIM,)), ("k_norm", (HEAD_DIM,))]
EMBEDDING = [("embed_tokens", (VOCAB, HIDDEN))]

# bytes moved per element by each fused step: param r+w, grad r, state r+w
BYTES_PER_ELEMENT = {"sgd": 12, "sgd-momentum": 20, "adamw": 28, "adamw-bf16-m": 24, "adamw-bf16-mv": 20,
                     "lion": 20, "muon": None, "apollo": None, "apollo-mini": None}
CASES = list(BYTES_PER_ELEMENT)


def add_arguments(parser):
    add_threads_flag(parser, os.cpu_count() or 1, "the bench", also="; torch gets the same N")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per case (median reported)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated optimizers (of {','.join(CASES)})")
    parser.add_argument("--sets", default="block,embedding", help="parameter sets: block, embedding or both")
    parser.add_argument("--apollo-rank", type=int, default=256, help="rank of the 'apollo' case (mini is rank 1)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.optim.AdamW baselines")


def _set_threads(n, with_torch):
    from ..threads import pin_threads
    pin_threads(n)
    if with_torch and n:
        try:
            import torch
            torch.set_num_threads(n)
        except ImportError:
            pass


def _make(case, named, apollo_rank):
    from pipeline.optim import SGD, AdamW, Apollo, Lion, Muon
    matrices = [(n, t) for n, t in named if t.ndim == 2 and n != "embed_tokens"]
    others = [(n, t) for n, t in named if not (t.ndim == 2 and n != "embed_tokens")]
    if case == "sgd":
        return SGD(named, lr=1e-3)
    if case == "sgd-momentum":
        return SGD(named, lr=1e-3, momentum=0.9)
    if case == "adamw":
        return AdamW(named)
    if case == "adamw-bf16-m":
        return AdamW(named, state_dtype="bf16")
    if case == "adamw-bf16-mv":
        return AdamW(named, state_dtype="bf16", second_moment_dtype="bf16")
    if case == "lion":
        return Lion(named)
    if case == "muon":
        return Muon(matrices, fallback_params=others)
    if case == "apollo":
        return Apollo(matrices, rank=apollo_rank, fallback_params=others)
    if case == "apollo-mini":
        return Apollo.mini(matrices, fallback_params=others)
    raise ValueError(case)


def _tensors(shapes, seed):
    from pipeline.kernels import rng
    from pipeline.autograd.tensor import Tensor
    named = []
    for i, (name, shape) in enumerate(shapes):
        t = Tensor(rng.gaussian(rng.derive_seed(seed, i), shape, std=0.02), requires_grad=True)
        t.grad = rng.gaussian(rng.derive_seed(seed, 100 + i), shape, std=1e-3)
        named.append((name, t))
    return named


def _triad_ms(n_bytes, repeat):
    from pipeline.kernels.optim import triad_par
    n = max(1, n_bytes // 12)
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    return median_ms(lambda: triad_par(a, b, np.float32(1e-3)), repeat, warmup=1)


def _torch_adamw(named, repeat):
    try:
        import torch
    except ImportError:
        return {}
    out = {}
    params = []
    for _, t in named:
        p = torch.nn.Parameter(torch.from_numpy(t.data.copy()))
        p.grad = torch.from_numpy(t.grad)
        params.append(p)
    for mode in ("foreach", "fused"):
        opt = torch.optim.AdamW(params, **{mode: True})
        out[f"torch_{mode}"] = median_ms(opt.step, min(repeat, 3), warmup=1)
        del opt  # numpy/torch buffers are freed by refcount: no gc pass needed
    return out


def run(args):
    _set_threads(args.threads, not args.no_torch)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in BYTES_PER_ELEMENT]
    if unknown:
        from pipeline.errors import UserError
        raise UserError(f"bench optim: unknown case(s) {unknown}; choose from {CASES}")
    rows = []
    for set_name in [s.strip() for s in args.sets.split(",") if s.strip()]:
        shapes = {"block": BLOCK, "embedding": EMBEDDING}.get(set_name)
        if shapes is None:
            from pipeline.errors import UserError
            raise UserError(f"bench optim: --sets takes block and/or embedding, got {set_name!r}")
        named = _tensors(shapes, seed=1)
        n = sum(t.size for _, t in named)
        torch_ms = {} if args.no_torch else _torch_adamw(named, args.repeat)
        triad_cache = {}
        for case in cases:
            opt = _make(case, named, args.apollo_rank)
            gemm_bound = BYTES_PER_ELEMENT[case] is None and set_name == "block"
            if case == "muon" and set_name == "block":  # seconds per step: one untimed-warm-up-free run
                ms = median_ms(opt.step, 1, warmup=0)
            else:
                ms = median_ms(opt.step, args.repeat, warmup=1)  # the warm-up step allocates the state
            row = {"case": f"{case}/{set_name}", "ms": ms, "baselines": {}, "params": n}
            per_el = BYTES_PER_ELEMENT[case] or BYTES_PER_ELEMENT["adamw"]  # fallbacks run AdamW
            if not gemm_bound:
                n_bytes = per_el * n
                if n_bytes not in triad_cache:
                    triad_cache[n_bytes] = _triad_ms(n_bytes, args.repeat)
                triad = triad_cache[n_bytes]
                row["gbps"] = n_bytes / ms / 1e6
                row["baselines"]["triad"] = triad
                row["notes"] = f"{triad / ms:.0%} of triad bandwidth"
            else:
                row["notes"] = "GEMM-bound (projection / Newton-Schulz)"
            if case in ("adamw", "adamw-bf16-m", "adamw-bf16-mv"):
                row["baselines"].update(torch_ms)
            rows.append(row)
            del opt
        del named
    return rows
