"""Serve a LoRA fine-tune without merging it: `generate`, `chat` and `eval-logits --lora PATH`.

llama.cpp's `--lora FILE` / `--lora-scaled FILE S` semantics: each adapted projection computes
y = W x + s * (alpha / rank) * B (A x) with W kept in its file format (a quantized base stays
quantized), and s the user's scale (1 by default). Like llama.cpp, an adapter whose alpha is 0
(or absent) is applied with scale s alone. Several adapters add their deltas.

PATH is either a fine-tune run or checkpoint directory (adapters.safetensors + trainer_state.json,
alpha from `config.lora.alpha`), or a llama.cpp LoRA adapter GGUF (`general.type = adapter`,
`adapter.type = lora`, tensors `blk.<i>.<tensor>.weight.lora_{a,b}`, as `export-gguf --lora-out`
and llama.cpp's convert_lora_to_gguf.py write them).

Trade-off: the delta runs beside the frozen product (two rank-thin GEMMs per adapted projection)
instead of being merged into W, so the base file is never rewritten and the logits equal the merged
dense model's within float rounding; the price is that the single-token decode kernel
(pipeline/kernels/decode.layer) covers only plain frozen projections, so adapted models decode on the
general path.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..models.decoder import PROJECTIONS
from .lora import lora_forward

_TENSOR_TO_TARGET = {v: k for k, v in PROJECTIONS.items()}


@dataclass
class ServedPair:
    """One adapted projection: layer, target (q, k, v, o, gate, up, down), A [rank, in], B [out, rank] and the
    effective scale user_scale * alpha / rank."""
    layer: int
    target: str
    a: np.ndarray
    b: np.ndarray
    scale: float


def _scale(user_scale: float, alpha, rank: int) -> float:
    """llama.cpp's llama_lora_adapter scale: alpha ? s * alpha / rank : s."""
    return float(user_scale) * (float(alpha) / rank if alpha else 1.0)


def load_lora(path, user_scale: float = 1.0) -> list[ServedPair]:
    """The adapter pairs of a run/checkpoint directory or a LoRA adapter GGUF, with their effective scales."""
    if not (isinstance(user_scale, (int, float)) and math.isfinite(user_scale)):
        raise UserError(f"--lora-scale must be a finite number, got {user_scale!r}")
    p = Path(path)
    if p.is_dir():
        return _from_run(p, user_scale)
    if not p.exists():
        raise UserError(f"--lora {path}: no such file or directory (pass a fine-tune run or checkpoint directory, "
                        "or a LoRA adapter GGUF)")
    return _from_gguf(p, user_scale)


def _from_run(directory: Path, user_scale: float) -> list[ServedPair]:
    from ..runtime.ckpt import is_committed, latest_checkpoint
    from .export import load_adapters, resolve_alpha
    where = directory
    if not is_committed(directory):  # a run directory whose final commit is missing: its newest checkpoint
        latest = latest_checkpoint(directory)
        if latest is None:
            raise UserError(f"--lora {directory}: neither a committed checkpoint (no trainer_state.json) nor a run "
                            "directory holding one")
        where = Path(latest)
    adapters = load_adapters(where)
    alpha = resolve_alpha(None, adapters)
    return [ServedPair(p.layer, p.target, p.a, p.b, _scale(user_scale, alpha, p.rank)) for p in adapters.pairs]


def _from_gguf(path: Path, user_scale: float) -> list[ServedPair]:
    from .gguf import open_gguf
    from .gguf_write import _as_str
    gg = open_gguf(path)
    kind = gg.get("general.type")
    if _as_str(kind) != "adapter" or _as_str(gg.get("adapter.type")) != "lora":
        raise UserError(f"--lora {path}: not a LoRA adapter GGUF (general.type is {kind!r}, adapter.type is "
                        f"{gg.get('adapter.type')!r}; expected 'adapter' and 'lora')")
    alpha = gg.get("adapter.lora.alpha") or 0.0
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
        raise UserError(f"--lora {path}: adapter.lora.alpha must be a non-negative number, got {alpha!r}")
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name in gg.tensor_names:
        parts = name.split(".")
        if (len(parts) != 5 or parts[0] != "blk" or not parts[1].isdigit() or len(parts[1]) > 9
                or parts[3] != "weight" or parts[4] not in ("lora_a", "lora_b")
                or parts[2] not in _TENSOR_TO_TARGET):
            raise UserError(f"--lora {path}: tensor '{name}' is not blk.<i>.<projection>.weight.lora_{{a,b}} with a "
                            f"projection among {', '.join(_TENSOR_TO_TARGET)}")
        w = gg.weight(name)
        halves.setdefault((int(parts[1]), _TENSOR_TO_TARGET[parts[2]]), {})[parts[4][-1]] = w.dequantize()
    if not halves:
        raise UserError(f"--lora {path}: no adapter tensors")
    pairs = []
    for (layer, target), ab in sorted(halves.items()):
        if set(ab) != {"a", "b"}:
            raise UserError(f"--lora {path}: blk.{layer}.{PROJECTIONS[target]}.weight.lora_"
                            f"{'b' if 'a' in ab else 'a'} is missing (A and B come in pairs)")
        a, b = np.ascontiguousarray(ab["a"], np.float32), np.ascontiguousarray(ab["b"], np.float32)
        if a.shape[0] != b.shape[1]:
            raise UserError(f"--lora {path}: blk.{layer}.{PROJECTIONS[target]}: lora_a {list(a.shape)} is [rank, in] "
                            f"but lora_b {list(b.shape)} is not [out, rank]")
        pairs.append(ServedPair(layer, target, a, b, _scale(user_scale, alpha, a.shape[0])))
    return pairs


