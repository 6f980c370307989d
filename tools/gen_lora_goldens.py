"""Generate the goldens under tests/goldens/lora/.

    .venv/bin/python tools/gen_lora_goldens.py [--only perm|torch]

perm:  loader_perm.json — shuffled epoch permutations computed by an
       independent pure-Python splitmix64 + Fisher-Yates (the checkpoint
       contract of pipeline/llm/data.py), so a drift in either side fails.
torch: trainer_golden.npz — an INDEPENDENT torch replica of the LoRA trainer
       (pipeline/finetune/model.py): Qwen3 block (RMSNorm eps inside the sqrt,
       per-head q/k RMSNorm, NeoX half-rotation RoPE, GQA causal softmax
       attention, up * silu(gate)), tied head, LoRA on all seven projections
       with B != 0, CE mean over non-ignored labels. Weights come from
       numpy's PCG64 (not the project's RNG) and are stored with the expected
       loss and adapter gradients, computed in float64.

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
           "contract": "Fisher-Yates over splitmix64 stream with state at(seed, epoch); "
                       "j = next() % (i+1), i from n-1 down to 1",
           "cases": cases}
    with open(os.path.join(OUT, "loader_perm.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print("wrote loader_perm.json")


TORCH_CFG = dict(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn=48, vocab=64,
                 rope_theta=10000.0, norm_eps=1e-6, rank=4, alpha=8.0, seq=40, n_masked=9)
PROJ = ("q", "k", "v", "o", "gate", "up", "down")


def gen_torch():
    import numpy as np
    import torch

    c = TORCH_CFG
    g = np.random.default_rng(20261129)
    H, L, NH, KV, D, F, V = (c[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab"))
    shapes = {"q": (NH * D, H), "k": (KV * D, H), "v": (KV * D, H), "o": (H, NH * D),
              "gate": (F, H), "up": (F, H), "down": (H, F)}
    arrays = {"token_embd": (g.standard_normal((V, H)) * 0.3).astype(np.float32),
              "output_norm": (1 + 0.1 * g.standard_normal(H)).astype(np.float32)}
    for i in range(L):
        for t in PROJ:
            arrays[f"blk.{i}.{t}"] = (0.05 * g.standard_normal(shapes[t])).astype(np.float32)
            arrays[f"layers.{i}.{t}.lora_a"] = (0.2 * g.standard_normal((c["rank"], shapes[t][1]))).astype(np.float32)
            arrays[f"layers.{i}.{t}.lora_b"] = (0.2 * g.standard_normal((shapes[t][0], c["rank"]))).astype(np.float32)
        for nm, dim in (("attn_norm", H), ("ffn_norm", H), ("attn_q_norm", D), ("attn_k_norm", D)):
            arrays[f"blk.{i}.{nm}"] = (1 + 0.1 * g.standard_normal(dim)).astype(np.float32)
    tokens = g.integers(0, V, c["seq"]).astype(np.int64)
    labels = np.concatenate([tokens[1:], g.integers(0, V, 1)]).astype(np.int64)
    labels[: c["n_masked"]] = -100
    labels[c["seq"] // 2] = -100  # a hole inside the response too

    T = {k: torch.tensor(v, dtype=torch.float64) for k, v in arrays.items()}
    for k, v in T.items():
        if ".lora_" in k:
            v.requires_grad_(True)
    scale = c["alpha"] / c["rank"]

    def rmsnorm(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + c["norm_eps"]) * w

    def proj(x, i, t):
        base = x @ T[f"blk.{i}.{t}"].T
        return base + scale * (x @ T[f"layers.{i}.{t}.lora_a"].T) @ T[f"layers.{i}.{t}.lora_b"].T

    def rope(x):  # x [S, heads, D], NeoX half rotation
        S = x.shape[0]
        inv = c["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = torch.arange(S, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    S = c["seq"]
    h = T["token_embd"][torch.tensor(tokens)]
    for i in range(L):
        a = rmsnorm(h, T[f"blk.{i}.attn_norm"])
        q = rope(rmsnorm(proj(a, i, "q").view(S, NH, D), T[f"blk.{i}.attn_q_norm"]))
        k = rope(rmsnorm(proj(a, i, "k").view(S, KV, D), T[f"blk.{i}.attn_k_norm"]))
        v = proj(a, i, "v").view(S, KV, D)
        k = k.repeat_interleave(NH // KV, dim=1)
        v = v.repeat_interleave(NH // KV, dim=1)
        att = torch.einsum("shd,thd->hst", q, k) / D ** 0.5
        att = att.masked_fill(torch.triu(torch.ones(S, S, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        o = torch.einsum("hst,thd->shd", att, v).reshape(S, NH * D)
        h = h + proj(o, i, "o")
        m = rmsnorm(h, T[f"blk.{i}.ffn_norm"])
        h = h + proj(torch.nn.functional.silu(proj(m, i, "gate")) * proj(m, i, "up"), i, "down")
    logits = rmsnorm(h, T["output_norm"]) @ T["token_embd"].T
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels), ignore_index=-100)
    loss.backward()
    out = dict(arrays)
    out["tokens"], out["labels"] = tokens, labels
    out["expected_loss"] = np.array(loss.item())
    for k, v in T.items():
        if ".lora_" in k:
            out["grad." + k] = v.grad.numpy()
    out["meta"] = np.array(json.dumps({"config": c, "torch": torch.__version__, "numpy": np.__version__,
                                        "python": platform.python_version(), "dtype": "float64"}))
    np.savez_compressed(os.path.join(OUT, "trainer_golden.npz"), **out)
    print(f"wrote trainer_golden.npz (loss {loss.item():.6f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["perm", "torch"], help="generate one golden family only")
    args = ap.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    if args.only in (None, "perm"):
        gen_perm()
    if args.only in (None, "torch"):
        gen_torch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
