"""Op semantics against PyTorch (optional oracle: skips when torch is absent)."""
import numpy as np
import pytest

import pipeline.autograd as ag
from pipeline.autograd import Tensor

pytestmark = [pytest.mark.parity, pytest.mark.needs("torch")]


def run_both(fn_ours, fn_torch, *arrays):
    import torch
    ours = [Tensor(a, requires_grad=True, dtype=np.float64) for a in arrays]
    theirs = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]
    out, ref = fn_ours(*ours), fn_torch(*theirs)
    g = np.random.default_rng(0).standard_normal(out.shape)
    out.backward(g.astype(np.float32))
    ref.backward(torch.tensor(g, dtype=torch.float64))
    np.testing.assert_allclose(out.data, ref.detach().numpy(), rtol=1e-6, atol=1e-9)
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o.grad, t.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.fixture
def r():
    return np.random.default_rng(5)


def test_gelu_silu_log_softmax(r):
    import torch.nn.functional as F
    x = r.standard_normal((4, 6))
    run_both(ag.gelu, F.gelu, x)
    run_both(lambda t: ag.gelu(t, approximate="tanh"), lambda t: F.gelu(t, approximate="tanh"), x)
    run_both(ag.silu, F.silu, x)
    run_both(lambda t: ag.log_softmax(t, -1), lambda t: F.log_softmax(t, -1), x)


def test_layer_norm_rms_norm(r):
    import torch.nn.functional as F
    x, w, b = r.standard_normal((3, 5, 8)), r.standard_normal(8), r.standard_normal(8)
    run_both(ag.layer_norm, lambda a, c, d: F.layer_norm(a, (8,), c, d, 1e-5), x, w, b)
    run_both(lambda a, c: ag.rms_norm(a, c, 1e-6), lambda a, c: F.rms_norm(a, (8,), c, 1e-6), x, w)


def test_rope_matches_neox_reference(r):
    import torch

    def torch_rope(x, pos, theta=10000.0):  # HF rotate_half formulation, [b, s, h, d]
        d = x.shape[-1]
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.tensor(pos, dtype=torch.float64)[:, None] * inv
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    pos = np.arange(3, 9)
    run_both(lambda t: ag.rope(t, pos), lambda t: torch_rope(t, pos), r.standard_normal((2, 6, 3, 8)))


@pytest.mark.parametrize("hq,hkv,sq,sk", [(4, 4, 5, 5), (6, 2, 5, 5), (4, 1, 2, 7), (6, 3, 130, 150)])
def test_attention_matches_sdpa(r, hq, hkv, sq, sk):
    import torch
    import torch.nn.functional as F

    def torch_attn(q, k, v):  # [b, s, h, d] -> sdpa's [b, h, s, d]
        g = hq // hkv
        qt = q.transpose(1, 2)
        kt, vt = k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
        mask = torch.arange(sk)[None, :] <= (sk - sq + torch.arange(sq))[:, None]
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)

    run_both(ag.attention, torch_attn, r.standard_normal((2, sq, hq, 8)), r.standard_normal((2, sk, hkv, 8)),
             r.standard_normal((2, sk, hkv, 8)))
