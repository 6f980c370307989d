"""Parity with llama.cpp (llama-cpp-python as the oracle): logits per position, greedy text, token ids.

Fixtures: tools/make_tiny_model.py shapes (tied/untied head, 2-4 layers, head
counts 4/8 with 2/2/1 kv heads, head_dim 64/32/128, rows of 256) written in
F32/F16/BF16 by gguf-py and quantized by llama.cpp's own quantizer. Bounds:
F32 max |diff| <= 1e-3 with an f32 KV cache in llama.cpp; F16, BF16 and block
formats (llama.cpp's CPU matmul rounds the activations to the weight type's dot
partner: F16 for F16 weights, so on logits of ~100 a half-precision ulp of
activations is ~3e-2 of logit): per-position relative error median <= 2e-2 (max <= 3e-2) in
llama-numerics mode (our activations rounded like llama.cpp's CPU dot
products); greedy 32-token continuations identical (for rounded-activation
kinds: identical up to a divergence at a near-tie of llama.cpp's own logits).
The loose bound for rounded activations is pinned to float rounding by
test_parity_ties.py (every gap is a handful of rounding ties).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer
from pipeline.models.qwen3 import Qwen3

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_tiny_model as mk  # noqa: E402
from llama_oracle import llama as oracle_llama  # noqa: E402

pytestmark = [pytest.mark.parity, pytest.mark.needs("llama_cpp")]

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TEXT = "The forge glows; def f(x): return x * 2  # 1024 tokens, café 你好 🔥 and more words here"
FLOAT_KINDS = ["F32", "F16", "BF16"]
QUANT_KINDS = ["Q8_0", "Q4_K_S", "Q5_K_M", "Q6_K"]
FAST = {("untied", "F16"), ("wide", "Q5_K_M")}  # by default (with the committed fixtures); the full matrix is -m slow
CASES = [pytest.param(s, k, id=f"{s}-{k}", marks=() if (s, k) in FAST else pytest.mark.slow)
         for s in ("tied", "untied", "wide") for k in FLOAT_KINDS + QUANT_KINDS]


def llama(path, quantized):
    """llama.cpp's repacked (extra buffer) CPU kernels: exact for float weights, but its AMX int8 path dies with
    SIGILL on this VM for block formats, so those run without them."""
    return oracle_llama(path, use_extra_bufts=not quantized, n_ctx=256, n_batch=256, n_ubatch=256,
                        logits_all=True, n_threads=1, type_k=0, type_v=0)  # type 0 = f32 KV cache


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(shape, kind) -> path, written on first use (vocab and weights shared per shape)."""
    out, made, base = tmp_path_factory.mktemp("qwen3"), {}, {}

    def get(shape_name, kind):
        if (shape_name, kind) not in made:
            shape = mk.SHAPES[shape_name]
            if shape_name not in base:
                base[shape_name] = (mk.train_vocab(shape.vocab), mk.make_weights(shape, seed=11))
            vocab, weights = base[shape_name]
            if kind in FLOAT_KINDS:
                made[shape_name, kind] = mk.write_gguf(out / f"{shape_name}-{kind}.gguf", shape, dtype=kind,
                                                       weights=weights, vocab=vocab)
            else:
                made[shape_name, kind] = mk.quantize_with_llama(get(shape_name, "F32"),
                                                                out / f"{shape_name}-{kind}.gguf", kind)
        return made[shape_name, kind]

    return get