class LoraProjection:
    """A frozen projection plus one or more LoRA deltas, for no-grad inference (DecoderLM's `infer` seam)."""

    def __init__(self, base, deltas):
        self.base, self.deltas = base, list(deltas)  # deltas: [(A, B, scale)]
        self.out_features, self.in_features = base.out_features, base.in_features
        self.bias = None  # the base applies its own bias

    def infer(self, x: np.ndarray) -> np.ndarray:
        y = np.array(self.base.infer(x), dtype=np.float32, copy=True)
        x2 = np.ascontiguousarray(x, np.float32).reshape(-1, self.in_features)
        for a, b, scale in self.deltas:
            y += lora_forward(x2, a, b, scale)[0].reshape(y.shape)
        return y

    @property
    def weight(self):
        return self.base.weight


def apply_lora(model, pairs: list[ServedPair], source: str = "--lora") -> int:
    """Wrap model's adapted projections (in place); returns how many projections now carry a delta.
    A layer, target or shape the model lacks is refused before anything changes."""
    c = model.config
    plan: dict[tuple[int, str], list] = {}
    for p in pairs:
        if not 0 <= p.layer < c.layers:
            raise UserError(f"{source}: adapter for layer {p.layer}, but the model has {c.layers} layers; "
                            "was it trained on another model?")
        proj = model.blocks[p.layer].projection(p.target)
        base = proj.base if isinstance(proj, LoraProjection) else proj
        want = (base.out_features, base.in_features)
        if (p.b.shape[0], p.a.shape[1]) != want:
            raise UserError(f"{source}: blk.{p.layer}.{PROJECTIONS[p.target]}.weight is [out, in] = {list(want)} but "
                            f"the adapter is B{list(p.b.shape)} @ A{list(p.a.shape)}; was it trained on another model?")
        plan.setdefault((p.layer, p.target), []).append((p.a, p.b, np.float32(p.scale)))
    for (layer, target), deltas in plan.items():
        blk = model.blocks[layer]
        owner, attr = (blk.attn, target) if target in ("q", "k", "v", "o") else (blk.mlp, target)
        proj = getattr(owner, attr)
        if isinstance(proj, LoraProjection):
            proj.deltas.extend(deltas)
        else:
            setattr(owner, attr, LoraProjection(proj, deltas))
    model.__dict__.pop("_decode", None)  # the decode plan covers plain frozen projections only
    return len(plan)


def attach(model, paths, scales=None, log=None) -> int:
    """apply_lora for each of --lora PATH... with --lora-scale S... (none: 1 each; one: for all; else one per path)."""
    paths = list(paths or [])
    scales = list(scales or [])
    if not paths:
        if scales:
            raise UserError("--lora-scale needs --lora PATH")
        return 0
    if len(scales) not in (0, 1, len(paths)):
        raise UserError(f"--lora-scale: give one scale for all adapters or one per --lora ({len(paths)}), got "
                        f"{len(scales)}")
    scales = scales * len(paths) if len(scales) == 1 else (scales or [1.0] * len(paths))
    n = 0
    for path, s in zip(paths, scales):
        pairs = load_lora(os.fspath(path), s)
        n = apply_lora(model, pairs, f"--lora {path}")
        if log:
            log(f"lora: {path}: {len(pairs)} adapted projections, rank {pairs[0].a.shape[0]}, scale {s:g}")
    return n

