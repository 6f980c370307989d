"""ES noise streams: which splitmix64 key draws which member's perturbation.

Trade-off: nothing is stored. A member's noise is a pure function of
(seed, iteration, member, slot, element), so perturb, restore and update all
regenerate it, a resumed run needs only the iteration counter, and replicas in
other processes or on other hosts draw identical noise from two integers.

    iteration key = at(seed, iteration)
    draw          = member            (antithetic: member // 2, sign -1 on odd members)
    draw key      = at(iteration key, draw)
    stream key    = at(draw key, slot)   scheme "iid": every (member, slot) independent
                  = draw key             scheme "correlated": one stream reused by every
                                         slot (same-length slots get identical noise,
                                         the es-at-scale reference's behaviour)
    eps[element]  = pipeline.kernels.es_noise value `element` of the stream key

Both schemes and the antithetic pairing are checkpoint contracts.
"""
from __future__ import annotations

import numpy as np

SCHEMES = ("iid", "correlated")
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def at(seed: int, i: int) -> int:
    """pipeline.kernels.rng.at in Python ints (cheap for the handful of keys per iteration)."""
    z = (int(seed) + (int(i) + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def draw_of(member: int, antithetic: bool) -> tuple[int, int]:
    """(noise draw index, sign) of a member: antithetic pairs (2k, 2k+1) share draw k as (+, -)."""
    if antithetic:
        return member // 2, (-1 if member & 1 else 1)
    return member, 1


def draw_keys(seed: int, iteration: int, draws, n_slots: int, scheme: str) -> np.ndarray:
    """(len(draws), n_slots) uint64 stream keys, one per (draw, slot)."""
    if scheme not in SCHEMES:
        raise ValueError(f"noise scheme must be one of {SCHEMES}, got {scheme!r}")
    it_key = at(seed, iteration)
    keys = np.empty((len(draws), n_slots), dtype=np.uint64)
    for row, d in enumerate(draws):
        dk = at(it_key, d)
        for s in range(n_slots):
            keys[row, s] = at(dk, s) if scheme == "iid" else dk
    return keys
