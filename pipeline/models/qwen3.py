"""The Qwen3-family dense transformer: one model for inference, training and from-scratch init.

    x = embed(ids)
    per layer:  h = rms_norm(x) ; q,k,v = q(h),k(h),v(h) ; q,k = rms_norm per head ; NeoX RoPE
                x = x + o(causal_gqa_attention(q, k, v))
                h = rms_norm(x) ; x = x + down(silu(gate(h)) * up(h))
    logits = output(rms_norm(x))            (output = token_embd when tied)

Trade-off: two forwards over the same weights. `forward(ids)` goes through the
autograd ops (pipeline.autograd) so the model trains; `infer(ids, cache)` is a
no-grad numpy path with a KV cache for generation, where frozen quantized
weights are consumed by a fused dequant-matvec (decode) or dequant + BLAS
(prefill). Tests pin the two paths to each other and to llama.cpp.

The projection seam (for LoRA and friends): every linear map is an object
stored on the layer — `layer.attn.q/k/v/o`, `layer.mlp.gate/up/down`, and
`model.output` — with (usually a Module subclass, so its parameters are found by named_parameters)
    __call__(x: Tensor) -> Tensor      the differentiable path (training)
    infer(x: ndarray) -> ndarray       optional fast no-grad path (generation)
    in_features, out_features
Replace one (`layer.attn.q = MyAdapter(layer.attn.q)`) and both forwards use
it; a replacement without `infer` is called under no_grad in the inference
path. `FrozenLinear` wraps a GGUF weight (a constant: no gradient, stays in its
file format); `Linear` holds a trainable f32 parameter [out, in].
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from numba import njit

from kernels import rng, workpool
from ..autograd import Module, Tensor, no_grad, ops, parameter
from ..errors import UserError
from ..llm.quants import FrozenWeight, matmul_t_many, weight_rows


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    context_length: int = 4096
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    tied_output: bool = True

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise UserError(f"Qwen3Config: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise UserError(f"Qwen3Config: head_dim ({self.head_dim}) must be even for RoPE")

    @classmethod
    def from_gguf(cls, gg) -> "Qwen3Config":
        arch = gg.architecture
        if arch == "qwen3moe" or gg.get(f"{arch}.expert_count", 0):
            raise UserError(f"{gg.path}: '{arch}' is a mixture-of-experts model; only dense Qwen3 models are supported")
        if arch != "qwen3":
            raise UserError(f"{gg.path}: architecture '{arch}' is not supported (expected 'qwen3')")
        heads = int(gg.require("qwen3.attention.head_count"))
        hidden = int(gg.require("qwen3.embedding_length"))
        return cls(
            vocab_size=int(gg.weight("token_embd.weight").shape[0]),
            hidden=hidden,
            layers=int(gg.require("qwen3.block_count")),
            heads=heads,
            kv_heads=int(gg.get("qwen3.attention.head_count_kv", heads)),
            head_dim=int(gg.get("qwen3.attention.key_length", hidden // heads)),
            ffn=int(gg.require("qwen3.feed_forward_length")),
            context_length=int(gg.get("qwen3.context_length", 4096)),
            rope_base=float(gg.get("qwen3.rope.freq_base", 1_000_000.0)),
            rms_eps=float(gg.get("qwen3.attention.layer_norm_rms_epsilon", 1e-6)),
            tied_output=not gg.has("output.weight"),
        )


# --- projections (the seam) ---------------------------------------------------
class FrozenLinear(Module):
    """y = x @ W.T with W a frozen GGUF weight (any supported format). No gradient to W."""

    def __init__(self, weight: FrozenWeight):
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def infer(self, x: np.ndarray) -> np.ndarray:
        return self.weight.matmul_t(x)

    def forward(self, x: Tensor) -> Tensor:
        x = ops.as_tensor(x)
        w = self.weight

        def backward(g):  # dx = g @ W, dequantized tile by tile inside the GEMM (never resident in f32)
            return w.matmul(np.asarray(g, np.float32).reshape(-1, w.shape[0])).reshape(x.shape),

        return Tensor.make(w.matmul_t(x.data), (x,), backward, "frozen_linear")


class Linear(Module):
    """y = x @ W.T with W a trainable f32 parameter [out, in]."""

    def __init__(self, weight: Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def infer(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float32) @ self.weight.data.T

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight)


def _infer(proj, x: np.ndarray) -> np.ndarray:
    if hasattr(proj, "infer"):
        return proj.infer(x)
    with no_grad():
        return proj(Tensor(x)).data


def _infer_many(projs, x: np.ndarray) -> list:
    """Projections of one input (q/k/v, gate/up): plain frozen weights share one thread dispatch."""
    if all(type(p) is FrozenLinear for p in projs):
        return matmul_t_many([p.weight for p in projs], x)
    return [_infer(p, x) for p in projs]


# --- the model ---------------------------------------------------------------
class Attention(Module):
    def __init__(self, q, k, v, o, q_norm: Tensor, k_norm: Tensor):
        self.q, self.k, self.v, self.o, self.q_norm, self.k_norm = q, k, v, o, q_norm, k_norm


class MLP(Module):
    def __init__(self, gate, up, down):
        self.gate, self.up, self.down = gate, up, down


class Block(Module):
    def __init__(self, attn_norm: Tensor, attn: Attention, ffn_norm: Tensor, mlp: MLP):
        self.attn_norm, self.attn, self.ffn_norm, self.mlp = attn_norm, attn, ffn_norm, mlp


class KVCache:
    """Per-layer f32 keys/values [capacity, kv_heads, head_dim]; grows by doubling."""

    def __init__(self, config: Qwen3Config, capacity: int = 256):
        shape = (capacity, config.kv_heads, config.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(config.layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(config.layers)]
        self.length = 0

    def store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray):
        end = pos + k.shape[0]
        if end > self.k[layer].shape[0]:
            grow = max(end, 2 * self.k[layer].shape[0])
            for store in (self.k, self.v):
                old = store[layer]
                store[layer] = np.zeros((grow,) + old.shape[1:], np.float32)
                store[layer][: old.shape[0]] = old
        self.k[layer][pos:end], self.v[layer][pos:end] = k, v
        return self.k[layer][:end], self.v[layer][:end]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


class Qwen3(Module):
    """Qwen3 dense transformer. Build with `from_gguf(path)` or `init_random(config, seed)`."""

    def __init__(self, config: Qwen3Config, embed, blocks: list[Block], out_norm: Tensor, output):
        self.config = config
        self.embed = embed          # Tensor [vocab, hidden] (trainable) or FrozenWeight
        self.blocks = blocks
        self.out_norm = out_norm
        self.output = output        # a projection; for a tied head it shares `embed`

    # --- construction -------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path_or_file, trainable: bool = False, llama_numerics: bool = False) -> "Qwen3":
        """Load a Qwen3 GGUF. Weights stay in the file's format (memory-mapped), frozen.

        trainable=True instead dequantizes every weight into f32 parameters (full fine-tune).
        llama_numerics=True rounds each matmul's activations the way llama.cpp's CPU
        kernels do (Q8_0/Q8_K/BF16), for tight parity checks; the default keeps them f32.
        """
        from ..llm.gguf import GGUFFile
        gg = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
        cfg = Qwen3Config.from_gguf(gg)
        _check_shapes(gg, cfg)

        def proj(name):
            w = gg.weight(name)
            w.llama_numerics = llama_numerics
            return Linear(parameter(w.dequantize(), name)) if trainable else FrozenLinear(w)

        def vec(name):
            return Tensor(gg.vector(name), requires_grad=trainable, name=name)

        blocks = []
        for i in range(cfg.layers):
            p = f"blk.{i}."
            attn = Attention(proj(p + "attn_q.weight"), proj(p + "attn_k.weight"), proj(p + "attn_v.weight"),
                             proj(p + "attn_output.weight"), vec(p + "attn_q_norm.weight"), vec(p + "attn_k_norm.weight"))
            mlp = MLP(proj(p + "ffn_gate.weight"), proj(p + "ffn_up.weight"), proj(p + "ffn_down.weight"))
            blocks.append(Block(vec(p + "attn_norm.weight"), attn, vec(p + "ffn_norm.weight"), mlp))
        if trainable:
            embed = parameter(gg.weight("token_embd.weight").dequantize(), "token_embd.weight")
            output = Linear(embed) if cfg.tied_output else proj("output.weight")
        else:
            embed = gg.weight("token_embd.weight")
            embed.llama_numerics = llama_numerics
            output = FrozenLinear(embed) if cfg.tied_output else proj("output.weight")
        model = cls(cfg, embed, blocks, vec("output_norm.weight"), output)
        model._source = gg
        return model

    @classmethod
    def init_random(cls, config: Qwen3Config, seed: int = 0) -> "Qwen3":
        """Random f32 parameters (requires_grad=True) from the counter RNG: a pure function of (config, seed)."""
        c, counter = config, iter(range(1 << 30))

        def mat(name, n_out, n_in):
            w = rng.gaussian(rng.derive_seed(seed, next(counter)), (n_out, n_in)) * np.float32(n_in ** -0.5)
            return Linear(parameter(w.astype(np.float32), name))

        def ones(name, n):
            return parameter(np.ones(n, np.float32), name)

        qd, kvd = c.heads * c.head_dim, c.kv_heads * c.head_dim
        embed = parameter((rng.gaussian(rng.derive_seed(seed, next(counter)), (c.vocab_size, c.hidden))).astype(np.float32),
                          "token_embd.weight")
        blocks = []
        for i in range(c.layers):
            p = f"blk.{i}."
            attn = Attention(mat(p + "attn_q.weight", qd, c.hidden), mat(p + "attn_k.weight", kvd, c.hidden),
                             mat(p + "attn_v.weight", kvd, c.hidden), mat(p + "attn_output.weight", c.hidden, qd),
                             ones(p + "attn_q_norm.weight", c.head_dim), ones(p + "attn_k_norm.weight", c.head_dim))
            mlp = MLP(mat(p + "ffn_gate.weight", c.ffn, c.hidden), mat(p + "ffn_up.weight", c.ffn, c.hidden),
                      mat(p + "ffn_down.weight", c.hidden, c.ffn))
            blocks.append(Block(ones(p + "attn_norm.weight", c.hidden), attn, ones(p + "ffn_norm.weight", c.hidden), mlp))
        output = Linear(embed) if c.tied_output else mat("output.weight", c.vocab_size, c.hidden)
        return cls(c, embed, blocks, ones("output_norm.weight", c.hidden), output)

    def named_weights(self) -> dict[str, object]:
        """GGUF tensor name -> Tensor or FrozenWeight (for export and inspection)."""
        out = {"token_embd.weight": self.embed, "output_norm.weight": self.out_norm}
        for i, b in enumerate(self.blocks):
            p = f"blk.{i}."
            for name, obj in (("attn_norm", b.attn_norm), ("ffn_norm", b.ffn_norm), ("attn_q_norm", b.attn.q_norm),
                              ("attn_k_norm", b.attn.k_norm), ("attn_q", b.attn.q), ("attn_k", b.attn.k),
                              ("attn_v", b.attn.v), ("attn_output", b.attn.o), ("ffn_gate", b.mlp.gate),
                              ("ffn_up", b.mlp.up), ("ffn_down", b.mlp.down)):
                out[p + name + ".weight"] = getattr(obj, "weight", obj)
        if not self.config.tied_output:
            out["output.weight"] = getattr(self.output, "weight", self.output)
        return out

    # --- differentiable forward --------------------------------------------------
    def _embed_tensor(self, ids: np.ndarray) -> Tensor:
        if isinstance(self.embed, Tensor):
            return ops.embedding(ids, self.embed)
        return Tensor(weight_rows(self.embed, ids).reshape(*ids.shape, self.config.hidden))

    def forward(self, ids, positions=None) -> Tensor:
        """Logits [*ids.shape, vocab] through the autograd ops. ids: [seq] or [batch, seq]."""
        c = self.config
        ids = self._check_ids(ids)
        single = ids.ndim == 1
        ids2 = ids[None] if single else ids
        b, t = ids2.shape
        pos = np.arange(t) if positions is None else np.asarray(positions)
        x = self._embed_tensor(ids2)
        for blk in self.blocks:
            h = ops.rms_norm(x, blk.attn_norm, c.rms_eps)
            q = ops.reshape(blk.attn.q(h), b, t, c.heads, c.head_dim)
            k = ops.reshape(blk.attn.k(h), b, t, c.kv_heads, c.head_dim)
            v = ops.reshape(blk.attn.v(h), b, t, c.kv_heads, c.head_dim)
            q = ops.rope(ops.rms_norm(q, blk.attn.q_norm, c.rms_eps), pos, c.rope_base)
            k = ops.rope(ops.rms_norm(k, blk.attn.k_norm, c.rms_eps), pos, c.rope_base)
            a = ops.attention(q, k, v, causal=True)
            x = x + blk.attn.o(ops.reshape(a, b, t, c.heads * c.head_dim))
            h = ops.rms_norm(x, blk.ffn_norm, c.rms_eps)
            x = x + blk.mlp.down(ops.silu(blk.mlp.gate(h)) * blk.mlp.up(h))
        logits = self.output(ops.rms_norm(x, self.out_norm, c.rms_eps))
        return ops.reshape(logits, t, c.vocab_size) if single else logits

    # --- no-grad inference with a KV cache ----------------------------------------
    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.config, capacity)

    def infer(self, ids, cache: KVCache | None = None, all_logits: bool = False) -> np.ndarray:
        """Append ids at cache.length; return logits of the last position [vocab] (all_logits: [seq, vocab])."""
        c = self.config
        ids = self._check_ids(ids)
        if ids.ndim != 1:
            raise UserError(f"Qwen3.infer: ids must be one sequence [seq], got shape {ids.shape}")
        cache = cache if cache is not None else self.new_cache(len(ids))
        pos0, t = cache.length, len(ids)
        if pos0 + t > c.context_length:
            raise UserError(f"context of {pos0 + t} tokens exceeds the model's context length {c.context_length}")
        pos = np.arange(pos0, pos0 + t)
        cos, sin = _rope_table(pos, c.head_dim, c.rope_base)
        x = (self.embed.data[ids] if isinstance(self.embed, Tensor) else weight_rows(self.embed, ids)).astype(np.float32)
        for li, blk in enumerate(self.blocks):
            h = _rms(x, blk.attn_norm.data, c.rms_eps)
            q, k, v = _infer_many((blk.attn.q, blk.attn.k, blk.attn.v), h)
            q, k, v = (q.reshape(t, c.heads, c.head_dim), k.reshape(t, c.kv_heads, c.head_dim),
                       v.reshape(t, c.kv_heads, c.head_dim))
            q = _norm_rope(q, blk.attn.q_norm.data, c.rms_eps, cos, sin)
            k = _norm_rope(k, blk.attn.k_norm.data, c.rms_eps, cos, sin)
            keys, values = cache.store(li, pos0, k, v)
            x = x + _infer(blk.attn.o, _attend(q, keys, values, pos0))
            h = _rms(x, blk.ffn_norm.data, c.rms_eps)
            g, u = _infer_many((blk.mlp.gate, blk.mlp.up), h)
            x = x + _infer(blk.mlp.down, _silu_mul(g, u))
        cache.length = pos0 + t
        x = _rms(x if all_logits else x[-1:], self.out_norm.data, c.rms_eps)
        logits = _infer(self.output, x)
        return logits if all_logits else logits[0]

    def _check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids.data if isinstance(ids, Tensor) else ids)
        if ids.size == 0:
            raise UserError("Qwen3: empty token sequence (give at least one token)")
        if ids.dtype.kind not in "iu":
            raise UserError(f"Qwen3: token ids must be integers, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise UserError(f"Qwen3: token id out of range [0, {self.config.vocab_size}): "
                            f"got min {ids.min()}, max {ids.max()}")
        return ids.astype(np.int64)

    def config_dict(self) -> dict:
        return asdict(self.config)

    @property
    def weight_bytes(self) -> int:
        total = 0
        for w in self.named_weights().values():
            total += w.nbytes if isinstance(w, FrozenWeight) else w.data.nbytes
        return total  # a tied table is listed (and counted) once


# --- numpy / numba kernels of the inference path ------------------------------
def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (a numba loop: at decode sizes numpy's
    per-call overhead cost more than the arithmetic)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _rms_rows(x2, np.ascontiguousarray(w, dtype=np.float32), np.float32(eps), out)
    return out.reshape(x.shape)


@njit(cache=True, nogil=True)
def _rms_rows(x, w, eps, out):
    """out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w for x, out f32 [n, d], w f32 [d]."""
    n, d = x.shape
    for r in range(n):
        ss = np.float32(0.0)
        for i in range(d):
            ss += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
        for i in range(d):
            out[r, i] = x[r, i] * inv * w[i]


def _rope_table(pos: np.ndarray, head_dim: int, base: float):
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    return np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]


def _norm_rope(x: np.ndarray, w: np.ndarray, eps: float, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Per-head RMSNorm, then the NeoX rotation, of x [seq, heads, head_dim] (one numba pass):
    halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); cos/sin [seq, 1, head_dim/2]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _norm_rope_heads(x, np.ascontiguousarray(w, dtype=np.float32), np.float32(eps), cos, sin, out)
    return out


@njit(cache=True, nogil=True)
def _norm_rope_heads(x, w, eps, cos, sin, out):
    """x, out f32 [t, heads, d]; w f32 [d]; cos, sin f32 [t, 1, d/2]."""
    t, n_heads, d = x.shape
    half = d // 2
    for p in range(t):
        for h in range(n_heads):
            ss = np.float32(0.0)
            for i in range(d):
                ss += x[p, h, i] * x[p, h, i]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
            for i in range(half):
                a = x[p, h, i] * inv * w[i]
                b = x[p, h, i + half] * inv * w[i + half]
                out[p, h, i] = a * cos[p, 0, i] - b * sin[p, 0, i]
                out[p, h, i + half] = b * cos[p, 0, i] + a * sin[p, 0, i]


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int) -> np.ndarray:
    """Causal grouped-query attention. q [t, H, D] at positions pos0.., k/v [s, KV, D] -> [t, H*D].

    Queries go in chunks of ATTEND_CHUNK positions, each against only the keys it can see
    (a prompt from an empty cache does ~5/8 of the full t x s work). A long prompt splits
    the kv heads over the worker threads (numpy releases the GIL). Chunks depend on t only
    and a head's arithmetic not on the split, so the result is the same for any thread count."""
    t, n_h, d = q.shape
    s, n_kv, _ = k.shape
    g = n_h // n_kv
    q4 = q.reshape(t, n_kv, g, d).transpose(1, 2, 0, 3)                    # [KV, g, t, D]
    kt, vt = k.transpose(1, 2, 0), v.transpose(1, 0, 2)
    out = np.empty((n_kv, g, t, d), np.float32)

    def heads(h0, h1):
        for c0 in range(0, t, ATTEND_CHUNK):
            c1, n = min(t, c0 + ATTEND_CHUNK), h1 - h0
            seen = pos0 + c1                                                # keys visible to the chunk's last row
            qc = q4[h0:h1, :, c0:c1].reshape(n, g * (c1 - c0), d)
            scores = (qc @ kt[h0:h1, :, :seen]) * np.float32(d ** -0.5)    # [h, g*c, seen]
            if c1 - c0 > 1:  # adding a 0/-inf mask broadcasts; boolean-index assignment was ~5x slower
                future = np.arange(seen)[None, :] > (pos0 + np.arange(c0, c1))[:, None]
                scores.reshape(n, g, c1 - c0, seen)[...] += np.where(future, np.float32(-np.inf), np.float32(0.0))
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores, out=scores)
            p /= p.sum(axis=-1, keepdims=True)
            out[h0:h1, :, c0:c1] = (p @ vt[h0:h1, :seen]).reshape(n, g, c1 - c0, d)

    parts = _worker_threads() if t * s * n_h >= ATTEND_SPLIT_WORK else 1
    workpool.split_range(n_kv, min(parts, n_kv), heads)
    return out.transpose(2, 0, 1, 3).reshape(t, n_h * d)


