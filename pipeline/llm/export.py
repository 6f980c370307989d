"""Export a LoRA fine-tune: merge into a dense GGUF, write a llama.cpp adapter GGUF, or a PEFT directory.

Trade-off: merging is allowed only into a dense (F32/F16/BF16) base, and
quantization is a separate pass afterwards (`gguf_write.transcode`). A merge
into a quantized base would have to dequantize -> add -> re-encode, which
stacks a second quantization error on the first; refusing it keeps exactly
one quantization in the artifact's history, at the price of a two-command
recipe. The adapter GGUF and PEFT exports never touch the base weights at
all: they are the small, composable form of the same fine-tune.

Names: the trainer saves `layers.<i>.<target>.lora_{a,b}` with A [rank, in]
and B [out, rank]; the GGUF weight is `blk.<i>.<tensor>.weight`, row-major
[out, in]; the merge adds (alpha / rank) * B @ A. Alpha is NOT in the adapter
file: it comes from --alpha or the checkpoint's trainer_state.json
(`config.lora.alpha`, as `fucina finetune` records it, else `config.lora_alpha`).
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType
from gguf.gguf_writer import GGUFValue

from pipeline.errors import CheckpointError, UserError
from pipeline.models.decoder import PROJECTIONS as GGUF_TENSOR
from pipeline.runtime.ckpt import latest_checkpoint, read_state
from pipeline.train.state_dict import atomic_write_bytes, read_safetensors, save_state_dict
from pipeline.untrusted import brief

from .gguf_write import DENSE, GGUFTensor, dense_values, encode, read_gguf, write_gguf

ADAPTER_FILE = "adapters.safetensors"
_NAME = re.compile(r"^layers\.(\d{1,9})\.([a-z]+)\.lora_([ab])$")  # bounded: int() refuses 4300+ digits

QUANTIZED_BASE_REFUSAL = (
    "merging into a quantized base would dequantize -> merge -> re-encode and compound the quantization error, "
    "so it is refused unless you ask for it with --dequantize (each merged weight is re-quantized to its own "
    "type and the measured cost is printed), or serve it unmerged with `fucina generate --lora RUN_DIR`. "
    "Best: merge into the dense f32/f16/bf16 base the adapters were trained against, then quantize "
    "the result in a second pass:\n"
    "  fucina export-gguf --from-gguf BASE-f16.gguf --adapters RUN_DIR --out merged-f16.gguf\n"
    "  fucina export-gguf --from-gguf merged-f16.gguf --dtype q4_k --out merged-q4_k.gguf")


@dataclass
class AdapterPair:
    layer: int
    target: str
    a: np.ndarray  # [rank, in] float32
    b: np.ndarray  # [out, rank] float32

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def gguf_name(self) -> str:
        return f"blk.{self.layer}.{GGUF_TENSOR[self.target]}.weight"

    @property
    def trainer_name(self) -> str:
        return f"layers.{self.layer}.{self.target}"


@dataclass
class Adapters:
    """The adapter pairs of one checkpoint directory plus what its sentinel says."""
    directory: Path
    pairs: list[AdapterPair]
    config: dict

    @property
    def rank(self) -> int:
        return self.pairs[0].rank

    @property
    def targets(self) -> list[str]:
        return sorted({p.target for p in self.pairs}, key=list(GGUF_TENSOR).index)

    @property
    def arch(self) -> str:
        """The architecture the adapters were trained on (config.lora.arch; checkpoints older than
        the field come from the time only qwen3 was supported)."""
        lora = self.config.get("lora") if isinstance(self.config.get("lora"), dict) else {}
        return str(lora.get("arch", "qwen3"))


def load_adapters(directory) -> Adapters:
    """Read `directory/adapters.safetensors`; the directory must be a committed checkpoint."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"--adapters {directory}: not a directory (pass the fine-tune's checkpoint directory)")
    try:
        state = read_state(directory)
    except CheckpointError as e:
        latest = latest_checkpoint(directory)
        hint = f"; its latest committed periodic save is {latest}" if latest else ""
        raise CheckpointError(f"{e}{hint}") from None
    path = directory / ADAPTER_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {ADAPTER_FILE} (is this a LoRA fine-tune checkpoint?)")
    tensors, _ = read_safetensors(path)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        m = _NAME.match(name)
        if not m or m.group(2) not in GGUF_TENSOR:
            raise UserError(f"{path}: tensor '{name}' is not an adapter name layers.<i>.<target>.lora_{{a,b}} "
                            f"with target in {'/'.join(GGUF_TENSOR)}")
        if value.ndim != 2 or not (value.dtype.kind == "f" or value.dtype.name == "bfloat16"):
            raise UserError(f"{path}: tensor '{name}' must be a 2-D float matrix, got {value.dtype}{list(value.shape)}")
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value.astype(np.float32)
    if not halves:
        raise UserError(f"{path}: no adapter tensors")
    pairs = []
    for (layer, target), ab in sorted(halves.items()):
        where = f"{path}: layers.{layer}.{target}"
        if set(ab) != {"a", "b"}:
            raise UserError(f"{where}: lora_{'b' if 'a' in ab else 'a'} is missing (A and B come in pairs)")
        a, b = ab["a"], ab["b"]
        if a.shape[0] != b.shape[1]:
            raise UserError(f"{where}: rank mismatch, lora_a {list(a.shape)} is [rank, in] and "
                            f"lora_b {list(b.shape)} is [out, rank]")
        pairs.append(AdapterPair(layer, target, a, b))
    ranks = sorted({p.rank for p in pairs})
    if len(ranks) != 1:
        raise UserError(f"{path}: adapters have different ranks {ranks}; one rank per checkpoint is supported")
    return Adapters(directory, pairs, state.config)


def resolve_alpha(alpha, adapters: Adapters) -> float:
    """--alpha if given, else the training alpha recorded in trainer_state.json; positive and finite."""
    source = "--alpha"
    if alpha is None:
        cfg, where = adapters.config, adapters.directory / "trainer_state.json"
        lora = cfg.get("lora") if isinstance(cfg.get("lora"), dict) else {}
        if "alpha" in lora:  # what `fucina finetune` records
            alpha, source = lora["alpha"], f"{where}: config.lora.alpha"
        elif "lora_alpha" in cfg:
            alpha, source = cfg["lora_alpha"], f"{where}: config.lora_alpha"
        else:
            raise UserError(f"{adapters.directory}: the training alpha is not recorded in trainer_state.json "
                            "(and the adapter file never stores it); pass --alpha with the training-time value "
                            "(fucina finetune's default is 16)")
    if isinstance(alpha, str):
        try:
            alpha = float(alpha)
        except ValueError:
            raise UserError(f"{source}: alpha must be a number, got {alpha!r}") from None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise UserError(f"{source}: alpha must be a number, got {type(alpha).__name__} {alpha!r}")
    too_big = isinstance(alpha, int) and abs(alpha) > sys.float_info.max  # math.isfinite would raise OverflowError
    if too_big or not math.isfinite(alpha) or alpha <= 0:
        raise UserError(f"{source}: alpha must be a positive finite number, got {brief(alpha)}")
    return float(alpha)


def _match(adapters: Adapters, base, base_path) -> dict[str, AdapterPair]:
    """Map every adapter pair onto a base tensor, checking names and [out, in] shapes."""
    matched = {}
    missing = []
    for p in adapters.pairs:
        t = base.tensor(p.gguf_name)
        if t is None:
            missing.append(f"{p.trainer_name} -> {p.gguf_name}")
            continue
        want = (p.b.shape[0], p.a.shape[1])
        if tuple(t.shape) != want:
            raise UserError(f"{base_path}: tensor '{p.gguf_name}' is [out, in] = {list(t.shape)} but adapter "
                            f"{p.trainer_name} is B{list(p.b.shape)} @ A{list(p.a.shape)} = {list(want)}; "
                            "were the adapters trained on another model?")
        matched[p.gguf_name] = p
    if missing:
        head = ", ".join(missing[:4]) + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "")
        what = "none of the adapters match" if not matched else f"{len(missing)} adapter(s) match no tensor"
        raise UserError(f"{base_path}: {what} a tensor of this model: {head}; "
                        "is it the base the adapters were trained on?")
    return matched


