"""pipeline/kernels/nn.py against numpy references; 1 vs 2 numba threads bitwise."""
import numba
import numpy as np
import pytest

from pipeline.kernels import nn, rng
from pipeline.threads import numba_threads

two_threads = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs NUMBA_NUM_THREADS >= 2")


@pytest.fixture(autouse=True)
def parallel_even_when_small(monkeypatch):
    """Small inputs run serially below nn.PARALLEL_MIN; here every kernel takes its parallel grid."""
    from pipeline.kernels import nn as kernels_nn
    monkeypatch.setattr(kernels_nn, "PARALLEL_MIN", 0)


def with_threads(n, fn):
    with numba_threads(n):
        return fn()


def ref_rms_norm(x, w, eps):
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    return (x64 * r * w).astype(x.dtype), r[:, 0]


def ref_rms_norm_backward(g, x, w, r):
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    xhat = x64 * r[:, None]
    gh = g64 * w
    gx = r[:, None] * (gh - xhat * (gh * xhat).mean(-1, keepdims=True))
    return gx, (g64 * xhat).sum(0)


@pytest.fixture
def big():
    r = np.random.default_rng(7)
    return r.standard_normal((300, 256)).astype(np.float32), r.standard_normal(256).astype(np.float32)


def test_rms_norm_matches_reference(big):
    x, w = big
    out, rstd = nn.rms_norm_forward(x, w, 1e-6)
    ref, rref = ref_rms_norm(x, w, 1e-6)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(rstd, rref, rtol=1e-12)
    g = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    gx, gw = nn.rms_norm_backward(g, x, w, rstd)
    rgx, rgw = ref_rms_norm_backward(g, x, w, rstd)
    np.testing.assert_allclose(gx, rgx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw, rgw, rtol=1e-4, atol=1e-4)


@two_threads
def test_rms_norm_thread_count_bitwise(big):
    x, w = big
    g = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)

    def run():
        out, rstd = nn.rms_norm_forward(x, w, 1e-6)
        return (out, rstd) + nn.rms_norm_backward(g, x, w, rstd)

    for a, b in zip(with_threads(1, run), with_threads(2, run)):
        np.testing.assert_array_equal(a, b)


def test_rms_norm_weight_grad_sums_chunks_in_order(big):
    """The weight gradient's per-chunk partials are summed in chunk order in float64: the bits of the plain loop."""
    x, w = big
    g = np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    _, rstd = nn.rms_norm_forward(x, w, 1e-6)
    _, gw = nn.rms_norm_backward(g, x, w, rstd)
    partial = np.empty((-(-x.shape[0] // nn.ROW_CHUNK), x.shape[1]), np.float64)
    nn._rms_norm_bwd(g, x, w, rstd, np.empty_like(x), partial)
    loop = np.zeros(x.shape[1], np.float64)
    for row in partial:
        loop += row
    np.testing.assert_array_equal(gw, loop.astype(np.float32))


def test_dropout_matches_rng_reference():
    x = np.random.default_rng(3).standard_normal((400, 300)).astype(np.float32)
    out = nn.dropout_apply(99, x, 0.1)
    keep = rng.uniform(99, x.shape, dtype=np.float64) < 0.9
    np.testing.assert_array_equal(out, np.where(keep, x * np.float32(1 / 0.9), 0).astype(np.float32))
    np.testing.assert_array_equal(nn.dropout_mask(99, x.shape, 0.1), keep)


@two_threads
def test_dropout_thread_count_bitwise():
    x = np.random.default_rng(3).standard_normal((400, 300)).astype(np.float32)
    np.testing.assert_array_equal(with_threads(1, lambda: nn.dropout_apply(5, x, 0.3)),
                                  with_threads(2, lambda: nn.dropout_apply(5, x, 0.3)))


def test_embedding_backward_matches_add_at():
    r = np.random.default_rng(4)
    ids = r.integers(0, 50, 700)
    g = r.standard_normal((700, 130)).astype(np.float32)
    ref = np.zeros((50, 130), np.float32)
    np.add.at(ref, ids, g)  # sequential in row order, like the kernel
    np.testing.assert_array_equal(nn.embedding_backward(ids, g, 50), ref)


@two_threads
def test_embedding_backward_thread_count_bitwise():
    r = np.random.default_rng(4)
    ids = r.integers(0, 50, 700)
    g = r.standard_normal((700, 130)).astype(np.float32)
    np.testing.assert_array_equal(with_threads(1, lambda: nn.embedding_backward(ids, g, 50)),
                                  with_threads(2, lambda: nn.embedding_backward(ids, g, 50)))


def test_wrappers_validate():
    with pytest.raises(ValueError, match="rms_norm"):
        nn.rms_norm_forward(np.zeros((2, 3), np.int32), None, 1e-6)
    with pytest.raises(ValueError, match="dropout"):
        nn.dropout_apply(0, np.zeros(3, np.int64), 0.5)
    with pytest.raises(ValueError, match="embedding"):
        nn.embedding_backward(np.zeros(3, np.int64), np.zeros((4, 2), np.float32), 5)


def test_gelu_tanh_is_the_correctly_rounded_float32():
    """The float32 tanh GELU equals the 80-bit long double value rounded to float32 everywhere, the negative
    tail included (where 0.5 x (1 + tanh) in float64 lost the last bits of 3% of normal samples)."""
    x = np.concatenate([np.random.default_rng(0).standard_normal(300_000) * 3, np.linspace(-40, 40, 40_001)])
    x = x.astype(np.float32)
    out = np.empty_like(x)
    nn.gelu_tanh_mul_range(x, np.ones_like(x), out)
    xl = x.astype(np.longdouble)
    y = np.sqrt(np.longdouble(2) / np.longdouble(np.pi)) * (xl + np.longdouble(0.044715) * xl ** 3)
    np.testing.assert_array_equal(out, (xl / (1 + np.exp(-2 * y))).astype(np.float32))
    v, d = nn.gelu_tanh(x.astype(np.float64))  # the derivative against the tanh form's
    t = np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x.astype(np.float64) ** 3))
    ref = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x.astype(np.float64) ** 2)
    np.testing.assert_allclose(d, ref, rtol=1e-12, atol=1e-14)


