"""`--search lowrank`: EGGROLL-style low-rank perturbations of the frozen projection matrices.

After Sarkar et al. 2025, "Evolution Strategies at the Hyperscale". Member m perturbs every searched matrix
W [out, in] (slot s) by sign_m * sigma * E_d, d = the member's draw (pipeline/es/noise.py: antithetic pairs
share d with signs +/-):

    E_d = A_d @ B_d.T / sqrt(r)        A_d [out, r], B_d [in, r]
    values 0 .. out*r-1 of the stream key (seed, iteration, d, s) are A_d row-major, the next in*r are B_d

(es_noise.gaussian_fill_fast: the key is every ES noise's, so the noise is a pure function of seed, iteration,
member and slot, and nothing is stored). Members are scored as one batch (pipeline/es/batched.py): x @ W.T is
the frozen product shared by all members' rows, and member m's rows add the low-rank term
(x @ B_d) @ (sign_m * f32(sigma / sqrt(r)) * A_d).T through the stacked LoRA-delta call. The update is one GEMM
per matrix, (A_1..A_D * c / sqrt(r)) @ (B_1..B_D).T = sum_d c_d E_d for the shaped coefficients c (antithetic:
c_+ - c_-), then W += f32(alpha) * that / population: the flat search's arithmetic and learning-rate semantics.

Trade-off: a member's perturbation has rank r per matrix instead of full rank, so it costs (out + in) * r
noise values and two thin products per projection instead of out * in, and the base product x @ W.T is paid
once per row for every member; the searched directions are sums of rank-r terms, so an update has rank at
most D * r. Bits: the batched forward is not bitwise the dense W + sigma * E_d (its rounding differs, within
float tolerance, tested), but it is the ONE definition of a member's score: one member alone is the same
call with k = 1, so in-process, N workers and any member batch give the same bits. The update runs under one
BLAS thread on every replica, the same bits at any thread count.
"""
from __future__ import annotations

import numpy as np

from pipeline.kernels import es_noise
from ..autograd import Tensor
from . import noise as es_streams
from .shaping import shape
from .trainer import ESConfigError, ESTrainer


