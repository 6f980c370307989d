"""Held-out evaluation of a model (plus LoRA adapters or an ES checkpoint) on a verifiable reward.

Every item is answered GREEDILY (temperature 0, ties to the lowest id) through
the KV-cache decoder, the same lock-step decoder an ES member's generation
reward uses (pipeline/es/batched.py), so an evaluation scores exactly what ES
optimised. An item's answer does not depend on which other items share its
pass (every decode row is computed alone; tested), so the per-item rewards,
and so the mean, are the same bits on 1 process or W: the command splits the
items into W contiguous shards and concatenates the shards' rewards in item
order.

Reported: the mean reward with its standard error (sample std, ddof 1, over
sqrt(n)) and the solved fraction (reward >= 1.0, the "accuracy" of a 0/1 or
Countdown reward) with its binomial standard error sqrt(p(1-p)/n).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..errors import UserError


def adapted_trainer(model, lora_dir=None, source="the model"):
    """A LoraModel over `model` carrying the adapters of `lora_dir` (an es-finetune / finetune checkpoint or run
    directory: its latest committed checkpoint), or, with none, zero adapters (B = 0: the base model's answers).

    An es-finetune `--search full` checkpoint (model.safetensors: the searched matrices under their GGUF names)
    is loaded into private writable copies of those matrices instead (pipeline/es/full.py)."""
    from ..finetune.model import LoraModel
    if lora_dir is None:
        return LoraModel(model, targets=("q",), rank=1, seed=0)
    from ..runtime.ckpt import load_checkpoint, read_state, resolve, tensors_of
    ckpt = Path(resolve(lora_dir))
    state = read_state(ckpt)
    if state.config.get("es_search") == "full":
        from .full import writable_dense_weights
        trainer = LoraModel(model, targets=("q",), rank=1, seed=0)
        arrays = writable_dense_weights(trainer, dequantize=True, source=source)
        load_checkpoint(ckpt, model=tensors_of(arrays))
        return trainer
    from ..llm.export import load_adapters, resolve_alpha
    adapters = load_adapters(ckpt)
    trainer = LoraModel(model, targets=tuple(adapters.targets), rank=adapters.rank,
                      alpha=resolve_alpha(None, adapters), seed=0)
    tensors = {}
    for pair in adapters.pairs:
        tensors[f"{pair.trainer_name}.lora_a"] = pair.a
        tensors[f"{pair.trainer_name}.lora_b"] = pair.b
    trainer.load_adapter_tensors(tensors, source=f"--lora {ckpt}")
    return trainer


def item_rewards(trainer, decode, items, reward, max_new_tokens: int, stop_ids, batch: int = 8,
                 start: int = 0, progress=None) -> list[float]:
    """reward(prompt, greedy answer, reference, sample index) of every item, `batch` items per decode pass.

    decode(ids) -> text is the tokenizer's; `start` is the index of items[0] in the whole set (error messages
    name the sample by it)."""
    from .batched import member_generations
    out = []
    for lo in range(0, len(items), batch):
        chunk = items[lo:lo + batch]
        [answers] = member_generations(trainer, {}, 1, [it.prompt_ids for it in chunk], max_new_tokens, stop_ids)
        for j, (item, ids) in enumerate(zip(chunk, answers)):
            out.append(float(reward(item.prompt, decode(ids), item.reference, start + lo + j)))
        if progress is not None:
            progress(len(out), len(items))
    return out


def summarize(rewards) -> dict:
    """Mean reward and solved fraction with their standard errors (module docstring)."""
    r = np.asarray(rewards, dtype=np.float64)
    n = int(r.size)
    if n == 0:
        raise UserError("eval: no items to score")
    mean = float(r.mean())
    se = float(r.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    solved = int((r >= 1.0).sum())
    acc = solved / n
    return {"n": n, "mean_reward": mean, "mean_reward_se": se, "solved": solved, "accuracy": acc,
            "accuracy_se": math.sqrt(acc * (1.0 - acc) / n)}


def shards(n: int, workers: int) -> list[tuple[int, int]]:
    """[start, stop) of W contiguous shards covering range(n), sizes differing by at most one."""
    base, extra = divmod(n, workers)
    out, lo = [], 0
    for w in range(workers):
        hi = lo + base + (1 if w < extra else 0)
        out.append((lo, hi))
        lo = hi
    return [s for s in out if s[1] > s[0]]
