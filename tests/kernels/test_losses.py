"""pipeline/kernels/losses.py against a numpy reference; 1 vs 2 numba threads bitwise."""
import numba
import numpy as np
import pytest

from pipeline.kernels import losses
from pipeline.threads import numba_threads

two_threads = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs NUMBA_NUM_THREADS >= 2")


@pytest.fixture(autouse=True)
def parallel_even_when_small(monkeypatch):
    """Small inputs run serially below nn.PARALLEL_MIN; here every kernel takes its parallel grid."""
    from pipeline.kernels import nn as kernels_nn
    monkeypatch.setattr(kernels_nn, "PARALLEL_MIN", 0)


def ref_ce(x, y, ignore, eps):
    x64 = x.astype(np.float64)
    m = x64.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(x64 - m).sum(-1, keepdims=True)))[:, 0]
    valid = y != ignore
    safe = np.where(valid, y, 0)
    loss = lse - (1 - eps) * x64[np.arange(len(y)), safe] - eps / x.shape[1] * x64.sum(-1)
    p = np.exp(x64 - lse[:, None])
    target = np.full(x.shape, eps / x.shape[1])
    target[np.arange(len(y)), safe] += 1 - eps
    return np.where(valid, loss, 0.0), np.where(valid[:, None], p - target, 0.0)


@pytest.fixture
def case():
    r = np.random.default_rng(11)
    x = (r.standard_normal((70, 1000)) * 3).astype(np.float32)
    y = r.integers(0, 1000, 70)
    y[[3, 40]] = -100
    return x, y


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_ce_matches_reference(case, eps):
    x, y = case
    loss, stats = losses.ce_forward(x, y, -100, eps)
    rl, rg = ref_ce(x, y, -100, eps)
    np.testing.assert_allclose(loss, rl, rtol=1e-6, atol=1e-6)
    scale = np.linspace(0.5, 2.0, len(y))
    g = losses.ce_backward(x, y, stats, scale, -100, eps)
    np.testing.assert_allclose(g, rg * scale[:, None], rtol=1e-5, atol=1e-7)
    inplace = x.copy()
    losses.ce_backward(inplace, y, stats, scale, -100, eps, out=inplace)
    np.testing.assert_array_equal(inplace, g)


@two_threads
def test_ce_thread_count_bitwise(case):
    x, y = case

    def run():
        loss, stats = losses.ce_forward(x, y, -100, 0.1)
        return loss, stats, losses.ce_backward(x, y, stats, np.ones(len(y)), -100, 0.1)

    with numba_threads(1):
        one = run()
    with numba_threads(2):
        two = run()
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def test_ce_wrapper_validates():
    with pytest.raises(ValueError, match="logits must be 2-D"):
        losses.ce_forward(np.zeros(3, np.float32), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="labels"):
        losses.ce_forward(np.zeros((3, 2), np.float32), np.zeros(2, np.int64))
