"""The ES trainer: vanilla OpenAI-ES over any registered parameters, no gradients.

    eps_n ~ N(0, I)                              n = 0..population-1, regenerated, never stored
    R_n   = reward(theta + sigma * eps_n)        forward passes only
    C_n   = shaping(R)                           z_score (default) | centered_ranks
    theta += alpha * (sum_n C_n * eps_n) / population      (no 1/sigma: folded into alpha)
    then, optionally, anchored weight decay toward a captured anchor theta_0:
        l2: theta = theta_0 + (theta - theta_0) * (1 - alpha * lambda)
        l1: theta = theta_0 + soft_threshold(theta - theta_0, alpha * lambda)

Trade-off: the algebra is the es-at-scale reference's, deliberately plain
(defaults sigma 1e-3, alpha sigma/2, population 30), with opt-in antithetic
pairs, rank shaping and anchored decay. All parameter arithmetic is float32 in
the reference's order (f32(sigma) * eps added; coefficient-weighted noise
summed in member order, divided by population, times f32(alpha), added);
f16/bf16 parameters are computed in float32 and rounded back to their dtype
after every perturb, restore and update. Coefficients and reward statistics
are float64.

Two evaluation shapes share one noise contract (pipeline/es/noise.py):
  * in place: perturb(m) -> evaluate -> restore(m); `step(evaluate)` drives it.
    restore_mode "regenerate" subtracts the regenerated noise (float drift of
    (x + t) - t), "snapshot" copies the saved values back bitwise.
  * replicas: materialize_members(ms) writes theta + sigma*eps_m rows into a
    (B, dim) float32 buffer without touching theta, for batched or
    multi-process evaluation; update(rewards) then applies the step. With
    cache_noise=True (small parameter sets) the eps rows drawn for this
    iteration are kept and the update reads them back instead of
    regenerating them: same bits, dim * 4 bytes per draw.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import ml_dtypes
import numpy as np

from pipeline.kernels import es_noise
from ..autograd import Tensor, named_parameters
from ..errors import FucinaError, UserError
from . import noise as es_streams
from .shaping import SHAPINGS, shape

DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
RESTORE_MODES = ("regenerate", "snapshot")
ANCHOR_DECAYS = (None, "l1", "l2")


class ESStateError(FucinaError):
    """The trainer was driven out of order (a member left applied, no anchor, ...)."""


class ESConfigError(UserError):
    """An ES configuration value is out of range."""


@dataclass
class ESConfig:
    sigma: float = 1e-3
    alpha: float | None = None  # None -> sigma / 2 (the reference default)
    population: int = 30
    seed: int = 0
    noise: str = "iid"  # "iid" | "correlated"
    antithetic: bool = False
    shaping: str = "z_score"  # "z_score" | "centered_ranks"
    restore_mode: str = "regenerate"  # "regenerate" | "snapshot"
    anchor_decay: str | None = None  # None | "l1" | "l2"
    anchor_lambda: float = 0.0

    def __post_init__(self):
        if self.alpha is None:
            self.alpha = self.sigma / 2
        checks = [
            (self.sigma > 0 and np.isfinite(self.sigma), "sigma", "a positive finite number"),
            (self.alpha > 0 and np.isfinite(self.alpha), "alpha", "a positive finite number"),
            (isinstance(self.population, int) and self.population >= 2, "population", "an integer >= 2"),
            (not self.antithetic or self.population % 2 == 0, "population", "even when antithetic=True"),
            (isinstance(self.seed, int) and 0 <= self.seed < 2**64, "seed", "an integer in [0, 2**64)"),
            (self.noise in es_streams.SCHEMES, "noise", f"one of {es_streams.SCHEMES}"),
            (self.shaping in SHAPINGS, "shaping", f"one of {SHAPINGS}"),
            (self.restore_mode in RESTORE_MODES, "restore_mode", f"one of {RESTORE_MODES}"),
            (self.anchor_decay in ANCHOR_DECAYS, "anchor_decay", f"one of {ANCHOR_DECAYS}"),
            (self.anchor_lambda >= 0 and np.isfinite(self.anchor_lambda), "anchor_lambda", "a finite number >= 0"),
        ]
        for ok, field, need in checks:
            if not ok:
                raise ESConfigError(f"ES config: {field} must be {need}, got {getattr(self, field)!r}")

    def to_dict(self) -> dict:
        return asdict(self)


class _Slot:
    """One registered parameter: a Tensor (read .data each time) or a bare array."""

    def __init__(self, name, holder, offset):
        self.name, self.holder, self.offset = name, holder, offset
        arr = self.array
        self.shape, self.dtype, self.size = arr.shape, arr.dtype, arr.size

    @property
    def array(self) -> np.ndarray:
        return self.holder.data if isinstance(self.holder, Tensor) else self.holder

    def read_f32(self) -> np.ndarray:
        return self.array.astype(np.float32).reshape(-1)

    def write_f32(self, values: np.ndarray):
        """Store float32 values, rounding to the slot's dtype (a no-op cast for f32)."""
        np.copyto(self.array, values.reshape(self.shape).astype(self.dtype, copy=False))


