"""pipeline/kernels/fastexp.py: the SIMD exp/max/sum-exp against numpy references."""
import numpy as np
from numba import njit

from pipeline.kernels import fastexp


def ulps(got, x):
    ref = np.exp(x.astype(np.float64))
    return np.abs(got.astype(np.float64) - ref) / np.spacing(ref.astype(np.float32)).astype(np.float64)


def test_exp_accuracy():
    x = np.random.default_rng(0).uniform(-87, 88, 200_000).astype(np.float32)
    err = ulps(fastexp.exp(x), x)
    assert err.max() <= 5.0 and err.mean() < 2.0
    small = np.random.default_rng(1).uniform(-10, 0, 200_000).astype(np.float32)  # the softmax range
    assert ulps(fastexp.exp(small), small).max() <= 5.0


def test_exp_edges():
    x = np.array([-np.inf, -1000.0, -87.5, 0.0, 1.0], np.float32)
    out = fastexp.exp(x)
    np.testing.assert_array_equal(out[:3], 0.0)
    assert out[3] == 1.0
    np.testing.assert_allclose(out[4], np.e, rtol=3e-7)


@njit
def _exp64_all(x, out):
    for i in range(x.shape[0]):
        out[i] = fastexp.exp64(x[i])


def test_exp64_accuracy_and_edges():
    x = np.concatenate([np.random.default_rng(3).uniform(-708, 0, 200_000), -np.logspace(-300, 2.8, 5000)])
    out = np.empty_like(x)
    _exp64_all(x, out)
    ref = np.exp(x.astype(np.longdouble))
    err = np.abs(out.astype(np.longdouble) - ref) / np.spacing(ref.astype(np.float64)).astype(np.longdouble)
    assert float(err.max()) <= 2.0
    edges = np.array([0.0, -0.0, -708.5, -1e4, -np.inf])
    got = np.empty_like(edges)
    _exp64_all(edges, got)
    np.testing.assert_array_equal(got, [1.0, 1.0, 0.0, 0.0, 0.0])


def test_row_max_exact():
    r = np.random.default_rng(2)
    for row in (r.standard_normal(1001).astype(np.float32), -np.abs(r.standard_normal(33)).astype(np.float32),
                np.array([-np.inf, -3.0, -np.inf], np.float32), np.array([-0.0, -1.0], np.float32)):
        assert fastexp.row_max(row) == row.max()
    assert np.isnan(fastexp.row_max(np.array([1.0, np.nan, 2.0], np.float32)))


def test_sum_exp_shifted_and_exp_into():
    row = (np.random.default_rng(3).standard_normal(5000) * 4).astype(np.float32)
    m = row.max()
    ref = np.exp(row.astype(np.float64) - m)
    np.testing.assert_allclose(fastexp.sum_exp_shifted(row, m), ref.sum(), rtol=1e-6)
    out = np.empty_like(row)
    fastexp.exp_shifted_into(row, m, out, np.float32(2.0), np.float32(0.5))
    np.testing.assert_allclose(out, ref * 2 - 0.5, rtol=1e-6, atol=1e-6)
