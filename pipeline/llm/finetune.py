"""LoRA fine-tuning over a frozen GGUF Qwen3: the trainer's grad-capable forward.

The forward mirrors `pipeline.models.qwen3.Qwen3.forward` op for op (RMSNorm,
per-head q/k RMSNorm, NeoX RoPE, grouped causal attention, SwiGLU, tied or
untied head), reads the weights through the model's projection seam, and adds
LoRA deltas on the selected projections (q, k, v, o, gate, up, down;
default q+v). Every base weight stays in its file format (quantized included)
and enters the graph as a CONSTANT through `frozen_linear`: gradients flow to
the f32 activations only, so the base never has a gradient to hold. The only
parameters are the adapters' A/B, named `layers.<i>.<target>.lora_{a,b}`.

Trade-off: a backward through a quantized weight needs its dense rows, so by
default each frozen weight is dequantized per use (memory stays at the file's
bits per weight); `dense_cache=True` keeps the f32 copies resident instead
(~4 bytes per weight, faster steps). The output head is always kept dense: it
is used in full on every step by the fused linear + cross-entropy.

Determinism: each `loss` call advances a step counter; the dropout seed of
(step, layer, projection) is at(seed, (step * n_layers + layer) * 7 + proj),
so a resumed run that restores the counter replays the exact dropout stream,
and `checkpoint_layers=True` (recompute each layer in backward) replays it
bitwise. `eval_logits` / `eval_last_logits` run with dropout off and no counter
advance.
"""
from __future__ import annotations

import numpy as np

from kernels.rng import derive_seed
from pipeline.autograd import ops
from pipeline.autograd.losses import linear_cross_entropy
from pipeline.autograd.module import Module
from pipeline.autograd.tensor import Tensor, no_grad
from pipeline.errors import UserError

from .data import IGNORE_INDEX
from .lora import LoraAdapter
from .quants import weight_rows

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
DEFAULT_TARGETS = ("q", "v")


class Frozen:
    """A frozen [out, in] weight taken from a model projection, used as a constant.

    Accepts the model seam's objects: a `FrozenLinear` (a GGUF weight in its
    file format), a `Linear` (its f32 parameter's data: trainable elsewhere,
    frozen here), a FrozenWeight, or a numpy array. `keep_dense` keeps an f32
    copy resident (faster backward, ~4 bytes per weight).
    """

    def __init__(self, proj, keep_dense=False):
        w = getattr(proj, "weight", proj)
        if isinstance(w, Tensor):
            w = w.data
        self.weight = w
        self._dense = None
        if isinstance(w, np.ndarray):
            self._dense = np.ascontiguousarray(w, dtype=np.float32)
        elif keep_dense:
            self._dense = w.dequantize()
        self.shape = tuple(w.shape)

    def dense(self):
        return self._dense if self._dense is not None else self.weight.dequantize()

    def matmul_t(self, x2):
        """x2 [N, in] -> x2 @ W.T [N, out]."""
        if self._dense is not None:
            return x2 @ self._dense.T
        return self.weight.matmul_t(x2)

    def rows(self, ids):
        """Dense f32 rows W[ids] (embedding lookup) without dequantizing the whole table."""
        if self._dense is not None:
            return self._dense[ids]
        return weight_rows(self.weight, ids)


def frozen_linear(x, w):
    """x [..., in] @ W.T for a frozen weight: gradient to x only (W is a constant)."""
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x.data, dtype=np.float32).reshape(-1, w.shape[1])
    y = w.matmul_t(x2).reshape(*lead, w.shape[0])
    return Tensor.make(y, (x,), lambda g: ((g.reshape(-1, w.shape[0]) @ w.dense()).reshape(x.shape),), "frozen_linear")


def _const(v):
    """A norm vector as a plain f32 array: a constant in the graph whatever the model holds."""
    return np.asarray(v.data if isinstance(v, Tensor) else v, dtype=np.float32)


def _proj_shape(c, target):
    """[out, in] of a projection of config c."""
    q, kv, h, f = c.heads * c.head_dim, c.kv_heads * c.head_dim, c.hidden, c.ffn
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (f, h), "up": (f, h), "down": (h, f)}[target]