ENCODABLE = (QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def _merge_plan(base, dtype):
    """{tensor name: output type} for a --dequantize merge: each tensor keeps its stored type, or with --dtype
    every matrix weight takes the target (llama-quantize's mix for q4_k_m / q5_k_m) where its rows fit."""
    from gguf.constants import GGML_QUANT_SIZES

    from .gguf_write import TARGETS, _block_count, is_matrix_weight
    from .quant_mix import MIXES, mix_types
    if dtype is None:
        return {t.name: t.qtype for t in base.tensors}
    target = TARGETS[dtype]
    mix = {}
    if dtype in MIXES:
        matrices = [(t.name, t.shape[-1]) for t in base.tensors if is_matrix_weight(t)]
        mix = mix_types(matrices, dtype, _block_count(base))
    plan = {}
    for t in base.tensors:
        new = mix.get(t.name, (target, ""))[0] if is_matrix_weight(t) else t.qtype
        plan[t.name] = new if t.shape[-1] % GGML_QUANT_SIZES[new][0] == 0 else t.qtype
    return plan


def merge(base_path, adapters: Adapters, alpha: float, out_path, dequantize: bool = False,
          dtype: str | None = None) -> list[str]:
    """Write base + (alpha/rank) * B @ A for every adapter pair to `out_path`; returns the merged tensor names.

    Every merged tensor keeps its stored type (F32 stays F32; F16/BF16 are
    widened, merged in float32 and rounded back once). Everything else is
    re-emitted verbatim. A quantized base weight is refused unless `dequantize`:
    then it is dequantized, merged in float32 and re-quantized to its own type with
    the byte-exact llama.cpp encoders (the file keeps its mix); `dtype` (with
    `dequantize`) re-encodes every matrix weight to that type instead.
    """
    from .gguf_write import FILE_TYPES, QUANTIZATION_VERSION, TARGETS, set_value
    base = read_gguf(base_path)
    matched = _match(adapters, base, base_path)
    quantized = [f"{n} ({base.tensor(n).qtype.name})" for n in matched if base.tensor(n).qtype not in DENSE]
    if quantized and not dequantize:
        raise UserError(f"{base_path}: quantized base weights {', '.join(quantized[:3])}: {QUANTIZED_BASE_REFUSAL}")
    if dtype is not None and not dequantize:
        raise UserError("merge and --dtype are separate passes by design (one quantization in the file's history); "
                        "--dequantize allows both in one pass")
    dtype = dtype.lower() if dtype else None
    if dtype is not None and dtype not in TARGETS:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(TARGETS)}")
    plan = _merge_plan(base, dtype)
    bad = [f"{t.name} ({plan[t.name].name})" for t in base.tensors
           if plan[t.name] not in ENCODABLE and (t.name in matched or plan[t.name] != t.qtype)]
    if bad:
        raise UserError(f"{base_path}: no byte-exact encoder for {', '.join(bad[:3])}"
                        f"{f' (+{len(bad) - 3} more)' if len(bad) > 3 else ''}; pass --dtype with one of "
                        f"{', '.join(n for n, q in TARGETS.items() if q in ENCODABLE)} to re-encode the merged "
                        "weights to it")
    tensors = []
    for t in base.tensors:
        p, new = matched.get(t.name), plan[t.name]
        if p is not None or new != t.qtype:
            values = dense_values(t)
            if p is not None:
                values = values + (p.b @ p.a) * np.float32(alpha / p.rank)
            t = GGUFTensor(t.name, new, t.shape, encode(values, new))
        tensors.append(t)
    metadata = dict(base.metadata)
    if dtype is not None:
        set_value(metadata, "general.file_type", int(FILE_TYPES[dtype]), GGUFValueType.UINT32)
        if TARGETS[dtype] not in DENSE:
            set_value(metadata, "general.quantization_version", QUANTIZATION_VERSION, GGUFValueType.UINT32)
    write_gguf(out_path, metadata, tensors, base.alignment)
    return list(matched)