def check_relative(ref, ours):
    """Block formats and BF16: per-position relative error (||diff|| / ||ref||) median <= 2e-2,
    and max |diff| <= 3e-2 of the largest logit. Most cases sit far below 1e-2 (e.g. tied
    Q4_K_S: 3e-7), but a single activation-quantization rounding flip in one cached K/V row
    shifts every later position by ~1% on these small random models (measured up to 1.35%)."""
    rows = np.linalg.norm(ref - ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.median(rows) <= 2e-2, f"median per-position relative error {np.median(rows):.3g}"
    assert np.abs(ref - ours).max() <= 3e-2 * np.abs(ref).max(), \
        f"max relative diff {np.abs(ref - ours).max() / np.abs(ref).max():.3g}"


def near_tie_at_divergence(path, ids, ours, theirs, kind, tol):
    """Where two greedy runs first differ, llama.cpp's own logits for the two picks must be within tol (twice the
    prompt's largest logit difference), unless a rounding flip of the quantized activations (check_relative) has
    moved the positions since: then both models are run on llama.cpp's continuation, their logits there must
    stay within check_relative's bounds at every position (a drift beyond them fails whatever the gap), and the
    gap within twice their difference at the divergence. With the integer dot products the prompt sits ~1e-6
    from llama.cpp, so one flip (a ~1% shift, measured) is what most divergences come from."""
    from pipeline.models.registry import load_model
    k = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    oracle = llama(path, quantized=kind not in FLOAT_KINDS)
    oracle.eval(list(ids) + theirs[:k])
    scores = np.array(oracle.scores[len(ids) - 1:len(ids) + k], dtype=np.float32)
    last = scores[-1]
    gap = abs(last[ours[k]] - last[theirs[k]])
    if gap <= tol:
        return True
    mine = load_model(path, llama_numerics=kind != "F32").infer(np.array(list(ids) + theirs[:k]), all_logits=True)
    mine = mine[len(ids) - 1:]
    check_relative(scores, mine)
    return gap <= 2 * np.abs(mine[-1] - last).max()


def compare(path, kind):
    model = Qwen3.from_gguf(path, llama_numerics=kind != "F32")
    ids = Tokenizer.from_gguf(GGUFFile(path)).encode(TEXT)
    oracle = llama(path, quantized=kind not in FLOAT_KINDS)
    oracle.eval(ids)
    ref = np.array(oracle.scores[: len(ids)], dtype=np.float32)
    ours = model.infer(np.array(ids), all_logits=True)
    oracle.reset()
    theirs = [t for _, t in zip(range(32), oracle.generate(ids, temp=0.0, top_k=1))]
    cache, greedy = model.new_cache(), []
    logits = model.infer(np.array(ids), cache)
    for _ in range(32):
        greedy.append(int(np.argmax(logits)))
        logits = model.infer(np.array(greedy[-1:]), cache)
    return ref, ours, theirs, greedy


@pytest.mark.parametrize("shape,kind", CASES)
def test_logits_and_greedy_match_llama_cpp(files, shape, kind):
    path = files(shape, kind)
    ref, ours, theirs, greedy = compare(path, kind)
    diff = np.abs(ref - ours).max()
    if kind == "F32":
        assert diff <= 1e-3, f"max |logit diff| {diff:.3g}"
    else:
        check_relative(ref, ours)
    if kind != "F32" and greedy != theirs:
        # Rounded/quantized activations make a one-step rounding flip in a K/V row persist for
        # every later position; a divergence is accepted only at a genuine near-tie of llama.cpp's own logits.
        ids = Tokenizer.from_gguf(GGUFFile(path)).encode(TEXT)
        assert near_tie_at_divergence(path, ids, greedy, theirs, kind, 2 * diff)
    else:
        assert greedy == theirs


@pytest.mark.parametrize("name", ["qwen3-mini-f32.gguf", "qwen3-mini-q8_0.gguf", "qwen3-tied-q4_k_s.gguf"])
def test_committed_fixtures_match_llama_cpp(name):
    kind = "F32" if "f32" in name else "Q"
    ref, ours, theirs, greedy = compare(FIXTURES / name, kind)
    if kind == "F32":
        assert np.abs(ref - ours).max() <= 1e-3
    else:
        check_relative(ref, ours)
    assert greedy == theirs


CORPUS = [
    "Hello world!", "   runs   of  spaces\t\ttabs\n\n\r\n newlines ", "digits 1234567890 3.14159 -42 0x1F 2026-11-29",
    "punctuation!?.,;:'\"()[]{}<>@#$%^&*-_=+\\|/~`", "def f(x):\n    return x ** 2  # code\n\tindent",
    "emoji 🔥🚀😀👍🏽 ZWJ 👨‍👩‍👧", "中文字符和日本語のテキスト、한국어",
    "café naïve Ärger Ελληνικά русский עברית العربية",
    "don't it's we'll they've I'm you'd SHE'S", "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
    "a" * 50 + " " + "ab" * 20, "\n", " ", "x\u00a0y\u2003z", "tabs\tand\u3000ideographic space",
]


@pytest.mark.parametrize("name", ["qwen3-mini-f32.gguf", "qwen3-tied-q4_k_s.gguf"])
@pytest.mark.parametrize("special", [True, False])
def test_tokenization_matches_llama_cpp(name, special):
    path = FIXTURES / name
    tok = Tokenizer.from_gguf(GGUFFile(path))
    oracle = oracle_llama(path, vocab_only=True)
    for text in CORPUS:
        assert tok.encode(text, special=special) == oracle.tokenize(text.encode(), add_bos=False, special=special), text
