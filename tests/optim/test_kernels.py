"""pipeline/kernels/optim.py against numpy references, and thread-count invariance."""
import ml_dtypes
import numba
import numpy as np
import pytest

from pipeline.kernels import optim as K

BIG = K.PARALLEL_MIN + 12345  # large enough to take the parallel entry points


def fma(x, y, z):
    """float32 fused multiply-add reference: the float64 product of two float32s is exact; the sum
    is rounded to float64 then float32 (a double rounding that is harmless for these data)."""
    return (np.asarray(x, np.float64) * np.asarray(y, np.float64) + np.asarray(z, np.float64)).astype(np.float32)


def lerp(a, b, w):
    w = np.float32(w)
    if abs(w) < 0.5:
        return fma(w, b - a, a)
    return fma(w - np.float32(1), b - a, b)


def data(n, seed=0):
    rs = np.random.RandomState(seed)
    return [rs.randn(n).astype(np.float32) for _ in range(4)]


def test_bf16_narrowing_matches_ml_dtypes_and_keeps_nan():
    rs = np.random.RandomState(3)
    x = np.concatenate([rs.randn(5000).astype(np.float32) * 10 ** rs.uniform(-30, 30, 5000).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, 3.4e38, 1.00390625, 1.01171875], np.float32)])
    bits = K.f32_to_bf16_bits(x)
    ref = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(bits, ref)  # round-to-nearest-even, including the ties above
    nans = np.array([np.nan, -np.nan], np.float32)
    nans = np.concatenate([nans, np.array([0x7F800001, 0xFF800001, 0x7FFFFFFF], np.uint32).view(np.float32)])
    out = K.bf16_bits_to_f32(K.f32_to_bf16_bits(nans))
    assert np.isnan(out).all()  # a plain RNE add would turn 0x7F800001 into inf; the guard keeps NaN
    assert np.array_equal(np.signbit(out), np.signbit(nans))


def test_bf16_widening_is_exact():
    bits = np.arange(0, 1 << 16, 7, dtype=np.uint16)
    ref = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    got = K.bf16_bits_to_f32(bits)
    finite = np.isfinite(ref)
    assert np.array_equal(got[finite], ref[finite])


def ref_adam(p, g, m, v, keep, l2, w1, b2, omb2, nss, bc2s, eps):
    f = np.float32
    g = fma(p, f(l2), g) if l2 else g
    p = p * f(keep) if keep != 1 else p
    m1 = lerp(m, g, w1)
    v1 = fma(f(omb2) * g, g, v * f(b2))
    return p + (f(nss) * m1) / (np.sqrt(v1) / f(bc2s) + f(eps)), m1, v1


@pytest.mark.parametrize("n", [1000, BIG])
@pytest.mark.parametrize("l2,keep", [(0.0, 0.999), (0.01, 1.0)])
def test_adam_kernel_matches_numpy(n, l2, keep):
    p, g, m, v = data(n)
    v = np.abs(v)
    args = (np.float32(keep), np.float32(l2), np.float32(0.1), np.float32(0.999), np.float32(0.001),
            np.float32(-0.003), np.float32(0.05), np.float32(1e-8))
    rp, rm, rv = ref_adam(p, g, m, v, *args)
    K.adam_step(p, g, m, v, *args)
    assert np.array_equal(p, rp) and np.array_equal(m, rm) and np.array_equal(v, rv)


@pytest.mark.parametrize("nesterov,first,wd", [(False, True, 0.0), (False, False, 0.1), (True, False, 0.01)])
def test_sgd_kernel_matches_numpy(nesterov, first, wd):
    p, g, buf, _ = data(BIG)
    f = np.float32
    d = fma(p, f(wd), g) if wd else g
    b = d.copy() if first else fma(d, f(0.7), buf * f(0.9))
    upd = fma(b, f(0.9), d) if nesterov else b
    ref = fma(upd, f(-0.05), p)
    K.sgd_step(p, g, buf, 0.05, 0.9, 0.7, wd, True, first, nesterov)
    assert np.array_equal(p, ref) and np.array_equal(buf, b)


def test_lion_kernel_matches_numpy():
    p, g, m, _ = data(5000)
    f = np.float32
    u = fma(g, f(0.1), m * f(0.9))
    ref_p = fma(np.sign(u), f(-1e-3), p * f(0.99))
    ref_m = fma(g, f(0.01), m * f(0.99))
    K.lion_step(p, g, m, 0.99, -1e-3, 0.9, 0.1, 0.99, 0.01)
    assert np.array_equal(p, ref_p) and np.array_equal(m, ref_m)


