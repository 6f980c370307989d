"""llama-quantize's `*_K_M` mixes: which type each tensor of a dense model gets under Q4_K_M / Q5_K_M.

Trade-off: we re-create llama.cpp's rules (llama_tensor_get_type in src/llama-quant.cpp, the path
without an importance matrix, `--pure` or per-tensor overrides) for the dense architectures Fucina
runs, not the whole decision tree: no Falcon, mixture-of-experts or 70B-size special cases, and
only the two `_M` mixes. In exchange the table is short enough to check line by line against the
C++ and is pinned by a golden of (tensor, type) pairs made by `llama_model_quantize` itself
(tools/gen_quant_goldens.py). The rules, for the mix's base type B (Q4_K or Q5_K):

  * output.weight (or token_embd.weight when the model ties it to the output): Q6_K, or Q8_0
    when its rows are not a multiple of B's 256-element block;
  * attn_v (and a fused attn_qkv): Q6_K on the "more bits" layers, counted over the attn_v tensors
    in llama.cpp's order: the first and last eighth, and every third layer in between
    (i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2); B elsewhere;
  * ffn_down: the same Q6_K choice over the layer count (general `<arch>.block_count`);
  * every other matrix weight: B;
  * then the shape fallback: a row length that is not a multiple of the chosen type's block
    demotes Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even 32 does not divide it.

llama.cpp visits tensors sorted by (layer, name) -- the counters above depend on that order --
so the plan is made in that order; the file keeps its own tensor order.
"""
from __future__ import annotations

import re

from gguf import GGMLQuantizationType as QT

from pipeline.kernels.formats import block_sizes

MIXES = {"q4_k_m": QT.Q4_K, "q5_k_m": QT.Q5_K}  # --dtype -> the mix's base type
FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}  # llama.cpp's tensor_type_fallback
_LAYER = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in a `_M` mix."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _category(name: str) -> str:
    """llama.cpp's tensor_get_category, as far as the `_M` mixes look at it (substring matches, in its order)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, category in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                           ("ffn_down", "ffn_down")):
        if part in name:
            return category
    return "other"


def visit_order(names) -> list[str]:
    """llama.cpp's model-loader order: tensors without a `blk.N.` prefix first, then by layer, then by name."""
    def key(name):
        m = _LAYER.match(name)
        return (int(m.group(1)) if m else -1, name)
    return sorted(names, key=key)


def fallback(qtype: QT, n_cols: int) -> tuple[QT, str]:
    """(type, reason) after llama.cpp's shape fallback for a row of n_cols elements."""
    block = block_sizes(qtype)[0]
    if n_cols % block == 0:
        return qtype, ""
    demoted = FALLBACK.get(qtype, qtype)
    if n_cols % block_sizes(demoted)[0]:
        demoted = QT.F16
    return demoted, f"row length {n_cols} is not a multiple of {block} ({qtype.name}): {demoted.name} instead"


def mix_types(matrices, dtype: str, n_layers: int) -> dict[str, tuple[QT, str]]:
    """{name: (type, reason)} for the quantizable matrices [(name, n_cols)] of a model under mix `dtype`.

    `matrices` are the tensors llama-quantize may convert (matrix weights, no norms); n_layers is the
    model's block count. The counters run over every attn_v-like name in `matrices`."""
    base = MIXES[dtype]
    cols = dict(matrices)
    names = visit_order(cols)
    tied = "output.weight" not in cols
    n_attn_v = sum(1 for n in names if _category(n) == "attn_v")
    i_attn_v = i_ffn_down = 0
    plan = {}
    for name in names:
        category = _category(name)
        qtype, why = base, f"{dtype}: {base.name}"
        if category == "output" or (tied and category == "token_embd"):
            head = "output" if category == "output" else "token_embd (tied to the output)"
            if cols[name] % block_sizes(base)[0]:
                qtype, why = QT.Q8_0, f"{dtype}: {head} rows not a multiple of 256 -> Q8_0"
            else:
                qtype, why = QT.Q6_K, f"{dtype}: {head} -> Q6_K"
        elif category == "attn_v":
            if use_more_bits(i_attn_v, n_attn_v):
                qtype, why = QT.Q6_K, f"{dtype}: attn_v #{i_attn_v} of {n_attn_v} gets more bits -> Q6_K"
            i_attn_v += 1
        elif category == "ffn_down":
            if use_more_bits(i_ffn_down, n_layers):
                qtype, why = QT.Q6_K, f"{dtype}: ffn_down #{i_ffn_down} of {n_layers} layers gets more bits -> Q6_K"
            i_ffn_down += 1
        qtype, demoted = fallback(qtype, cols[name])
        plan[name] = (qtype, f"{why}; {demoted}" if demoted else why)
    return plan
