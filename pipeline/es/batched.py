"""The population as one batch: k members score the same samples in one pass through the frozen weights.

Member m's rows carry m's adapters. Each frozen weight is read (and, quantized,
dequantized) ONCE per pass for all k members (pipeline/llm/quants.py's
matmul_t_groups): every tile, once dequantized, is multiplied by all members'
rows in one BLAS call where a once-per-shape probe shows BLAS gives each
member's rows the bits of its own call (OpenBLAS's general GEMM path), else by
each member's rows with exactly the call the member alone would have made (its
small-matrix kernels sum in another order); the fused decode matvec computes
every row alone anyway. Then each member's LoRA delta
scale * (x_m @ A_m.T) @ B_m.T is added to its own rows, all members' deltas in two
stacked np.matmul calls (llm.lora.lora_forward_stacked: per entry the 2-D product's BLAS call). Everything else is per
row or per batch entry, so a member's reward has the same bits as scoring it
alone with its perturbation applied in place (tested bitwise for several batch
splits and worker counts). What the batch saves: the dequantization of every
tile (k times -> once), the weight streaming from memory, the per-member BLAS
calls where the probe allows, and the per-call Python and graph overhead.

Two rewards, two forwards, one definition of the model each:
  * NLL (teacher-forced): the LoraModel's own forward (`LoraModel.block`, its
    embedding and head) on a [k, T, hidden] batch with a per-member projection;
  * generation: the KV-cache decoder's `infer_rows` (members x prompts rows,
    each with its own cache) through `llm.generate.greedy_rows`, members in
    lock-step, with each row's member delta added by its adapt hook. One member
    alone is the same call with k = 1, so batched and one-by-one decoding are
    one mechanism.
"""
from __future__ import annotations

import numpy as np

from ..autograd.losses import cross_entropy
from ..autograd.tensor import Tensor, no_grad
from ..errors import UserError
from ..finetune.model import TARGETS, adapted_linears
from ..llm.generate import greedy_rows
from ..llm.lora import lora_forward_stacked
from ..llm.quants import FrozenWeight, matmul_t_groups
from ..kernels.nn import matmul_nt_each


NOISE_IN, NOISE_OUT = "noise_bt", "noise_a"  # stacked names of --search lowrank's factors (pipeline/es/lowrank.py)


def member_factors(trainer, stacked: dict, k: int) -> list:
    """Per layer {target: [(a [k, r, in], b [k, out, r], scale), ...]}, the terms lora_forward_stacked adds to a
    member's rows: the LoRA adapter (searched factors from `stacked`, else the trainer's own live arrays broadcast
    to the k members), then, with --search lowrank, the member's low-rank noise term
    (`layers.<i>.<t>.noise_bt` / `.noise_a`, sign and sigma / sqrt(r) carried by noise_a)."""
    factors = []
    for i, layer in enumerate(trainer.layers):
        per = {}
        for t, ad in layer.items():
            a = stacked.get(f"layers.{i}.{t}.lora_a")
            b = stacked.get(f"layers.{i}.{t}.lora_b")
            per[t] = [(np.broadcast_to(ad.lora_a.data, (k,) + ad.lora_a.shape) if a is None else a,
                       np.broadcast_to(ad.lora_b.data, (k,) + ad.lora_b.shape) if b is None else b, ad.scale)]
        for t in TARGETS:
            bt = stacked.get(f"layers.{i}.{t}.{NOISE_IN}")
            if bt is not None:
                per.setdefault(t, []).append((bt, stacked[f"layers.{i}.{t}.{NOISE_OUT}"], 1.0))
        factors.append(per)
    return factors


def frozen_products(ws, x3: np.ndarray) -> list:
    """[k, T, out] arrays: each member's frozen product x_m @ W.T (+ bias), the bits of the trainer's own call."""
    k = x3.shape[0]
    if all(w._dense is None and isinstance(w.weight, FrozenWeight) for w in ws):
        ys = matmul_t_groups([w.weight for w in ws], x3)
        for w, y in zip(ws, ys):
            if w.bias is not None:
                y += w.bias
        return ys
    per_member = [[y.data for y in adapted_linears(Tensor(x3[m][None]), ws)] for m in range(k)]
    return [np.concatenate([p[j] for p in per_member]) for j in range(len(ws))]


