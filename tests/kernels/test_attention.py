"""kernels/attention.py softmax rows vs numpy; 1 vs 2 threads bitwise; the
float32 attention op (kernel path) vs a float64 reference."""
import numba
import numpy as np
import pytest

from kernels import attention as ka
from pipeline.threads import numba_threads

two_threads = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs NUMBA_NUM_THREADS >= 2")


@pytest.fixture(autouse=True)
def parallel_even_when_small(monkeypatch):
    """Small inputs run serially below nn.PARALLEL_MIN; here every kernel takes its parallel grid."""
    from kernels import nn as kernels_nn
    monkeypatch.setattr(kernels_nn, "PARALLEL_MIN", 0)


def scores():
    s = np.random.default_rng(0).standard_normal((300, 257)).astype(np.float32) * 3
    s[:, 200:] = -np.inf  # masked keys
    return s


def test_softmax_matches_numpy():
    s = scores()
    ref = np.exp(s.astype(np.float64) - s.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    got = ka.softmax_inplace(s.copy())
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    assert (got[:, 200:] == 0).all()
    dp = np.random.default_rng(1).standard_normal(s.shape).astype(np.float32)
    want = ref * (dp - (dp * ref).sum(-1, keepdims=True)) * 0.125
    np.testing.assert_allclose(ka.softmax_backward_inplace(got, dp.copy(), 0.125), want, rtol=1e-4, atol=1e-6)


@two_threads
def test_softmax_thread_count_bitwise():
    dp = np.random.default_rng(1).standard_normal((300, 257)).astype(np.float32)

    def run():
        p = ka.softmax_inplace(scores())
        return p, ka.softmax_backward_inplace(p, dp.copy(), 0.5)

    with numba_threads(1):
        one = run()
    with numba_threads(2):
        two = run()
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def test_float32_attention_op_matches_float64():
    import pipeline.autograd as ag
    from pipeline.autograd import Tensor
    r = np.random.default_rng(2)
    arrays = [r.standard_normal((2, 40, h, 16)) for h in (6, 2, 2)]
    g = r.standard_normal((2, 40, 6, 16))
    res = []
    for dt in (np.float32, np.float64):
        ts = [Tensor(a.astype(dt), requires_grad=True, dtype=dt) for a in arrays]
        out = ag.attention(*ts)
        out.backward(g.astype(np.float32))
        res.append([out.data] + [t.grad for t in ts])
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@two_threads
def test_attention_op_thread_count_bitwise():
    """The (batch, kv head) pairs run on numba.get_num_threads() Python threads: same bits for 1 and 2."""
    import pipeline.autograd as ag
    from pipeline.autograd import Tensor
    r = np.random.default_rng(4)
    arrays = [r.standard_normal((2, 130, h, 16)).astype(np.float32) for h in (6, 2, 2)]
    g = r.standard_normal((2, 130, 6, 16)).astype(np.float32)

    def run():
        ts = [Tensor(a, requires_grad=True) for a in arrays]
        out = ag.attention(*ts)
        out.backward(g)
        return [out.data] + [t.grad for t in ts]

    with numba_threads(1):
        one = run()
    with numba_threads(2):
        two = run()
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)