HELD_OUT_PROMPTS = ("What is the capital of France?", "Write one sentence about the sea.",
                    "List three prime numbers.", "Explain what a compiler does.")


def merge_cost(base_path, adapters: Adapters, alpha: float, merged_path, prompts=HELD_OUT_PROMPTS) -> dict:
    """What re-quantizing the merge cost: KL(base+adapter || merged) of the next-token distributions at every
    position of a few prompts (chat-templated when the model has a template; token ids when it has no
    tokenizer), the reference being the base served with the adapters unmerged (pipeline/llm/lora_serve.py)."""
    from .generate import LoadedModel
    from .lora_serve import ServedPair, apply_lora
    ref, merged = LoadedModel(base_path), LoadedModel(merged_path)
    apply_lora(ref.model, [ServedPair(p.layer, p.target, p.a, p.b, alpha / p.rank) for p in adapters.pairs])
    kls, agree, n = [], 0, 0
    for i, text in enumerate(prompts):
        if ref.tokenizer is None:
            ids = [(7 * i + 13 * j + 1) % ref.model.config.vocab_size for j in range(12)]
        else:
            try:
                ids = ref.encode_prompt(text, chat=True)
            except UserError:
                ids = ref.encode_prompt(text)
        lp, lq = (log_softmax(m.model.infer(np.asarray(ids), all_logits=True)) for m in (ref, merged))
        kls.extend((np.exp(lp) * (lp - lq)).sum(-1).tolist())
        agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
        n += len(ids)
    return {"kl_mean": float(np.mean(kls)), "kl_max": float(np.max(kls)), "top1_agree": agree / n,
            "positions": n, "prompts": len(prompts)}


