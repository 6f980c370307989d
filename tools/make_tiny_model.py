"""Build tiny random GGUFs of every registered architecture (fixtures for tests, docs and llama.cpp parity).

Usage:
  python tools/make_tiny_model.py --out tests/fixtures            # the committed fixtures
  python tools/make_tiny_model.py --out /tmp/q --arch llama --shape wide --dtype F16

Each file is laid out the way llama.cpp's convert_hf_to_gguf.py writes that
architecture: qwen3 with per-head q/k norms; qwen2 with q/k/v biases; llama
with its Q/K rows permuted from the Hugging Face half-rotation order into the
adjacent-pair order llama.cpp's "normal" RoPE expects, optional biases, and
(shape "llama3") the rope_freqs.weight frequency factors of Llama 3 RoPE scaling;
gemma3 with per-head q/k norms, the post-attention / post-MLP norms, norm weights
stored as Gemma's (1 + w) the way Gemma3Model writes them, and a sliding window
shorter than the test sequences (its shapes have six or more layers, so both the
local and the global layer kinds occur).

The tokenizer is a byte-level BPE trained (deterministically) with Hugging Face
`tokenizers` on a small built-in corpus and stored the way llama.cpp expects it
(tokenizer.ggml.model "gpt2", pre "qwen2", tokens/types/merges, ChatML special
tokens). Weights come from the project's counter RNG, so a (shape, seed) pair
always gives the same bytes. Quantized variants are made by llama.cpp's own
quantizer via llama-cpp-python when installed: its mixes (Q8_0, Q4_K_S, Q4_K_M,
Q5_K_M, Q6_K) or one block format on every matrix (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
Q3_K, Q4_K, Q5_K, IQ4_NL, IQ4_XS; llama-quantize --pure).
Generating versions are written into the GGUF's general.description.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from pipeline.kernels import rng  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    vocab: int = 512
    context: int = 256
    rope_base: float = 1_000_000.0
    biases: tuple = ()          # llama: projections given a bias (qwen2 always has q/k/v biases)
    llama3_rope: bool = False   # llama: write rope_freqs.weight (Llama 3 scaling by llama3_factor)
    llama3_factor: float = 8.0  # llama: Llama 3.1's rope_scaling.factor (Llama 3.2 uses 32)
    linear_rope: float = 0.0    # llama: linear RoPE scaling by this factor (llama.rope.scaling.*), 0 = none
    sliding_window: int = 0     # gemma3: attention.sliding_window (its local layers' window)
    embed_std: float = 1.0      # std of the random token embeddings


SHAPES = {
    # docs/unit-test model: small enough to commit in F32
    "mini": Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, tied=True, vocab=384),
    # parity shapes: every matrix row (n_in) is a multiple of 256 so K-quants apply
    "tied": Shape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, tied=True),
    "untied": Shape(hidden=256, layers=3, heads=8, kv_heads=2, head_dim=32, ffn=256, tied=False, rope_base=10_000.0),
    "wide": Shape(hidden=256, layers=4, heads=4, kv_heads=1, head_dim=128, ffn=256, tied=False),
    # llama only: Llama 3 RoPE scaling factors, linear RoPE scaling, and every optional bias
    "llama3": Shape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, tied=True, rope_base=500_000.0,
                    llama3_rope=True),
    "linear": Shape(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=256, tied=True, rope_base=10_000.0,
                    linear_rope=4.0),
    "biased": Shape(hidden=256, layers=2, heads=4, kv_heads=4, head_dim=64, ffn=256, tied=False, rope_base=10_000.0,
                    biases=("q", "k", "v", "o", "gate", "up", "down")),
    # gemma3 only: five local layers then a global one (llama.cpp's pattern), and a local layer after it
    "gemma-mini": Shape(hidden=64, layers=7, heads=4, kv_heads=1, head_dim=16, ffn=64, tied=True, vocab=384,
                        sliding_window=8),
    "gemma": Shape(hidden=256, layers=7, heads=4, kv_heads=1, head_dim=64, ffn=512, tied=True, sliding_window=16),
    # "gemma" with embeddings of std hidden^-1/2, so Gemma's sqrt(hidden) input scale gives rows of unit RMS as in
    # trained Gemma files; at std 1 the tied head's logit of the input token itself (~16 * hidden) drowns a
    # fine-tune's margin, and quantization noise flips its answer back
    "gemma-unit": Shape(hidden=256, layers=7, heads=4, kv_heads=1, head_dim=64, ffn=512, tied=True, sliding_window=16,
                        embed_std=256 ** -0.5),
}
ARCHS = ("gemma3", "llama", "qwen2", "qwen3")
BIAS_TENSORS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}

SPECIAL_TOKENS = [  # (text, llama.cpp token type)
    ("<|endoftext|>", gguf.TokenType.CONTROL),
    ("<|im_start|>", gguf.TokenType.CONTROL),
    ("<|im_end|>", gguf.TokenType.CONTROL),
    ("<think>", gguf.TokenType.USER_DEFINED),
    ("</think>", gguf.TokenType.USER_DEFINED),
]

# A ChatML template in the style of Qwen3's (system, user/assistant turns, and
# an empty think block when enable_thinking is false).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A forge heats metal until it glows;
the smith hammers it into shape, quenches it, and tempers it again.
def forward(self, x):\n    return self.down(silu(self.gate(x)) * self.up(x))
for (int i = 0; i < 1024; ++i) { sum += a[i] * b[i]; }
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 256 1024 3.14159 2026-11-29 12:35
Questions? Answers! Quotes "like this" and 'that' -- dashes, ellipses...
   indented lines\n\n\ttabs\tand   runs of    spaces
你好，世界。机器学习在中央处理器上训练。 こんにちは世界 안녕하세요
Emoji: 🔥🚀😀 and accents: café, naïve, Ärger, façade, São Paulo
user assistant system message content think answer model token
"""


