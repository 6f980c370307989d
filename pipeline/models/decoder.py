"""The dense decoder-only transformer that llama.cpp's llama, qwen2, qwen3 and gemma3 graphs share.

    x = embed(ids)                          (x sqrt(hidden) for families with embed_scale)
    per layer:  h = rms_norm(x) ; q,k,v = q(h),k(h),v(h)            (+ bias where the file has one)
                q,k = rms_norm per head (families with qk_norm) ; RoPE (NeoX or "normal" pair layout)
                x = x + post(o(causal_gqa_attention(q, k, v)))     (a sliding window on local layers)
                h = rms_norm(x) ; x = x + post(down(act(gate(h)) * up(h)))   (act: silu or gelu_tanh)
    logits = output(rms_norm(x))            (output = token_embd when tied)
    post = rms_norm for families with post_norms, else the identity

What differs between architectures is a `Family` (pipeline/models/<arch>.py),
found through pipeline/models/registry.py: the RoPE layout, per-head q/k norms,
which projection biases exist, llama3 RoPE frequency factors, the defaults of
its GGUF metadata and its Hugging Face module names.

Trade-off: one block definition (`DecoderLM.block`) written with the autograd
ops serves both from-scratch training (`forward`) and LoRA training
(`pipeline.finetune.model.LoraModel`, which passes its own `project` function), and
one no-grad numpy path with a KV cache (`infer_rows`: many rows in lock-step, each
with its own cache, bitwise each row alone; `infer` is its one-row case) serves generation, where frozen
quantized weights are consumed by a fused dequant-matvec (decode) or dequant +
BLAS (prefill). Tests pin the two paths to each other and to llama.cpp.

The projection seam (for LoRA and friends): every linear map is an object
stored on the layer — `layer.attn.q/k/v/o`, `layer.mlp.gate/up/down`, and
`model.output` — with (usually a Module subclass, so its parameters are found by named_parameters)
    __call__(x: Tensor) -> Tensor      the differentiable path (training)
    infer(x: ndarray) -> ndarray       optional fast no-grad path (generation)
    in_features, out_features, bias (None or a vector added after the product)
Replace one (`layer.attn.q = MyAdapter(layer.attn.q)`) and both paths use
it; a replacement without `infer` is called under no_grad in the inference
path. `FrozenLinear` wraps a GGUF weight (a constant: no gradient, stays in its
file format); `Linear` holds a trainable f32 parameter [out, in].
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from pipeline.kernels import attention, decode, ggml_f32, handoff, nn, rng, workpool
from pipeline.kernels.dequant import HALF_TO_FLOAT
from pipeline.kernels.decode import norm_rope_heads as _norm_rope_heads, rms_rows as _rms_rows
from pipeline.kernels.nn import swiglu as swiglu_f32  # the training path's kernel: the same bits in inference
from ..autograd import Module, Tensor, no_grad, ops, parameter
from ..errors import GGUFError, UserError
from ..llm.quants import FrozenWeight, integer_product, matmul_t_groups, matmul_t_many, weight_rows
from ..untrusted import brief

# the projections LoRA can adapt, in canonical order -> their llama.cpp tensor names (blk.<i>.<name>.weight)
PROJECTIONS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
               "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
# Hugging Face module paths of the same projections (LlamaForCausalLM, Qwen2/Qwen3ForCausalLM alike)
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


@dataclass(frozen=True)
class Family:
    """One architecture: how its GGUF differs from the shared dense decoder."""
    name: str                          # general.architecture
    rope: str                          # "neox": rotate halves; "normal": rotate adjacent pairs (llama.cpp's names)
    qk_norm: bool = False              # per-head RMSNorm of q and k before RoPE
    required_biases: tuple = ()        # projections whose .bias tensor the file must have
    optional_biases: tuple = ()        # projections whose .bias tensor is used when present
    rope_freqs: bool = False           # rope_freqs.weight (llama3 RoPE scaling) used when present
    q_width_is_hidden: bool = False    # llama.cpp builds q/o as [hidden, hidden]: heads * head_dim must be hidden
    default_rope_base: float = 10_000.0
    default_rms_eps: float = 1e-5
    hf_modules: tuple = tuple(HF_MODULES.items())  # (target, module path) for PEFT exports
    embed_scale: bool = False          # embeddings multiplied by sqrt(hidden) before the first block
    post_norms: bool = False           # RMSNorm of the attention and MLP outputs before each residual add
    activation: str = "silu"           # gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, GELU's tanh form)
    swa_pattern: int = 0               # n > 0: layer i is sliding-window (local) iff i % n < n - 1; 0: all global
    swa_rope_base: float = 10_000.0    # RoPE base of the local layers (llama.cpp fixes it per family)
    attention_scale: Callable | None = None  # (hidden, heads, head_dim, layers) -> q scale; None: head_dim^-1/2
    scale_query: bool = False          # llama.cpp scales q after RoPE (scores x 1) rather than the scores
    chat_format: str = "chatml"        # turn format for a GGUF without tokenizer.chat_template (llm/chat.py)

    def __post_init__(self):
        if self.rope not in ("neox", "normal"):
            raise ValueError(f"family {self.name}: rope must be 'neox' or 'normal', got {self.rope!r}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"family {self.name}: activation must be 'silu' or 'gelu_tanh', got {self.activation!r}")

    def hf_rows(self, target: str, rows: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
        """An array over projection `target`'s output rows, from GGUF order to Hugging Face order.
        A "normal"-RoPE family is stored with its q/k rows permuted from HF's half-rotation order
        into adjacent pairs (convert_hf_to_gguf); this undoes that. Other rows are the same in both."""
        if self.rope != "normal" or target not in ("q", "k"):
            return rows
        n_head = heads if target == "q" else kv_heads
        return rows.reshape(n_head, -1, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass(frozen=True)
class DecoderConfig:
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
    arch: str = "qwen3"                # the registered family (pipeline/models/registry.py)
    biases: tuple = ()                 # projections that carry a bias (every layer alike)
    rope_scale: float = 1.0            # linear RoPE scaling: positions are multiplied by it (llama.cpp freq_scale)
    sliding_window: int = 0            # local layers see the last sliding_window positions (0: no local layers)
    swa_pattern: int = 0               # see Family.swa_pattern
    rope_base_local: float = 10_000.0  # RoPE base of the local layers (never scaled, as in llama.cpp)
    attn_scale: float = 0.0            # the query scale; 0: head_dim ** -0.5

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise UserError(f"{self.arch}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise UserError(f"{self.arch}: head_dim ({self.head_dim}) must be even for RoPE")
        bad = [b for b in self.biases if b not in PROJECTIONS]
        if bad:
            raise UserError(f"{self.arch}: unknown projection bias {bad}; projections are {', '.join(PROJECTIONS)}")
        if self.sliding_window < 0 or self.swa_pattern < 0:
            raise UserError(f"{self.arch}: sliding_window ({self.sliding_window}) and swa_pattern "
                            f"({self.swa_pattern}) must be >= 0")

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window (llama.cpp's set_swa_pattern)."""
        n = self.swa_pattern
        return self.sliding_window > 0 and n > 0 and layer % n < n - 1

    def window(self, layer: int) -> int:
        """The attention window of layer `layer` in positions (0: the whole causal prefix)."""
        return self.sliding_window if self.is_local(layer) else 0

    def layer_rope(self, layer: int) -> tuple:
        """(RoPE base, position scale) of layer `layer`: local layers use their own base, unscaled."""
        return (self.rope_base_local, 1.0) if self.is_local(layer) else (self.rope_base, self.rope_scale)

    @property
    def family(self) -> Family:
        from .registry import family
        return family(self.arch)

    @classmethod
    def from_gguf(cls, gg) -> "DecoderConfig":
        """The config of a GGUF of a registered architecture (its `{arch}.*` metadata keys)."""
        from .registry import family_of
        fam = family_of(gg)
        a = fam.name
        if _meta_int(gg, f"{a}.expert_count", 0, minimum=0):
            raise UserError(f"{gg.path}: this '{a}' model is a mixture of experts ({a}.expert_count = "
                            f"{gg.get(f'{a}.expert_count')}); only dense models are supported")
        heads = _meta_int(gg, f"{a}.attention.head_count")
        hidden = _meta_int(gg, f"{a}.embedding_length")
        kv_heads = _meta_int(gg, f"{a}.attention.head_count_kv", heads)
        if heads % kv_heads:
            raise GGUFError(f"{gg.path}: metadata key '{a}.attention.head_count' ({heads}) must be a multiple of "
                            f"'{a}.attention.head_count_kv' ({kv_heads})")
        head_dim = _meta_int(gg, f"{a}.attention.key_length", max(1, hidden // heads))
        value_dim = _meta_int(gg, f"{a}.attention.value_length", head_dim)
        rope_dims = _meta_int(gg, f"{a}.rope.dimension_count", head_dim)
        if value_dim != head_dim or rope_dims != head_dim:
            raise UserError(f"{gg.path}: key_length {head_dim}, value_length {value_dim} and rope.dimension_count "
                            f"{rope_dims} differ; only models that rotate the whole head are supported")
        if fam.q_width_is_hidden and heads * head_dim != hidden:
            raise UserError(f"{gg.path}: {a} needs heads x head_dim == embedding_length (llama.cpp builds its q and "
                            f"output projections square), got {heads} x {head_dim} != {hidden}")
        scaling = gg.get(f"{a}.rope.scaling.type", "none")
        if not isinstance(scaling, str):
            raise GGUFError(f"{gg.path}: metadata key '{a}.rope.scaling.type' must be a string, got {brief(scaling)}")
        if scaling not in ("none", "linear"):
            raise UserError(f"{gg.path}: {a}.rope.scaling.type '{scaling}' is not supported (supported: none, linear; "
                            "llama3 scaling is read from the rope_freqs.weight tensor)")
        # llama.cpp reads a factor of 0 as no scaling
        factor = _meta_float(gg, f"{a}.rope.scaling.factor", 1.0, zero_ok=True) if scaling == "linear" else 1.0
        biases = tuple(p for p in PROJECTIONS if p in fam.required_biases
                       or (p in fam.optional_biases and gg.has(f"blk.0.{PROJECTIONS[p]}.bias")))
        layers = _meta_int(gg, f"{a}.block_count")
        # Each layer is at least its two norms and seven projections: a count the tensor table cannot hold is
        # refused here, before anything (the shape check's table of expected tensors) is built from it.
        n_tensors = len(gg.tensor_names)
        if layers * TENSORS_PER_LAYER > n_tensors:
            raise GGUFError(f"{gg.path}: metadata key '{a}.block_count' is {layers}: that many layers need at "
                            f"least {layers * TENSORS_PER_LAYER} tensors, the file has {n_tensors}")
        window = 0
        if fam.swa_pattern:
            window = _meta_int(gg, f"{a}.attention.sliding_window", minimum=0)
            if window <= 0:  # llama.cpp builds another graph (final-logit soft-capping, no local layers) then
                raise UserError(f"{gg.path}: {a}.attention.sliding_window is {window}; only {a} models with "
                                "sliding-window layers are supported")
        attn_scale = fam.attention_scale(hidden, heads, head_dim, layers) if fam.attention_scale else 0.0
        ffn = _meta_int(gg, f"{a}.feed_forward_length")
        context = _meta_int(gg, f"{a}.context_length", 4096)
        rope_base = _meta_float(gg, f"{a}.rope.freq_base", fam.default_rope_base)
        rms_eps = _meta_float(gg, f"{a}.attention.layer_norm_rms_epsilon", fam.default_rms_eps)
        try:
            return cls(
                vocab_size=int(gg.weight("token_embd.weight").shape[0]),
                hidden=hidden,
                layers=layers,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                ffn=ffn,
                context_length=context,
                rope_base=rope_base,
                rms_eps=rms_eps,
                tied_output=not gg.has("output.weight"),
                arch=a,
                biases=biases,
                rope_scale=1.0 / factor if factor else 1.0,
                sliding_window=window,
                swa_pattern=fam.swa_pattern,
                rope_base_local=fam.swa_rope_base,
                attn_scale=attn_scale,
            )
        except UserError as e:  # the dataclass's own checks (odd head_dim, ...) name the file too
            raise UserError(f"{gg.path}: {e}") from None

    def projection_shape(self, target: str) -> tuple:
        """[out, in] of projection `target`."""
        q, kv, h, f = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.ffn
        shapes = {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "gate": (f, h), "up": (f, h), "down": (h, f)}
        return shapes[target]


MAX_DIMENSION = 1 << 31  # no real model comes near; larger values are corrupt or hostile headers
TENSORS_PER_LAYER = 2 + len(PROJECTIONS)  # the fewest tensors a layer has: attn_norm, ffn_norm, the projections


def _meta_int(gg, key: str, default=None, minimum: int = 1) -> int:
    """Integer metadata `key` (required when default is None) in [minimum, MAX_DIMENSION]: a GGUF's
    values are typed by the file, so a string, list, float or bool here is one GGUFError naming the key."""
    value = gg.require(key) if default is None else gg.get(key, default)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise GGUFError(f"{gg.path}: metadata key '{key}' must be an integer, got {brief(value)}")
    if not minimum <= value <= MAX_DIMENSION:
        raise GGUFError(f"{gg.path}: metadata key '{key}' is {value}; it must be in [{minimum}, {MAX_DIMENSION}]")
    return int(value)


def _meta_float(gg, key: str, default: float, zero_ok: bool = False) -> float:
    """Finite positive number metadata `key` (RoPE bases, epsilons, scaling factors; zero_ok: or 0)."""
    value = gg.get(key, default)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise GGUFError(f"{gg.path}: metadata key '{key}' must be a number, got {brief(value)}")
    if not (math.isfinite(value) and (value > 0 or (zero_ok and value == 0))):
        raise GGUFError(f"{gg.path}: metadata key '{key}' is {value}; it must be a finite number "
                        f"{'>= 0' if zero_ok else '> 0'}")
    return float(value)


# --- projections (the seam) ---------------------------------------------------
class FrozenLinear(Module):
    """y = x @ W.T (+ b) with W a frozen GGUF weight (any supported format). No gradient to W or b."""

    def __init__(self, weight: FrozenWeight, bias: np.ndarray | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def infer(self, x: np.ndarray) -> np.ndarray:
        y = self.weight.matmul_t(x)
        if self.bias is not None:
            y += self.bias
        return y

    def forward(self, x: Tensor) -> Tensor:
        x = ops.as_tensor(x)
        w = self.weight

        def backward(g):  # dx = g @ W, dequantized tile by tile inside the GEMM (never resident in f32)
            return w.matmul(np.asarray(g, np.float32).reshape(-1, w.shape[0])).reshape(x.shape),

        return Tensor.make(self.infer(x.data), (x,), backward, "frozen_linear")


class Linear(Module):
    """y = x @ W.T (+ b) with W a trainable f32 parameter [out, in] (b a trainable vector or None)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def infer(self, x: np.ndarray) -> np.ndarray:
        y = np.asarray(x, np.float32) @ self.weight.data.T
        return y + self.bias.data if self.bias is not None else y

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)


def _infer(proj, x: np.ndarray) -> np.ndarray:
    if hasattr(proj, "infer"):
        return proj.infer(x)
    with no_grad():
        return proj(Tensor(x)).data


def _infer_many(projs, x: np.ndarray) -> list:
    """Projections of one input (q/k/v, gate/up): plain frozen weights share one thread dispatch."""
    if all(type(p) is FrozenLinear for p in projs):
        ys = matmul_t_many([p.weight for p in projs], x)
        for p, y in zip(projs, ys):
            if p.bias is not None:
                y += p.bias
        return ys
    return [_infer(p, x) for p in projs]


def _infer_rows(projs, x3: np.ndarray) -> list:
    """[rows, seq, out] products of projections sharing the input x3 [rows, seq, in], each row with the
    bits of `_infer_many(projs, x3[r])` alone: frozen weights are read once for all rows."""
    if len(x3) == 1:
        return [y[None] for y in (_infer_many(projs, x3[0]) if len(projs) > 1 else [_infer(projs[0], x3[0])])]
    if all(type(p) is FrozenLinear for p in projs):
        ys = matmul_t_groups([p.weight for p in projs], x3)
        for p, y in zip(projs, ys):
            if p.bias is not None:
                y += p.bias
        return ys
    per_row = [_infer_many(projs, x) for x in x3]
    return [np.stack([ys[i] for ys in per_row]) for i in range(len(projs))]


def swiglu(gate, up):
    """silu(gate) * up as one op: the bits of ops.silu then ops.mul, in one pass
    each way with no [T, ffn] temporaries beyond the outputs."""
    from pipeline.kernels.nn import swiglu_backward
    a = np.ascontiguousarray(gate.data, dtype=np.float32)
    b = np.ascontiguousarray(up.data, dtype=np.float32)

    def backward(g):
        ga, gb = swiglu_backward(np.ascontiguousarray(g, dtype=np.float32), a, b)
        return (ga if gate.requires_grad else None, gb if up.requires_grad else None)

    return Tensor.make(swiglu_f32(a, b), (gate, up), backward, "swiglu")


# --- the model ---------------------------------------------------------------
class Attention(Module):
    def __init__(self, q, k, v, o, q_norm: Tensor | None = None, k_norm: Tensor | None = None):
        self.q, self.k, self.v, self.o, self.q_norm, self.k_norm = q, k, v, o, q_norm, k_norm


class MLP(Module):
    def __init__(self, gate, up, down):
        self.gate, self.up, self.down = gate, up, down


class Block(Module):
    def __init__(self, attn_norm: Tensor, attn: Attention, ffn_norm: Tensor, mlp: MLP,
                 post_attn_norm: Tensor | None = None, post_ffn_norm: Tensor | None = None):
        self.attn_norm, self.attn, self.ffn_norm, self.mlp = attn_norm, attn, ffn_norm, mlp
        self.post_attn_norm, self.post_ffn_norm = post_attn_norm, post_ffn_norm  # families with post_norms

    def projection(self, target: str):
        return getattr(self.attn if target in ("q", "k", "v", "o") else self.mlp, target)


class KVCache:
    """Per-layer f32 keys/values [capacity, kv_heads, head_dim]; grows by doubling."""

    def __init__(self, config: DecoderConfig, capacity: int = 256):
        shape = (capacity, config.kv_heads, config.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(config.layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(config.layers)]
        self.length = 0

    def store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray):
        end = pos + k.shape[0]
        self._grow(layer, end)
        self.k[layer][pos:end], self.v[layer][pos:end] = k, v
        return self.k[layer][:end], self.v[layer][:end]

    def reserve(self, end: int):
        """Room for positions up to end in every layer (pipeline/kernels/decode.layer writes its own slot)."""
        for layer in range(len(self.k)):
            self._grow(layer, end)

    def _grow(self, layer: int, end: int):
        if end > self.k[layer].shape[0]:
            grow = max(end, 2 * self.k[layer].shape[0])
            for store in (self.k, self.v):
                old = store[layer]
                store[layer] = np.zeros((grow,) + old.shape[1:], np.float32)
                store[layer][: old.shape[0]] = old

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


class _DecodeLayer:
    """One layer's constant arguments of pipeline/kernels/decode.layer."""

    def __init__(self, blk, templates, needs, rows, runners):
        f32 = lambda a: np.ascontiguousarray(a, np.float32)
        self.attn_norm, self.ffn_norm = f32(blk.attn_norm.data), f32(blk.ffn_norm.data)
        self.normed = blk.attn.q_norm is not None
        head_dim = blk.attn.q_norm.data.shape[0] if self.normed else 1
        self.q_norm, self.k_norm = ((f32(blk.attn.q_norm.data), f32(blk.attn.k_norm.data)) if self.normed
                                    else (np.ones(head_dim, np.float32),) * 2)
        self.post = blk.post_attn_norm is not None
        data = lambda norm: f32(norm.data if isinstance(norm, Tensor) else norm)
        self.post_attn_norm, self.post_ffn_norm = ((data(blk.post_attn_norm), data(blk.post_ffn_norm)) if self.post
                                                   else (self.attn_norm, self.ffn_norm))  # unread
        self.templates, self.needs, self.rows, self.runners = templates, needs, rows, runners


class _DecodePlan:
    """Model._decode_plan's result: the layers' arguments for one thread count, and the weights they were laid
    out from (projection, weight, raw), checked by identity before each use."""

    def __init__(self, threads, layers, used, ropes, scale):
        self.threads, self.layers, self.used, self.ropes, self.scale = threads, layers, used, ropes, scale

    def current(self, model) -> bool:
        i = 0
        for blk in model.blocks:
            for t in ("q", "k", "v", "o", "gate", "up", "down"):
                p, w, raw = self.used[i]
                if blk.projection(t) is not p or p.weight is not w or w.raw is not raw or not w.uses_integer_dot(1):
                    return False
                i += 1
        return True


class DecoderLM(Module):
    """A dense decoder of a registered family. Build with `from_gguf(path)` or `init_random(config, seed)`."""

    def __init__(self, config: DecoderConfig, embed, blocks: list[Block], out_norm: Tensor, output,
                 rope_factors: np.ndarray | None = None):
        self.config = config
        self.family = config.family
        self.embed = embed          # Tensor [vocab, hidden] (trainable) or FrozenWeight
        self.blocks = blocks
        self.out_norm = out_norm
        self.output = output        # a projection; for a tied head it shares `embed`
        self._rope_factors = rope_factors  # [head_dim/2] f32 frequency divisors (rope_freqs.weight) or None
        self.llama_numerics = False        # inference rounds as llama.cpp's CPU kernels do (from_gguf sets it)

    # --- construction -------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path_or_file, trainable: bool = False, llama_numerics: bool = False) -> "DecoderLM":
        """Load a GGUF of any registered architecture. Weights stay in the file's format (memory-mapped), frozen.

        trainable=True instead dequantizes every weight into f32 parameters (full fine-tune).
        llama_numerics=True rounds each matmul's activations the way llama.cpp's CPU
        kernels do (Q8_0/Q8_K/BF16), for tight parity checks; the default keeps them f32.
        """
        from ..llm.gguf import GGUFFile
        gg = path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)
        cfg = DecoderConfig.from_gguf(gg)
        fam = cfg.family
        _check_shapes(gg, cfg)

        def vec(name):
            return Tensor(gg.vector(name), requires_grad=trainable, name=name)

        def proj(name, bias_name=None):
            w = gg.weight(name)
            w.llama_numerics = llama_numerics
            if trainable:
                return Linear(parameter(w.dequantize(), name), vec(bias_name) if bias_name else None)
            return FrozenLinear(w, gg.vector(bias_name) if bias_name else None)

        blocks = []
        for i in range(cfg.layers):
            p = f"blk.{i}."
            ps = {t: proj(p + n + ".weight", p + n + ".bias" if t in cfg.biases else None)
                  for t, n in PROJECTIONS.items()}
            norms = (vec(p + "attn_q_norm.weight"), vec(p + "attn_k_norm.weight")) if fam.qk_norm else ()
            attn = Attention(ps["q"], ps["k"], ps["v"], ps["o"], *norms)
            post = ((vec(p + "post_attention_norm.weight"), vec(p + "post_ffw_norm.weight")) if fam.post_norms
                    else ())
            blocks.append(Block(vec(p + "attn_norm.weight"), attn, vec(p + "ffn_norm.weight"),
                                MLP(ps["gate"], ps["up"], ps["down"]), *post))
        if trainable:
            embed = parameter(gg.weight("token_embd.weight").dequantize(), "token_embd.weight")
            output = Linear(embed) if cfg.tied_output else proj("output.weight")
        else:
            embed = gg.weight("token_embd.weight")
            embed.llama_numerics = llama_numerics
            output = FrozenLinear(embed) if cfg.tied_output else proj("output.weight")
        factors = gg.vector("rope_freqs.weight") if fam.rope_freqs and gg.has("rope_freqs.weight") else None
        model = cls(cfg, embed, blocks, vec("output_norm.weight"), output, factors)
        model._source = gg
        model.llama_numerics = llama_numerics
        return model

    @classmethod
    def init_random(cls, config: DecoderConfig, seed: int = 0) -> "DecoderLM":
        """Random f32 parameters (requires_grad=True) from the counter RNG: a pure function of (config, seed)."""
        c, counter = config, iter(range(1 << 30))

        def mat(name, n_out, n_in):
            w = rng.gaussian(rng.derive_seed(seed, next(counter)), (n_out, n_in)) * np.float32(n_in ** -0.5)
            return Linear(parameter(w.astype(np.float32), name))

        def ones(name, n):
            return parameter(np.ones(n, np.float32), name)

        table = rng.gaussian(rng.derive_seed(seed, next(counter)), (c.vocab_size, c.hidden))
        embed = parameter(table.astype(np.float32), "token_embd.weight")
        blocks = []
        for i in range(c.layers):
            p = f"blk.{i}."
            ps = {t: mat(p + n + ".weight", *c.projection_shape(t)) for t, n in PROJECTIONS.items()}
            for t in c.biases:
                ps[t].bias = parameter(np.zeros(ps[t].out_features, np.float32), p + PROJECTIONS[t] + ".bias")
            norms = ((ones(p + "attn_q_norm.weight", c.head_dim), ones(p + "attn_k_norm.weight", c.head_dim))
                     if c.family.qk_norm else ())
            attn = Attention(ps["q"], ps["k"], ps["v"], ps["o"], *norms)
            post = ((ones(p + "post_attention_norm.weight", c.hidden), ones(p + "post_ffw_norm.weight", c.hidden))
                    if c.family.post_norms else ())
            blocks.append(Block(ones(p + "attn_norm.weight", c.hidden), attn, ones(p + "ffn_norm.weight", c.hidden),
                                MLP(ps["gate"], ps["up"], ps["down"]), *post))
        output = Linear(embed) if c.tied_output else mat("output.weight", c.vocab_size, c.hidden)
        return cls(c, embed, blocks, ones("output_norm.weight", c.hidden), output)

    def with_constant_norms(self) -> "DecoderLM":
        """The same model (projections shared) with every norm vector a plain f32 array, so a
        graph through its block sends no gradient into the base, whatever requires grad here."""
        const = lambda v: None if v is None else np.asarray(v.data if isinstance(v, Tensor) else v, np.float32)
        blocks = [Block(const(b.attn_norm), Attention(b.attn.q, b.attn.k, b.attn.v, b.attn.o, const(b.attn.q_norm),
                                                      const(b.attn.k_norm)), const(b.ffn_norm), b.mlp,
                        const(b.post_attn_norm), const(b.post_ffn_norm))
                  for b in self.blocks]
        return type(self)(self.config, self.embed, blocks, const(self.out_norm), self.output, self._rope_factors)

    def named_weights(self) -> dict[str, object]:
        """GGUF tensor name -> Tensor, FrozenWeight or f32 array (for export and inspection)."""
        out = {"token_embd.weight": self.embed, "output_norm.weight": self.out_norm}
        if self._rope_factors is not None:
            out["rope_freqs.weight"] = self._rope_factors
        for i, b in enumerate(self.blocks):
            p = f"blk.{i}."
            out[p + "attn_norm.weight"], out[p + "ffn_norm.weight"] = b.attn_norm, b.ffn_norm
            if self.family.qk_norm:
                out[p + "attn_q_norm.weight"], out[p + "attn_k_norm.weight"] = b.attn.q_norm, b.attn.k_norm
            if self.family.post_norms:
                out[p + "post_attention_norm.weight"] = b.post_attn_norm
                out[p + "post_ffw_norm.weight"] = b.post_ffn_norm
            for t, n in PROJECTIONS.items():
                proj = b.projection(t)
                out[p + n + ".weight"] = getattr(proj, "weight", proj)
                if getattr(proj, "bias", None) is not None:
                    out[p + n + ".bias"] = proj.bias
        if not self.config.tied_output:
            out["output.weight"] = getattr(self.output, "weight", self.output)
        return out

    # --- the block (training: the autograd ops) -----------------------------------
    def _seam(self, i: int, targets, x: Tensor) -> list:
        blk = self.blocks[i]
        return [blk.projection(t)(x) for t in targets]

    def rope(self, x: Tensor, positions, layer: int = 0) -> Tensor:
        """The family's RoPE of layer `layer` on x [..., seq, heads, head_dim] (positions [seq] or [batch, seq])."""
        base, scale = self.config.layer_rope(layer)
        pos = np.asarray(positions) if scale == 1.0 else np.asarray(positions, np.float64) * scale
        return ops.rope(x, pos, base, self._rope_factors, interleaved=self.family.rope == "normal")

    def scale_embedding(self, x):
        """The embedding rows as the first block reads them (x sqrt(hidden) for families with embed_scale)."""
        return x * np.float32(math.sqrt(self.config.hidden)) if self.family.embed_scale else x

    def _mlp_activation(self, gate, up):
        return swiglu(gate, up) if self.family.activation == "silu" else ops.gelu(gate, "tanh") * up

    def _post_norm(self, x, norm):
        return x if norm is None else ops.rms_norm(x, norm, self.config.rms_eps)

    def block(self, i: int, x: Tensor, positions, project=None, segments=None) -> Tensor:
        """Decoder block i on x [batch, seq, hidden]. project(i, targets, h) -> the projections `targets`
        of layer i on their shared input h (default: the model's own seam); the LoRA trainer passes its
        adapted products here, so training and fine-tuning run this one definition. segments [seq]: packed
        samples (ops.attention: a position attends only within its segment; positions restart per sample)."""
        c, blk, project = self.config, self.blocks[i], project or self._seam
        b, t = x.shape[0], x.shape[1]
        h = ops.rms_norm(x, blk.attn_norm, c.rms_eps)
        q, k, v = project(i, ("q", "k", "v"), h)
        q = ops.reshape(q, b, t, c.heads, c.head_dim)
        k = ops.reshape(k, b, t, c.kv_heads, c.head_dim)
        v = ops.reshape(v, b, t, c.kv_heads, c.head_dim)
        if self.family.qk_norm:
            q, k = ops.rms_norm(q, blk.attn.q_norm, c.rms_eps), ops.rms_norm(k, blk.attn.k_norm, c.rms_eps)
        q, k = self.rope(q, positions, i), self.rope(k, positions, i)
        a = ops.attention(q, k, v, causal=True, scale=c.attn_scale or None, window=c.window(i), segments=segments)
        x = x + self._post_norm(project(i, ("o",), ops.reshape(a, b, t, c.heads * c.head_dim))[0], blk.post_attn_norm)
        h = ops.rms_norm(x, blk.ffn_norm, c.rms_eps)
        m = project(i, ("down",), self._mlp_activation(*project(i, ("gate", "up"), h)))[0]
        return x + self._post_norm(m, blk.post_ffn_norm)

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
        t = ids2.shape[1]
        pos = np.arange(t) if positions is None else np.asarray(positions)
        x = self.scale_embedding(self._embed_tensor(ids2))
        for i in range(c.layers):
            x = self.block(i, x, pos)
        logits = self.output(ops.rms_norm(x, self.out_norm, c.rms_eps))
        return ops.reshape(logits, t, c.vocab_size) if single else logits

    # --- no-grad inference with a KV cache ----------------------------------------
    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.config, capacity)

    @no_grad()  # records no graph: the no-grad kernels (integer decode dots, FrozenWeight) apply
    def infer(self, ids, cache: KVCache | None = None, all_logits: bool = False) -> np.ndarray:
        """Append ids at cache.length; return logits of the last position [vocab] (all_logits: [seq, vocab])."""
        ids = self._check_ids(ids)
        if ids.ndim != 1:
            raise UserError(f"{self.config.arch}.infer: ids must be one sequence [seq], got shape {ids.shape}")
        cache = cache if cache is not None else self.new_cache(len(ids))
        return self.infer_rows(ids[None], [cache], all_logits=all_logits)[0]

    def infer_rows(self, ids, caches: list, adapt=None, all_logits: bool = False) -> np.ndarray:
        """Append ids [rows, seq] (row r at caches[r].length, each row its own KVCache); return the logits of
        each row's last position [rows, vocab] (all_logits: [rows, seq, vocab]).

        Each row gets the bits `infer` gives it alone: norms, RoPE and the activation are per row;
        attention runs per row against its own cache; the projections read each weight once for all rows
        (quants.matmul_t_groups: the fused matvec computes every row alone; tiles are dequantized once and
        multiplied per row with the call one row would make). adapt(layer, target, x3, y3), when given, adds
        per-row terms to a layer projection's output y3 [rows, seq, out] in place from its input x3 (ES
        members decoding in lock-step add each member's LoRA delta to its own rows)."""
        with workpool.hold():  # the pool's threads spin between this forward's products instead of sleeping
            if adapt is None and not all_logits and len(caches) == 1 and np.shape(ids) == (1, 1):
                logits = self._decode_token(ids, caches[0])
                if logits is not None:
                    return logits
            return self._infer_rows(ids, caches, adapt, all_logits)

    def _decode_token(self, ids, cache: KVCache):
        """One token of one row through pipeline/kernels/decode.layer (a layer per numba call, the general path's bits),
        or None when this model or call is not the shape it covers (the general path then runs)."""
        c = self.config
        ids = self._check_ids(ids)
        p0 = cache.length
        if p0 + 1 > c.context_length or (not handoff.FUTEX and workpool.threads() > 1):
            return None  # the general path raises the error / dispatches through Python locks (no futex)
        with workpool.native_workers() as (cells, n, ticks, hold):
            plan = self._decode_plan(n + 1)
            if plan is None:
                return None
            x = self.embed.data[ids[0]] if isinstance(self.embed, Tensor) else weight_rows(self.embed, ids[0])
            x = np.ascontiguousarray(self.scale_embedding(x.astype(np.float32)))
            tables = {}
            for base, scale in plan.ropes:
                pos = np.array([p0], np.float64) * scale
                tables[base, scale] = tuple(a[:, None, :] for a in
                                            ops.rope_tables(pos, c.head_dim, base, np.float32, self._rope_factors))
            cache.reserve(p0 + 1)
            eps, interleaved = np.float32(c.rms_eps), self.family.rope == "normal"
            gelu = self.family.activation != "silu"
            for li, lp in enumerate(plan.layers):
                cos, sin = tables[c.layer_rope(li)]
                x = decode.layer(x, eps, lp.attn_norm, lp.ffn_norm, lp.q_norm, lp.k_norm, lp.normed,
                                 lp.post_attn_norm, lp.post_ffn_norm, lp.post, gelu, cos, sin,
                                 interleaved, c.heads, c.kv_heads, c.head_dim, cache.k[li], cache.v[li], p0,
                                 plan.scale, c.window(li), lp.templates, lp.needs, lp.rows, HALF_TO_FLOAT, cells,
                                 n, lp.runners, ticks, hold)
        cache.length = p0 + 1
        x = _rms(x.reshape(1, 1, c.hidden), self.out_norm.data, c.rms_eps)
        return _infer_rows([self.output], x)[0][:, 0]

    def _decode_plan(self, threads: int):
        """The per-layer arguments of pipeline/kernels/decode.layer for `threads` threads, kept on the model while its
        projections hold the same weights and raw arrays; None when a layer is not what it covers."""
        from pipeline.autograd.tensor import grad_enabled
        plan = self.__dict__.get("_decode")
        if grad_enabled() or self.llama_numerics:
            return None  # llama.cpp's f32 arithmetic (parity runs, pipeline/kernels/ggml_f32.py) is the general path's
        if plan is not None and plan.threads == threads and plan.current(self):
            return plan
        layers, used = [], []
        for blk in self.blocks:
            projections = {t: blk.projection(t) for t in ("q", "k", "v", "o", "gate", "up", "down")}
            if ((blk.post_attn_norm is None) != (blk.post_ffn_norm is None)
                    or (blk.attn.q_norm is None) != (blk.attn.k_norm is None)
                    or any(type(p) is not FrozenLinear or p.bias is not None or not p.weight.uses_integer_dot(1)
                           for p in projections.values())):
                return None
            used += [(p, p.weight, p.weight.raw) for p in projections.values()]
            groups = [[projections[t].weight for t in g] for g in (("q", "k", "v"), ("o",), ("gate", "up"),
                                                                   ("down",))]
            products = [integer_product(g) for g in groups]
            layers.append(_DecodeLayer(blk, tuple(pr.template(threads) for pr in products),
                                       np.array([pr.needs for pr in products], np.int64),
                                       np.array([pr.offsets[-1] for pr in products], np.int64),
                                       np.array([pr.runner.address for pr in products], np.int64)))
        c = self.config
        plan = _DecodePlan(threads, layers, used, sorted({c.layer_rope(li) for li in range(c.layers)}),
                           np.float32(c.head_dim ** -0.5 if not c.attn_scale else c.attn_scale))
        self.__dict__["_decode"] = plan
        return plan

    def _infer_rows(self, ids, caches: list, adapt, all_logits: bool) -> np.ndarray:
        c = self.config
        ids = self._check_ids(ids)
        if ids.ndim != 2 or len(caches) != ids.shape[0]:
            raise UserError(f"{c.arch}.infer_rows: ids must be [rows, seq] with one cache per row, got shape "
                            f"{ids.shape} and {len(caches)} caches")
        n_rows, t = ids.shape
        starts = [cache.length for cache in caches]
        if max(starts) + t > c.context_length:
            raise UserError(f"context of {max(starts) + t} tokens exceeds the model's context length "
                            f"{c.context_length}")
        ln = self.llama_numerics  # llama.cpp's f32 arithmetic between the products too (pipeline/kernels/ggml_f32.py)
        tables = {}  # (base, scale) -> (cos, sin) [rows * t, 1, head_dim/2]: one pair per RoPE kind in the model
        for base, scale in sorted({c.layer_rope(li) for li in range(c.layers)}):
            if ln:
                pos = np.concatenate([np.arange(p0, p0 + t) for p0 in starts])
                tables[base, scale] = ggml_f32.rope_tables(pos, c.head_dim, base, scale, self._rope_factors)
                continue
            pos = np.concatenate([np.arange(p0, p0 + t, dtype=np.float64) for p0 in starts]) * scale
            tables[base, scale] = tuple(a[:, None, :] for a in
                                        ops.rope_tables(pos, c.head_dim, base, np.float32, self._rope_factors))
        interleaved = self.family.rope == "normal"
        flat = ids.reshape(-1)
        x = self.embed.data[flat] if isinstance(self.embed, Tensor) else weight_rows(self.embed, flat)
        x = self.scale_embedding(x.astype(np.float32))
        scale = c.attn_scale or None
        rms, norm_rope, attend, q_scale = _rms, _norm_rope, _attend, None
        if ln:
            rms, norm_rope, attend = _rms_llama, _norm_rope_llama, _attend_llama
            scale, q_scale = _llama_attention_scales(c, self.family)

        def project(li, targets, h):
            h3 = h.reshape(n_rows, t, -1)
            ys = _infer_rows([self.blocks[li].projection(target) for target in targets], h3)
            if adapt is not None:
                for target, y3 in zip(targets, ys):
                    adapt(li, target, h3, y3)
            return [y.reshape(n_rows * t, -1) for y in ys]

        for li, blk in enumerate(self.blocks):
            cos, sin = tables[c.layer_rope(li)]
            h = rms(x, blk.attn_norm.data, c.rms_eps)
            q, k, v = project(li, ("q", "k", "v"), h)
            q, k, v = (q.reshape(-1, c.heads, c.head_dim), k.reshape(-1, c.kv_heads, c.head_dim),
                       v.reshape(-1, c.kv_heads, c.head_dim))
            q = norm_rope(q, blk.attn.q_norm, c.rms_eps, cos, sin, interleaved).reshape(n_rows, t, c.heads, -1)
            k = norm_rope(k, blk.attn.k_norm, c.rms_eps, cos, sin, interleaved).reshape(n_rows, t, c.kv_heads, -1)
            if q_scale is not None:  # llama.cpp's gemma3 graph scales q after RoPE and the scores by 1
                q = q * q_scale
            v = v.reshape(n_rows, t, c.kv_heads, c.head_dim)
            attended = []
            for r, (cache, p0) in enumerate(zip(caches, starts)):
                keys, values = cache.store(li, p0, k[r], v[r])
                attended.append(attend(q[r], keys, values, p0, scale, c.window(li)))
            a = attended[0] if n_rows == 1 else np.concatenate(attended)
            x = x + _infer_post_norm(project(li, ("o",), a)[0], blk.post_attn_norm, c.rms_eps, rms)
            h = rms(x, blk.ffn_norm.data, c.rms_eps)
            g, u = project(li, ("gate", "up"), h)
            m = project(li, ("down",), (_swiglu_llama(g, u) if ln else swiglu_f32(g, u))
                        if self.family.activation == "silu" else _gelu_tanh_mul(g, u, ln))[0]
            x = x + _infer_post_norm(m, blk.post_ffn_norm, c.rms_eps, rms)
        for cache, p0 in zip(caches, starts):
            cache.length = p0 + t
        x = x.reshape(n_rows, t, c.hidden)
        x = rms(x if all_logits else x[:, -1:], self.out_norm.data, c.rms_eps)
        logits = _infer_rows([self.output], x)[0]
        return logits if all_logits else logits[:, 0]

    def _check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids.data if isinstance(ids, Tensor) else ids)
        arch = self.config.arch
        if ids.size == 0:
            raise UserError(f"{arch}: empty token sequence (give at least one token)")
        if ids.dtype.kind not in "iu":
            raise UserError(f"{arch}: token ids must be integers, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise UserError(f"{arch}: token id out of range [0, {self.config.vocab_size}): "
                            f"got min {ids.min()}, max {ids.max()}")
        return ids.astype(np.int64)

    def config_dict(self) -> dict:
        return asdict(self.config)

    @property
    def weight_bytes(self) -> int:
        total = 0
        for w in self.named_weights().values():
            total += w.nbytes if isinstance(w, (FrozenWeight, np.ndarray)) else w.data.nbytes
        return total  # a tied table is listed (and counted) once