def log_softmax(logits) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def write_lora_gguf(adapters: Adapters, alpha: float, base_path, out_path) -> Path:
    """A llama.cpp LoRA adapter GGUF: general.type adapter, adapter.type lora, adapter.lora.alpha,
    tensors `<base weight>.lora_a` [rank, in] and `.lora_b` [out, rank] (numpy order), float32.

    The base is read only to check names/shapes and copy its architecture
    (llama.cpp refuses an adapter whose architecture differs from the model's)."""
    base = read_gguf(base_path)
    matched = _match(adapters, base, base_path)
    arch = base.metadata.get("general.architecture")
    if arch is None:
        raise UserError(f"{base_path}: metadata key 'general.architecture' is missing")
    metadata = {
        "general.architecture": arch,
        "general.type": GGUFValue("adapter", GGUFValueType.STRING),
        "adapter.type": GGUFValue("lora", GGUFValueType.STRING),
        "adapter.lora.alpha": GGUFValue(float(alpha), GGUFValueType.FLOAT32),
    }
    tensors = []
    for name, p in matched.items():
        for suffix, value in (("lora_a", p.a), ("lora_b", p.b)):
            value = np.ascontiguousarray(value, np.float32)
            tensors.append(GGUFTensor(f"{name}.{suffix}", QT.F32, value.shape, value.view(np.uint8)))
    return write_gguf(out_path, metadata, tensors)


def write_peft(adapters: Adapters, alpha: float, out_dir, base_model: str = "") -> Path:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) named by the Hugging Face
    modules of the adapters' architecture (pipeline.models.registry)."""
    from pipeline.models.registry import family
    where = adapters.directory / "trainer_state.json"
    fam = family(adapters.arch, f"{where}: config.lora.arch")
    modules = dict(fam.hf_modules)
    lora = adapters.config.get("lora") if isinstance(adapters.config.get("lora"), dict) else {}
    heads, kv_heads = lora.get("heads"), lora.get("kv_heads")
    if fam.rope == "normal" and not (isinstance(heads, int) and isinstance(kv_heads, int)):
        raise UserError(f"{where}: config.lora.heads / kv_heads are missing; a {fam.name} model's q/k adapters "
                        "need them to be reordered into Hugging Face rows (re-save the run with this version)")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir}: exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for p in adapters.pairs:
        prefix = f"base_model.model.model.layers.{p.layer}.{modules[p.target]}"
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(p.a, np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(fam.hf_rows(p.target, p.b, heads, kv_heads),
                                                                  np.float32)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": adapters.rank,
        "lora_alpha": alpha,
        "lora_dropout": float((adapters.config.get("lora") or {}).get("dropout", 0.0) or 0.0),
        "target_modules": [modules[t].split(".")[1] for t in adapters.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    # safetensors first, config last: a directory with a config is complete
    save_state_dict(out_dir / "adapter_model.safetensors", tensors, metadata={"format": "pt"})
    atomic_write_bytes(out_dir / "adapter_config.json", (json.dumps(config, indent=2) + "\n").encode("utf-8"))
    return out_dir
