"""Held-out evaluation of a model (plus LoRA adapters or an ES checkpoint) on a verifiable reward.

Every item is answered GREEDILY (temperature 0, ties to the lowest id) through
the KV-cache decoder, the same lock-step decoder an ES member's generation
reward uses (pipeline/es/batched.py), so an evaluation scores exactly what ES
optimised. An item's answer does not depend on which other items share its
pass (every decode row is computed alone; tested), so the per-item rewards,
and so the mean, are the same bits on 1 process or W: the command splits the
items into W contiguous shards and concatenates the shards' rewards in item
order. The model and its adapters are built by pipeline/finetune/build.eval_model.

Reported: the mean reward with its standard error (sample std, ddof 1, over
sqrt(n)) and the solved fraction (reward >= 1.0, the "accuracy" of a 0/1 or
Countdown reward) with its binomial standard error sqrt(p(1-p)/n).
"""
from __future__ import annotations

import math
import numpy as np

from ..errors import UserError


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
