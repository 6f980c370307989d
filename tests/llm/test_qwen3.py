"""The Qwen3 model: inference vs autograd forward, KV cache, training, the projection seam, errors."""
from pathlib import Path

import numpy as np
import pytest

from pipeline.autograd import Module, Tensor, cross_entropy, ops, parameter
from pipeline.errors import UserError
from pipeline.llm.generate import Sampling, generate, greedy
from pipeline.models.qwen3 import FrozenLinear, Qwen3, Qwen3Config

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FILES = ["qwen3-mini-f32.gguf", "qwen3-mini-q8_0.gguf", "qwen3-tied-q4_k_s.gguf"]
IDS = np.array([5, 17, 200, 3, 99, 41, 250, 7, 7, 120, 64, 1])


@pytest.fixture(scope="module", params=FILES)
def model(request):
    return Qwen3.from_gguf(FIXTURES / request.param)


def test_infer_matches_autograd_forward(model, monkeypatch):
    # f32 activations in both (the tolerance is float32 rounding): by default the no-grad K-quant products round
    # their activations to 8 bits as llama.cpp does (tests/kernels/test_qint.py bounds that)
    from pipeline.llm.quants import FrozenWeight
    monkeypatch.setattr(FrozenWeight, "integer_dot", False)
    a = model.infer(IDS, all_logits=True)
    b = model.forward(IDS).data
    assert a.shape == (len(IDS), model.config.vocab_size)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_kv_cache_decode_matches_full_prefill(model, monkeypatch):
    # f32 activations everywhere (the tolerance is float32 rounding): with the default integer decode dots the
    # one-row products round their activations to 8 bits as llama.cpp does (tests/kernels/test_qint.py bounds it)
    from pipeline.llm.quants import FrozenWeight
    monkeypatch.setattr(FrozenWeight, "integer_dot", False)
    full = model.infer(IDS, all_logits=True)
    cache = model.new_cache(capacity=2)  # forces the cache to grow
    first = model.infer(IDS[:5], cache)
    np.testing.assert_allclose(first, full[4], rtol=1e-4, atol=1e-4 * np.abs(full).max())
    for i in range(5, len(IDS)):  # one token at a time: the fused dequant-matvec path
        step = model.infer(IDS[i:i + 1], cache)
        np.testing.assert_allclose(step, full[i], rtol=1e-4, atol=1e-4 * np.abs(full).max())
    assert cache.length == len(IDS)


def test_batched_forward_equals_rows():
    m = Qwen3.from_gguf(FIXTURES / FILES[0])
    batch = np.stack([IDS, IDS[::-1]])
    out = m.forward(batch).data
    np.testing.assert_allclose(out[1], m.forward(IDS[::-1]).data, rtol=1e-5, atol=1e-4)


def test_frozen_gguf_model_has_no_parameters_and_passes_gradients_to_adapters():
    m = Qwen3.from_gguf(FIXTURES / "qwen3-mini-q8_0.gguf")
    assert m.named_parameters() == []

    class Adapter(Module):  # the LoRA-shaped seam: base(x) + B(A(x)), B starts at zero
        def __init__(self, base, rank=2):
            self.base = base
            self.in_features, self.out_features = base.in_features, base.out_features
            self.a = parameter(
                np.random.default_rng(0).standard_normal((rank, base.in_features)).astype(np.float32) * 0.1)
            self.b = parameter(np.zeros((base.out_features, rank), np.float32))

        def forward(self, x):
            return self.base(x) + ops.linear(ops.linear(x, self.a), self.b)

    m.blocks[0].attn.q = Adapter(m.blocks[0].attn.q)
    m.blocks[1].mlp.down = Adapter(m.blocks[1].mlp.down)
    names = [n for n, _ in m.named_parameters()]
    assert names == ["blocks.0.attn.q.a", "blocks.0.attn.q.b", "blocks.1.mlp.down.a", "blocks.1.mlp.down.b"]
    loss = cross_entropy(m.forward(IDS[:-1]), IDS[1:])
    loss.backward()
    a0, b0 = m.blocks[0].attn.q.a, m.blocks[0].attn.q.b
    assert np.abs(b0.grad).sum() > 0 and np.all(a0.grad == 0)  # B == 0 => dL/dA == 0 exactly
    # the no-grad inference path falls back to __call__ for a projection without infer()
    np.testing.assert_allclose(m.infer(IDS, all_logits=True), m.forward(IDS).data, rtol=1e-4, atol=1e-3)


