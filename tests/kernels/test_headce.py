"""pipeline/kernels/headce.py (one-pass head cross-entropy) against a float64 numpy reference;
1 vs 2 numba threads bitwise; online-max rescaling; partial last chunk (cold == warm numba
cache: tests/kernels/test_cold_cache.py)."""

import numba
import numpy as np
import pytest

from pipeline.kernels import headce
from pipeline.threads import numba_threads

two_threads = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs NUMBA_NUM_THREADS >= 2")


def ref_head(x, w, y, eps=0.0):
    """float64 loss rows and d(loss_i)/d(x_i) for logits = x @ w.T."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    logits = x64 @ w64.T
    m = logits.max(1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(1, keepdims=True)))[:, 0]
    rows = np.arange(len(y))
    c = w.shape[0]
    loss = lse - (1 - eps) * logits[rows, y] - eps / c * logits.sum(1)
    p = np.exp(logits - lse[:, None])
    gx = p @ w64 - (1 - eps) * w64[y] - eps / c * w64.sum(0)
    return loss, gx


def case(n=37, h=48, c=1000, seed=0, scale=1.0):
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, h)).astype(np.float32)
    w = (r.standard_normal((c, h)) * scale / np.sqrt(h)).astype(np.float32)
    return x, w, r.integers(0, c, n)


def check(x, w, y, eps=0.0, **grid):
    loss, gx = headce.head_ce(x, w, y, eps, **grid)
    rl, rg = ref_head(x, w, y, eps)
    assert loss.dtype == np.float64 and gx.dtype == np.float32 and gx.shape == x.shape
    np.testing.assert_allclose(loss, rl, rtol=2e-6, atol=2e-6 * np.abs(rl).max())
    np.testing.assert_allclose(gx, rg, rtol=1e-5, atol=2e-6 * np.abs(rg).max())
    return loss, gx


def test_chunk_kernels_match_numpy():
    """_chunk_softmax (two chunks: the max grows for some rows, not others) and _rescale_add."""
    r = np.random.default_rng(9)
    n, rows = 11, 150
    chunks = [r.standard_normal((rows, n)).astype(np.float32) for _ in range(2)]
    chunks[1][:, :5] += 4  # rows 0..4 of X get a larger max in the second chunk, the rest a smaller one
    chunks[1][:, 5:] -= 4
    labels = np.array([0, 149, 150, 299, 7, 160, 3, 200, 100, 250, 5])
    m, s = np.full(n, -np.inf, np.float32), np.zeros(n)
    ll, scale = np.zeros(n, np.float32), np.empty(n, np.float32)
    scratch = [np.empty(n, np.float32) for _ in range(2)]
    for k, lt in enumerate(chunks):
        before_m = m.copy()
        p = lt.copy()
        headce._chunk_softmax(p, k * rows, labels, m, s, ll, scale, *scratch)
        want_m = np.maximum(before_m, lt.max(0))
        np.testing.assert_array_equal(m, want_m)
        np.testing.assert_allclose(scale, np.exp(before_m.astype(np.float64) - want_m), rtol=1e-6)
        np.testing.assert_allclose(p, np.exp(lt.astype(np.float64) - want_m), rtol=1e-6, atol=1e-30)
    both = np.concatenate(chunks).astype(np.float64)
    np.testing.assert_allclose(s, np.exp(both - m).sum(0), rtol=1e-6)
    np.testing.assert_array_equal(ll, both[labels, np.arange(n)].astype(np.float32))
    assert (scale[:5] < 1).all() and (scale[5:] == 1).all()
    acc, part = r.standard_normal((2, n, 9)).astype(np.float32)
    want = acc * scale[:, None] + part
    headce._rescale_add(acc, part, scale)
    np.testing.assert_allclose(acc, want, rtol=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("grid", [dict(segment_rows=256, chunk_rows=96),   # 4 segments, partial chunks
                                  dict(segment_rows=1000, chunk_rows=1000),  # one chunk
                                  dict(segment_rows=333, chunk_rows=7),
                                  dict()])                                   # the defaults
def test_matches_float64_reference(eps, grid):
    check(*case(), eps=eps, **grid)


def test_labels_in_the_last_partial_chunk():
    x, w, _ = case(n=12, c=1000)
    y = np.array([999, 998, 960, 961, 0, 959, 999, 975, 990, 500, 960, 997])
    # segments 0..512, 512..1000; chunks of 96: the last chunk is 992..1000 (8 rows)
    check(x, w, y, segment_rows=512, chunk_rows=96)
    check(x, w, y, 0.2, segment_rows=512, chunk_rows=96)


@pytest.mark.parametrize("growing", [True, False])
def test_large_logits_rescale_the_running_max(growing):
    """Logits in the thousands whose row max changes chunk after chunk: every
    rescale of the running sum and accumulator is exercised (exp(m_old - m_new)
    underflows to 0 for large jumps)."""
    x, w, y = case(n=20, h=32, c=600, seed=3)
    norms = np.linspace(1.0, 400.0, 600) if growing else np.linspace(400.0, 1.0, 600)
    w = (w * norms[:, None]).astype(np.float32)
    loss, gx = headce.head_ce(x, w, y, segment_rows=200, chunk_rows=64)
    rl, rg = ref_head(x, w, y)
    biggest = np.abs(x.astype(np.float64) @ w.T.astype(np.float64)).max()
    assert biggest > 1000
    np.testing.assert_allclose(loss, rl, rtol=1e-6)
    # float32 logits carry ~eps32 * |logit| absolute error, which the softmax passes on
    # to the gradient: the bound any float32 path meets (the two-pass path's error is the same)
    np.testing.assert_allclose(gx, rg, rtol=0, atol=np.finfo(np.float32).eps * biggest * np.abs(rg).max())


def test_nan_propagates_to_the_loss():
    """fastexp's exp maps NaN to 0; the running max keeps the NaN so the loss shows it."""
    x, w, y = case(n=8, h=16, c=300)
    w[170] = np.nan  # one class: every row's logits contain a NaN
    loss, gx = headce.head_ce(x, w, y, segment_rows=100, chunk_rows=40)
    assert np.isnan(loss).all() and np.isnan(gx).all()
    x, w, y = case(n=8, h=16, c=300)
    x[3, 2] = np.nan  # one row
    loss, gx = headce.head_ce(x, w, y, segment_rows=100, chunk_rows=40)
    bad = np.isnan(loss)
    assert bad.tolist() == [i == 3 for i in range(8)] and np.isnan(gx[3]).all() and np.isfinite(gx[~bad]).all()


def test_one_class_and_one_row():
    x, w, y = case(n=1, c=1)
    loss, gx = check(x, w, y)
    np.testing.assert_allclose(loss, 0.0, atol=1e-7)


def test_empty_rows():
    x, w, _ = case(n=0)
    loss, gx = headce.head_ce(x, w, np.zeros(0, np.int64))
    assert loss.shape == (0,) and gx.shape == (0, x.shape[1])


def test_bad_input():
    x, w, y = case()
    with pytest.raises(ValueError, match=r"head_ce: expected float32 X \[N, H\] and W \[C, H\], got float64"):
        headce.head_ce(x.astype(np.float64), w, y)
    with pytest.raises(ValueError, match=r"labels must be 37 integers in \[0, 1000\)"):
        headce.head_ce(x, w, np.full(37, 1000))
    with pytest.raises(ValueError, match="must be positive"):
        headce.head_ce(x, w, y, segment_rows=0)


@two_threads
def test_thread_count_bitwise():
    x, w, y = case(n=40, c=2000, seed=5)
    out = []
    for threads in (1, 2):
        with numba_threads(threads):
            out.append(headce.head_ce(x, w, y, 0.05, segment_rows=256, chunk_rows=100))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)