def test_erf_matches_math_erf():
    import math
    x = np.random.default_rng(5).standard_normal(100_000) * 3
    np.testing.assert_array_equal(nn.erf(x), [math.erf(v) for v in x])


@two_threads
def test_erf_thread_count_bitwise():
    x = np.random.default_rng(5).standard_normal(100_000)
    np.testing.assert_array_equal(with_threads(1, lambda: nn.erf(x)), with_threads(2, lambda: nn.erf(x)))


# --- sigmoid / SiLU / SwiGLU / RoPE ----------------------------------------------------
def ref_sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(np.float32)


@pytest.fixture
def acts():
    r = np.random.default_rng(11)
    a = (r.standard_normal((70, 3001)) * 6).astype(np.float32)  # odd size: tails of chunks and vectors
    a[0, :4] = [-1000.0, 1000.0, 0.0, -0.0]
    return a, r.standard_normal(a.shape).astype(np.float32), r.standard_normal(a.shape).astype(np.float32)


def ulps(a, b):
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


def test_sigmoid_silu_match_numpy(acts):
    a, b, g = acts
    s = ref_sigmoid(a)
    assert ulps(nn.sigmoid(a), s) <= 8  # the SIMD exp is within 5 ulp
    np.testing.assert_allclose(nn.silu(a), a * s, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(nn.silu_backward(g, a), g * s * (1 + a * (1 - s)), rtol=1e-5, atol=1e-6)
    assert nn.sigmoid(a)[0, :3].tolist() == [0.0, 1.0, 0.5]


def test_swiglu_is_silu_then_multiply_bitwise(acts):
    a, b, g = acts
    silu = nn.silu(a)
    np.testing.assert_array_equal(nn.swiglu(a, b), silu * b)
    ga, gb = nn.swiglu_backward(g, a, b)
    np.testing.assert_array_equal(gb, g * silu)
    np.testing.assert_array_equal(ga, nn.silu_backward(g * b, a))


@two_threads
def test_swiglu_thread_count_bitwise(acts):
    a, b, g = acts
    run = lambda: (nn.sigmoid(a), nn.silu(a), nn.silu_backward(g, a), nn.swiglu(a, b)) + nn.swiglu_backward(g, a, b)
    for x, y in zip(with_threads(1, run), with_threads(2, run)):
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def rope_case():
    r = np.random.default_rng(12)
    x = r.standard_normal((75, 6, 32)).astype(np.float32)
    ang = r.uniform(-50, 50, (75, 16))
    return x, np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def test_rope_rotate_matches_numpy_bitwise(rope_case):
    x, cos, sin = rope_case
    x1, x2 = x[..., :16], x[..., 16:]
    c, s = cos[:, None], sin[:, None]
    np.testing.assert_array_equal(nn.rope_rotate(x, cos, sin), np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1))
    back = nn.rope_rotate(nn.rope_rotate(x, cos, sin), cos, -sin)
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)  # a rotation and its inverse


