"""`llama_numerics=True` is llama.cpp's logits bit for bit at every position, on trained weights.

Random-weight fixtures hid the gap: on them a float32 difference between the matrix products rarely crossed a
Q8 rounding midpoint, while on a trained 30-layer model it did at nearly every position (SmolLM2-135M Q4_1:
bit-equal at positions 0 and 1, then 2.3e-2 - 3.8e-2 relative). pipeline/kernels/ggml_f32.py now reproduces those f32
parts (RMSNorm's f64 sum, RoPE's angles and contraction, the scores, softmax's v_expf and f64 sums, the order
of the weighted value sum, SiLU) and pipeline/kernels/qtile.py llama.cpp's AVX2 tiled K-quant epilogue. This file holds
them to ggml-cpu's exported vec functions (ctypes) and, on the real files (FUCINA_REAL_GGUFS, see
tools/fetch_real_ggufs.py), every logit of a prompt and of single-token decode steps to llama-cpp-python's
(F32 KV cache, no flash attention, its default CPU kernels without the repacked buffers)."""
import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from pipeline.kernels import ggml_f32
from llama_oracle import ggml_cpu, plain_llama

pytestmark = [pytest.mark.parity, pytest.mark.needs("llama_cpp")]

REAL = {"smollm2-q4_1": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-q4_k_m": "gemma-3-270m-q4_k_m.gguf"}
TEXT = ("The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; def f(x): return x * 2"
        " -- café, 你好, 🔥. Then the forge glowed for another hour while the smith hammered the blade.")


@pytest.fixture(scope="module")
def ggml():
    lib = ggml_cpu()
    lib.ggml_vec_soft_max_f32.restype = ctypes.c_double
    return lib


def _p(a):
    return a.ctypes.data_as(ctypes.c_void_p)


@njit(cache=True)
def _dot(x, y):
    return ggml_f32._vec_dot(x, y, x.shape[0], np.zeros(ggml_f32.STEP, np.float32))


@njit(cache=True)
def _softmax(x, big, y):
    total = 0.0
    for c in range(x.shape[0]):
        y[c] = ggml_f32.expf(x[c] - big)
    for c in range(0, x.shape[0], ggml_f32.LANES):
        total += np.float64(ggml_f32.group_sum(y, c))
    return total


def test_vec_dot_f32_softmax_and_swiglu_give_ggml_bits(ggml):
    """On this host's llama.cpp build: AVX-512 (F + DQ) hosts run ggml's 16-lane paths, others the AVX2 ones
    (ggml_f32.AVX512 picks the model; a native llama-cpp-python build follows the host)."""
    rng = np.random.default_rng(0)
    for n in list(range(1, 70)) + [128, 256, 576, 1000]:  # the leftovers' runs of 8, 4 and fused tail included
        x, y = (rng.standard_normal((2, n)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
        s = ctypes.c_float()
        ggml.ggml_vec_dot_f32(ctypes.c_int(n), ctypes.byref(s), ctypes.c_size_t(0), _p(x), ctypes.c_size_t(0), _p(y),
                              ctypes.c_size_t(0), ctypes.c_int(1))
        assert np.float32(s.value).view(np.uint32) == np.float32(_dot(x, y)).view(np.uint32), n
    x = np.concatenate([np.linspace(-200, 100, 200_000), [-np.inf, 0.0, -0.0, 88.7, -87.3, -103.0]]).astype(np.float32)
    x = x[: x.size - x.size % 16]  # v_expf over its whole range, special paths included (ggml's softmax, max 0)
    for scores in (x, np.where(rng.random(1024) < 0.3, -np.inf, rng.standard_normal(1024) * 20).astype(np.float32)):
        big = np.float32(scores.max())
        want, got = np.empty_like(scores), np.empty_like(scores)
        total = ggml.ggml_vec_soft_max_f32(ctypes.c_int(scores.size), _p(want), _p(scores), ctypes.c_float(big))
        assert _softmax(scores, big, got) == total
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for n in (1, 7, 8, 1536, 2051):
        g, u = (rng.standard_normal((2, n)) * 6).astype(np.float32)
        want, got = np.empty(n, np.float32), np.empty(n, np.float32)
        ggml.ggml_vec_swiglu_f32(ctypes.c_int(n), _p(want), _p(g), _p(u))
        ggml_f32.swiglu_rows(g, u, got)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=str(n))


def _real(name):
    root = os.environ.get("FUCINA_REAL_GGUFS")
    if not root:
        pytest.skip("FUCINA_REAL_GGUFS is not set (tools/fetch_real_ggufs.py fetches the real files)")
    path = Path(root) / REAL[name]
    if not path.is_file():
        pytest.skip(f"{path} is missing (tools/fetch_real_ggufs.py)")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL))
def test_every_position_equals_llama_cpp_on_real_files(name):
    """A prompt of every position in one call, then single-token decode steps (their scores and the value sums
    take other kernels in llama.cpp), each logit bit-equal."""
    from pipeline.llm.gguf import GGUFFile
    from pipeline.llm.tokenizer import Tokenizer
    from pipeline.models.registry import load_model
    path = _real(name)
    ids = Tokenizer.from_gguf(GGUFFile(path)).encode(TEXT)
    prompt, steps = ids[:-8], ids[-8:]
    oracle = plain_llama(path, 256)
    oracle.eval(prompt)
    for t in steps:
        oracle.eval([t])
    ref = np.array(oracle.scores[: len(ids)], dtype=np.float32)
    model = load_model(path, llama_numerics=True)
    cache = model.new_cache()
    ours = [model.infer(np.array(prompt), cache, all_logits=True)]
    ours += [model.infer(np.array([t]), cache)[None] for t in steps]
    ours = np.concatenate(ours)
    equal = [np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(ours, ref)]
    bad = [i for i, e in enumerate(equal) if not e]
    assert not bad, (f"{name}: positions {bad[:10]} of {len(ids)} differ from llama.cpp (max relative "
                     f"{np.abs(ours - ref).max() / np.abs(ref).max():.3g})")