class Trainer(Module):
    """LoRA adapters on the selected projections of a frozen Qwen3, and its losses.

    model: a `pipeline.models.qwen3.Qwen3` (its projection seam is read, never
    written: every weight becomes a constant of this trainer's forward).
    As a Module its only tensors are `layers[i][target].lora_{a,b}`, so
    named_parameters() yields exactly the checkpoint names
    "layers.<i>.<target>.lora_a" / ".lora_b".
    """

    def __init__(self, model, targets=DEFAULT_TARGETS, rank=8, alpha=16.0, dropout=0.0, seed=0,
                 checkpoint_layers=False, ignore_index=IGNORE_INDEX, dense_cache=False):
        bad = [t for t in targets if t not in TARGETS]
        if bad or not targets:
            raise UserError(f"targets must be a non-empty subset of {','.join(TARGETS)}, got {','.join(targets) or '(none)'}")
        self._model, self.config = model, model.config
        self._layers = []
        for b in model.blocks:
            projs = {"q": b.attn.q, "k": b.attn.k, "v": b.attn.v, "o": b.attn.o,
                     "gate": b.mlp.gate, "up": b.mlp.up, "down": b.mlp.down}
            layer = {t: Frozen(p, dense_cache) for t, p in projs.items()}
            layer.update(attn_norm=_const(b.attn_norm), ffn_norm=_const(b.ffn_norm),
                         q_norm=_const(b.attn.q_norm), k_norm=_const(b.attn.k_norm))
            self._layers.append(layer)
        self._embed = Frozen(model.embed, dense_cache)
        self._out_norm = _const(model.out_norm)
        self._head = Frozen(model.output, keep_dense=True)  # used in full every step by the fused CE
        self.targets = tuple(t for t in TARGETS if t in targets)  # canonical order
        self.rank, self.alpha, self.dropout, self.seed = int(rank), float(alpha), float(dropout), int(seed)
        self.checkpoint_layers = checkpoint_layers
        self.ignore_index = ignore_index
        self.step = 0  # micro-batch counter: one per training loss call (dropout streams)
        self.layers = []  # per layer: {target: LoraAdapter}
        for i in range(self.config.layers):
            layer = {}
            for t in self.targets:
                out_dim, in_dim = _proj_shape(self.config, t)
                a_seed = derive_seed(self.seed, i * len(TARGETS) + TARGETS.index(t))
                layer[t] = LoraAdapter(in_dim, out_dim, rank, alpha, dropout, a_seed, prefix=f"layers.{i}.{t}")
            self.layers.append(layer)

    @classmethod
    def from_gguf(cls, path, **kwargs):
        """A trainer over the frozen GGUF at `path` (weights memory-mapped, quantized stays quantized)."""
        from pipeline.models.qwen3 import Qwen3
        return cls(Qwen3.from_gguf(path), **kwargs)

    @property
    def model(self):
        return self._model

    # --- parameters -------------------------------------------------------
    def n_parameters(self):
        return int(sum(p.size for p in self.parameters()))

    # --- forward ----------------------------------------------------------
    def _dropout_seed(self, step, layer, target):
        if step is None or self.dropout == 0.0:
            return None
        return derive_seed(self.seed, (step * self.config.layers + layer) * len(TARGETS) + TARGETS.index(target))

    def _proj(self, x, i, target, step):
        y = frozen_linear(x, self._layers[i][target])
        adapter = self.layers[i].get(target)
        if adapter is not None:
            y = y + adapter.delta(x, self._dropout_seed(step, i, target))
        return y

    def _layer(self, h, i, step):
        """One decoder block on h [T, hidden]."""
        c, w = self.config, self._layers[i]
        T = h.shape[0]
        pos = np.arange(T)
        a = ops.rms_norm(h, w["attn_norm"], c.rms_eps)
        q = ops.reshape(self._proj(a, i, "q", step), (1, T, c.heads, c.head_dim))
        k = ops.reshape(self._proj(a, i, "k", step), (1, T, c.kv_heads, c.head_dim))
        v = ops.reshape(self._proj(a, i, "v", step), (1, T, c.kv_heads, c.head_dim))
        q = ops.rope(ops.rms_norm(q, w["q_norm"], c.rms_eps), pos, c.rope_base)
        k = ops.rope(ops.rms_norm(k, w["k_norm"], c.rms_eps), pos, c.rope_base)
        att = ops.reshape(ops.attention(q, k, v, causal=True), (T, c.heads * c.head_dim))
        h = h + self._proj(att, i, "o", step)
        m = ops.rms_norm(h, w["ffn_norm"], c.rms_eps)
        f = ops.silu(self._proj(m, i, "gate", step)) * self._proj(m, i, "up", step)
        return h + self._proj(f, i, "down", step)

    def hidden(self, tokens, step=None):
        """Final-normed hidden states [T, hidden]; step None = eval (no dropout)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
            raise UserError(f"tokens must be a non-empty 1-D integer sequence, got shape {tokens.shape} dtype {tokens.dtype}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise UserError(f"token ids must be in [0, {self.config.vocab_size}), got range [{tokens.min()}, {tokens.max()}]")
        h = Tensor(self._embed.rows(tokens.astype(np.int64)))
        for i in range(self.config.layers):
            if self.checkpoint_layers and step is not None:
                h = ops.checkpoint(lambda x, i=i: self._layer(x, i, step), h)
            else:
                h = self._layer(h, i, step)
        return ops.rms_norm(h, self._out_norm, self.config.rms_eps)

    def loss(self, tokens, labels, reduction="mean", loss_scale=None):
        """Cross-entropy of next-token labels (ignore_index masked); advances the step counter.

        reduction='mean' averages over supervised positions; 'sum' with
        loss_scale = 1/total_valid is the accumulation-window arm.
        """
        labels = np.asarray(labels)
        if labels.shape != np.shape(tokens):
            raise UserError(f"labels shape {labels.shape} must equal tokens shape {np.shape(tokens)}")
        step = self.step
        self.step += 1
        h = self.hidden(tokens, step)
        loss = linear_cross_entropy(h, self._head.dense(), labels.astype(np.int64),
                                    ignore_index=self.ignore_index, reduction=reduction)
        if loss_scale is not None:
            loss = loss * np.float32(loss_scale)
        return loss

    def eval_logits(self, tokens):
        """Logits [T, vocab] with dropout off; no graph, no counter advance."""
        with no_grad():
            h = self.hidden(tokens, None)
            return self._head.matmul_t(h.data)

    def eval_last_logits(self, tokens):
        """Logits of the last position [vocab] (generation)."""
        with no_grad():
            h = self.hidden(tokens, None)
            return self._head.matmul_t(h.data[-1:])[0]

    def generate(self, prompt_ids, max_new_tokens=32, stop_ids=()):
        """Greedy continuation (no KV cache: a training diagnostic, not a decoder)."""
        ids = [int(t) for t in prompt_ids]
        out = []
        for _ in range(max_new_tokens):
            nxt = int(np.argmax(self.eval_last_logits(np.asarray(ids, dtype=np.int64))))
            if nxt in stop_ids:
                break
            ids.append(nxt)
            out.append(nxt)
        return out

    # --- persistence of adapters ------------------------------------------
    def adapter_tensors(self):
        """{name: f32 array} of every adapter factor (copies)."""
        return {n: p.data.copy() for n, p in self.named_parameters()}

    def load_adapter_tensors(self, tensors, source="adapters"):
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(tensors))
        extra = sorted(set(tensors) - set(params))
        if missing or extra:
            raise UserError(f"{source}: adapter names do not match this trainer (missing {missing[:4]}, unexpected {extra[:4]}); "
                            f"check --targets and the model")
        for n, p in params.items():
            arr = np.asarray(tensors[n])
            if arr.shape != p.shape or arr.dtype != np.float32:
                raise UserError(f"{source}: tensor {n} is {arr.dtype}{list(arr.shape)}, expected float32{list(p.shape)}")
            p.data[...] = arr
