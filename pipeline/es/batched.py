"""The population as one batch: k members score the same samples in one pass through the frozen weights.

Member m's rows carry m's adapters. Each frozen weight is read (and, quantized,
dequantized) ONCE per pass for all k members: the tiled product of
kernels/qgemm.py is re-driven here so that every tile, once dequantized into
its buffer, is multiplied by each member's T rows in turn, with exactly the
BLAS call (shape, operand layout) the member alone would have made. That is
the price of bit-identity: OpenBLAS's per-row results depend on how many rows
a call has (measured: x[:n] @ W.T differs from the first n rows of x @ W.T at
every shape we tried), so one GEMM over all k x T rows would give different
bits from scoring a member alone. Then each member's LoRA delta
scale * (x_m @ A_m.T) @ B_m.T is added to its own rows. Norms, RoPE,
attention (one GEMM per (batch, kv head)) and SwiGLU are per row or per batch
entry, and each member's loss is taken on its own slice as `batch_loss` takes
it, so a member's reward has the same bits as scoring it alone with its
perturbation applied in place (tested bitwise for several batch splits and
worker counts). What the batch saves: the dequantization of every tile (k
times -> once), the weight streaming from memory, and the per-call Python and
graph overhead of the block.

This is the trainer's forward re-driven with a per-member projection: it
reads the Trainer's frozen constants (its embedding, projections, head) and
runs the model's own `block`, so there is one definition of the model. Paths
the tiled product does not take alone (a few rows: the fused matvec; dense
f32 arrays; llama-numerics rounding) are computed member by member with the
trainer's own call, so they stay bit-identical too.
"""
from __future__ import annotations

import numpy as np

from ..autograd import ops
from ..autograd.losses import linear_cross_entropy
from ..autograd.tensor import Tensor, no_grad
from ..errors import UserError
from kernels import dequant, qgemm
from kernels.blas import gemm
from kernels.workpool import run_tiles
from ..llm.finetune import adapted_linears
from ..llm.lora import lora_forward
from ..llm.quants import FrozenWeight


def _member_factors(trainer, stacked: dict, k: int):
    """Per layer {target: (A [k, r, in], B [k, out, r])}: searched factors from `stacked`, the rest broadcast."""
    factors = []
    for i, layer in enumerate(trainer.layers):
        per = {}
        for t, ad in layer.items():
            a = stacked.get(f"layers.{i}.{t}.lora_a")
            b = stacked.get(f"layers.{i}.{t}.lora_b")
            per[t] = (np.broadcast_to(ad.lora_a.data, (k,) + ad.lora_a.shape) if a is None else a,
                      np.broadcast_to(ad.lora_b.data, (k,) + ad.lora_b.shape) if b is None else b, ad.scale)
        factors.append(per)
    return factors


