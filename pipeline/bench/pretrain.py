"""`fucina bench pretrain`: one from-scratch optimizer step (forward + backward over the step's tokens in
micro-batches, global clip, Muon on block matrices + AdamW on the rest) of the d6 preset and of the `lm`
job's shape, against the same model in torch eager with the same optimizer split, batch and threads.

Both sides run one after the other in one process on the same random token batch: ours through the
autograd ops and pipeline.optim, torch's through nn.functional and torch.optim.Muon + AdamW (the same
split; torch's Muon scales its update by its own rule, which costs the same). peak_rss_mb is the process's,
both sides included. Run it on a quiet machine: the default sizes take seconds to minutes per step.
"""
from __future__ import annotations

import numpy as np

from ..runtime.metrics import peak_rss_mb
from ..commands._args import add_threads_flag
from . import timed

NAME = "pretrain"
HELP = "pretrain step ms and tokens/s: the d6 preset and the lm shape, vs torch eager (same optimizer split)"

# name -> (layers, hidden, heads, kv_heads, head_dim, ffn, vocab, seq, batch_tokens, tied)
SHAPES = {"d6": (6, 384, 6, 6, 64, 1024, 8192, 512, 16384, False),
          "lm": (2, 128, 4, 2, 32, 384, 262, 128, 2048, True)}


def add_arguments(parser):
    parser.add_argument("--shapes", default="d6,lm", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--batch-tokens", type=int, default=0, help="tokens per step (0: the shape's)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side (median)")
    add_threads_flag(parser, 1, "the bench", also="; torch gets the same N")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch baseline")


def _ours(shape, batch_tokens, micro, ids):
    from ..autograd.losses import cross_entropy
    from ..jobs.recipes import muon_adamw
    from ..models.qwen3 import Qwen3, Qwen3Config
    layers, hidden, heads, kv, hd, ffn, vocab, seq, _, tied = shape
    model = Qwen3.init_random(Qwen3Config(vocab_size=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv,
                                          head_dim=hd, ffn=ffn, context_length=seq, rope_base=10_000.0,
                                          tied_output=tied), seed=0)
    opt = muon_adamw(model.named_parameters(), lr=0.02, adamw_lr=3e-3)
    scale = np.float32(1.0 / batch_tokens)

    def step():
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


def run(args):
    from ..errors import UserError
    from ..threads import pin_threads
    pin_threads(args.threads)
    rows = []
    for name in (s.strip() for s in args.shapes.split(",") if s.strip()):
        if name not in SHAPES:
            raise UserError(f"--shapes: unknown shape {name!r} (known: {', '.join(SHAPES)})")
        shape = SHAPES[name]
        seq, batch_tokens = shape[7], args.batch_tokens or shape[8]
        n_rows = batch_tokens // seq
        if n_rows < 1 or n_rows % args.micro_batches:
            raise UserError(f"--batch-tokens {batch_tokens}: {n_rows} windows of {seq} do not split into "
                            f"{args.micro_batches} micro-batches")
        ids = np.random.default_rng(0).integers(0, shape[6], (n_rows, seq + 1)).astype(np.int64)
        ours = _ours(shape, n_rows * seq, args.micro_batches, ids)
        theirs = None if args.no_torch else _torch(shape, n_rows * seq, args.micro_batches, ids, args.threads)
        ms, cpu = timed(ours, repeat=args.steps)
        torch_ms = timed(theirs, repeat=args.steps)[0] if theirs else None
        rows.append({"case": f"{name} step ({n_rows * seq} tokens)", "ms": ms, "cpu_ms": cpu,
                     "tokens_per_s": n_rows * seq / ms * 1e3,
                     "baselines": {"torch_eager": torch_ms} if torch_ms else {}, "peak_rss_mb": peak_rss_mb(),
                     "notes": f"{args.threads} thread(s), {args.micro_batches} micro-batches"})
    return rows