def train_vocab(n_vocab: int):
    """(tokens, types, merges) of a byte-level BPE with the qwen2 pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from pipeline.llm.tokenizer import QWEN2_PATTERN
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    n_special = len(SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=n_vocab - n_special, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer)
    import json
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for text, ttype in SPECIAL_TOKENS:
        tokens.append(text)
        types.append(ttype)
    while len(tokens) < n_vocab:  # pad (rare): unused tokens llama.cpp accepts
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(gguf.TokenType.UNUSED)
    return tokens, types, merges


def _matrix(seed: int, name_index: int, rows: int, cols: int, std: float) -> np.ndarray:
    return rng.gaussian(rng.derive_seed(seed, name_index), (rows, cols)) * np.float32(std)


def hf_to_gguf_qk_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Llama Q/K permutation: within each head, rows in HF's half-rotation
    order (x[i], x[i + d/2]) become adjacent pairs (x[2i], x[2i+1]) for llama.cpp's normal RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, base: float, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_context=8192) -> np.ndarray:
    """The frequency divisors Llama 3.1's rope_scaling implies (what convert_hf_to_gguf stores as
    rope_freqs.weight): 1 for short wavelengths, `factor` for long ones, a smooth ramp between."""
    freqs = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    ramp = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < original_context / high_freq_factor, 1.0,
                   np.where(wavelen > original_context / low_freq_factor, factor, ramp))
    return out.astype(np.float32)


def make_weights(shape: Shape, seed: int, arch: str = "qwen3") -> dict[str, np.ndarray]:
    """name -> f32 array, numpy order [rows=n_out, cols=n_in], laid out as convert_hf_to_gguf writes `arch`."""
    w, k = {}, iter(range(10_000))
    h, qd, kvd = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    biases = {"llama": shape.biases, "qwen2": ("q", "k", "v"), "qwen3": (), "gemma3": ()}[arch]

    def norm(n):  # RMSNorm gains near 1 so activations keep a useful scale
        return 1.0 + 0.1 * rng.gaussian(rng.derive_seed(seed, next(k)), (n,))

    def bias(n):
        return 0.1 * rng.gaussian(rng.derive_seed(seed, next(k)), (n,))

    w["token_embd.weight"] = _matrix(seed, next(k), shape.vocab, h, shape.embed_std)
    if arch == "llama" and shape.llama3_rope:
        w["rope_freqs.weight"] = llama3_rope_factors(shape.head_dim, shape.rope_base, factor=shape.llama3_factor)
    for i in range(shape.layers):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = norm(h)
        w[p + "attn_q.weight"] = _matrix(seed, next(k), qd, h, h ** -0.5)
        w[p + "attn_k.weight"] = _matrix(seed, next(k), kvd, h, h ** -0.5)
        w[p + "attn_v.weight"] = _matrix(seed, next(k), kvd, h, h ** -0.5)
        if arch in ("qwen3", "gemma3"):
            w[p + "attn_q_norm.weight"] = norm(shape.head_dim)
            w[p + "attn_k_norm.weight"] = norm(shape.head_dim)
        w[p + "attn_output.weight"] = _matrix(seed, next(k), h, qd, qd ** -0.5)
        if arch == "gemma3":  # Gemma's (1 + w) norms: HF w near 0 is stored as a gain near 1, like the others
            w[p + "post_attention_norm.weight"] = norm(h)
        w[p + "ffn_norm.weight"] = norm(h)
        w[p + "ffn_gate.weight"] = _matrix(seed, next(k), shape.ffn, h, h ** -0.5)
        w[p + "ffn_up.weight"] = _matrix(seed, next(k), shape.ffn, h, h ** -0.5)
        w[p + "ffn_down.weight"] = _matrix(seed, next(k), h, shape.ffn, shape.ffn ** -0.5)
        if arch == "gemma3":
            w[p + "post_ffw_norm.weight"] = norm(h)
        for t in biases:
            w[p + BIAS_TENSORS[t] + ".bias"] = bias(w[p + BIAS_TENSORS[t] + ".weight"].shape[0])
        if arch == "llama":  # the random matrices stand for HF's; store them as the converter does
            for t, n_head in (("q", shape.heads), ("k", shape.kv_heads)):
                for kind in ("weight", "bias"):
                    name = p + BIAS_TENSORS[t] + "." + kind
                    if name in w:
                        w[name] = hf_to_gguf_qk_rows(w[name], n_head)
    w["output_norm.weight"] = norm(h)
    if not shape.tied:
        w["output.weight"] = _matrix(seed, next(k), shape.vocab, h, 1.0)
    return {name: a.astype(np.float32) for name, a in w.items()}


def versions() -> str:
    import tokenizers
    return (f"fucina tools/make_tiny_model.py; gguf-py {gguf.__version__ if hasattr(gguf, '__version__') else '0.19'}; "
            f"tokenizers {tokenizers.__version__}; numpy {np.__version__}")



def write_gguf(path, shape: Shape, seed: int = 0, dtype: str = "F32", name: str = "tiny-qwen3",
               weights: dict | None = None, vocab=None, arch: str = "qwen3"):
    """Write one GGUF of `arch`. dtype: F32, F16 or BF16 for the matrices (norms, biases stay F32)."""
    tokens, types, merges = vocab or train_vocab(shape.vocab)
    weights = weights if weights is not None else make_weights(shape, seed, arch)
    wr = gguf.GGUFWriter(str(path), arch=arch)
    wr.add_name(name)
    wr.add_description(versions())
    wr.add_context_length(shape.context)
    wr.add_embedding_length(shape.hidden)
    wr.add_block_count(shape.layers)
    wr.add_feed_forward_length(shape.ffn)
    wr.add_head_count(shape.heads)
    wr.add_head_count_kv(shape.kv_heads)
    wr.add_key_length(shape.head_dim)
    wr.add_value_length(shape.head_dim)
    wr.add_rope_freq_base(shape.rope_base)
    if arch == "llama":  # convert_hf_to_gguf's LlamaModel also records these
        wr.add_vocab_size(shape.vocab)
        wr.add_rope_dimension_count(shape.head_dim)
        if shape.linear_rope:
            wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            wr.add_rope_scaling_factor(shape.linear_rope)
    if arch == "gemma3" and shape.sliding_window:  # convert_hf_to_gguf's Gemma3Model: the local layers' window
        wr.add_sliding_window(shape.sliding_window)
    wr.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    wr.add_file_type({"F32": 0, "F16": 1, "BF16": 32}[dtype])
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("qwen2")
    wr.add_token_list(tokens)
    wr.add_token_types([int(t) for t in types])
    wr.add_token_merges(merges)
    wr.add_bos_token_id(tokens.index("<|endoftext|>"))
    wr.add_eos_token_id(tokens.index("<|im_end|>"))
    wr.add_pad_token_id(tokens.index("<|endoftext|>"))
    wr.add_add_bos_token(False)
    wr.add_chat_template(CHAT_TEMPLATE)
    for tname, a in weights.items():
        if a.ndim == 1 or dtype == "F32":
            wr.add_tensor(tname, a)
        elif dtype == "F16":
            wr.add_tensor(tname, a.astype(np.float16))
        else:
            wr.add_tensor(tname, gguf.quants.quantize(a, QT.BF16), raw_dtype=QT.BF16)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return Path(path)


LLAMA_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
                "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
                "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}
# One block format on every matrix (embedding and head included): llama_model_quantize with `pure`,
# which skips llama.cpp's per-tensor upgrades (Q6_K head, Q4_K/Q5_K attn_v, ...). The K-quant names
# are the format; the llama.cpp ftype giving it is its _S mix.
PURE_FTYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
               "Q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "Q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
               "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K", "Q3_K": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
               "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q5_K": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
               "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL", "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS"}
QUANT_KINDS = {**LLAMA_FTYPES, **PURE_FTYPES}


def quantize_with_llama(src, dst, kind: str):
    """Quantize a GGUF with llama.cpp's own quantizer (llama-cpp-python): a llama.cpp mix (LLAMA_FTYPES)
    or one format throughout (PURE_FTYPES)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_KINDS[kind])
    params.pure = kind in PURE_FTYPES
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {kind}) failed with {rc}")
    return Path(dst)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--arch", choices=ARCHS, default="qwen3", help="architecture of --shape (default qwen3)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="one shape (default: the committed fixture set)")
    ap.add_argument("--dtype", default="F32",
                    help="F32, F16, BF16, a llama.cpp mix (Q8_0, Q4_K_S, Q4_K_M, Q5_K_M, Q6_K) "
                    "or one format throughout (Q4_0 ... IQ4_XS: PURE_FTYPES)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.shape:
        jobs = [(args.arch, args.shape, args.dtype)]
    else:  # the committed fixtures (each well under 1 MB)
        jobs = [("qwen3", "mini", "F32"), ("qwen3", "mini", "Q8_0"), ("qwen3", "tied", "Q4_K_S"),
                ("llama", "mini", "F32"), ("qwen2", "mini", "F32"), ("gemma3", "gemma-mini", "F32")]
    for arch, shape_name, dtype in jobs:
        print(f"{make(out, arch, shape_name, dtype, args.seed)}")


def make(out, arch: str, shape_name: str, dtype: str = "F32", seed: int = 0) -> Path:
    """out/<arch>-<shape>-<dtype>.gguf (a llama.cpp quant type is made by llama.cpp's quantizer from F32)."""
    shape, out = SHAPES[shape_name], Path(out)
    dst = out / f"{arch}-{shape_name}-{dtype.lower()}.gguf"
    if dtype in QUANT_KINDS:
        src = out / f".{arch}-{shape_name}-f32.tmp.gguf"
        write_gguf(src, shape, seed, "F32", name=f"{arch}-{shape_name}", arch=arch)
        quantize_with_llama(src, dst, dtype)
        os.remove(src)
    else:
        write_gguf(dst, shape, seed, dtype, name=f"{arch}-{shape_name}", arch=arch)
    return dst


if __name__ == "__main__":
    main()
