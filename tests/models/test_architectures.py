"""Every registered architecture: config from GGUF metadata, the KV cache against the full forward,
the autograd forward against the inference path, and an independent float64 reference of the
Hugging Face formulation (llama: the Q/K rows un-permuted back to HF order and rotated by halves),
so llama.cpp's "normal" RoPE on convert_hf_to_gguf's permuted weights is pinned without llama.cpp.
gemma3's reference is Gemma3ForCausalLM's: scaled embeddings, pre+post norms, GeGLU, the sliding-window
layers with their own RoPE base, sequences longer than the window."""
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.llm.gguf import GGUFFile
from pipeline.models.registry import ARCHITECTURES, family, load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_tiny_model as mk  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CASES = [("llama", "mini"), ("qwen2", "mini"), ("qwen3", "mini"), ("llama", "llama3"), ("llama", "linear"),
         ("llama", "biased"), ("gemma3", "gemma-mini")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("arch")
    vocab = mk.train_vocab(mk.SHAPES["mini"].vocab)
    paths = {}
    for arch, shape in CASES:
        committed = FIXTURES / f"{arch}-{shape}-f32.gguf"
        if committed.is_file():
            paths[arch, shape] = committed
        else:
            s = mk.SHAPES[shape]
            paths[arch, shape] = mk.write_gguf(out / f"{arch}-{shape}.gguf", s, arch=arch, name=shape,
                                               vocab=vocab if s.vocab == mk.SHAPES["mini"].vocab else None)
    return paths


def test_registry_names_every_family():
    assert sorted(ARCHITECTURES) == ["gemma3", "llama", "qwen2", "qwen3"]
    with pytest.raises(UserError, match=r"^architecture 'gemma' is not supported \(supported: gemma3, llama, qwen2, "
                                        r"qwen3\)$"):
        family("gemma")


@pytest.mark.parametrize("arch,shape", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_config_from_metadata(files, arch, shape):
    m = load_model(files[arch, shape])
    s, c = mk.SHAPES[shape], m.config
    assert (c.arch, c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.ffn, c.tied_output) == \
        (arch, s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.ffn, s.tied)
    assert c.rope_base == s.rope_base
    assert c.rope_scale == (1.0 / s.linear_rope if s.linear_rope else 1.0)
    want_biases = {"llama": s.biases, "qwen2": ("q", "k", "v"), "qwen3": (), "gemma3": ()}[arch]
    assert c.biases == tuple(want_biases)
    assert (m._rope_factors is not None) == (arch == "llama" and s.llama3_rope)
    assert m.family.qk_norm == (arch in ("qwen3", "gemma3"))
    assert c.sliding_window == s.sliding_window
    local = [i for i in range(c.layers) if c.is_local(i)]
    assert local == ([0, 1, 2, 3, 4, 6] if arch == "gemma3" else [])  # llama.cpp's set_swa_pattern(6)


@pytest.mark.parametrize("arch,shape", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_kv_cache_and_autograd_forward_match_full_inference(files, arch, shape):
    """Prefill + one-token decode steps equal one full pass; the autograd forward equals it too.
    Bound: float32 sums over <= 512 terms of O(1) products through a few layers, relative ~1e-5
    of the logit scale (the two paths order their sums differently)."""
    m = load_model(files[arch, shape])
    ids = np.arange(5, 5 + 40) % m.config.vocab_size
    full = m.infer(ids, all_logits=True)
    cache = m.new_cache(8)  # grows by doubling on the way
    steps = [m.infer(ids[:17], cache)] + [m.infer(ids[i:i + 1], cache) for i in range(17, len(ids))]
    scale = np.abs(full).max()
    np.testing.assert_allclose(np.array(steps), full[16:], rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(m.forward(ids).data, full, rtol=0, atol=2e-5 * scale)


def _hf_reference(path, ids):
    """float64 Hugging Face-style forward from the GGUF's tensors: HF's rotate-half RoPE, llama's
    Q/K rows permuted back from convert_hf_to_gguf's order, biases where present."""
    gg = GGUFFile(path)
    arch = gg.architecture
    t = lambda n: gg.weight(n).dequantize().astype(np.float64)
    has = gg.has
    heads, kv = int(gg.get(f"{arch}.attention.head_count")), int(gg.get(f"{arch}.attention.head_count_kv"))
    hidden = int(gg.get(f"{arch}.embedding_length"))
    d = int(gg.get(f"{arch}.attention.key_length", hidden // heads))
    eps = float(gg.get(f"{arch}.attention.layer_norm_rms_epsilon"))
    gemma = arch == "gemma3"
    window = int(gg.get(f"{arch}.attention.sliding_window", 0))

    def sliding(i):  # Gemma3Config: sliding_window_pattern 6, every sixth layer full attention
        return gemma and (i + 1) % 6 != 0

    def rope_tables(base):
        inv = base ** (-np.arange(0, d, 2) / d)
        if has("rope_freqs.weight"):
            inv = inv / t("rope_freqs.weight").reshape(-1)
        positions = np.arange(len(ids)) / float(gg.get(f"{arch}.rope.scaling.factor", 1.0))  # linear scaling
        ang = positions[:, None] * inv[None]
        return np.cos(ang)[:, None], np.sin(ang)[:, None]

    rope_global = rope_tables(float(gg.get(f"{arch}.rope.freq_base")))
    rope_local = rope_tables(10_000.0)  # Gemma3Config.rope_local_base_freq

    def unpermute(w, n_head):  # inverse of convert_hf_to_gguf's LlamaModel.permute
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.reshape(-1)

    def lin(x, p, name, n_head=None):
        w = t(p + name + ".weight")
        b = t(p + name + ".bias").reshape(-1, 1) if has(p + name + ".bias") else None
        if arch == "llama" and n_head:
            w = unpermute(w, n_head)
            b = None if b is None else unpermute(b, n_head)
        return x @ w.T + (0 if b is None else b.reshape(-1))

    def rope(x, cos, sin):  # HF rotate_half
        h = d // 2
        return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)

    def gelu_tanh(g):
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))

    x = t("token_embd.weight")[ids]
    if gemma:  # Gemma3TextScaledWordEmbedding
        x = x * np.sqrt(hidden)
    n = len(ids)
    query, key = np.arange(n)[:, None], np.arange(n)[None, :]
    for i in range(int(gg.get(f"{arch}.block_count"))):
        p = f"blk.{i}."
        post = (lambda y, name: rms(y, t(p + name + ".weight"))) if gemma else (lambda y, name: y)
        h = rms(x, t(p + "attn_norm.weight"))
        q = lin(h, p, "attn_q", heads).reshape(n, heads, d)
        k = lin(h, p, "attn_k", kv).reshape(n, kv, d)
        v = lin(h, p, "attn_v").reshape(n, kv, d)
        if has(p + "attn_q_norm.weight"):
            q, k = rms(q, t(p + "attn_q_norm.weight")), rms(k, t(p + "attn_k_norm.weight"))
        cos, sin = rope_local if sliding(i) else rope_global
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)  # query_pre_attn_scalar = head_dim for gemma3 <= 12B
        hidden_keys = (key > query) | ((query - key >= window) if sliding(i) else False)
        s[:, hidden_keys] = -np.inf
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + post(lin(np.einsum("hts,shd->thd", a, v).reshape(n, heads * d), p, "attn_output"),
                     "post_attention_norm")
        h = rms(x, t(p + "ffn_norm.weight"))
        g = lin(h, p, "ffn_gate")
        act = gelu_tanh(g) if gemma else g / (1 + np.exp(-g))
        x = x + post(lin(act * lin(h, p, "ffn_up"), p, "ffn_down"), "post_ffw_norm")
    head = t("output.weight") if has("output.weight") else t("token_embd.weight")
    return rms(x, t("output_norm.weight")) @ head.T


@pytest.mark.parametrize("arch,shape", CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_matches_the_hugging_face_formulation(files, arch, shape):
    """F32 weights, f32 arithmetic against float64: relative error of a few 1e-6 of the logit scale.
    24 positions: three times gemma-mini's window of 8."""
    ids = np.arange(3, 3 + 24)
    ref = _hf_reference(files[arch, shape], ids)
    ours = load_model(files[arch, shape]).infer(ids, all_logits=True)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_llama_rope_is_not_neox_on_permuted_weights(files):
    """The check above has teeth: rotating llama's stored rows by halves (NeoX) is visibly wrong."""
    import dataclasses
    m = load_model(files["llama", "mini"])
    ids = np.arange(3, 3 + 24)
    ref = _hf_reference(files["llama", "mini"], ids)
    m.family = dataclasses.replace(m.family, rope="neox")
    assert np.abs(m.infer(ids, all_logits=True) - ref).max() > 1e-2 * np.abs(ref).max()


def test_qwen2_requires_its_biases(tmp_path):
    w = mk.make_weights(mk.SHAPES["mini"], 0, "qwen2")
    del w["blk.1.attn_k.bias"]
    p = mk.write_gguf(tmp_path / "nobias.gguf", mk.SHAPES["mini"], weights=w, arch="qwen2")
    with pytest.raises(UserError, match="nobias.gguf: tensor 'blk.1.attn_k.bias' is missing"):
        load_model(p)


def test_qwen2_refuses_a_q_wider_than_hidden_as_llama_cpp_does(tmp_path):
    p = mk.write_gguf(tmp_path / "wide.gguf", mk.SHAPES["wide"], arch="qwen2")
    with pytest.raises(UserError,
                       match=r"wide.gguf: qwen2 needs heads x head_dim == embedding_length .* 4 x 128 != 256"):
        load_model(p)


def test_a_tensor_the_family_does_not_read_is_refused(tmp_path):
    w = mk.make_weights(mk.SHAPES["mini"], 0, "llama")
    w["blk.1.ffn_up.bias"] = np.zeros(mk.SHAPES["mini"].ffn, np.float32)  # a bias in layer 1 only
    p = mk.write_gguf(tmp_path / "odd.gguf", mk.SHAPES["mini"], weights=w, arch="llama")
    with pytest.raises(UserError, match=r"odd.gguf: tensor\(s\) blk.1.ffn_up.bias are not part of a llama model"):
        load_model(p)


def test_gemma3_sliding_window_has_teeth(files):
    """The reference check sees the window: the same model with every layer global is visibly off."""
    import dataclasses
    m = load_model(files["gemma3", "gemma-mini"])
    ids = np.arange(3, 3 + 24)
    ref = _hf_reference(files["gemma3", "gemma-mini"], ids)
    m.config = dataclasses.replace(m.config, sliding_window=0)
    assert np.abs(m.infer(ids, all_logits=True) - ref).max() > 1e-2 * np.abs(ref).max()


def test_gemma3_without_a_sliding_window_is_refused(tmp_path):
    """llama.cpp builds another graph for such a file (no local layers, final-logit soft-capping)."""
    import dataclasses
    s = dataclasses.replace(mk.SHAPES["gemma-mini"], sliding_window=0)
    p = mk.write_gguf(tmp_path / "noswa.gguf", s, arch="gemma3", vocab=mk.train_vocab(s.vocab))
    with pytest.raises(UserError, match="noswa.gguf.*gemma3.attention.sliding_window"):
        load_model(p)