class LowRankES(ESTrainer):
    """ESTrainer whose members perturb registered f32 matrices by rank-`rank` products (see above)."""

    def __init__(self, config=None, rank: int = 1, **overrides):
        super().__init__(config, **overrides)
        if not isinstance(rank, int) or rank < 1:
            raise ESConfigError(f"ES config: the low-rank noise rank must be an integer >= 1, got {rank!r}")
        self.rank = rank

    def add_param(self, param, name=None):
        arr = param.data if isinstance(param, Tensor) else param
        if getattr(arr, "ndim", 0) != 2 or arr.dtype != np.float32:
            raise ESConfigError(f"add_param {name!r}: low-rank search perturbs float32 matrices, got "
                                f"{getattr(arr, 'dtype', type(arr).__name__)} {getattr(arr, 'shape', ())}")
        return super().add_param(param, name)

    def _draws(self, keys) -> list:
        """Per draw (a row of stream keys), per slot (A [out, r], B [in, r]) float32: every draw's factors of
        every slot in ONE noise pass (es_noise.materialize of 0 + 1 * eps: the stream values themselves)."""
        r = self.rank
        sizes = np.array([(o + i) * r for o, i in (s.shape for s in self._slots)], np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        eps = np.empty((len(keys), int(sizes.sum())), np.float32)
        es_noise.materialize(keys, np.ones(len(keys), np.float32), np.zeros(eps.shape[1], np.float32), offsets,
                             sizes, eps)
        out = []
        for row in eps:
            per = []
            for slot, off in zip(self._slots, offsets):
                o, i = slot.shape
                per.append((row[off:off + o * r].reshape(o, r), row[off + o * r:off + (o + i) * r].reshape(i, r)))
            out.append(per)
        return out

    def member_factors(self, members) -> dict:
        """{slot name: (bt [k, r, in], a [k, out, r])} of members: member j's term in its rows is
        (x @ bt[j].T) @ a[j].T, a carrying sign * f32(sigma / sqrt(r))."""
        members = [int(m) for m in members]
        keys, scales = self._keys(members)
        draws = self._draws(keys)
        scale = np.float32(self.config.sigma / np.sqrt(self.rank))
        factors = {}
        for s, slot in enumerate(self._slots):
            bt = np.stack([draws[j][s][1].T for j in range(len(members))])
            a = np.stack([draws[j][s][0] * (scale if sign > 0 else -scale) for j, sign in enumerate(scales)])
            factors[slot.name] = (bt, a)
        return factors

    def dense_noise(self, member: int) -> dict:
        """{slot name: sign * sigma * E_d} of one member as dense float32 matrices (the reference the tests
        compare the batched term with; perturb/restore use it)."""
        keys, scales = self._keys([member])
        out = {}
        for slot, (a_raw, b_raw) in zip(self._slots, self._draws(keys)[0]):
            out[slot.name] = (a_raw @ b_raw.T) * np.float32(scales[0] / np.sqrt(self.rank))
        return out

    def _add_noise(self, member: int, direction: int):
        for slot, e in zip(self._slots, self.dense_noise(member).values()):
            np.add(slot.array, e if direction > 0 else -e, out=slot.array)

    def materialize_members(self, members, out=None, theta=None):
        raise ESConfigError("low-rank search scores members through member_factors, not flat rows")

    def update(self, rewards) -> dict:
        """Shape the rewards, W += f32(alpha) * (sum_d c_d E_d) / population per matrix, one GEMM each."""
        from ..kernels.workpool import single_thread_blas
        cfg = self.config
        coeffs, stats = shape(rewards, cfg.population, cfg.shaping)
        if cfg.antithetic:
            coeffs = coeffs[0::2] - coeffs[1::2]
        keys = es_streams.draw_keys(cfg.seed, self.iteration, range(len(coeffs)), len(self._slots), cfg.noise)
        c = (coeffs / np.sqrt(self.rank)).astype(np.float32)
        sq = 0.0
        draws = self._draws(keys)
        with single_thread_blas():
            for s, slot in enumerate(self._slots):
                out_dim, in_dim = slot.shape
                a_all = np.empty((out_dim, len(c) * self.rank), np.float32)
                b_all = np.empty((in_dim, len(c) * self.rank), np.float32)
                for d in range(len(c)):
                    a_raw, b_raw = draws[d][s]
                    a_all[:, d * self.rank:(d + 1) * self.rank] = a_raw * c[d]
                    b_all[:, d * self.rank:(d + 1) * self.rank] = b_raw
                delta = a_all @ b_all.T  # then alpha * (that / population) in place: no full-size temporaries
                delta /= np.float32(cfg.population)
                delta *= np.float32(cfg.alpha)
                np.add(slot.array, delta, out=slot.array)
                flat = delta.reshape(-1)
                sq += float(np.dot(flat, flat))
        if cfg.anchor_decay is not None:
            self._anchor_decay()
        self.iteration += 1
        stats["iteration"] = self.iteration
        stats["update_rms"] = float(np.sqrt(sq / self.dim)) if self.dim else 0.0
        return stats

    def state_fields(self) -> dict:
        return {**super().state_fields(), "es_noise_rank": self.rank}


def projection_slots(trainer) -> dict:
    """{(layer, target): GGUF name} of every projection matrix of the trainer's blocks (what lowrank searches):
    the attention and MLP products every member's rows pass through; the embedding and head stay frozen."""
    from ..finetune.model import TARGETS
    by_id = {id(w): name for name, w in trainer.model.named_weights().items()}
    out = {}
    for i in range(trainer.config.layers):
        for t in TARGETS:
            w = trainer.frozen(i, t).weight
            if id(w) in by_id:
                out[(i, t)] = by_id[id(w)]
    return out
