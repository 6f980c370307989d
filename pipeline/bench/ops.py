"""`fucina bench ops`: the engine's hot ops, forward + backward, side by side.

Each case times our op (autograd forward + backward) against the same math
composed from plain numpy calls (`numpy_composed`) and against torch
(`torch`, when installed), all at the same thread count in one run.
Trade-off: timings include the autograd bookkeeping, because that is what a
training step pays.
"""
from __future__ import annotations

import os

import numpy as np

from ..threads import add_threads_flag
from . import median_ms

NAME = "ops"
HELP = ("cross-entropy (plain and fused with the projection), RMSNorm and attention forward+backward "
        "vs composed numpy and torch")


def add_arguments(parser):
    add_threads_flag(parser, os.cpu_count() or 1, "the bench", also="; torch gets the same N")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (median reported)")
    parser.add_argument("--rows", type=int, default=1024, help="cross-entropy rows")
    parser.add_argument("--classes", type=int, default=32768, help="cross-entropy classes")


def _set_threads(n):
    from ..threads import pin_threads
    pin_threads(n)
    try:
        import torch
        if n:
            torch.set_num_threads(n)
    except ImportError:
        pass


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


# --- cross-entropy ------------------------------------------------------------
def _ce_numpy(x, y):
    m = x.max(-1, keepdims=True)
    e = np.exp(x - m)
    s = e.sum(-1, keepdims=True)
    loss = (np.log(s[:, 0]) + m[:, 0] - x[np.arange(len(y)), y]).mean()
    g = e / s
    g[np.arange(len(y)), y] -= 1.0
    g /= len(y)
    return loss, g


def _case_ce(args, repeat):
    from pipeline.autograd import Tensor, cross_entropy
    r = np.random.default_rng(0)
    x = r.standard_normal((args.rows, args.classes)).astype(np.float32)
    y = r.integers(0, args.classes, args.rows)

    def ours():
        t = Tensor(x, requires_grad=True)
        cross_entropy(t, y).backward()

    base = {"numpy_composed": median_ms(lambda: _ce_numpy(x, y), repeat)}
    torch = _torch()
    if torch:
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)

        def th():
            t = tx.clone().requires_grad_(True)
            torch.nn.functional.cross_entropy(t, ty).backward()
        base["torch"] = median_ms(th, repeat)
    ms = median_ms(ours, repeat)
    return {"case": f"cross_entropy/{args.rows}x{args.classes}", "ms": ms,
            "gbps": 2 * x.nbytes / ms / 1e6, "baselines": base,
            "notes": "fwd+bwd, mean reduction; gbps = logits read + grad written"}


def _case_linear_ce(args, repeat, hidden=384):
    from pipeline.autograd import Tensor, linear_cross_entropy
    r = np.random.default_rng(3)
    x = r.standard_normal((args.rows, hidden)).astype(np.float32)
    w = (r.standard_normal((args.classes, hidden)) * 0.05).astype(np.float32)
    y = r.integers(0, args.classes, args.rows)

    def ours():
        tx, tw = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        linear_cross_entropy(tx, tw, y).backward()

    def composed():
        _, g = _ce_numpy(x @ w.T, y)
        return g @ w, g.T @ x

    base = {"numpy_composed": median_ms(composed, repeat)}
    torch = _torch()
    if torch:
        tx0, tw0, ty = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(y)

        def th():
            tx, tw = tx0.clone().requires_grad_(True), tw0.clone().requires_grad_(True)
            torch.nn.functional.cross_entropy(tx @ tw.T, ty).backward()
        base["torch"] = median_ms(th, repeat)
    return {"case": f"linear_cross_entropy/{args.rows}x{hidden}x{args.classes}", "ms": median_ms(ours, repeat),
            "baselines": base, "notes": "fused x @ w.T + CE, fwd+bwd (3 GEMMs); logits grad written in place"}


# --- RMSNorm --------------------------------------------------------------------
def _rms_numpy(x, w, g, eps=1e-6):
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    xhat = x * r
    out = xhat * w
    gh = g * w
    gx = r * (gh - xhat * (gh * xhat).mean(-1, keepdims=True))
    gw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
    return out, gx, gw


def _case_rms(repeat, shape=(8, 256, 384)):
    from pipeline.autograd import Tensor, rms_norm
    r = np.random.default_rng(1)
    x = r.standard_normal(shape).astype(np.float32)
    w = r.standard_normal(shape[-1]).astype(np.float32)
    g = r.standard_normal(shape).astype(np.float32)

    def ours():
        tx, tw = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        rms_norm(tx, tw).backward(g)

    base = {"numpy_composed": median_ms(lambda: _rms_numpy(x, w, g), repeat)}
    torch = _torch()
    if torch:
        gx_t = torch.from_numpy(g)

        def th():
            tx = torch.from_numpy(x).requires_grad_(True)
            tw = torch.from_numpy(w).requires_grad_(True)
            torch.nn.functional.rms_norm(tx, (shape[-1],), tw, 1e-6).backward(gx_t)
        base["torch"] = median_ms(th, repeat)
    return {"case": "rms_norm/" + "x".join(map(str, shape)), "ms": median_ms(ours, repeat), "baselines": base,
            "notes": "fwd+bwd with weight"}


# --- attention ------------------------------------------------------------------
def _attn_numpy(q, k, v, g):
    B, S, H, D = q.shape
    Q, K, V, G = (a.transpose(0, 2, 1, 3) for a in (q, k, v, g))
    s = Q @ K.swapaxes(-1, -2) / np.float32(np.sqrt(D))
    s = np.where(np.triu(np.ones((S, S), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ V
    dv = p.swapaxes(-1, -2) @ G
    dp = G @ V.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.float32(np.sqrt(D))
    return out, ds @ K, ds.swapaxes(-1, -2) @ Q, dv


def _case_attention(repeat, shape=(8, 256, 6, 64)):
    from pipeline.autograd import Tensor, attention
    r = np.random.default_rng(2)
    q, k, v, g = (r.standard_normal(shape).astype(np.float32) for _ in range(4))

    def ours():
        ts = [Tensor(a, requires_grad=True) for a in (q, k, v)]
        attention(*ts).backward(g)

    base = {"numpy_composed": median_ms(lambda: _attn_numpy(q, k, v, g), repeat)}
    torch = _torch()
    if torch:
        gt = torch.from_numpy(g).transpose(1, 2)

        def th():
            ts = [torch.from_numpy(a).transpose(1, 2).requires_grad_(True) for a in (q, k, v)]
            torch.nn.functional.scaled_dot_product_attention(*ts, is_causal=True).backward(gt)
        base["torch"] = median_ms(th, repeat)
    return {"case": "attention/" + "x".join(map(str, shape)), "ms": median_ms(ours, repeat), "baselines": base,
            "notes": "causal, fwd+bwd, [batch, seq, heads, head_dim]"}


def run(args):
    _set_threads(args.threads)
    repeat = max(1, args.repeat)
    return [_case_ce(args, repeat), _case_linear_ce(args, repeat), _case_rms(repeat), _case_attention(repeat)]