def test_frozen_linear_input_gradient_by_finite_differences():
    m = Qwen3.from_gguf(FIXTURES / "qwen3-tied-q4_k_s.gguf")
    lin = m.blocks[0].attn.v
    assert isinstance(lin, FrozenLinear) and lin.weight.format.name == "Q5_K"
    x0 = np.random.default_rng(1).standard_normal((2, lin.in_features)).astype(np.float32)
    proj = np.random.default_rng(2).standard_normal((2, lin.out_features)).astype(np.float32)
    x = parameter(x0.copy())
    (lin(x) * Tensor(proj)).sum().backward()
    w = lin.weight.dequantize().astype(np.float64)
    numeric = proj.astype(np.float64) @ w  # d/dx sum(proj * x W^T) is exact for a linear map
    np.testing.assert_allclose(x.grad, numeric, rtol=1e-4, atol=1e-4)
    eps, (i, j) = 1e-2, (1, 7)
    xp, xm = x0.astype(np.float64).copy(), x0.astype(np.float64).copy()
    xp[i, j] += eps
    xm[i, j] -= eps
    fd = ((proj * (xp @ w.T)).sum() - (proj * (xm @ w.T)).sum()) / (2 * eps)
    assert abs(fd - x.grad[i, j]) < 1e-3 * max(1.0, abs(fd))


def test_init_random_trains():
    cfg = Qwen3Config(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn=64,
                      context_length=64, tied_output=False)
    m = Qwen3.init_random(cfg, seed=3)
    params = m.named_parameters()
    assert len(params) == 1 + 2 * 11 + 2 and all(p.requires_grad for _, p in params)
    m2 = Qwen3.init_random(cfg, seed=3)
    assert all(np.array_equal(a.data, b.data) for (_, a), (_, b) in zip(params, m2.named_parameters()))
    seq = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 2)
    losses = []
    for _ in range(8):
        m.zero_grad()
        loss = cross_entropy(m.forward(seq[:-1]), seq[1:])
        loss.backward()
        losses.append(float(loss.data))
        for _, p in m.named_parameters():
            assert p.grad is not None and np.isfinite(p.grad).all()
            p.data -= 0.5 * p.grad
    assert losses[-1] < 0.7 * losses[0]
    np.testing.assert_allclose(m.infer(seq, all_logits=True), m.forward(seq).data, rtol=1e-4, atol=1e-3)


def test_trainable_load_matches_frozen():
    frozen = Qwen3.from_gguf(FIXTURES / "qwen3-mini-q8_0.gguf")
    full = Qwen3.from_gguf(FIXTURES / "qwen3-mini-q8_0.gguf", trainable=True)
    assert len(full.named_parameters()) == 1 + 2 * 11 + 1  # tied head shares token_embd
    np.testing.assert_allclose(full.forward(IDS).data, frozen.forward(IDS).data, rtol=1e-4, atol=1e-3)


def test_generation_is_deterministic():
    m = Qwen3.from_gguf(FIXTURES / "qwen3-mini-f32.gguf")
    a, b = greedy(m, IDS[:4], 16), greedy(m, IDS[:4], 16)
    assert a == b and len(a) == 16
    s1 = list(generate(m, IDS[:4], 16, Sampling(temperature=30.0, top_k=50, top_p=0.95, seed=7)))
    s2 = list(generate(m, IDS[:4], 16, Sampling(temperature=30.0, top_k=50, top_p=0.95, seed=7)))
    s3 = list(generate(m, IDS[:4], 16, Sampling(temperature=30.0, top_k=50, top_p=0.95, seed=8)))
    assert s1 == s2 and s1 != s3
    stop = a[3]
    assert list(generate(m, IDS[:4], 16, stop_ids=(stop,)))[-1] == stop


