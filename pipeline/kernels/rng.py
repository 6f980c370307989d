"""Counter-based RNG: splitmix64 with O(1) random access.

Every random stream in Fucina (init, dropout masks, APOLLO projections, data
shuffles, ES noise) is a pure function of (seed, index) through this module.
The (seed -> values) mapping is a checkpoint contract pinned by golden tests:
do not change any formula here.

    splitmix64 sequential: state += GOLDEN; out = mix64(state)
    at(seed, i)          = mix64(seed + (i + 1) * GOLDEN)   (the i-th output of
                           the sequential stream started at state = seed)
    uniform(seed, i)     = (at(seed, i) >> 11) * 2**-53       in [0, 1)
    gaussian(seed, i)    = Box-Muller on the pair p = i // 2:
                           u1 = 1 - uniform(seed, 2p)  in (0, 1]
                           u2 = uniform(seed, 2p + 1)
                           r = sqrt(-2 ln u1), t = 2 pi u2
                           even i -> r cos t, odd i -> r sin t   (float64, then cast)

Kernels take plain arrays and write into them; elements are independent, so
the parallel loops are bitwise identical for any thread count.
"""
import math

import numpy as np
from numba import njit, prange

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_ONE = np.uint64(1)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53
_TWO_PI = 2.0 * math.pi
CHUNK = 1 << 16  # fixed chunk grid for parallel fills (independent of threads)


@njit(cache=True, inline="always")
def mix64(z):
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


@njit(cache=True, inline="always")
def at(seed, i):
    """The i-th output of the splitmix64 stream that starts at state `seed`."""
    return mix64(np.uint64(seed) + (np.uint64(i) + _ONE) * GOLDEN)


@njit(cache=True)
def splitmix64_next(state):
    """Sequential form: returns (new_state, value)."""
    state = np.uint64(state) + GOLDEN
    return state, mix64(state)


@njit(cache=True, inline="always")
def uniform_at(seed, i):
    return np.float64(at(seed, i) >> _S11) * _INV53


@njit(cache=True, inline="always")
def gaussian_at(seed, i):
    p = np.uint64(i) >> _ONE
    two_p = p + p
    u1 = 1.0 - uniform_at(seed, two_p)
    u2 = uniform_at(seed, two_p + _ONE)
    r = math.sqrt(-2.0 * math.log(u1))
    t = _TWO_PI * u2
    if np.uint64(i) & _ONE:
        return r * math.sin(t)
    return r * math.cos(t)


@njit(cache=True, parallel=True)
def _uniform_fill(seed, out, low, high, offset):
    n = out.size
    nchunks = (n + CHUNK - 1) // CHUNK
    span = high - low
    for c in prange(nchunks):
        start = c * CHUNK
        stop = min(n, start + CHUNK)
        for j in range(start, stop):
            out[j] = low + span * uniform_at(seed, np.uint64(offset + j))


@njit(cache=True, parallel=True)
def _gaussian_fill(seed, out, mean, std, offset):
    n = out.size
    nchunks = (n + CHUNK - 1) // CHUNK
    for c in prange(nchunks):
        start = c * CHUNK
        stop = min(n, start + CHUNK)
        for j in range(start, stop):
            out[j] = mean + std * gaussian_at(seed, np.uint64(offset + j))


@njit(cache=True)
def _at_array(seed, idx, out):
    for j in range(idx.size):
        out[j] = at(seed, idx[j])


def _u64(x):
    return np.uint64(int(x) & 0xFFFFFFFFFFFFFFFF)


def at_values(seed, indices):
    """Vector of at(seed, i) for an array of indices (uint64)."""
    idx = np.ascontiguousarray(np.asarray(indices, dtype=np.uint64)).ravel()
    out = np.empty(idx.size, dtype=np.uint64)
    _at_array(_u64(seed), idx, out)
    return out


def derive_seed(seed, i):
    """A fresh seed for call site / step i (e.g. at(base, step * n_layers + layer))."""
    return int(at_values(seed, [i])[0])


def _check_out(out):
    if not isinstance(out, np.ndarray) or out.dtype not in (np.float32, np.float64):
        raise TypeError(f"rng fill: out must be a float32/float64 numpy array, got {getattr(out, 'dtype', type(out))}")
    if not out.flags.c_contiguous:
        raise ValueError("rng fill: out must be C-contiguous")
    return out.reshape(-1)


def uniform_fill(seed, out, low=0.0, high=1.0, offset=0):
    """out[j] = low + (high - low) * uniform(seed, offset + j), in place; returns out."""
    _uniform_fill(_u64(seed), _check_out(out), float(low), float(high), int(offset))
    return out


def gaussian_fill(seed, out, mean=0.0, std=1.0, offset=0):
    """out[j] = mean + std * gaussian(seed, offset + j), in place; returns out."""
    _gaussian_fill(_u64(seed), _check_out(out), float(mean), float(std), int(offset))
    return out


normal_fill = gaussian_fill


def kaiming_uniform_fill(seed, out, fan_in):
    """PyTorch kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    if fan_in <= 0:
        raise ValueError(f"kaiming_uniform_fill: fan_in must be positive, got {fan_in}")
    bound = 1.0 / math.sqrt(fan_in)  # gain sqrt(2/(1+a^2)) = sqrt(1/3); bound = gain*sqrt(3/fan_in)
    return uniform_fill(seed, out, -bound, bound)


def uniform(seed, shape, low=0.0, high=1.0, dtype=np.float32, offset=0):
    return uniform_fill(seed, np.empty(shape, dtype=dtype), low, high, offset)


def gaussian(seed, shape, mean=0.0, std=1.0, dtype=np.float32, offset=0):
    return gaussian_fill(seed, np.empty(shape, dtype=dtype), mean, std, offset)


def kaiming_uniform(seed, shape, fan_in=None, dtype=np.float32):
    fan_in = shape[-1] if fan_in is None else fan_in
    return kaiming_uniform_fill(seed, np.empty(shape, dtype=dtype), fan_in)


class SplitMix64:
    """Sequential splitmix64 stream (e.g. Fisher-Yates shuffles). Pure Python ints."""

    MASK = 0xFFFFFFFFFFFFFFFF

    def __init__(self, state):
        self.state = int(state) & self.MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)
