"""`fucina bench pretrain`: one from-scratch optimizer step (forward + backward over the step's tokens in
micro-batches, global clip, Muon on block matrices + AdamW on the rest) of the d6 preset and of the `lm`
job's shape, against the same model in torch eager with the same optimizer split, batch and threads.

Rows, all in one run: for each shape and each of the `--threads` counts, the step in-process, measured in a
subprocess of its own (`--row`), where ours and torch run one after the other on the same random token
batch: ours through the autograd ops and pipeline.optim, torch's through nn.functional and torch.optim.Muon
+ AdamW (the same split; torch's Muon scales its update by its own rule, which costs the same). peak_rss_mb
is that subprocess's peak before torch is imported: ours alone. Then, for a shape that is a pretrain preset
(d6), the `--trainers K` row: a real `fucina pretrain --trainers K --threads 1` run (the job on the
runtime: scheduler, optimizer role and K trainer processes), ms = the median of its steps after the first
two (numba compiles), against torch's step at K threads (the total of the K trainers); its peak_rss_mb is
the largest sum of resident sets of that run's processes, sampled every 0.2 s. Each in-process row also
gives tokens/s and the step's GEMM rate (step_flops: the step's GEMM FLOPs over its time) as a share of the
f32 GEMM peak measured in the same subprocess (gemm_peak: the step's own tiled GEMM on a large product), so a
row says how far the step is from the machine's limit, not only from torch. Run it on a quiet machine:
the default sizes take seconds to minutes per step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading

import numpy as np

from ..errors import FucinaError, UserError
from ..runtime.metrics import peak_rss_mb
from ..threads import add_threads_flag
from . import timed

NAME = "pretrain"
HELP = ("pretrain step ms and tokens/s: the d6 preset and the lm shape at 1 and 2 threads and with 2 trainer "
        "processes, vs torch eager (same optimizer split)")

# name -> (layers, hidden, heads, kv_heads, head_dim, ffn, vocab, seq, batch_tokens, tied)
SHAPES = {"d6": (6, 384, 6, 6, 64, 1024, 8192, 512, 16384, False),
          "lm": (2, 128, 4, 2, 32, 384, 262, 128, 2048, True),
          "tiny": (2, 64, 2, 2, 32, 192, 8192, 64, 1024, False)}
PRESET_SHAPES = ("d6", "tiny")  # the shapes that are pretrain presets: they get the --trainers row
STEADY_AFTER = 2  # leading steps of a --trainers run left out of its median (numba compiles in each process)


def add_arguments(parser):
    parser.add_argument("--shapes", default="d6,lm", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--batch-tokens", type=int, default=0, help="tokens per step (0: the shape's)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (median)")
    add_threads_flag(parser, [1, 2], "each in-process row (one row per count and shape, each in a subprocess "
                     "of its own)", also="; torch gets the same N", many=True)
    parser.add_argument("--trainers", type=int, default=2,
                        help="also, for a pretrain preset shape (d6), the pretrain job on the runtime with this "
                             "many trainer processes of one thread each, vs torch at as many threads (0: no such row)")
    parser.add_argument("--data", default="",
                        help="the --trainers run's corpus, as `fucina pretrain --data` (empty: the built-in one)")
    parser.add_argument("--cache-dir", default="runs/cache",
                        help="the --trainers run's tokenizer and token cache (a cold one trains the BPE first)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    parser.add_argument("--row", action="store_true", help=argparse.SUPPRESS)  # a subprocess measuring one row
def _ours(shape, batch_tokens, micro, ids):
    from ..autograd.losses import cross_entropy
    from ..jobs.recipes import muon_adamw
    from ..kernels.workpool import single_thread_blas
    from ..models.qwen3 import Qwen3, Qwen3Config
    layers, hidden, heads, kv, hd, ffn, vocab, seq, _, tied = shape
    model = Qwen3.init_random(Qwen3Config(vocab_size=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv,
                                          head_dim=hd, ffn=ffn, context_length=seq, rope_base=10_000.0,
                                          tied_output=tied), seed=0)
    opt = muon_adamw(model.named_parameters(), lr=0.02, adamw_lr=3e-3)
    scale = np.float32(1.0 / batch_tokens)

    def step():
        with single_thread_blas():  # as the jobs' micro_grad: one threadpoolctl round trip per step, not per op
            for rows in np.split(ids, micro):
                (cross_entropy(model(rows[:, :-1]), rows[:, 1:], reduction="sum") * scale).backward()
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()
    return step


def _torch(shape, batch_tokens, micro, ids, threads):
    try:
        import torch
    except ImportError:
        return None
    import torch.nn.functional as F
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    layers, hidden, heads, kv, hd, ffn, vocab, seq, _, tied = shape
    mat = lambda o, i: (torch.randn(o, i) * i ** -0.5).requires_grad_()
    ones = lambda n: torch.ones(n, requires_grad=True)
    blocks = [{"an": ones(hidden), "q": mat(heads * hd, hidden), "k": mat(kv * hd, hidden),
               "v": mat(kv * hd, hidden), "o": mat(hidden, heads * hd), "qn": ones(hd), "kn": ones(hd),
               "fn": ones(hidden),
               "gate": mat(ffn, hidden), "up": mat(ffn, hidden), "down": mat(hidden, ffn)} for _ in range(layers)]
    embed, out_norm = (torch.randn(vocab, hidden) * 0.02).requires_grad_(), ones(hidden)
    head = embed if tied else mat(vocab, hidden)
    inv = 10_000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * inv
    cos, sin = torch.cos(angles)[:, None], torch.sin(angles)[:, None]
    rms = lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    def rope(x):  # NeoX halves, x [b, t, h, d]
        t, h = x.shape[1], hd // 2
        c, s = cos[:t], sin[:t]
        return torch.cat([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)

    def forward(x_ids):
        b, t = x_ids.shape
        x = embed[x_ids]
        for p in blocks:
            h = rms(x, p["an"])
            q = rope(rms((h @ p["q"].T).view(b, t, heads, hd), p["qn"])).transpose(1, 2)
            k = rope(rms((h @ p["k"].T).view(b, t, kv, hd), p["kn"])).transpose(1, 2)
            v = (h @ p["v"].T).view(b, t, kv, hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
            x = x + a.transpose(1, 2).reshape(b, t, heads * hd) @ p["o"].T
            h = rms(x, p["fn"])
            x = x + (F.silu(h @ p["gate"].T) * (h @ p["up"].T)) @ p["down"].T
        return rms(x, out_norm) @ head.T

    matrices = [p[n] for p in blocks for n in ("q", "k", "v", "o", "gate", "up", "down")]
    rest = [embed, out_norm] + ([] if tied else [head]) + [p[n] for p in blocks for n in ("an", "qn", "kn", "fn")]
    opts = [torch.optim.Muon(matrices, lr=0.02, momentum=0.95, nesterov=True),
            torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)]
    chunks = [torch.from_numpy(r) for r in np.split(ids, micro)]

    def step():
        for rows in chunks:
            logits = forward(rows[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, vocab), rows[:, 1:].reshape(-1), reduction="sum")
            (loss / batch_tokens).backward()
        torch.nn.utils.clip_grad_norm_(matrices + rest, 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    return step


def step_flops(shape, batch_tokens):
    """(GEMM FLOPs of the forward and backward, of Muon's Newton-Schulz) in one step of `shape`: every linear
    layer and the head at 6 FLOPs per weight per token (forward, input and weight gradients), attention's
    scores and mix over the whole square the per-head products compute (x3 for their backward), and five
    Newton-Schulz iterations per hidden matrix (X X^T, A A, B X: 4 m^2 n + 2 m^3 with m <= n its sides)."""
    layers, hidden, heads, kv, hd, ffn, vocab, seq, _, _ = shape
    mats = [(heads * hd, hidden), (kv * hd, hidden), (kv * hd, hidden), (hidden, heads * hd),
            (ffn, hidden), (ffn, hidden), (hidden, ffn)]
    per_token = layers * (sum(2 * o * i for o, i in mats) + 2 * 2 * seq * hd * heads) + 2 * hidden * vocab
    muon = 0
    for o, i in mats:
        m, n = min(o, i), max(o, i)
        muon += layers * 5 * (4 * m * m * n + 2 * m ** 3)
    return 3 * per_token * batch_tokens, muon


def gemm_peak(repeat=3):
    """GFLOP/s of the training step's own f32 GEMM (pipeline.kernels.nn.matmul_nn's tiles on the pinned
    threads, BLAS single-threaded per tile) on a 2048 x 1024 x 1024 product: what a step's share is read
    against."""
    from ..kernels.nn import matmul_nn
    a = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32)
    matmul_nn(a, b)
    return 2 * 2048 * 1024 * 1024 / min(timed(lambda: matmul_nn(a, b), repeat)[0] for _ in range(2)) / 1e6


def _measure(name, args):
    """The in-process row of shape `name` at args.threads[0] threads, in this process (the --row subprocess)."""
    from ..threads import pin_threads
    threads = args.threads[0]
    pin_threads(threads)
    shape = SHAPES[name]
    seq, batch_tokens = shape[7], _batch_tokens(name, args)
    n_rows = batch_tokens // seq
    ids = np.random.default_rng(0).integers(0, shape[6], (n_rows, seq + 1)).astype(np.int64)
    ms, cpu = timed(_ours(shape, batch_tokens, args.micro_batches, ids), repeat=args.steps)
    rss = peak_rss_mb()  # before torch is imported: ours alone
    theirs = None if args.no_torch else _torch(shape, batch_tokens, args.micro_batches, ids, threads)
    torch_ms = timed(theirs, repeat=args.steps)[0] if theirs else None
    model_flops, muon_flops = step_flops(shape, batch_tokens)
    peak = gemm_peak()
    gflops = (model_flops + muon_flops) / ms / 1e6
    return {"case": f"{name} step ({batch_tokens} tokens), {threads} thread(s)", "ms": ms, "cpu_ms": cpu,
            "tokens_per_s": batch_tokens / ms * 1e3, "baselines": {"torch_eager": torch_ms} if torch_ms else {},
            "peak_rss_mb": rss, "threads": threads, "step_gflop": (model_flops + muon_flops) / 1e9,
            "gflops": gflops, "gemm_peak_gflops": peak,
            "notes": f"in-process, {threads} thread(s), {args.micro_batches} micro-batches; "
                     f"{batch_tokens / ms * 1e3:,.0f} tok/s; {(model_flops + muon_flops) / 1e9:.1f} GFLOP of GEMMs "
                     f"({muon_flops / 1e9:.1f} of them Muon's) at {gflops:.0f} GFLOP/s = {100 * gflops / peak:.0f}% "
                     f"of the {peak:.0f} GFLOP/s f32 GEMM peak measured here"}


def _batch_tokens(name, args):
    seq, batch_tokens = SHAPES[name][7], args.batch_tokens or SHAPES[name][8]
    n_rows = batch_tokens // seq
    if n_rows < 1 or n_rows % args.micro_batches:
        raise UserError(f"--batch-tokens {batch_tokens}: {n_rows} windows of {seq} do not split into "
                        f"{args.micro_batches} micro-batches")
    return n_rows * seq


def _subprocess_row(name, threads, args):
    cmd = [sys.executable, "-m", "pipeline.cli", "bench", "pretrain", "--json", "--row", "--shapes", name,
           "--threads", str(threads), "--batch-tokens", str(_batch_tokens(name, args)),
           "--micro-batches", str(args.micro_batches), "--steps", str(args.steps)] + (["--no-torch"] * args.no_torch)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise FucinaError(f"bench pretrain: the {name} row at {threads} thread(s) failed:\n{out.stderr[-2000:]}")
    (row,) = json.loads(out.stdout)["results"]
    return row


def _tree_rss_mb(root_pid):
    """Resident MB of root_pid and all its descendants now (Linux /proc; 0 elsewhere)."""
    parents, rss = {}, {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:  # the process ended meanwhile
            continue
        parents[int(entry)] = int(fields.get("PPid", "0"))
        rss[int(entry)] = int(fields.get("VmRSS", "0 kB").split()[0]) / 1024.0
    tree, grew = {root_pid}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return sum(rss.get(pid, 0.0) for pid in tree)


def _trainers_row(name, args, torch_ms):
    """`fucina pretrain --preset NAME --trainers K` for a few steps: the median steady-state step."""
    k, batch_tokens = args.trainers, _batch_tokens(name, args)
    with tempfile.TemporaryDirectory(prefix="fucina-bench-pretrain-") as run_dir:
        cmd = [sys.executable, "-m", "pipeline.cli", "pretrain", "--preset", name, "--trainers", str(k),
               "--threads", "1", "--steps", str(args.steps + STEADY_AFTER), "--batch-tokens", str(batch_tokens),
               "--micro-batches", str(args.micro_batches), "--no-seq-warmup", "--eval-every", "0",
               "--sample-tokens", "0", "--checkpoint-every", "0", "--data", args.data, "--cache-dir",
               args.cache_dir, "--run-dir", run_dir, "--json"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak, done = [0.0], threading.Event()

        def sample():
            while not done.wait(0.2):
                peak[0] = max(peak[0], _tree_rss_mb(proc.pid))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, err = proc.communicate()
        done.set()
        sampler.join()
        if proc.returncode != 0:
            raise FucinaError(f"bench pretrain: the {name} --trainers {k} run failed:\n{err[-2000:]}")
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            steps = [r["step_ms"] for r in map(json.loads, fh) if r.get("kind") == "metrics"]
    ms = statistics.median(steps[STEADY_AFTER:])
    return {"case": f"{name} step ({batch_tokens} tokens), {k} trainers", "ms": ms,
            "tokens_per_s": batch_tokens / ms * 1e3, "baselines": {"torch_eager": torch_ms} if torch_ms else {},
            "peak_rss_mb": peak[0], "threads": k,
            "notes": f"pretrain job on the runtime, {k} trainer processes x 1 thread, {args.micro_batches} "
                     f"micro-batches, median of steps {STEADY_AFTER + 1}-{len(steps)}; torch at {k} threads"}


def run(args):
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name in names:
        if name not in SHAPES:
            raise UserError(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPES)})")
        _batch_tokens(name, args)
    if args.row:
        return [_measure(name, args) for name in names]
    rows = []
    for name in names:
        trainers = args.trainers > 0 and name in PRESET_SHAPES
        baseline_row = trainers and not args.no_torch and args.trainers not in args.threads
        counts = args.threads + ([args.trainers] if baseline_row else [])
        by_threads = {n: _subprocess_row(name, n, args) for n in counts}  # the K-thread row is K trainers' baseline
        rows.extend(by_threads.values())
        if trainers:
            torch_ms = by_threads[args.trainers]["baselines"].get("torch_eager") if not args.no_torch else None
            rows.append(_trainers_row(name, args, torch_ms))
    return rows
