"""pipeline/kernels/ggml_f32.py without the oracle: llama.cpp's f32 arithmetic is a rounding of the same math, so
each op stays within float rounding of the default path's (windows, GQA, a decode step after a prompt included), and the
llama-numerics forward runs every family. Bit-equality with llama.cpp itself:
tests/models/test_llama_numerics_real.py."""
from pathlib import Path

import numpy as np
import pytest

from pipeline.kernels import ggml_f32
from pipeline.autograd import ops
from pipeline.models import decoder as D
from pipeline.models.registry import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("t,pos0,window", [(20, 0, 0), (20, 0, 5), (1, 30, 7), (9, 13, 4), (3, 40, 0), (1, 0, 3)])
def test_attention_is_the_default_attention_to_rounding(t, pos0, window):
    rng = np.random.default_rng(t + pos0 + window)
    q = rng.standard_normal((t, 4, 64)).astype(np.float32)
    k, v = rng.standard_normal((2, pos0 + t, 2, 64)).astype(np.float32)
    got = ggml_f32.attend(q, k, v, pos0, np.float32(0.125), window)
    np.testing.assert_allclose(got, D._attend(q, k, v, pos0, 0.125, window), rtol=0, atol=2e-6)
    if pos0 == 0:  # the first query sees one key: its value, exactly
        np.testing.assert_array_equal(got[0].reshape(4, 64), v[0, [0, 0, 1, 1]])


def test_exp_rope_norm_and_swiglu_are_roundings_of_the_math():
    x = np.linspace(-80, 80, 100_001).astype(np.float32)
    got = np.array([ggml_f32.expf8(v) for v in x[::97]], np.float32)
    np.testing.assert_allclose(got, np.exp(x[::97].astype(np.float64)), rtol=4e-7)
    assert ggml_f32.expf8(np.float32(-np.inf)) == 0.0 and ggml_f32.expf8(np.float32(0.0)) == 1.0
    cos, sin = ggml_f32.rope_tables(np.arange(300), 64, 100_000.0)
    ref_cos, ref_sin = ops.rope_tables(np.arange(300, dtype=np.float64), 64, 100_000.0)
    assert np.all(cos[0] == 1) and np.all(sin[0] == 0)
    np.testing.assert_allclose(cos, ref_cos, atol=3e-5)  # f32 angles: an ulp of p * theta_i
    np.testing.assert_allclose(sin, ref_sin, atol=3e-5)
    rng = np.random.default_rng(1)
    h = (rng.standard_normal((5, 576)) * [[1e-3], [1], [30], [1], [1]]).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    np.testing.assert_allclose(D._rms_llama(h, w, 1e-5), D._rms(h, w, 1e-5), rtol=2e-6, atol=1e-7)
    g, u = (rng.standard_normal((2, 1539)) * 6).astype(np.float32)
    np.testing.assert_allclose(D._swiglu_llama(g, u), D.swiglu_f32(g, u), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["llama-mini-f32.gguf", "gemma3-gemma-mini-f32.gguf", "qwen3-tied-q4_k_s.gguf"])
def test_llama_numerics_decode_continues_the_prompt(name):
    """One call of the whole sequence vs a prompt then single tokens: the value sums take another kernel for
    one token and the products' arithmetic depends on the row count (as in llama.cpp), so the two agree to
    rounding (and its Q8 flips), not bitwise; logits stay close to the default mode's."""
    model = load_model(FIXTURES / name, llama_numerics=True)
    ids = np.array([5, 17, 42, 7, 99, 3, 64, 8, 11, 2])
    full = model.infer(ids, all_logits=True)
    cache = model.new_cache()
    steps = [model.infer(ids[:6], cache, all_logits=True)] + [model.infer(ids[i:i + 1], cache)[None]
                                                              for i in range(6, len(ids))]
    steps = np.concatenate(steps)
    scale = np.abs(full).max()
    assert np.abs(steps - full).max() <= 3e-2 * scale
    default = load_model(FIXTURES / name).infer(ids, all_logits=True)
    assert np.abs(default - full).max() <= 3e-2 * scale