def test_bad_inputs():
    m = Qwen3.from_gguf(FIXTURES / "qwen3-mini-f32.gguf")
    with pytest.raises(UserError, match="empty"):
        m.infer(np.array([], np.int64))
    with pytest.raises(UserError, match="out of range"):
        m.forward(np.array([1, 10_000]))
    with pytest.raises(UserError, match="context length 256"):
        m.infer(np.zeros(300, np.int64))
    with pytest.raises(UserError, match="the model's context is 256"):
        list(generate(m, np.zeros(256, np.int64), 4))
    with pytest.raises(UserError, match="empty"):
        list(generate(m, [], 4))
    with pytest.raises(UserError, match="multiple of kv_heads"):
        Qwen3Config(vocab_size=8, hidden=8, layers=1, heads=3, kv_heads=2, head_dim=4, ffn=8)
    with pytest.raises(UserError, match="top-p"):
        Sampling(temperature=1.0, top_p=0.0)


def test_inference_norm_and_rope_kernels_match_numpy():
    """The numba _rms / _norm_rope against the plain numpy formulas they replace (both RoPE layouts)."""
    from pipeline.autograd import ops
    from pipeline.models.decoder import _norm_rope, _rms
    r = np.random.default_rng(0)
    x = r.standard_normal((5, 3, 64)).astype(np.float32) * 3
    w = r.standard_normal(64).astype(np.float32)

    def rms(a):
        return a * (1.0 / np.sqrt(np.mean(np.square(a.astype(np.float64)), axis=-1, keepdims=True) + 1e-6)) * w

    def neox(n):
        return np.concatenate([n[..., :32] * cos - n[..., 32:] * sin, n[..., 32:] * cos + n[..., :32] * sin], axis=-1)

    np.testing.assert_allclose(_rms(x, w, 1e-6), rms(x), rtol=1e-5, atol=1e-5)
    cos, sin = (a[:, None, :] for a in ops.rope_tables(np.arange(7, 12), 64, 1e6))
    np.testing.assert_allclose(_norm_rope(x, Tensor(w), 1e-6, cos, sin, False), neox(rms(x)), rtol=1e-5, atol=1e-5)
    # interleaved ("normal") layout, no norm: pair (x[2i], x[2i+1]) rotates like NeoX's (x[i], x[i + 32])
    halves = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    ref = np.empty_like(x)
    ref[..., 0::2], ref[..., 1::2] = neox(halves)[..., :32], neox(halves)[..., 32:]
    np.testing.assert_allclose(_norm_rope(x, None, 1e-6, cos, sin, True), ref, rtol=1e-5, atol=1e-5)


def test_inference_attention_chunks_and_threads():
    """Chunked causal GQA attention: equal to a plain softmax reference, bitwise across thread counts."""
    import numba
    from pipeline.models import decoder as qwen3
    r = np.random.default_rng(1)
    t, pos0 = qwen3.ATTEND_CHUNK + 37, 9
    q = r.standard_normal((t, 8, 32)).astype(np.float32)
    k, v = (r.standard_normal((pos0 + t, 2, 32)).astype(np.float32) for _ in range(2))
    kk, vv = np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1)              # GQA: 4 q heads per kv head
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), kk) / np.sqrt(32)
    scores[:, np.arange(pos0 + t)[None, :] > (pos0 + np.arange(t))[:, None]] = -np.inf
    p = np.exp(scores - scores.max(-1, keepdims=True))
    ref = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), vv).reshape(t, -1)
    before, outs = numba.get_num_threads(), []
    try:
        for n in (1, 2):
            numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
            outs.append(qwen3._attend(q, k, v, pos0))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_allclose(outs[0], ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(outs[0], outs[1])
