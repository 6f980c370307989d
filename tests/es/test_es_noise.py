"""pipeline/kernels/es_noise: the fast gaussian mapping and the three ES noise passes.

Each kernel is checked bitwise against a straight-line numpy reference written
here from the formulas in the module docstring, for 1 and 2 numba threads.
"""
import json
from pathlib import Path

import numba
import numpy as np
import pytest

from pipeline.kernels import es_noise, rng

GOLDEN = Path(__file__).parent.parent / "goldens" / "es" / "noise.json"
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _at(key, idx):
    with np.errstate(over="ignore"):
        return _mix64(np.uint64(key) + (idx.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))


def reference_gaussian(key, n):
    """Straight-line numpy transcription of the module-docstring mapping (float64)."""
    E = es_noise
    p = np.arange((n + 1) // 2, dtype=np.uint64)
    u1 = 1.0 - (_at(key, 2 * p) >> np.uint64(11)).astype(np.float64) * E._INV53
    u2 = (_at(key, 2 * p + np.uint64(1)) >> np.uint64(11)).astype(np.float64) * E._INV53
    m, e = np.frexp(u1)
    small = m < E.SQRT_HALF
    m = np.where(small, m * 2.0, m)
    e = np.where(small, e - 1, e)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    poly = 1.0 + z * (E.L1 + z * (E.L2 + z * (E.L3 + z * (E.L4 + z * (E.L5 + z * E.L6)))))
    log_u1 = e.astype(np.float64) * E.LN2 + 2.0 * s * poly
    r = np.sqrt(-2.0 * log_u1)
    y = u2 * 4.0
    q = np.floor(y + 0.5)
    x = (y - q) * E.HALF_PI
    x2 = x * x
    sin_x = x * (1.0 + x2 * (E.S1 + x2 * (E.S2 + x2 * (E.S3 + x2 * (E.S4 + x2 * E.S5)))))
    cos_x = 1.0 + x2 * (E.K1 + x2 * (E.K2 + x2 * (E.K3 + x2 * (E.K4 + x2 * (E.K5 + x2 * E.K6)))))
    quad = q.astype(np.int64) & 3
    c = np.choose(quad, [cos_x, -sin_x, -cos_x, sin_x])
    sn = np.choose(quad, [sin_x, cos_x, -sin_x, -cos_x])
    out = np.empty(2 * p.size)
    out[0::2], out[1::2] = r * c, r * sn
    return out[:n]


@pytest.fixture(params=[(False, 1), (True, 1), (True, 2)], ids=["serial", "parallel-1thread", "parallel-2threads"])
def threads(request):
    """(parallel build?, numba threads): every combination must give the reference bits."""
    parallel, n = request.param
    old = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    yield parallel
    numba.set_num_threads(old)


@pytest.mark.parametrize("n", [1, 7, 3 * es_noise.CHUNK + 3])
def test_fill_matches_reference_bitwise(threads, n):
    key = 0xDEADBEEF12345
    ref = reference_gaussian(key, n)
    out64 = es_noise.gaussian_fill_fast(key, np.empty(n), parallel=threads)
    out32 = es_noise.gaussian_fill_fast(key, np.empty(n, np.float32), parallel=threads)
    assert np.array_equal(out64, ref)
    assert np.array_equal(out32, ref.astype(np.float32))


def test_fill_thread_count_invariant():
    key, n = 99, 5 * es_noise.CHUNK + 11
    outs = []
    for t in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
        numba.set_num_threads(t)
        outs.append(es_noise.gaussian_fill_fast(key, np.empty(n, np.float32), parallel=True))
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


def test_fast_mapping_close_to_exact_scalar_gaussian():
    """Same pair stream and uniforms as pipeline.kernels.rng, polynomial transcendentals (~1e-10 apart)."""
    n = 200_000
    fast = es_noise.gaussian_fill_fast(1234, np.empty(n))
    exact = rng.gaussian_fill(1234, np.empty(n))
    assert np.max(np.abs(fast - exact)) < 1e-9
    assert not np.array_equal(fast, exact)  # it IS a distinct mapping
    assert abs(fast.mean()) < 0.01 and abs(fast.std() - 1.0) < 0.01


def test_golden_values_pinned():
    doc = json.loads(GOLDEN.read_text())
    for case in doc["noise"]:
        got = es_noise.gaussian_fill_fast(int(case["key"]), np.empty(case["n"]))
        want = np.array([float.fromhex(h) for h in case["values"]])
        assert np.array_equal(got, want), f"noise mapping changed for key {case['key']}"


def _layout():
    sizes = np.array([5, es_noise.CHUNK + 9, 1, 64], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return offsets, sizes, int(sizes.sum())


def test_materialize_matches_numpy(threads):
    offsets, sizes, dim = _layout()
    g = np.random.default_rng(0)
    theta = g.standard_normal(dim).astype(np.float32)
    keys = g.integers(0, 2**63, size=(3, sizes.size), dtype=np.uint64)
    scales = np.array([0.01, -0.01, 0.5], np.float32)
    out = es_noise.materialize(keys, scales, theta, offsets, sizes, np.empty((3, dim), np.float32), parallel=threads)
    for b in range(3):
        for s in range(sizes.size):
            eps = reference_gaussian(keys[b, s], sizes[s]).astype(np.float32)
            seg = slice(offsets[s], offsets[s] + sizes[s])
            assert np.array_equal(out[b, seg], theta[seg] + scales[b] * eps)


def test_materialize_pairs_equals_two_materialized_rows(threads):
    offsets, sizes, dim = _layout()
    g = np.random.default_rng(2)
    theta = g.standard_normal(dim).astype(np.float32)
    keys = g.integers(0, 2**63, size=(2, sizes.size), dtype=np.uint64)
    scales = np.array([0.02, 0.7], np.float32)
    pairs = es_noise.materialize_pairs(keys, scales, theta, offsets, sizes, np.empty((4, dim), np.float32),
                                       parallel=threads)
    rows = es_noise.materialize(np.repeat(keys, 2, axis=0), np.array([0.02, -0.02, 0.7, -0.7], np.float32), theta,
                                offsets, sizes, np.empty((4, dim), np.float32), parallel=False)
    assert np.array_equal(pairs, rows)


def test_weighted_sum_matches_numpy(threads):
    offsets, sizes, dim = _layout()
    g = np.random.default_rng(1)
    keys = g.integers(0, 2**63, size=(6, sizes.size), dtype=np.uint64)
    coeffs = g.standard_normal(6).astype(np.float32)
    out = es_noise.weighted_sum(keys, coeffs, offsets, sizes, np.full(dim, np.nan, np.float32), parallel=threads)
    for s in range(sizes.size):
        acc = np.zeros(sizes[s], np.float32)
        for n in range(6):
            acc = acc + coeffs[n] * reference_gaussian(keys[n, s], sizes[s]).astype(np.float32)
        assert np.array_equal(out[offsets[s]:offsets[s] + sizes[s]], acc)


def test_weighted_sum_reads_cached_rows_bitwise(threads):
    offsets, sizes, dim = _layout()
    g = np.random.default_rng(4)
    theta = np.zeros(dim, np.float32)
    keys = g.integers(0, 2**63, size=(4, sizes.size), dtype=np.uint64)
    coeffs = g.standard_normal(4).astype(np.float32)
    eps = np.empty((2, dim), np.float32)
    es_noise.materialize_pairs(keys[[1, 3]], np.ones(2, np.float32), theta, offsets, sizes,
                               np.empty((4, dim), np.float32), eps_out=eps)
    plain = es_noise.weighted_sum(keys, coeffs, offsets, sizes, np.zeros(dim, np.float32), parallel=threads)
    cached = es_noise.weighted_sum(keys, coeffs, offsets, sizes, np.zeros(dim, np.float32), parallel=threads,
                                   cache=eps, cache_row=[-1, 0, -1, 1])
    assert np.array_equal(plain, cached)


def test_wrappers_reject_bad_input():
    with pytest.raises(TypeError, match="float32/float64"):
        es_noise.gaussian_fill_fast(1, np.empty(3, np.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        es_noise.gaussian_fill_fast(1, np.empty((4, 4))[:, 0])
    theta = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="exceed"):
        es_noise.materialize(np.zeros((1, 1), np.uint64), [1.0], theta, [5], [6], np.empty((1, 10), np.float32))
    with pytest.raises(TypeError, match="theta"):
        es_noise.materialize(np.zeros((1, 1), np.uint64), [1.0], theta.astype(np.float64), [0], [10],
                             np.empty((1, 10), np.float32))
    with pytest.raises(ValueError, match="coeffs"):
        es_noise.weighted_sum(np.zeros((2, 1), np.uint64), [1.0], [0], [10], theta)
