"""LoRA fine-tuning over a frozen GGUF model of any registered architecture.

The forward IS the model's own block (`pipeline.models.decoder.DecoderLM.block`:
whatever its family does — q/k norms, RoPE layout, biases), with the trainer's
`project` function in place of the model's projections: it reads each weight
through the model's projection seam and adds LoRA deltas on the selected
projections (q, k, v, o, gate, up, down; default q+v). Every base weight stays
in its file format (quantized included) and enters the graph as a CONSTANT
through `adapted_linears`: gradients flow to the f32 activations only, so the
base never has a gradient to hold. The only parameters are the adapters' A/B,
named `layers.<i>.<target>.lora_{a,b}`.

Trade-off: a product with a quantized weight needs its dense values, so by
default each frozen weight is dequantized per use, a few L2-sized tiles at a
time inside the GEMM (pipeline/kernels/qgemm.py: forward x @ W.T and backward g @ W), so
memory stays at the file's bits per weight (resident f32 copies were measured
slower: streaming them from DRAM costs more than dequantizing tiles). The output head too: the
training step's fused linear + cross-entropy (pipeline/kernels/headce.py) dequantizes it a chunk of rows at a
time (HeadRows), with the bits a dense f32 copy gave, and never holds that copy (Gemma 3's 262144 x 640 head:
671 MB). Callers without a gradient (ES scoring, eval logits, generation) still build the dense copy on their
first use and keep it.
The step's BLAS runs single-threaded: big products tile over our own threads,
small ones (attention per head, LoRA) would only spin-wait on BLAS threads.

Determinism: each `loss` call advances a step counter; the dropout seed of
(step, layer, projection) is at(at(seed, 1), (step * n_layers + layer) * 7 + proj)
(adapter A of (layer, projection) is seeded by at(at(seed, 0), layer * 7 + proj)),
so a resumed run that restores the counter replays the exact dropout stream,
and `checkpoint_layers=True` (recompute each layer in backward) replays it
bitwise. `eval_logits` / `eval_last_logits` run with dropout off and no counter
advance.
"""
from __future__ import annotations

import numpy as np

from pipeline.kernels.nn import matmul_nn, matmul_nt
from pipeline.kernels.rng import derive_seed
from pipeline.autograd import ops
from pipeline.autograd.losses import linear_cross_entropy
from pipeline.autograd.module import Module
from pipeline.autograd.tensor import Tensor, grad_enabled, no_grad
from pipeline.kernels.headce import RowSource
from pipeline.errors import UserError

from pipeline.models.decoder import PROJECTIONS

from pipeline.llm.data import IGNORE_INDEX
from pipeline.llm.lora import LoraAdapter, keep_mask_or_none, lora_backward, lora_forward
from pipeline.llm.quants import FrozenWeight, matmul_t_many, weight_rows

TARGETS = tuple(PROJECTIONS)
DEFAULT_TARGETS = ("q", "v")


class Frozen:
    """A frozen [out, in] weight taken from a model projection, used as a constant.

    Accepts the model seam's objects: a `FrozenLinear` (a GGUF weight in its
    file format), a `Linear` (its f32 parameter's data: trainable elsewhere,
    frozen here), a FrozenWeight, or a numpy array. `keep_dense` keeps an f32
    copy resident (~4 bytes per weight) instead of dequantizing tiles per use.
    A projection's bias (None for most) is a constant too. `cache_dense` keeps the f32 copy that the first
    dense() call makes (none is made before) while the weight's raw is read-only (the mapped file: it cannot
    change); a writable raw (ES --search full perturbs it in place) is dequantized at every call.
    """

    def __init__(self, proj, keep_dense=False, cache_dense=False):
        w = getattr(proj, "weight", proj)
        if isinstance(w, Tensor):
            w = w.data
        self.weight = w
        bias = getattr(proj, "bias", None)
        self.bias = None if bias is None else _const(bias)
        self._dense = None
        if isinstance(w, np.ndarray):
            self._dense = np.ascontiguousarray(w, dtype=np.float32)
        elif keep_dense:
            self._dense = w.dequantize()
        self.shape = tuple(w.shape)
        self._cache_dense, self._cached = cache_dense, None

    def dense(self):
        if self._dense is not None:
            return self._dense
        if not self._cache_dense or np.asarray(self.weight.raw).flags.writeable:
            return self.weight.dequantize()
        if self._cached is None or self._cached[0] is not self.weight.raw:
            self._cached = (self.weight.raw, self.weight.dequantize())
        return self._cached[1]

    def matmul_t(self, x2):
        """x2 [N, in] -> x2 @ W.T [N, out]."""
        if self._dense is not None:
            return matmul_nt(x2, self._dense)
        return self.weight.matmul_t(x2)

    def matmul(self, g2):
        """g2 [N, out] -> g2 @ W [N, in]: the input gradient of x @ W.T (a quantized
        weight is dequantized tile by tile inside the GEMM, never as a whole)."""
        if self._dense is not None:
            return matmul_nn(g2, self._dense)
        return self.weight.matmul(g2)

    def rows(self, ids):
        """Dense f32 rows W[ids] (embedding lookup) without dequantizing the whole table."""
        if self._dense is not None:
            return self._dense[ids]
        return weight_rows(self.weight, ids)