def _tiled_many_members(ws, x3: np.ndarray) -> list:
    """[x_m @ W.T for every member m, stacked to [k, T, out]] for frozen weights ws sharing the input x3 [k, T, in]:
    each tile of W dequantized once, then multiplied per member exactly as qgemm.matmul_t_many does for one."""
    k, n, n_in = x3.shape
    transposed = n < qgemm.TRANSPOSE_BELOW_ROWS
    xs = [np.ascontiguousarray(x3[m].T) if transposed else np.ascontiguousarray(x3[m]) for m in range(k)]
    tiles, outs = [], []
    for w in ws:
        qtype, (n_out, _) = int(w.weight.format.qtype), w.weight.shape
        raw = (np.ascontiguousarray(w.weight.raw, dtype=np.float32) if qtype == qgemm.F32
               else qgemm._check_raw(qtype, w.weight.raw, w.weight.shape))
        out = np.empty((k, n, n_out), np.float32)
        rows = qgemm.row_tile(w.weight.shape)
        tiles += [(qtype, raw, r0, min(n_out, r0 + rows), out) for r0 in range(0, n_out, rows)]
        outs.append(out)

    def tile(i):
        qtype, raw, r0, r1, out = tiles[i]
        if qtype == qgemm.F32:
            wt = raw[r0:r1]
        else:
            kernel, unit, _ = dequant.TILE_KERNELS[qtype]
            wt = qgemm._buffer((r1 - r0) * n_in).reshape(r1 - r0, n_in)
            kernel(raw[r0:r1], wt, dequant.HALF_TO_FLOAT, 0, -(-n_in // unit))
        for m in range(k):  # the one-member call, once per member, on the tile dequantized once
            if transposed:
                out[m, :, r0:r1] = gemm(wt, xs[m], qgemm._buffer((r1 - r0) * n, "product").reshape(r1 - r0, -1)).T
            else:
                gemm(xs[m], wt.T, out[m, :, r0:r1])

    run_tiles(len(tiles), tile)
    return outs


def frozen_products(ws, x3: np.ndarray) -> list:
    """[k, T, out] arrays: each member's frozen product x_m @ W.T (+ bias), the bits of the trainer's own call."""
    k, n = x3.shape[:2]
    if n > FrozenWeight.FUSED_MAX_ROWS and all(
            w._dense is None and isinstance(w.weight, FrozenWeight) and not w.weight.llama_numerics for w in ws):
        ys = _tiled_many_members(ws, x3)
        for w, y in zip(ws, ys):
            if w.bias is not None:
                y += w.bias
        return ys
    per_member = [[y.data for y in adapted_linears(Tensor(x3[m][None]), ws)] for m in range(k)]
    return [np.concatenate([p[j] for p in per_member]) for j in range(len(ws))]


def member_nll_rewards(trainer, stacked: dict, samples) -> list[float]:
    """-token-weighted mean CE of `samples` for each of k members; stacked: {adapter name: (k, *shape)}."""
    k = len(next(iter(stacked.values())))
    c = trainer.config
    factors = _member_factors(trainer, stacked, k)
    totals, valid = [0.0] * k, 0
    with no_grad():
        for s in samples:
            tokens = np.asarray(s.inputs, dtype=np.int64)
            n = tokens.size
            pos = np.arange(n)

            def project(i, targets, x):
                x3 = np.ascontiguousarray(x.data, dtype=np.float32).reshape(k, n, -1)
                ys = frozen_products([trainer._layers[i][t] for t in targets], x3)
                for t, y in zip(targets, ys):
                    if t in factors[i]:
                        a, b, scale = factors[i][t]
                        for m in range(k):
                            y[m] += lora_forward(x3[m], a[m], b[m], scale)[0]  # the bits of the trainer's y + d
                return [Tensor(y) for y in ys]

            row = trainer._embed.rows(tokens).reshape(1, n, c.hidden)
            h = Tensor(np.ascontiguousarray(np.broadcast_to(row, (k, n, c.hidden))))
            for i in range(c.layers):
                h = trainer._base.block(i, h, pos, project)
            head = trainer._head.dense()
            labels = np.asarray(s.labels, dtype=np.int64)
            for m in range(k):
                hm = ops.rms_norm(Tensor(h.data[m]), trainer._out_norm, c.rms_eps)
                loss = linear_cross_entropy(hm, head, labels, ignore_index=trainer.ignore_index, reduction="sum")
                totals[m] += float(loss.item())
            valid += s.n_valid
    if valid == 0:
        raise UserError("the batch has no supervised token")
    return [-t / valid for t in totals]


def chunked_rewards(trainer, stacked: dict, samples, member_batch: int) -> list[float]:
    """member_nll_rewards over consecutive chunks of member_batch members (the chunking changes no bit)."""
    n = len(next(iter(stacked.values())))
    rewards = []
    for start in range(0, n, member_batch):
        rewards += member_nll_rewards(trainer, {name: v[start:start + member_batch] for name, v in stacked.items()},
                                      samples)
    return rewards
