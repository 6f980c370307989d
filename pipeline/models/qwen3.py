"""Qwen3 (dense): per-head RMSNorm of q and k before NeoX RoPE, no projection biases.

The block itself is pipeline/models/decoder.py's; `Qwen3` and `Qwen3Config`
are its historical names (the from-scratch `lm` job builds a Qwen3 config).
"""
from __future__ import annotations

from .decoder import DecoderConfig, DecoderLM, Family, FrozenLinear, KVCache, Linear  # noqa: F401 (re-exported)

QWEN3 = Family(name="qwen3", rope="neox", qk_norm=True, default_rope_base=1_000_000.0, default_rms_eps=1e-6)

Qwen3 = DecoderLM
Qwen3Config = DecoderConfig  # arch defaults to "qwen3"
