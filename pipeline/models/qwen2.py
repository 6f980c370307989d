"""Qwen2 / Qwen2.5: biases on q, k and v (an output bias too, when a file has one), NeoX RoPE.

As llama.cpp's qwen2 graph (src/models/qwen2.cpp): no per-head q/k norm, a tied
or separate output head, and q/o projections as wide as the hidden size.
"""
from __future__ import annotations

from .decoder import Family

QWEN2 = Family(name="qwen2", rope="neox", required_biases=("q", "k", "v"), optional_biases=("o",),
               q_width_is_hidden=True, default_rope_base=10_000.0, default_rms_eps=1e-6)
