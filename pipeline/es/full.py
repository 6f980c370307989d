"""`--search full`: ES over every dense weight matrix of the frozen model, perturbed in place.

The GGUF's tensors are memory-mapped read-only, so each dense (F32/F16/BF16)
matrix gets one private writable copy that replaces its `raw` array inside the
model's own FrozenWeight: the trainer's forward, the embedding lookup and the
KV-cache decoder all read `raw` at call time, so a perturbation applied to that
copy is what every path computes with, and the snapshot restore puts it back
bitwise (docs/es.md's noise contract: f16/bf16 slots are perturbed in float32
and rounded back). BF16 stays uint16 bits for the kernels; the ES trainer
sees a bfloat16 view of the same memory.

A quantized matrix cannot take gaussian noise in its block format: it is
refused, unless dequantize=True, which replaces it by a dequantized f32 copy
(~4 bytes per weight of memory; the model is then an f32 model that started
from the quantized values). Norm vectors and biases stay frozen: "every dense
matrix", the parameters that carry the model's capacity.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..autograd.tensor import Tensor
from ..errors import UserError
from ..llm.quants import FORMATS, QT, FrozenWeight


def writable_dense_weights(trainer, dequantize: bool = False, source: str = "the model", search: str = "full") -> dict:
    """{GGUF name: writable array} for every matrix of trainer.model, installed in place (see above)."""
    weights = {name: w for name, w in trainer.model.named_weights().items() if len(getattr(w, "shape", ())) == 2}
    quantized = [(n, w) for n, w in weights.items() if isinstance(w, FrozenWeight) and w.format.quantized]
    if quantized and not dequantize:
        name, w = quantized[0]
        more = f" (and {len(quantized) - 1} more quantized)" if len(quantized) > 1 else ""
        raise UserError(f"{source}: --search {search} perturbs dense (F32/F16/BF16) weights in place, but tensor "
                        f"{name!r} is {w.format.name}{more}; "
                        "pass --dequantize to perturb an f32 copy of every quantized matrix (4 bytes per weight "
                        "in memory), or search LoRA adapters (--search ab)")
    out, seen = {}, set()
    for name, w in weights.items():
        if id(w) in seen:  # a tied head shares the embedding: one slot
            continue
        seen.add(id(w))
        if isinstance(w, Tensor):
            out[name] = w.data
        elif isinstance(w, np.ndarray):
            out[name] = w
        elif w.format.quantized:
            w.raw, w.format = w.dequantize(), FORMATS[QT.F32]
            out[name] = w.raw
        else:
            w.raw = np.array(w.raw, order="C")  # the private writable copy of the mapped bytes
            out[name] = w.raw.view(ml_dtypes.bfloat16) if w.format.qtype == QT.BF16 else w.raw
    # the trainer keeps a dense f32 copy of the head for its fused CE: drop it, so dense() reads the live raw
    trainer._head._dense = None
    return out