class HeadRows(RowSource):
    """A frozen FrozenWeight as pipeline/kernels/headce.py reads a head: rows a..b dequantized into the caller's
    buffer on the calling thread (the format's serial dequant kernel, the values dequantize() gives), so the
    fused CE never needs the [C, H] f32 copy. Reads the weight's raw and format at each call (ES's --search
    full swaps them for a writable f32 copy)."""

    def __init__(self, weight: FrozenWeight):
        self.weight = weight
        self.shape = tuple(weight.shape)

    def rows_into(self, a, b, out):
        from pipeline.kernels import dequant
        from pipeline.llm.quants import QT
        w = self.weight
        raw = np.asarray(w.raw)[a:b]
        qt = w.format.qtype
        if qt in (QT.F32, QT.F16):
            np.copyto(out, raw)
        elif qt == QT.BF16:
            out.view(np.uint32)[...] = raw.view(np.uint16).astype(np.uint32) << 16
        else:
            kernel, block = dequant.TILE_KERNELS[int(qt)][:2]
            kernel(np.ascontiguousarray(raw), out, dequant.HALF_TO_FLOAT, 0, self.shape[1] // block)

    def rows(self, ids):
        return weight_rows(self.weight, ids)


def adapted_linears(x, ws, adapters=None):
    """[x @ W.T (+ its LoRA delta) for W in ws] for weights sharing their input x (q/k/v, gate/up).

    adapters: per weight None or (LoraAdapter, dropout seed). Each output is ONE node,
    y = x @ W.T + scale * dropout(x) @ A.T @ B.T, with parents (x, A, B) (or x alone):
    W is a constant, so only x and the adapter receive gradients. Quantized weights
    share one tile dispatch to the threads (the same bits as one call per weight)."""
    adapters = list(adapters) if adapters is not None else [None] * len(ws)
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x.data, dtype=np.float32).reshape(-1, ws[0].shape[1])
    if all(w._dense is None and isinstance(w.weight, FrozenWeight) for w in ws):
        ys = matmul_t_many([w.weight for w in ws], x2)
    else:
        ys = [w.matmul_t(x2) for w in ws]
    return [_adapted_node(x, x2, w, y, adapter, lead) for w, y, adapter in zip(ws, ys, adapters)]


def _adapted_node(x, x2, w, y, adapter, lead):
    n_out = w.shape[0]
    if w.bias is not None:
        y += w.bias  # y is this call's own product array
    if adapter is None:
        return Tensor.make(y.reshape(*lead, n_out), (x,),
                           lambda g: (w.matmul(g.reshape(-1, n_out)).reshape(x.shape),), "frozen_linear")
    ad, seed = adapter
    a, b = ad.lora_a, ad.lora_b
    d, h = lora_forward(x2, a.data, b.data, ad.scale, keep_mask_or_none(seed, x2.shape, ad.dropout))
    y += d  # y is this call's own product array: the bits of y + d

    def backward(g):
        g2 = np.ascontiguousarray(g, dtype=np.float32).reshape(-1, n_out)
        keep = keep_mask_or_none(seed, x2.shape, ad.dropout)  # regenerated from its seed, never stored
        gx, ga, gb = lora_backward(g2, x2, h, a.data, b.data, ad.scale, keep,
                                   x.requires_grad, a.requires_grad, b.requires_grad)
        if x.requires_grad:
            gx = (w.matmul(g2) + gx).reshape(x.shape)  # frozen part first: the order of the sum
        return gx, ga, gb

    return Tensor.make(y.reshape(*lead, n_out), (x, a, b), backward, "adapted_linear")