def member_head_sums(trainer, hs: list, labels) -> list[float]:
    """[float(trainer.head_loss(Tensor(h), labels, "sum")) for h in hs], the bits of each call, with the head's
    products shared through head_loss's own steps (linear_cross_entropy in no-grad: only the supervised rows
    enter the product, cross_entropy's serial float32 sum; the ignored rows it scatters back add exact zeros)."""
    flat = np.asarray(labels).astype(np.int64).reshape(-1)
    rows = np.flatnonzero(flat != trainer.ignore_index)
    w = trainer._head.dense()
    if not rows.size or w.dtype != np.float32 or hs[0].dtype != np.float32:
        return [float(trainer.head_loss(Tensor(h), labels, "sum").item()) for h in hs]
    xs = [np.ascontiguousarray(h.reshape(-1, w.shape[1])[rows]) for h in hs]
    return [float(cross_entropy(Tensor(logits), flat[rows], trainer.ignore_index, "sum").item())
            for logits in matmul_nt_each(xs, w)]


def member_nll_rewards(trainer, stacked: dict, samples) -> list[float]:
    """-token-weighted mean CE of `samples` for each of k members; stacked: {adapter name: (k, *shape)}."""
    k = len(next(iter(stacked.values())))
    c = trainer.config
    factors = member_factors(trainer, stacked, k)
    totals, valid = [0.0] * k, 0
    with no_grad():
        for s in samples:
            tokens = np.asarray(s.inputs, dtype=np.int64)
            n = tokens.size
            pos = np.arange(n)

            def project(i, targets, x):
                x3 = np.ascontiguousarray(x.data, dtype=np.float32).reshape(k, n, -1)
                ys = frozen_products([trainer.frozen(i, t) for t in targets], x3)
                for t, y in zip(targets, ys):
                    for a, b, scale in factors[i].get(t, ()):
                        y += lora_forward_stacked(x3, a, b, scale)  # member m: the bits of the trainer's y + d
                return [Tensor(y) for y in ys]

            h = trainer.embedded(tokens, rows=k)
            for i in range(c.layers):
                h = trainer.block(i, h, pos, project)
            hs = [trainer.final_norm(Tensor(h.data[m])).data for m in range(k)]
            for m, total in enumerate(member_head_sums(trainer, hs, s.labels)):
                totals[m] += total
            valid += s.n_valid
    if valid == 0:
        raise UserError("the batch has no supervised token")
    return [-t / valid for t in totals]


def member_generations(trainer, stacked: dict, k: int, prompts, max_new_tokens: int, stop_ids=()) -> list:
    """[member][prompt] greedy token ids (the stop excluded) of k members decoding every prompt in lock-step:
    row m * len(prompts) + p is member m on prompt p; stacked {} = the trainer's live adapters (k = 1)."""
    factors = member_factors(trainer, stacked, k)
    n_prompts = len(prompts)

    every_row = list(range(k * n_prompts))

    def adapt(rows, layer, target, x3, y3):
        for a, b, scale in factors[layer].get(target, ()):
            if rows == every_row:  # members' rows in order: broadcast each member's factors over its prompts
                shape = (k, n_prompts) + x3.shape[1:]
                d = lora_forward_stacked(x3.reshape(shape), a[:, None], b[:, None], scale).reshape(y3.shape)
            else:  # a subset (rows stopped, or prompts of another length): each row's member's factors
                members = np.asarray(rows) // n_prompts
                d = lora_forward_stacked(x3, a[members], b[members], scale)
            y3 += d  # row j: the bits of lora_forward(x3[j], a[m], b[m]) added to its product, as alone

    with no_grad():
        rows = greedy_rows(trainer.model, [p for _ in range(k) for p in prompts], max_new_tokens, stop_ids, adapt)
    rows = [r[:-1] if r and r[-1] in stop_ids else r for r in rows]
    return [rows[m * n_prompts:(m + 1) * n_prompts] for m in range(k)]


def chunked(score_chunk, stacked: dict, member_batch: int) -> list[float]:
    """score_chunk over consecutive chunks of member_batch members' rows (the chunking changes no bit)."""
    n = len(next(iter(stacked.values())))
    rewards = []
    for start in range(0, n, member_batch):
        rewards += score_chunk({name: v[start:start + member_batch] for name, v in stacked.items()})
    return rewards