@pytest.mark.parametrize("n", [777, BIG])
def test_hf_adamw_kernel_matches_numpy(n):
    p, g, m, v = data(n, seed=2)
    v = np.abs(v)
    f = np.float32
    m1 = fma(g, f(0.1), m * f(0.9))
    v1 = fma(f(0.001) * g, g, v * f(0.999))
    p1 = fma(m1 / (np.sqrt(v1) + f(1e-6)), f(-0.01), p)
    p1 = fma(p1, f(-1e-4), p1)
    K.hf_adamw_step(p, g, m, v, 0.9, 0.1, 0.999, 0.001, 1e-6, -0.01, -1e-4)
    assert np.array_equal(p, p1) and np.array_equal(m, m1) and np.array_equal(v, v1)


def test_muon_momentum_kernel_matches_torch_lerp_formulas():
    g, buf, _, _ = data(3000)
    b1 = lerp(buf, g, np.float32(0.05))
    ref = lerp(g, b1, np.float32(0.95))
    out = K.muon_momentum(g, buf, 0.05, 0.95, True)
    assert np.array_equal(buf, b1) and np.array_equal(out, ref)


def test_bf16_state_arm_widens_and_narrows():
    p, g, m32, v32 = data(4000)
    v32 = np.abs(v32)
    m16 = K.f32_to_bf16_bits(m32)
    v16 = K.f32_to_bf16_bits(v32)
    p2 = p.copy()
    args = (np.float32(1), np.float32(0), np.float32(0.1), np.float32(0.999), np.float32(0.001),
            np.float32(-0.003), np.float32(0.05), np.float32(1e-8))
    rp, rm, rv = ref_adam(p, g, K.bf16_bits_to_f32(m16), K.bf16_bits_to_f32(v16), *args)
    K.adam_step(p2, g, m16, v16, *args)
    assert np.array_equal(p2, rp)  # the step uses the unrounded float32 moments
    assert np.array_equal(m16, K.f32_to_bf16_bits(rm)) and np.array_equal(v16, K.f32_to_bf16_bits(rv))


def test_sum_squares_is_float64_and_chunk_ordered():
    x = np.random.RandomState(1).randn(BIG).astype(np.float32)
    ref = 0.0
    for c in range(0, x.size, K.CHUNK):
        ref += float(np.sum(x[c:c + K.CHUNK].astype(np.float64) ** 2))
    assert abs(K.sum_squares(x) - ref) <= 1e-12 * ref
    assert K.sum_squares(x) == K.sum_squares_ser(x)  # parallel and serial: same bits


def test_one_vs_two_threads_bitwise():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba was started with one thread")
    results = []
    for threads in (1, 2):
        numba.set_num_threads(threads)
        try:
            p, g, m, v = data(BIG, seed=5)
            v = np.abs(v)
            K.adam_step(p, g, m, v, 0.999, 0.0, 0.1, 0.999, 0.001, -0.003, 0.05, 1e-8)
            q, g2, buf, _ = data(BIG, seed=6)
            K.sgd_step(q, g2, buf, 0.05, 0.9, 1.0, 0.01, True, False, True)
            r, g3, mb, _ = data(BIG, seed=7)
            mb16 = K.f32_to_bf16_bits(mb)
            K.lion_step(r, g3, mb16, 0.99, -1e-3, 0.9, 0.1, 0.99, 0.01)
            upd = K.muon_momentum(g3, mb.copy(), 0.05, 0.95, True)
            results.append((p, m, v, q, buf, r, mb16, upd, K.sum_squares(g)))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_wrappers_reject_bad_arrays():
    p = np.zeros(10, np.float32)
    with pytest.raises(TypeError, match="float32"):
        K.adam_step(p.astype(np.float64), p, p, p, 1, 0, .1, .9, .1, -1, 1, 1e-8)
    with pytest.raises(ValueError, match="elements"):
        K.adam_step(p, np.zeros(9, np.float32), p, p, 1, 0, .1, .9, .1, -1, 1, 1e-8)
    with pytest.raises(ValueError, match=r"\[10\]"):
        K.lion_step(p, p, np.zeros(4, np.float32), 1, -1, .9, .1, .9, .1)
    with pytest.raises(TypeError, match="uint16"):
        K.lion_step(p, p, np.zeros(10, np.float64), 1, -1, .9, .1, .9, .1)
