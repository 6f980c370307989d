"""Gemma 3 (text): llama.cpp's `gemma3` architecture (src/models/gemma3.cpp, the sliding-window graph).

What it adds to the shared dense decoder, each a Family switch:
  - embeddings multiplied by sqrt(hidden) before the first block;
  - RMSNorm before and after attention and before and after the MLP (`post_attention_norm`,
    `post_ffw_norm`). convert_hf_to_gguf stores every norm weight as Gemma's (1 + w), so the file's
    weights multiply directly, as for the other families;
  - per-head q/k RMSNorm, NeoX RoPE, a GELU(tanh) gated MLP, a tied head;
  - five sliding-window (local) layers then one global layer, repeating (llama.cpp's
    set_swa_pattern(6)); local layers see `gemma3.attention.sliding_window` positions and rotate
    with RoPE base 10000 unscaled (llama.cpp fixes it), global ones with `rope.freq_base` and the
    file's linear scaling;
  - the query scale llama.cpp uses: head_dim^-1/2, except the 62-layer (27B) model's
    (hidden / heads)^-1/2. llama.cpp reads no query_pre_attn_scalar key, so neither does this.
No logit soft-capping: llama.cpp's sliding-window Gemma 3 graph applies none (a file without a
sliding window builds another graph, and is refused here).
"""
from __future__ import annotations

import numpy as np

from .decoder import Family

GEMMA3_SWA_PATTERN = 6       # llama.cpp: hparams.set_swa_pattern(6) for LLM_ARCH_GEMMA3
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62       # llama.cpp's LLM_TYPE_27B, the one size whose query scale uses hidden / heads


def gemma3_attention_scale(hidden: int, heads: int, head_dim: int, layers: int) -> float:
    """llama.cpp's hparams.f_attention_scale for gemma3, in its float32 arithmetic."""
    width = hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim
    return float(np.float32(1.0) / np.sqrt(np.float32(width)))


GEMMA3 = Family(name="gemma3", rope="neox", qk_norm=True, default_rope_base=1_000_000.0, default_rms_eps=1e-6,
                embed_scale=True, post_norms=True, activation="gelu_tanh", swa_pattern=GEMMA3_SWA_PATTERN,
                swa_rope_base=GEMMA3_LOCAL_ROPE_BASE, attention_scale=gemma3_attention_scale,
                scale_query=True, chat_format="gemma")
