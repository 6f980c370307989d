"""gemma3 against llama.cpp (llama-cpp-python): logits and greedy continuations, and LoRA gradients
against a float64 torch replica of Gemma3ForCausalLM's formulation.

Files: tools/make_tiny_model.py's gemma shapes (seven layers: five local, one global, one local; a
sliding window of 16 positions, shorter than the test text), F32 from gguf-py as convert_hf_to_gguf's
Gemma3Model writes them, block formats from llama.cpp's quantizer. F32 runs in llama-numerics mode:
ggml's CPU GeGLU reads GELU from an f16 table (input and output rounded to f16, 2^-11 relative each),
which alone moves the logits by ~5e-5 relative; emulated, the rest is f32 summation order (measured
1.2e-5), bound 1e-4 per position. Block formats as the other architectures (check_relative, greedy
equal or diverging only at a near-tie of llama.cpp's own logits).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer
from pipeline.models.registry import load_model
from test_parity_llama import TEXT, check_relative, llama, near_tie_at_divergence

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_tiny_model as mk  # noqa: E402

pytestmark = [pytest.mark.parity]
CASES = [pytest.param("F32", id="F32"), pytest.param("Q8_0", id="Q8_0"),
         pytest.param("F16", id="F16", marks=pytest.mark.slow),
         pytest.param("Q4_K_M", id="Q4_K_M", marks=pytest.mark.slow)]


@pytest.mark.needs("llama_cpp")
@pytest.mark.parametrize("kind", CASES)
def test_gemma3_logits_and_greedy_match_llama_cpp(tmp_path, kind):
    path = mk.make(tmp_path, "gemma3", "gemma", kind, seed=5)
    model = load_model(path, llama_numerics=True)
    ids = Tokenizer.from_gguf(GGUFFile(path)).encode(TEXT)
    assert len(ids) > 2 * model.config.sliding_window  # the local layers' window matters
    oracle = llama(path, kind != "F32")
    oracle.eval(ids)
    ref = np.array(oracle.scores[: len(ids)], dtype=np.float32)
    ours = model.infer(np.array(ids), all_logits=True)
    oracle.reset()
    theirs = [t for _, t in zip(range(24), oracle.generate(ids, temp=0.0, top_k=1))]
    cache, greedy = model.new_cache(), []
    logits = model.infer(np.array(ids), cache)
    for _ in range(24):
        greedy.append(int(np.argmax(logits)))
        logits = model.infer(np.array(greedy[-1:]), cache)
    if kind == "F32":
        rows = np.linalg.norm(ref - ours, axis=1) / np.linalg.norm(ref, axis=1)
        assert rows.max() <= 1e-4, f"max per-position relative error {rows.max():.3g}"
        assert greedy == theirs
        return
    check_relative(ref, ours)
    if greedy != theirs:
        assert near_tie_at_divergence(path, ids, greedy, theirs, kind, 2 * np.abs(ref - ours).max())
