"""pipeline/kernels/attention.py softmax rows vs numpy; 1 vs 2 threads bitwise; the
float32 attention op (kernel path) vs a float64 reference."""
import numba
import numpy as np
import pytest

from pipeline.kernels import attention as ka
from pipeline.threads import numba_threads

two_threads = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs NUMBA_NUM_THREADS >= 2")


@pytest.fixture(autouse=True)
def parallel_even_when_small(monkeypatch):
    """Small inputs run serially below nn.PARALLEL_MIN; here every kernel takes its parallel grid."""
    from pipeline.kernels import nn as kernels_nn
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


def _attention_reference(q, k, v, pos0, scale, window):
    """float64 causal GQA attention with an optional sliding window: q [t, H, D] at positions pos0..."""
    t, n_h, d = q.shape
    g = n_h // k.shape[1]
    kk, vv = (np.repeat(a.astype(np.float64), g, axis=1) for a in (k, v))
    s = np.einsum("thd,shd->hts", q.astype(np.float64), kk) * scale
    key, query = np.arange(k.shape[0])[None, :], (pos0 + np.arange(t))[:, None]
    hidden = (key > query) | ((query - key >= window) if window else False)
    s[:, hidden] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), vv).reshape(t, -1)


@pytest.mark.parametrize("t, keys, heads, kv, d, window", [(1, 65, 16, 8, 128, 0), (3, 40, 4, 1, 36, 0),
                                                           (2, 300, 8, 2, 64, 50), (4, 9, 2, 2, 8, 3)])
def test_attend_cached_matches_a_float64_reference(t, keys, heads, kv, d, window):
    """The decode attention kernel (one numba call, 8-lane dots, head dims that are not a multiple of 8 too):
    within f32 rounding of the float64 attention, a cache longer than the visible keys ignored."""
    r = np.random.default_rng(t * 100 + keys)
    pos0 = keys - t
    q = r.standard_normal((t, heads, d)).astype(np.float32)
    k, v = (r.standard_normal((keys + 5, kv, d)).astype(np.float32) for _ in range(2))  # 5 unused slots
    got = ka.attend_cached(q, k, v, pos0, d ** -0.5, window)
    np.testing.assert_allclose(got, _attention_reference(q, k[:keys], v[:keys], pos0, d ** -0.5, window),
                               rtol=1e-5, atol=2e-6)


def test_attend_cached_refuses_a_short_cache():
    q = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="attend_cached"):
        ka.attend_cached(q, np.zeros((5, 2, 8), np.float32), np.zeros((5, 2, 8), np.float32), 4, 1.0)
