"""Write a SmolLM2-135M- or Llama-3.2-1B-shaped `llama` GGUF with random weights (for `fucina bench llm` and
`bench finetune`; never commit the output).

Shapes (the published Hugging Face configs):
  smollm2-135m  30 layers, hidden 576, 9 query heads, 3 kv heads, head_dim 64, ffn 1536, vocab 49152,
                tied output, RoPE base 1e5, no RoPE scaling                         (F16 about 0.27 GB)
  llama3.2-1b   16 layers, hidden 2048, 32 query heads, 8 kv heads, head_dim 64, ffn 8192, vocab 128256,
                tied output, RoPE base 5e5 with Llama 3 scaling (factor 32, low/high frequency factors 1/4,
                original context 8192) stored as rope_freqs.weight                  (F16 about 2.5 GB)
Laid out as tools/make_tiny_model.py writes llama (Q/K rows permuted as convert_hf_to_gguf does). F16 is
written by gguf-py; the quantized file (Q8_0 for SmolLM2, whose 576-wide rows are not a multiple of the
K-quants' 256; Q4_K_M for Llama 3.2, the common download) is made from it by llama.cpp's quantizer via
llama-cpp-python. The tokenizer is the tiny fixtures' trained BPE padded to the full vocabulary with
unused tokens, so text prompts work.

    python tools/make_llama_shaped.py --model smollm2-135m --out /tmp/llama-shaped
    python tools/make_llama_shaped.py --model llama3.2-1b --out /tmp/llama-shaped    # peak memory ~6 GB
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import make_tiny_model as tiny  # noqa: E402

SHAPES = {  # name -> (shape, the llama.cpp quantization written beside the F16)
    "smollm2-135m": (tiny.Shape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, ffn=1536, tied=True,
                                vocab=49152, context=8192, rope_base=100_000.0), "Q8_0"),
    "llama3.2-1b": (tiny.Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, tied=True,
                               vocab=128256, context=131072, rope_base=500_000.0, llama3_rope=True,
                               llama3_factor=32.0), "Q4_K_M"),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, choices=sorted(SHAPES), help="which published shape")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="weight seed")
    ap.add_argument("--no-quant", action="store_true", help="only write the F16 file")
    args = ap.parse_args(argv)
    shape, quant = SHAPES[args.model]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{args.model}-shaped-f16.gguf"
    tokens, types, merges = tiny.train_vocab(512)
    while len(tokens) < shape.vocab:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(tiny.gguf.TokenType.UNUSED)
    weights = {name: (a.astype(np.float16) if a.ndim == 2 else a)  # halve the writer's memory
               for name, a in tiny.make_weights(shape, args.seed, "llama").items()}
    tiny.write_gguf(f16, shape, args.seed, "F16", name=f"{args.model}-shaped", weights=weights,
                    vocab=(tokens, types, merges), arch="llama")
    print(f"{f16}  {f16.stat().st_size / 1e9:.2f} GB")
    if not args.no_quant:
        q = tiny.quantize_with_llama(f16, out / f"{args.model}-shaped-{quant.lower()}.gguf", quant)
        print(f"{q}  {q.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
