"""llama and qwen2 beside qwen3: logits and greedy continuations against llama.cpp (llama-cpp-python).

Files: tools/make_tiny_model.py, laid out as convert_hf_to_gguf writes each architecture (llama's
Q/K rows permuted; Llama 3 rope_freqs; every optional llama bias; qwen2's q/k/v biases), F32 from
gguf-py and block formats from llama.cpp's own quantizer. Bounds: F32 per-position relative error
<= 1e-4 (measured <= 1e-6: both sides sum in f32, in different orders); block formats as the
qwen3 parity tests (tests/llm/test_parity_llama.py: check_relative, greedy equal or diverging only
at a near-tie of llama.cpp's own logits).
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

pytestmark = [pytest.mark.parity, pytest.mark.needs("llama_cpp")]

FAST = [("llama", "mini", "F32"), ("llama", "llama3", "F32"), ("llama", "linear", "F32"), ("llama", "biased", "F32"),
        ("qwen2", "untied", "F32"),
        ("llama", "tied", "Q4_K_S"), ("qwen2", "tied", "Q8_0")]
SLOW = [(a, s, k) for a in ("llama", "qwen2") for s in ("tied", "untied", "wide") for k in ("F32", "Q8_0", "Q4_K_S")
        if (a, s, k) not in FAST and (a, s) != ("qwen2", "wide")  # qwen2 refuses wide q (as llama.cpp does)
        ] + [("llama", "llama3", "Q5_K_M"), ("llama", "biased", "Q8_0")]
CASES = [pytest.param(*c, id="-".join(c)) for c in FAST] + [pytest.param(*c, id="-".join(c), marks=pytest.mark.slow)
                                                            for c in SLOW]


@pytest.mark.parametrize("arch,shape,kind", CASES)
def test_logits_and_greedy_match_llama_cpp(tmp_path, arch, shape, kind):
    path = mk.make(tmp_path, arch, shape, kind, seed=5)
    quantized = kind != "F32"
    model = load_model(path, llama_numerics=quantized)
    assert model.config.arch == arch
    ids = Tokenizer.from_gguf(GGUFFile(path)).encode(TEXT)
    oracle = llama(path, quantized)
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
    if not quantized:
        rows = np.linalg.norm(ref - ours, axis=1) / np.linalg.norm(ref, axis=1)
        assert rows.max() <= 1e-4, f"max per-position relative error {rows.max():.3g}"
        assert greedy == theirs
        return
    check_relative(ref, ours)
    if greedy != theirs:
        assert near_tie_at_divergence(path, ids, greedy, theirs, kind, 2 * np.abs(ref - ours).max())


# Every format the registry reads, on llama with Llama 3 rope_freqs and a tied head, llama with plain RoPE and
# a separate head, and qwen2 (q/k/v biases, separate head): the float kinds written by gguf-py, block formats
# by llama.cpp's quantizer, one format on every matrix (mk.PURE_FTYPES) or llama.cpp's own K_M mixes.
FORMAT_FIXTURES = [("llama", "llama3"), ("llama", "untied"), ("qwen2", "untied")]
FORMAT_KINDS = ["F16", "BF16", "Q8_0", *mk.PURE_FTYPES, "Q6_K", "Q4_K_M", "Q5_K_M"]
MIXES = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q5_K_M": {"Q5_K", "Q6_K"}}  # formats llama.cpp's mix must contain
FORMAT_FAST = {("llama", "llama3", "Q4_1"), ("llama", "untied", "IQ4_XS"), ("qwen2", "untied", "Q3_K")}
FORMAT_CASES = [pytest.param(a, s, k, id=f"{a}-{s}-{k}", marks=() if (a, s, k) in FORMAT_FAST else pytest.mark.slow)
                for a, s in FORMAT_FIXTURES for k in FORMAT_KINDS]


@pytest.fixture(scope="module")
def format_files(tmp_path_factory):
    """(arch, shape, kind) -> path; one F32 source per fixture, quantized by llama.cpp on first use."""
    out, made = tmp_path_factory.mktemp("formats"), {}

    def get(arch, shape, kind):
        if (arch, shape, kind) not in made:
            if kind in mk.QUANT_KINDS:
                made[arch, shape, kind] = mk.quantize_with_llama(get(arch, shape, "F32"),
                                                                 out / f"{arch}-{shape}-{kind}.gguf", kind)
            else:
                made[arch, shape, kind] = mk.make(out, arch, shape, kind, seed=5)
        return made[arch, shape, kind]

    return get


@pytest.mark.parametrize("arch,shape,kind", FORMAT_CASES)
def test_every_format_matches_llama_cpp(format_files, arch, shape, kind):
    path = format_files(arch, shape, kind)
    gg = GGUFFile(path)
    formats = {gg.weight(n).format.name for n in gg.tensor_names if gg.weight(n).shape[0] > 1}
    if kind in MIXES:  # what the case claims to cover is what the file holds
        assert MIXES[kind] <= formats, formats
    else:
        assert formats == {kind}, formats
    model = load_model(path, llama_numerics=True)
    ids = Tokenizer.from_gguf(gg).encode(TEXT)
    oracle = llama(path, quantized=kind not in ("F16", "BF16"))
    oracle.eval(ids)
    ref = np.array(oracle.scores[: len(ids)], dtype=np.float32)
    ours = model.infer(np.array(ids), all_logits=True)
    check_relative(ref, ours)
    oracle.reset()
    theirs = [t for _, t in zip(range(24), oracle.generate(ids, temp=0.0, top_k=1))]
    cache, greedy = model.new_cache(), []
    logits = model.infer(np.array(ids), cache)
    for _ in range(24):
        greedy.append(int(np.argmax(logits)))
        logits = model.infer(np.array(greedy[-1:]), cache)
    if greedy != theirs:
        assert near_tie_at_divergence(path, ids, greedy, theirs, kind, 2 * np.abs(ref - ours).max())