@two_threads
def test_rope_rotate_thread_count_bitwise(rope_case):
    x, cos, sin = rope_case
    np.testing.assert_array_equal(with_threads(1, lambda: nn.rope_rotate(x, cos, sin)),
                                  with_threads(2, lambda: nn.rope_rotate(x, cos, sin)))


def test_new_wrappers_validate(rope_case):
    x, cos, sin = rope_case
    with pytest.raises(ValueError, match="swiglu"):
        nn.swiglu(np.ones(3, np.float32), np.ones(4, np.float32))
    with pytest.raises(ValueError, match="silu"):
        nn.silu(np.ones(3, np.float64))
    with pytest.raises(ValueError, match="rope"):
        nn.rope_rotate(x, cos[:, :8], sin[:, :8])


# --- tiled GEMMs ---------------------------------------------------------------------
@pytest.fixture
def gemm_case():
    r = np.random.default_rng(13)
    # big enough to take the tiled path (2*M*N*K >= TILED_MIN_FLOPS), N not a multiple of the tile
    return r.standard_normal((40, 512)).astype(np.float32), r.standard_normal((3333, 512)).astype(np.float32)


def test_tiled_gemms_match_numpy(gemm_case):
    a, b = gemm_case
    assert 2 * a.shape[0] * b.shape[0] * a.shape[1] >= nn.TILED_MIN_FLOPS
    # against float64, within float32 summation error: |err| <= 1e-5 * (|A| @ |B|) elementwise
    # (the BLAS may be numpy's OpenBLAS or MKL, which sum in different orders)
    def close(got, x, y):
        bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(y.astype(np.float64)))
        assert np.all(np.abs(got - x.astype(np.float64) @ y.astype(np.float64)) <= bound)
    close(nn.matmul_nt(a, b), a, b.T)
    g = a @ b.T
    close(nn.matmul_nn(g, b), g, b)
    assert 2 * g.shape[1] * a.shape[0] * a.shape[1] >= nn.TILED_MIN_FLOPS
    close(nn.matmul_nn(g.T, a), g.T, a)  # a transposed view, as a weight gradient g.T @ x passes it: no copy
    small = a[:2, :8]
    np.testing.assert_array_equal(nn.matmul_nt(small, b[:5, :8]), small @ b[:5, :8].T)


@two_threads
def test_tiled_gemms_thread_count_bitwise(gemm_case):
    a, b = gemm_case
    g = a @ b.T
    assert g.T.shape[0] > a.shape[1] and g.shape[0] < b.shape[1]  # matmul_nn cuts a's rows, then b's columns
    run = lambda: (nn.matmul_nt(a, b), nn.matmul_nn(g, b), nn.matmul_nn(g.T, a))
    for x, y in zip(with_threads(1, run), with_threads(2, run)):
        np.testing.assert_array_equal(x, y)


def test_tiled_gemms_validate(gemm_case):
    a, b = gemm_case
    with pytest.raises(ValueError, match="matmul_nt"):
        nn.matmul_nt(a, b[:, :100])
    with pytest.raises(ValueError, match="matmul_nn"):
        nn.matmul_nn(a.astype(np.float64), b)


@two_threads
def test_row_kernels_split_on_our_threads_equal_the_parallel_grid_bitwise(monkeypatch):
    """Below PARALLEL_MIN the serial row functions run cut at chunk boundaries on the
    tile pool: 1 vs 2 threads and the numba parallel grid give the same bits."""
    g = np.random.default_rng(3)
    x = g.standard_normal((200, 96)).astype(np.float32)          # 7 row chunks, ragged tail
    gy = g.standard_normal((200, 96)).astype(np.float32)
    w = g.standard_normal(96).astype(np.float32)
    a = g.standard_normal(3 * nn.ELEM_CHUNK + 123).astype(np.float32)
    b = g.standard_normal(a.size).astype(np.float32)
    r = g.standard_normal((100, 4, 16)).astype(np.float32)
    ang = g.standard_normal((100, 8))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def run():
        y, rstd = nn.rms_norm_forward(x, w, 1e-6)
        return [y, rstd, *nn.rms_norm_backward(gy, x, w, rstd), nn.swiglu(a, b), *nn.swiglu_backward(b, a, b),
                nn.silu(a), nn.silu_backward(b, a), nn.sigmoid(a), nn.rope_rotate(r, cos, sin)]

    parallel = with_threads(2, run)                     # PARALLEL_MIN = 0 (fixture): numba's grid
    monkeypatch.setattr(nn, "PARALLEL_MIN", 1 << 40)
    monkeypatch.setattr(nn, "SPLIT_MIN", 0)
    for got in (with_threads(1, run), with_threads(2, run)):
        for p, q in zip(parallel, got):
            assert p.dtype == q.dtype and np.array_equal(p, q)
