"""Write a Qwen3-0.6B-shaped GGUF with random weights (for `fucina bench llm`; never commit the output).

Shape: 28 layers, hidden 1024, 16 query heads, 8 kv heads, head_dim 128, ffn 3072,
vocab 151936, tied output (as Qwen3-0.6B). F16 is written by gguf-py one tensor
at a time (about 1.2 GB); Q4_K (llama.cpp's Q4_K_S mix, as the reference
Qwen3-0.6B-Q4_K_S) is made from it by llama.cpp's quantizer via
llama-cpp-python. The tokenizer is the tiny fixtures' trained BPE padded to the
full vocabulary with unused tokens, so text prompts work.

    python tools/make_qwen3_06b_shaped.py --out /tmp/qwen3-06b        # F16 and Q4_K
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import make_tiny_model as tiny  # noqa: E402

SHAPE_06B = tiny.Shape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=3072, tied=True,
                       vocab=151936, context=40960)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="weight seed")
    ap.add_argument("--no-q4k", action="store_true", help="only write the F16 file")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "qwen3-0.6b-shaped-f16.gguf"
    tokens, types, merges = tiny.train_vocab(512)
    while len(tokens) < SHAPE_06B.vocab:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(tiny.gguf.TokenType.UNUSED)
    weights = {name: (a.astype(np.float16) if a.ndim == 2 else a)  # halve the writer's memory
               for name, a in tiny.make_weights(SHAPE_06B, args.seed).items()}
    tiny.write_gguf(f16, SHAPE_06B, args.seed, "F16", name="qwen3-0.6b-shaped", weights=weights,
                    vocab=(tokens, types, merges))
    print(f"{f16}  {f16.stat().st_size / 1e9:.2f} GB")
    if not args.no_q4k:
        q4 = tiny.quantize_with_llama(f16, out / "qwen3-0.6b-shaped-q4_k.gguf", "Q4_K_S")
        print(f"{q4}  {q4.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
