"""LoRA on every projection of every architecture: loss and adapter gradients against a float64 torch
replica written in the Hugging Face formulation (llama's q/k outputs un-permuted from
convert_hf_to_gguf's row order and rotated by halves), so the trainer's seam, biases, RoPE layout,
llama3 frequency factors and linear RoPE scaling are checked against code that shares none of ours.
gemma3 adds Gemma3ForCausalLM's scaled embeddings, post norms, GeGLU, and its sliding-window layers
(window 8 < the 20 training positions) rotated with their own RoPE base."""
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.finetune.model import TARGETS, LoraModel
from pipeline.models.registry import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_tiny_model as mk  # noqa: E402

pytestmark = [pytest.mark.parity, pytest.mark.needs("torch")]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CASES = [("llama", "mini"), ("qwen2", "mini"), ("qwen3", "mini"), ("llama", "llama3"), ("llama", "linear"),
         ("llama", "biased"), ("gemma3", "gemma-mini")]


def _path(tmp_path, arch, shape):
    committed = FIXTURES / f"{arch}-{shape}-f32.gguf"
    return committed if committed.is_file() else mk.write_gguf(tmp_path / f"{arch}-{shape}.gguf", mk.SHAPES[shape],
                                                               arch=arch, name=shape)


def _torch_loss(model, adapters, scale, tokens, labels):
    import torch
    c, fam = model.config, model.family
    f64 = lambda a: torch.tensor(np.asarray(getattr(a, "data", a), np.float64))
    dense = lambda proj: f64(proj.weight.dequantize())
    d, n = c.head_dim, len(tokens)
    gemma = c.arch == "gemma3"

    def tables(base, position_scale):
        inv = base ** (-np.arange(0, d, 2) / d)
        if model._rope_factors is not None:
            inv = inv / np.asarray(model._rope_factors, np.float64)
        ang = torch.tensor((np.arange(n) * position_scale)[:, None] * inv[None])
        return torch.cos(ang)[:, None], torch.sin(ang)[:, None]

    def sliding(i):  # Gemma3Config: every sixth layer is full attention
        return gemma and (i + 1) % 6 != 0

    rope_global, rope_local = tables(c.rope_base, c.rope_scale), tables(10_000.0, 1.0)

    def to_hf(y, n_head):  # output features from GGUF (adjacent-pair) order back to HF (half) order
        return y.reshape(n, n_head, d // 2, 2).transpose(-1, -2).reshape(n, n_head, d) if fam.rope == "normal" \
            else y.reshape(n, n_head, d)

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_eps) * f64(w)

    def rope(x, cos, sin):
        h = d // 2
        return torch.cat([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)

    def proj(x, i, t):
        p = model.blocks[i].projection(t)
        y = x @ dense(p).T
        if p.bias is not None:
            y = y + f64(p.bias)
        if (i, t) in adapters:
            a, b = adapters[i, t]
            y = y + scale * (x @ a.T) @ b.T
        return y

    x = f64(model.embed.dequantize())[torch.tensor(tokens)]
    if gemma:
        x = x * c.hidden ** 0.5
    query, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for i, blk in enumerate(model.blocks):
        post = (lambda y, w: rms(y, w)) if gemma else (lambda y, w: y)
        h = rms(x, blk.attn_norm)
        q, k = to_hf(proj(h, i, "q"), c.heads), to_hf(proj(h, i, "k"), c.kv_heads)
        v = proj(h, i, "v").reshape(n, c.kv_heads, d)
        if fam.qk_norm:
            q, k = rms(q, blk.attn.q_norm), rms(k, blk.attn.k_norm)
        cos_sin = rope_local if sliding(i) else rope_global
        q, k = rope(q, *cos_sin), rope(k, *cos_sin)
        g = c.heads // c.kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = torch.einsum("thd,shd->hts", q, k) / d ** 0.5
        hidden_keys = (key > query) | ((query - key >= c.sliding_window) if sliding(i) else False)
        s = s.masked_fill(hidden_keys, float("-inf"))
        o = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v)
        x = x + post(proj(o.reshape(n, -1), i, "o"), blk.post_attn_norm)
        h = rms(x, blk.ffn_norm)
        gate = proj(h, i, "gate")
        act = torch.nn.functional.gelu(gate, approximate="tanh") if gemma else torch.nn.functional.silu(gate)
        x = x + post(proj(act * proj(h, i, "up"), i, "down"), blk.post_ffn_norm)
    head = f64(model.output.weight.dequantize())
    logits = rms(x, model.out_norm) @ head.T
    return torch.nn.functional.cross_entropy(logits, torch.tensor(labels), ignore_index=-100)


@pytest.mark.parametrize("arch,shape", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_lora_loss_and_gradients_match_torch(tmp_path, arch, shape):
    import torch
    model = load_model(_path(tmp_path, arch, shape))
    tr = LoraModel(model, targets=TARGETS, rank=4, alpha=8.0, seed=3)
    g = np.random.default_rng(0)
    for p in tr.parameters():  # B != 0 so every A gradient is live too
        if p.name.endswith("lora_b"):
            p.data[...] = (0.05 * g.standard_normal(p.shape)).astype(np.float32)
    tokens = g.integers(0, model.config.vocab_size, 20)
    labels = np.r_[tokens[1:], 0]
    labels[:4] = -100
    loss = tr.loss(tokens, labels)
    loss.backward()

    adapters = {}
    for i, layer in enumerate(tr.layers):
        for t, ad in layer.items():
            adapters[i, t] = tuple(torch.tensor(x.data.astype(np.float64), requires_grad=True)
                                   for x in (ad.lora_a, ad.lora_b))
    ref = _torch_loss(model, adapters, 8.0 / 4, tokens, labels)
    ref.backward()
    # float32 through 2 layers vs float64: the loss to ~1e-6 relative; each gradient tensor to 3e-5 of its
    # norm (a sum over 20 positions of f32 products whose rounding the attention softmax amplifies).
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for i, layer in enumerate(tr.layers):
        for t, ad in layer.items():
            for ours, theirs in zip((ad.lora_a.grad, ad.lora_b.grad), adapters[i, t]):
                want = theirs.grad.numpy()
                err = np.linalg.norm(ours - want) / np.linalg.norm(want)
                assert err <= 3e-5, (i, t, err)  # measured <= 6e-6