class ESTrainer:
    def __init__(self, config: ESConfig | None = None, **overrides):
        self.config = config if config is not None else ESConfig(**overrides)
        if config is not None and overrides:
            raise ESConfigError("ESTrainer: pass either an ESConfig or keyword overrides, not both")
        self.iteration = 0
        self.cache_noise = False  # keep materialized eps rows for this iteration's update (small parameter sets)
        self._eps_cache = (None, {})  # (iteration, {draw: float32 eps row})
        self._slots: list[_Slot] = []
        self._active = None  # (member, snapshot list or None) while a member is applied
        self._anchor = None

    # ------------------------------------------------------------ registration
    def add_param(self, param, name: str | None = None):
        """Register a Tensor (trainable or frozen) or a float32/float16/bfloat16 numpy array."""
        name = name if name is not None else f"param{len(self._slots)}"
        arr = param.data if isinstance(param, Tensor) else param
        if not isinstance(arr, np.ndarray):
            raise ESConfigError(f"add_param {name!r}: expected a Tensor or numpy array, got {type(param).__name__}")
        if arr.dtype not in DTYPES:
            raise ESConfigError(f"add_param {name!r}: dtype {arr.dtype} cannot take gaussian noise "
                                "(float32, float16, bfloat16 only; dequantize quantized weights first)")
        if not arr.flags.c_contiguous or not arr.flags.writeable:
            raise ESConfigError(f"add_param {name!r}: the array must be C-contiguous and writeable")
        for slot in self._slots:
            if slot.name == name:
                raise ESConfigError(f"add_param: duplicate name {name!r}")
            if np.shares_memory(slot.array, arr):
                raise ESConfigError(f"add_param {name!r}: shares memory with {slot.name!r} "
                                    "(register tied storage once)")
        if self._active is not None:
            raise ESStateError(f"add_param {name!r}: member {self._active[0]} is applied; restore it first")
        offset = self._slots[-1].offset + self._slots[-1].size if self._slots else 0
        self._slots.append(_Slot(name, param, offset))
        self._anchor = None
        return self

    def add_registry(self, model, prefix: str = "", trainable_only: bool = False):
        """Register every Tensor named_parameters() finds (frozen ones too unless trainable_only)."""
        for name, tensor in named_parameters(model, prefix, trainable_only=trainable_only):
            self.add_param(tensor, name)
        return self

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._slots]

    @property
    def dim(self) -> int:
        return sum(s.size for s in self._slots)

    def layout(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, sizes) int64 of every slot in the flat parameter vector."""
        return (np.array([s.offset for s in self._slots], dtype=np.int64),
                np.array([s.size for s in self._slots], dtype=np.int64))

    # ------------------------------------------------------------ noise
    def _keys(self, members, iteration=None):
        """(stream keys (B, S), float32 scales (B,) = sign * f32(sigma)) for members."""
        cfg = self.config
        pop = cfg.population
        for m in members:
            if not (0 <= int(m) < pop):
                raise ESStateError(f"member {m} out of range for population {pop}")
        draws, signs = zip(*(es_streams.draw_of(int(m), cfg.antithetic) for m in members)) if len(members) else ((), ())
        it = self.iteration if iteration is None else iteration
        keys = es_streams.draw_keys(cfg.seed, it, draws, len(self._slots), cfg.noise)
        sigma = np.float32(cfg.sigma)
        scales = np.array([sigma if s > 0 else -sigma for s in signs], dtype=np.float32)
        return keys, scales

    def _add_noise(self, member: int, direction: int):
        keys, scales = self._keys([member])
        scales = scales if direction > 0 else -scales
        for s, slot in enumerate(self._slots):
            if slot.dtype == np.float32:
                flat = slot.array.reshape(-1)
                es_noise.materialize(keys[:, s:s + 1], scales, flat, [0], [slot.size], flat.reshape(1, -1))
            else:
                tmp = slot.read_f32()
                es_noise.materialize(keys[:, s:s + 1], scales, tmp, [0], [slot.size], tmp.reshape(1, -1))
                slot.write_f32(tmp)

    # ------------------------------------------------------------ in place
    def perturb(self, member: int):
        """theta += sigma * eps_member in every registered buffer."""
        if self._active is not None:
            raise ESStateError(f"perturb({member}): member {self._active[0]} is still applied; restore it first")
        self._keys([member])  # range check before touching anything
        snapshot = [s.array.copy() for s in self._slots] if self.config.restore_mode == "snapshot" else None
        self._add_noise(member, +1)
        self._active = (member, snapshot)

    def restore(self, member: int | None = None):
        """Undo perturb(member): subtract the regenerated noise, or copy the snapshot back."""
        if self._active is None:
            raise ESStateError("restore: no member is applied")
        active, snapshot = self._active
        if member is not None and member != active:
            raise ESStateError(f"restore({member}): the applied member is {active}")
        if snapshot is not None:
            for slot, saved in zip(self._slots, snapshot):
                np.copyto(slot.array, saved)
        else:
            self._add_noise(active, -1)
        self._active = None

    def step(self, evaluate) -> dict:
        """One sequential iteration: for each member perturb, R = evaluate(member), restore; then update.

        An exception from evaluate restores the member before it propagates.
        """
        rewards = []
        for m in range(self.config.population):
            self.perturb(m)
            try:
                reward = evaluate(m)
            finally:
                self.restore(m)
            rewards.append(float(reward))
        return self.update(rewards)

    # ------------------------------------------------------------ replicas
    def flat_params(self) -> np.ndarray:
        """theta as one float32 vector (slots concatenated in registration order)."""
        return np.concatenate([s.read_f32() for s in self._slots]) if self._slots else np.zeros(0, np.float32)

    def materialize_members(self, members, out=None, theta=None) -> np.ndarray:
        """(B, dim) float32 rows theta + sigma * eps_m, bitwise what perturb(m) would leave in the buffers.

        theta: a cached flat_params() (valid until the next update).
        """
        members = [int(m) for m in members]
        theta = self.flat_params() if theta is None else theta
        out = np.empty((len(members), self.dim), dtype=np.float32) if out is None else out
        offsets, sizes = self.layout()
        pairs = list(zip(members[0::2], members[1::2]))
        if self.config.antithetic and len(members) % 2 == 0 and all(a % 2 == 0 and b == a + 1 for a, b in pairs):
            # whole (+, -) pairs: one noise draw serves both rows (same bits as one row at a time)
            drawn = members[0::2]
            keys, scales = self._keys(drawn)
            eps = np.empty((len(drawn), self.dim), np.float32) if self.cache_noise else None
            es_noise.materialize_pairs(keys, scales, theta, offsets, sizes, out, eps_out=eps)
        else:
            drawn = members
            keys, scales = self._keys(members)
            eps = np.empty((len(members), self.dim), np.float32) if self.cache_noise else None
            es_noise.materialize(keys, scales, theta, offsets, sizes, out, eps_out=eps)
        if eps is not None:
            if self._eps_cache[0] != self.iteration:
                self._eps_cache = (self.iteration, {})
            for m, row in zip(drawn, eps):
                self._eps_cache[1][es_streams.draw_of(m, self.config.antithetic)[0]] = row
        for slot in self._slots:  # round low-precision slots exactly as the in-place path does
            if slot.dtype != np.float32:
                seg = out[:, slot.offset:slot.offset + slot.size]
                seg[...] = seg.astype(slot.dtype).astype(np.float32)
        return out

    def split(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Views of a (..., dim) float32 array per slot, shaped (..., *slot.shape)."""
        lead = flat.shape[:-1]
        return {s.name: flat[..., s.offset:s.offset + s.size].reshape(lead + s.shape) for s in self._slots}

    # ------------------------------------------------------------ update
    def update(self, rewards) -> dict:
        """Shape the rewards (member order), apply the ES step and anchored decay, advance the iteration."""
        if self._active is not None:
            raise ESStateError(f"update: member {self._active[0]} is still applied; restore it first")
        cfg = self.config
        coeffs, stats = shape(rewards, cfg.population, cfg.shaping)
        if cfg.antithetic:  # pair (2k, 2k+1) shares eps_k with signs (+, -)
            coeffs = coeffs[0::2] - coeffs[1::2]
        keys = es_streams.draw_keys(cfg.seed, self.iteration, range(len(coeffs)), len(self._slots), cfg.noise)
        offsets, sizes = self.layout()
        total = np.zeros(self.dim, dtype=np.float32)
        cached = self._eps_cache[1] if self._eps_cache[0] == self.iteration else {}
        self._eps_cache = (None, {})
        if cached:  # draws this replica already materialized are read back, not regenerated (same bits)
            draws = sorted(cached)
            rows = {d: i for i, d in enumerate(draws)}
            cache_row = [rows.get(d, -1) for d in range(len(coeffs))]
            es_noise.weighted_sum(keys, coeffs.astype(np.float32), offsets, sizes, total,
                                  cache=np.stack([cached[d] for d in draws]), cache_row=cache_row)
        else:
            es_noise.weighted_sum(keys, coeffs.astype(np.float32), offsets, sizes, total)
        total /= np.float32(cfg.population)
        delta = np.float32(cfg.alpha) * total
        for slot in self._slots:
            seg = delta[slot.offset:slot.offset + slot.size].reshape(slot.shape)
            if slot.dtype == np.float32:
                np.add(slot.array, seg, out=slot.array)
            else:
                slot.write_f32(slot.read_f32() + seg.reshape(-1))
        if cfg.anchor_decay is not None:
            self._anchor_decay()
        self.iteration += 1
        stats["iteration"] = self.iteration
        stats["update_rms"] = float(np.sqrt(np.mean(delta.astype(np.float64) ** 2))) if delta.size else 0.0
        return stats

    def capture_anchor(self):
        """Remember the current parameters as theta_0 for anchored weight decay (never serialized)."""
        if self._active is not None:
            raise ESStateError("capture_anchor: a member is applied; restore it first")
        self._anchor = [s.read_f32() for s in self._slots]

    def _anchor_decay(self):
        if self._anchor is None:
            raise ESStateError("anchor_decay is configured but no anchor was captured: call capture_anchor() "
                               "(on resume: from the initial weights, BEFORE loading the checkpoint)")
        cfg = self.config
        shrink = cfg.alpha * cfg.anchor_lambda  # float64, cast once below
        for slot, anchor in zip(self._slots, self._anchor):
            d = slot.read_f32() - anchor
            if cfg.anchor_decay == "l2":
                d = d * np.float32(1.0 - shrink)
            else:
                d = np.sign(d) * np.maximum(np.abs(d) - np.float32(shrink), np.float32(0))
            slot.write_f32(anchor + d)

    # ------------------------------------------------------------ persistence helpers
    def state_fields(self) -> dict:
        """The es_* fields of trainer_state.json (the whole resume story besides the weights)."""
        c = self.config
        return {"es_sigma": c.sigma, "es_alpha": c.alpha, "es_population": c.population, "es_seed": c.seed,
                "es_noise": c.noise, "es_antithetic": c.antithetic, "es_shaping": c.shaping,
                "es_restore_mode": c.restore_mode, "es_anchor_decay": c.anchor_decay,
                "es_anchor_lambda": c.anchor_lambda, "es_iteration": self.iteration}

    def named_arrays(self) -> list[tuple[str, np.ndarray]]:
        return [(s.name, s.array) for s in self._slots]

    @property
    def active_member(self):
        return None if self._active is None else self._active[0]
