"""Write a Gemma-3-270M-shaped GGUF with random weights (for `fucina bench llm` / `bench finetune` and the
memory check of the 262k-row tied head; never commit the output).

Shape (Gemma 3 270M's config): 18 layers, hidden 640, 4 query heads, 1 kv head, head_dim 256, ffn 2048,
vocab 262144, tied output, sliding window 512 (five local layers, then one global), RoPE base 1e6.
F16 is written by gguf-py (about 0.54 GB), laid out as tools/make_tiny_model.py writes gemma3; Q8_0 is
made from it by llama.cpp's quantizer via llama-cpp-python. The tokenizer is the tiny fixtures'
trained BPE padded to the full vocabulary with unused tokens, so text prompts work.

    python tools/make_gemma3_270m_shaped.py --out /tmp/gemma3-270m        # F16 and Q8_0
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import make_tiny_model as tiny  # noqa: E402

SHAPE_270M = tiny.Shape(hidden=640, layers=18, heads=4, kv_heads=1, head_dim=256, ffn=2048, tied=True,
                        vocab=262144, context=32768, sliding_window=512)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="weight seed")
    ap.add_argument("--no-q8", action="store_true", help="only write the F16 file")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / "gemma3-270m-shaped-f16.gguf"
    tokens, types, merges = tiny.train_vocab(512)
    while len(tokens) < SHAPE_270M.vocab:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(tiny.gguf.TokenType.UNUSED)
    weights = {name: (a.astype(np.float16) if a.ndim == 2 else a)  # halve the writer's memory
               for name, a in tiny.make_weights(SHAPE_270M, args.seed, "gemma3").items()}
    tiny.write_gguf(f16, SHAPE_270M, args.seed, "F16", name="gemma3-270m-shaped", weights=weights,
                    vocab=(tokens, types, merges), arch="gemma3")
    print(f"{f16}  {f16.stat().st_size / 1e9:.2f} GB")
    if not args.no_q8:
        q8 = tiny.quantize_with_llama(f16, out / "gemma3-270m-shaped-q8_0.gguf", "Q8_0")
        print(f"{q8}  {q8.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