def keep_freed_memory():
    """Let glibc reuse the step's freed activations instead of returning them to the OS.

    A step allocates and frees ~170 MB of [T, dim] arrays; with glibc's defaults
    most come from fresh mmap pages, so every step paid ~44 000 page faults
    (60-160 ms of system time on 2 cores). Arrays up to 32 MB now come from the
    heap and the heap is never trimmed: the resident set stays at the step's
    high-water mark, which it reaches anyway. No-op off glibc."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: the largest value glibc accepts on 64-bit
        libc.mallopt(-1, 1 << 30)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _const(v):
    """A norm vector as a plain f32 array: a constant in the graph whatever the model holds."""
    return np.asarray(v.data if isinstance(v, Tensor) else v, dtype=np.float32)


class LoraModel(Module):
    """LoRA adapters on the selected projections of a frozen model, and its losses (the one LoRA model of the
    tree: the backprop job, ES and the commands build this; "Trainer" names only the runtime's worker role,
    workers/trainer.py).

    model: a `pipeline.models.decoder.DecoderLM` of any family, frozen (its
    projection seam is read, never written: every weight becomes a constant of
    this trainer's forward, which runs the model's own `block`).
    As a Module its only tensors are `layers[i][target].lora_{a,b}`, so
    named_parameters() yields exactly the checkpoint names
    "layers.<i>.<target>.lora_a" / ".lora_b".
    """

    def __init__(self, model, targets=DEFAULT_TARGETS, rank=8, alpha=16.0, dropout=0.0, seed=0,
                 checkpoint_layers=False, ignore_index=IGNORE_INDEX):
        bad = [t for t in targets if t not in TARGETS]
        if bad or not targets:
            raise UserError(f"targets must be a non-empty subset of {','.join(TARGETS)}, got "
                            f"{','.join(targets) or '(none)'}")
        self._model, self.config = model, model.config
        self._base = model.with_constant_norms()  # its block never sends a gradient into the base
        self._layers = [{t: Frozen(b.projection(t)) for t in TARGETS} for b in model.blocks]  # per layer: constants
        self._embed = Frozen(model.embed)
        self._out_norm = _const(model.out_norm)
        # the training CE reads the head through HeadRows; a dense copy only for no-grad callers (ES, generation)
        self._head = Frozen(model.output, cache_dense=True)
        self.targets = tuple(t for t in TARGETS if t in targets)  # canonical order
        self.rank, self.alpha, self.dropout, self.seed = int(rank), float(alpha), float(dropout), int(seed)
        # two independent streams from one seed: adapter init and dropout masks never share a seed
        self._init_seed, self._dropout_base = derive_seed(self.seed, 0), derive_seed(self.seed, 1)
        self.checkpoint_layers = checkpoint_layers
        self.ignore_index = ignore_index
        self.step = 0  # micro-batch counter: one per training loss call (dropout streams)
        self.layers = []  # per layer: {target: LoraAdapter}
        for i in range(self.config.layers):
            layer = {}
            for t in self.targets:
                out_dim, in_dim = self.config.projection_shape(t)
                a_seed = derive_seed(self._init_seed, i * len(TARGETS) + TARGETS.index(t))
                layer[t] = LoraAdapter(in_dim, out_dim, rank, alpha, dropout, a_seed, prefix=f"layers.{i}.{t}")
            self.layers.append(layer)

    @classmethod
    def from_gguf(cls, path, **kwargs):
        """A LoraModel over the frozen GGUF at `path` (weights memory-mapped, quantized stays quantized)."""
        from pipeline.models.registry import load_model
        return cls(load_model(path), **kwargs)

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
        stream = (step * self.config.layers + layer) * len(TARGETS) + TARGETS.index(target)
        return derive_seed(self._dropout_base, stream)

    def _projs(self, x, i, targets, step):
        """The adapted projections `targets` of layer i on one input x."""
        adapters = [(self.layers[i][t], self._dropout_seed(step, i, t)) if t in self.layers[i] else None
                    for t in targets]
        return adapted_linears(x, [self._layers[i][t] for t in targets], adapters)

    def hidden(self, tokens, step=None, segments=None):
        """Final-normed hidden states [T, hidden]; step None = eval (no dropout). segments: packed samples
        (sample_segments), each attending only to itself with positions from 0, as if run alone."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
            raise UserError(f"tokens must be a non-empty 1-D integer sequence, got shape {tokens.shape} dtype "
                            f"{tokens.dtype}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise UserError(f"token ids must be in [0, {self.config.vocab_size}), got range [{tokens.min()}, "
                            f"{tokens.max()}]")
        c, n = self.config, tokens.size
        pos = np.arange(n)
        if segments is not None:
            segments = np.asarray(segments, dtype=np.int64)
            if segments.shape != tokens.shape:
                raise UserError(f"segments shape {segments.shape} must equal tokens shape {tokens.shape}")
            pos = pos - np.searchsorted(segments, segments, side="left")  # RoPE restarts at every sample

        def project(i, targets, x):
            return self._projs(x, i, targets, step)

        h = self.embedded(tokens)
        for i in range(c.layers):
            if self.checkpoint_layers and step is not None:
                h = ops.checkpoint(lambda x, i=i: self._base.block(i, x, pos, project, segments), h)
            else:
                h = self._base.block(i, h, pos, project, segments)
        return self.final_norm(ops.reshape(h, n, c.hidden))

    # --- the frozen forward's parts, for callers that run it with their own projections (ES's member batch)
    def frozen(self, layer: int, target: str) -> Frozen:
        """The constant weight (and bias) of projection `target` of layer `layer`."""
        return self._layers[layer][target]

    def embedded(self, tokens, rows: int = 1) -> Tensor:
        """The embeddings of tokens [n] as the first block reads them, [rows, n, hidden] (rows identical copies)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        row = self._embed.rows(tokens).reshape(1, tokens.size, self.config.hidden)
        return self._base.scale_embedding(Tensor(np.ascontiguousarray(np.broadcast_to(row, (rows,) + row.shape[1:]))))

    def block(self, i: int, h: Tensor, positions, project) -> Tensor:
        """Decoder block i of the frozen model on h with projections from project(i, targets, x)."""
        return self._base.block(i, h, positions, project)

    def final_norm(self, h: Tensor) -> Tensor:
        return ops.rms_norm(h, self._out_norm, self.config.rms_eps)

    def head_loss(self, h: Tensor, labels, reduction="mean") -> Tensor:
        """Cross-entropy of final-normed hidden states h [n, hidden] against next-token labels [n].

        With a gradient to compute, a quantized head is read a chunk of rows at a time (HeadRows: the bits of
        its dense copy, which is never made); without one, the dense copy (made once) and the plain CE's bits."""
        head = self._head
        if grad_enabled() and h.requires_grad and head._dense is None and isinstance(head.weight, FrozenWeight):
            w = HeadRows(head.weight)
        else:
            w = head.dense()
        return linear_cross_entropy(h, w, np.asarray(labels).astype(np.int64),
                                    ignore_index=self.ignore_index, reduction=reduction)

    def loss(self, tokens, labels, reduction="mean", loss_scale=None, segments=None):
        """Cross-entropy of next-token labels (ignore_index masked); advances the step counter.

        reduction='mean' averages over supervised positions; 'sum' with
        loss_scale = 1/total_valid is the accumulation-window arm. segments: the
        samples packed in tokens (hidden); a sample's labels never cross into the next.
        """
        labels = np.asarray(labels)
        if labels.shape != np.shape(tokens):
            raise UserError(f"labels shape {labels.shape} must equal tokens shape {np.shape(tokens)}")
        step = self.step
        self.step += 1
        loss = self.head_loss(self.hidden(tokens, step, segments), labels, reduction)
        if loss_scale is not None:
            loss = loss * np.float32(loss_scale)
        return loss

    def eval_logits(self, tokens):
        """Logits [T, vocab] with dropout off; no graph, no counter advance."""
        with no_grad():
            h = self.hidden(tokens, None)
            return matmul_nt(np.ascontiguousarray(h.data), self._head.dense())

    def eval_last_logits(self, tokens):
        """Logits of the last position [vocab] (generation)."""
        with no_grad():
            h = self.hidden(tokens, None)
            return matmul_nt(np.ascontiguousarray(h.data[-1:]), self._head.dense())[0]

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
            raise UserError(f"{source}: adapter names do not match this trainer (missing {missing[:4]}, unexpected "
                            f"{extra[:4]}); "
                            f"check --targets and the model")
        for n, p in params.items():
            arr = np.asarray(tensors[n])
            if arr.shape != p.shape or arr.dtype != np.float32:
                raise UserError(f"{source}: tensor {n} is {arr.dtype}{list(arr.shape)}, expected "
                                f"float32{list(p.shape)}")
            p.data[...] = arr




# --- the fingerprint and the stored config of a run ----------------------------------
def adapters_sha256(trainer):
    """The run's fingerprint: the one digest (pipeline/runtime/ckpt.params_sha256) of the adapter tensors."""
    from ..runtime.ckpt import params_sha256
    return params_sha256((name, p.data) for name, p in trainer.named_parameters())


def lora_config(trainer):
    """The structural LoRA config stored in trainer_state.json (alpha, the model's architecture and
    head counts: the exports need them)."""
    c = trainer.config
    return {"rank": trainer.rank, "alpha": trainer.alpha, "dropout": trainer.dropout,
            "targets": list(trainer.targets), "ignore_index": trainer.ignore_index,
            "arch": c.arch, "heads": c.heads, "kv_heads": c.kv_heads}


def check_resume_config(stored, trainer, source):
    """A rank or target set that differs from the checkpoint's is refused, never silently overridden."""
    from pipeline.errors import ConfigMismatchError
    lora = stored.get("lora")
    if not isinstance(lora, dict):
        raise ConfigMismatchError(f"{source}: field 'config.lora' is missing; not a LoRA fine-tune checkpoint")
    mine = lora_config(trainer)
    for key in ("rank", "targets"):
        if lora.get(key) != mine[key]:
            raise ConfigMismatchError(f"{source}: field 'config.lora.{key}' is {lora.get(key)!r} but this run has "
                                      f"{mine[key]!r}; pass the checkpoint's value (--{key} …) to resume")


def pack_windows(lengths, capacity):
    """Windows of sample indices (first fit, in order: each sample goes into the first window with room for it,
    a window's samples in their order) whose lengths sum to at most `capacity` each."""
    windows, room = [], []
    for i, n in enumerate(lengths):
        if n > capacity:
            raise UserError(f"a sample of {n} tokens does not fit a window of {capacity}")
        for w, free in enumerate(room):
            if n <= free:
                windows[w].append(i)
                room[w] -= n
                break
        else:
            windows.append([i])
            room.append(capacity - n)
    return windows


def packed(samples):
    """(tokens, labels, segments) of samples concatenated into one window: segment j = sample j's positions."""
    tokens = np.concatenate([s.inputs for s in samples])
    labels = np.concatenate([s.labels for s in samples])
    segments = np.repeat(np.arange(len(samples), dtype=np.int64), [len(s.inputs) for s in samples])
    return tokens, labels, segments


def batch_loss(model, samples) -> float:
    """Token-weighted mean CE of `samples` under the model's current adapters (no graph, no dropout).

    Each sample's CE sum is accumulated in float64 in batch order, then divided
    by the batch's supervised-token count: one serial sum, same bits every call.
    """
    total, valid = 0.0, 0
    saved_step = model.step  # loss() advances the dropout counter; evaluation must not
    try:
        with no_grad():
            for s in samples:
                total += float(model.loss(s.inputs, s.labels, reduction="sum").item())
                valid += s.n_valid
    finally:
        model.step = saved_step
    if valid == 0:
        raise UserError("the batch has no supervised token")
    return total / valid
