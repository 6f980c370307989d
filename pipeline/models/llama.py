"""Llama 2/3.x, TinyLlama, SmolLM/SmolLM2, dense Mistral: llama.cpp's `llama` architecture.

RoPE is llama.cpp's "normal" layout, rotating adjacent pairs (x[2i], x[2i+1]):
convert_hf_to_gguf permutes the Hugging Face Q/K rows so that this equals the
HF half-rotation, and the GGUF weights are used exactly as stored. Llama 3.x
stores its RoPE scaling as frequency divisors in `rope_freqs.weight`; linear
scaling comes from `llama.rope.scaling.*`. Attention and MLP biases are
optional (read when the file has them), the output head tied or separate.
"""
from __future__ import annotations

from .decoder import PROJECTIONS, Family

LLAMA = Family(name="llama", rope="normal", optional_biases=tuple(PROJECTIONS), rope_freqs=True,
               default_rope_base=10_000.0, default_rms_eps=1e-5, chat_format="llama3")