# --- numpy / numba kernels of the inference path ------------------------------
def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (a numba loop: at decode sizes numpy's
    per-call overhead cost more than the arithmetic)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _rms_rows(x2, np.ascontiguousarray(w, dtype=np.float32), np.float32(eps), out)
    return out.reshape(x.shape)


def _norm_rope(x: np.ndarray, norm, eps: float, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Per-head RMSNorm (when norm is a weight Tensor, not None), then the rotation, of x
    [seq, heads, head_dim] in one numba pass: pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
    a pair being (x[i], x[i + d/2]) (NeoX) or (x[2i], x[2i+1]) (interleaved); cos/sin [seq, 1, d/2]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    normed = norm is not None
    w = np.ascontiguousarray(norm.data if normed else np.ones(x.shape[-1]), dtype=np.float32)
    eps = np.float32(eps)
    parts = _worker_threads() if x.size >= ATTEND_SPLIT_WORK else 1  # positions are independent: the same bits
    workpool.split_range(len(x), parts, lambda p0, p1: _norm_rope_heads(x[p0:p1], w, eps, cos[p0:p1], sin[p0:p1],
                                                                         out[p0:p1], normed, interleaved))
    return out


def _infer_post_norm(x: np.ndarray, norm, eps: float, rms=None) -> np.ndarray:
    return x if norm is None else (rms or _rms)(x, norm.data if isinstance(norm, Tensor) else norm, eps)


# --- llama-numerics: llama.cpp's own f32 arithmetic between the products (pipeline/kernels/ggml_f32.py) ---------------
def _rms_llama(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """ggml's rms_norm (float64 sum of squares) then the weight."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    ggml_f32.rms_rows(x2, np.ascontiguousarray(w, dtype=np.float32), np.float32(eps), out)
    return out.reshape(x.shape)


def _norm_rope_llama(x: np.ndarray, norm, eps: float, cos: np.ndarray, sin: np.ndarray,
                     interleaved: bool) -> np.ndarray:
    """_norm_rope with ggml's per-head rms_norm and rope_f32 (cos/sin [seq, head_dim/2] from ggml_f32)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    normed = norm is not None
    w = np.ascontiguousarray(norm.data if normed else np.ones(x.shape[-1]), dtype=np.float32)
    ggml_f32.norm_rope_heads(x, w, np.float32(eps), cos, sin, out, normed, interleaved)
    return out


def _attend_llama(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale, window: int = 0) -> np.ndarray:
    return ggml_f32.attend(q, k, v, pos0, scale, window)


def _swiglu_llama(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g, u = (np.ascontiguousarray(a, np.float32) for a in (g, u))
    out = np.empty_like(g)
    ggml_f32.swiglu_rows(g.reshape(-1), u.reshape(-1), out.reshape(-1))
    return out


def _llama_attention_scales(c: DecoderConfig, family: Family):
    """(softmax scale, q scale or None) as llama.cpp's graphs apply them, in f32: kq_scale = 1/sqrtf(head_dim)
    on the scores, or (gemma3, `Family.scale_query`) q multiplied by f_attention_scale after RoPE and the
    scores by 1."""
    if family.scale_query:
        return np.float32(1.0), np.float32(c.attn_scale or np.float32(1.0) / np.sqrt(np.float32(c.head_dim)))
    return np.float32(c.attn_scale or np.float32(1.0) / np.sqrt(np.float32(c.head_dim))), None


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale=None, window: int = 0) -> np.ndarray:
    """Causal grouped-query attention. q [t, H, D] at positions pos0.., k/v [s, KV, D] -> [t, H*D].
    Scores are scaled by `scale` (default head_dim^-1/2); window > 0 also hides keys `window` or more
    positions behind the query (sliding-window layers); a chunk multiplies only against the keys some
    row of it can see.

    At most ATTEND_CACHED_MAX_T queries (decode) go through pipeline/kernels/attention.attend_cached in one numba call;
    more go in chunks of ATTEND_CHUNK positions, each against only the keys it can see
    (a prompt from an empty cache does ~5/8 of the full t x s work). A long prompt splits
    the kv heads over the worker threads (numpy releases the GIL). Chunks depend on t only
    and a head's arithmetic not on the split, so the result is the same for any thread count."""
    t, n_h, d = q.shape
    s, n_kv, _ = k.shape
    g = n_h // n_kv
    scale = np.float32(d ** -0.5 if scale is None else scale)
    if t <= ATTEND_CACHED_MAX_T:  # decode: one numba call, no score matrix (pipeline/kernels/attention.attend_cached)
        return attention.attend_cached(q, k, v, pos0, scale, window)
    q4 = q.reshape(t, n_kv, g, d).transpose(1, 2, 0, 3)                    # [KV, g, t, D]
    kt, vt = k.transpose(1, 2, 0), v.transpose(1, 0, 2)
    out = np.empty((n_kv, g, t, d), np.float32)

    def heads(h0, h1):
        for c0 in range(0, t, ATTEND_CHUNK):
            c1, n = min(t, c0 + ATTEND_CHUNK), h1 - h0
            seen = pos0 + c1                                                # keys visible to the chunk's last row
            first = max(0, pos0 + c0 - window + 1) if window else 0        # ... and to its first row
            qc = q4[h0:h1, :, c0:c1].reshape(n, g * (c1 - c0), d)
            scores = qc @ kt[h0:h1, :, first:seen]                          # [h, g*c, seen - first]
            scores *= scale
            c = c1 - c0
            if c > 1 and not window:  # only the chunk's own c keys can be hidden: a c x c triangle on the tail
                scores.reshape(n, g, c, seen - first)[..., seen - first - c:] += _causal_triangle(c)
            elif c > 1:  # adding a 0/-inf mask broadcasts; boolean-index assignment was ~5x slower
                key_pos, query_pos = np.arange(first, seen)[None, :], (pos0 + np.arange(c0, c1))[:, None]
                hidden = key_pos > query_pos
                if window:
                    hidden |= query_pos - key_pos >= window
                scores.reshape(n, g, c1 - c0, seen - first)[...] += np.where(hidden, np.float32(-np.inf),
                                                                              np.float32(0.0))
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores, out=scores)
            p /= p.sum(axis=-1, keepdims=True)
            out[h0:h1, :, c0:c1] = (p @ vt[h0:h1, first:seen]).reshape(n, g, c1 - c0, d)

    parts = _worker_threads() if t * s * n_h >= ATTEND_SPLIT_WORK else 1
    workpool.split_range(n_kv, min(parts, n_kv), heads)
    return out.transpose(2, 0, 1, 3).reshape(t, n_h * d)


def _gelu_tanh_mul(g: np.ndarray, u: np.ndarray, f16_table: bool = False) -> np.ndarray:
    """gelu_tanh(g) * u with the bits of the training path (ops.gelu's float64 x sigmoid(2y) rounded to f32,
    then the f32 product). f16_table: as ggml's CPU geglu (GGML_GELU_FP16) instead: g rounded to f16,
    its f32 GELU rounded to f16 (the lookup table), 0 below -10 and the identity above 10; its two f16
    roundings (2^-11 relative each) are most of llama.cpp's distance from the exact GELU."""
    if not f16_table:  # one numba pass (kernels.nn.gelu_tanh_mul_range: the decode layer's bits too)
        g, u = (np.ascontiguousarray(a, np.float32) for a in (g, u))
        out = np.empty_like(g)
        nn.gelu_tanh_mul_range(g.reshape(-1), u.reshape(-1), out.reshape(-1))
        return out
    x = np.asarray(g, np.float32)
    h = x.astype(np.float16).astype(np.float32)
    one = np.float32(1.0)
    inner = np.float32(math.sqrt(2.0 / math.pi)) * h * (one + np.float32(0.044715) * h * h)
    table = (np.float32(0.5) * h * (one + np.tanh(inner))).astype(np.float16).astype(np.float32)
    gelu = np.where(x <= -10.0, np.float32(0.0), np.where(x >= 10.0, x, table))
    return gelu * np.asarray(u, np.float32)


@functools.lru_cache(maxsize=8)
def _causal_triangle(c: int) -> np.ndarray:
    """f32 [c, c]: -inf above the diagonal (a later key than the query), 0 elsewhere."""
    tri = np.where(np.arange(c)[None, :] > np.arange(c)[:, None], np.float32(-np.inf), np.float32(0.0))
    tri.flags.writeable = False
    return tri


ATTEND_CHUNK = 64             # query positions per chunk
ATTEND_CACHED_MAX_T = 4       # at most this many new queries (decode) take the one-call kernel
ATTEND_SPLIT_WORK = 1 << 16  # score elements below which one thread is quicker than two


def _worker_threads() -> int:
    import numba
    return numba.get_num_threads()


def _check_shapes(gg, cfg: DecoderConfig):
    """Every tensor the config implies must exist with the implied shape (named on mismatch), and
    the file must hold no other: a tensor this family does not read (a fused attn_qkv, an output
    bias, ...) would otherwise be silently ignored (llama.cpp refuses such files too)."""
    want = {"token_embd.weight": (cfg.vocab_size, cfg.hidden), "output_norm.weight": (1, cfg.hidden)}
    if not cfg.tied_output:
        want["output.weight"] = (cfg.vocab_size, cfg.hidden)
    if cfg.family.rope_freqs and gg.has("rope_freqs.weight"):
        want["rope_freqs.weight"] = (1, cfg.head_dim // 2)
    for i in range(cfg.layers):
        p = f"blk.{i}."
        want.update({p + "attn_norm.weight": (1, cfg.hidden), p + "ffn_norm.weight": (1, cfg.hidden)})
        if cfg.family.post_norms:
            want.update({p + "post_attention_norm.weight": (1, cfg.hidden),
                         p + "post_ffw_norm.weight": (1, cfg.hidden)})
        if cfg.family.qk_norm:
            want.update({p + "attn_q_norm.weight": (1, cfg.head_dim), p + "attn_k_norm.weight": (1, cfg.head_dim)})
        for t, n in PROJECTIONS.items():
            shape = cfg.projection_shape(t)
            want[p + n + ".weight"] = shape
            if t in cfg.biases:
                want[p + n + ".bias"] = (1, shape[0])
    for name, shape in want.items():
        got = gg.weight(name).shape
        if got != shape:
            raise UserError(f"{gg.path}: tensor '{name}' has shape {got}, the {cfg.arch} metadata implies {shape}")
    extra = [n for n in gg.tensor_names if n not in want]
    if extra:
        more = f" (+{len(extra) - 3} more)" if len(extra) > 3 else ""
        raise UserError(f"{gg.path}: tensor(s) {', '.join(extra[:3])}{more} are not part of a {cfg.arch} model as "
                        "Fucina reads it (which biases a file has must be the same in every layer)")
