"""Write a Qwen3-0.6B-shaped GGUF with random weights for `fucina bench finetune`.

    python tools/make_finetune_fixture.py --out /tmp/qwen3-0.6b-shape.gguf [--dtype Q4_K_S] [--layers 28]

Shape: 28 layers, hidden 1024, 16 query heads, 8 kv heads, head_dim 128,
ffn 3072, vocab 151936, tied head (Qwen3-0.6B's nine numbers). Weights are
gaussian (std 0.02; norms 1) from numpy's PCG64 seeded by --seed; F16 is
written first, then Q4_K_S/Q8_0/... come from llama.cpp's own quantizer
(llama-cpp-python). No tokenizer: the bench feeds token ids. Never imported at
run time.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def write_f16(path, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, seed):
    import gguf
    g = np.random.default_rng(seed)
    wr = gguf.GGUFWriter(str(path), arch="qwen3")
    wr.add_name("qwen3-0.6b-shape-random")
    wr.add_description("fucina tools/make_finetune_fixture.py: random weights, Qwen3-0.6B shape")
    wr.add_context_length(4096)
    wr.add_embedding_length(hidden)
    wr.add_block_count(layers)
    wr.add_feed_forward_length(ffn)
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv_heads)
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_rope_freq_base(1_000_000.0)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_file_type(1)

    def mat(rows, cols):
        return (0.02 * g.standard_normal((rows, cols), dtype=np.float32)).astype(np.float16)

    wr.add_tensor("token_embd.weight", mat(vocab, hidden))
    wr.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (q, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, q)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            wr.add_tensor(p + name + ".weight", mat(*shape))
        for name, n in (("attn_norm", hidden), ("ffn_norm", hidden),
                        ("attn_q_norm", head_dim), ("attn_k_norm", head_dim)):
            wr.add_tensor(p + name + ".weight", np.ones(n, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def quantize(src, dst, kind):
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, {"Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
                                       "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K"}[kind])
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed with {rc}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output GGUF path")
    ap.add_argument("--dtype", default="Q4_K_S", help="F16, or a llama.cpp quant: Q4_K_S, Q4_K_M, Q8_0, Q6_K")
    ap.add_argument("--layers", type=int, default=28, help="number of layers (28 = Qwen3-0.6B)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed")
    args = ap.parse_args(argv)
    shape = dict(layers=args.layers, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936)
    if args.dtype == "F16":
        write_f16(args.out, seed=args.seed, **shape)
    else:
        tmp = args.out + ".f16.tmp"
        write_f16(tmp, seed=args.seed, **shape)
        try:
            quantize(tmp, args.out, args.dtype)
        finally:
            os.unlink(tmp)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
