"""The default mode stays at least as close as llama.cpp to the exact forward of the quantized model, on trained
weights (FUCINA_REAL_GGUFS, see tools/fetch_real_ggufs.py): `fucina bench llm`'s accuracy row, held in the slow
suite so a speed change cannot trade it away silently (issue 31, item 2; docs/models.md "Two numerics")."""
import os

import pytest

from pipeline.bench.llm import _accuracy

pytestmark = [pytest.mark.parity, pytest.mark.needs("llama_cpp"), pytest.mark.slow]

REAL = {"smollm2-q4_1": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-q4_k_m": "gemma-3-270m-q4_k_m.gguf"}


@pytest.mark.parametrize("name", sorted(REAL))
def test_the_default_mode_is_no_farther_than_llama_cpp_from_the_exact_forward(name):
    root = os.environ.get("FUCINA_REAL_GGUFS")
    if not root or not os.path.isfile(os.path.join(root, REAL[name])):
        pytest.skip("FUCINA_REAL_GGUFS is not set (tools/fetch_real_ggufs.py fetches the real files)")
    kl, ref = _accuracy(os.path.join(root, REAL[name]), 2, use_llama=True)
    assert ref == "llama.cpp on the F32 copy", kl
    assert kl["positions"] >= 50
    # the two exact forwards (Fucina's and llama.cpp's on the F32 copy) agree far below quantization's cost
    assert kl["fucina on the F32 copy"] < 1e-5, kl
    assert 0 < kl["llama.cpp"] < 0.05, kl  # llama.cpp's own quantized activations and f16 KV cache
    assert kl["fucina"] <= kl["llama.cpp"], kl  # a prompt: f32 activations wherever the products allow
    # decode steps take llama.cpp's own integer arithmetic (Q8 activations: the speed of a matvec), so their
    # contract is llama.cpp's level, not below it: measured 1.04x (Q4_1) and 0.96x (Q4_K_M) of llama.cpp's decode
    assert 0 < kl["fucina decode"] <= 1.25 * kl["llama.cpp decode"], kl