def _silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u = g / (1 + exp(-g)) * u, in place in g; a long prompt's rows are split over
    the worker threads (elementwise, so the split cannot change a bit)."""
    g = np.ascontiguousarray(g, dtype=np.float32)

    def rows(r0, r1):
        gr = g[r0:r1]
        e = np.exp(-gr)
        e += 1.0
        np.divide(gr, e, out=gr)
        gr *= u[r0:r1]

    parts = _worker_threads() if g.size >= ATTEND_SPLIT_WORK else 1
    workpool.split_range(len(g), parts, rows)
    return g


ATTEND_CHUNK = 64             # query positions per chunk
ATTEND_SPLIT_WORK = 1 << 16  # score elements below which one thread is quicker than two


def _worker_threads() -> int:
    import numba
    return numba.get_num_threads()


def _check_shapes(gg, cfg: Qwen3Config):
    """Every tensor the config implies must exist with the implied shape (named on mismatch)."""
    qd, kvd = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    want = {"token_embd.weight": (cfg.vocab_size, cfg.hidden), "output_norm.weight": (1, cfg.hidden)}
    if not cfg.tied_output:
        want["output.weight"] = (cfg.vocab_size, cfg.hidden)
    for i in range(cfg.layers):
        p = f"blk.{i}."
        want.update({p + "attn_norm.weight": (1, cfg.hidden), p + "ffn_norm.weight": (1, cfg.hidden),
                     p + "attn_q_norm.weight": (1, cfg.head_dim), p + "attn_k_norm.weight": (1, cfg.head_dim),
                     p + "attn_q.weight": (qd, cfg.hidden), p + "attn_k.weight": (kvd, cfg.hidden),
                     p + "attn_v.weight": (kvd, cfg.hidden), p + "attn_output.weight": (cfg.hidden, qd),
                     p + "ffn_gate.weight": (cfg.ffn, cfg.hidden), p + "ffn_up.weight": (cfg.ffn, cfg.hidden),
                     p + "ffn_down.weight": (cfg.hidden, cfg.ffn)})
    for name, shape in want.items():
        got = gg.weight(name).shape
        if got != shape:
            raise UserError(f"{gg.path}: tensor '{name}' has shape {got}, the qwen3 metadata implies {shape}")
