"""Spirals data and MLP: determinism, shapes, init, and that SGD learns it."""
import numpy as np

from pipeline.kernels import rng
from pipeline.autograd import cross_entropy, named_parameters
from pipeline.models.spirals import SpiralsMLP, accuracy, make_spirals


def test_make_spirals_shapes_and_symmetry():
    X, y = make_spirals(noise=0.0)
    assert X.shape == (400, 2) and X.dtype == np.float32 and y.shape == (400,)
    assert (y[:200] == 0).all() and (y[200:] == 1).all()
    np.testing.assert_array_equal(X[200:], -X[:200])  # class 1 = class 0 rotated by pi
    radius = np.hypot(*X[:200].T)
    assert (np.diff(radius) > 0).all()


def test_make_spirals_is_a_function_of_seed():
    a, _ = make_spirals(seed=3)
    b, _ = make_spirals(seed=3)
    c, _ = make_spirals(seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    clean, _ = make_spirals(noise=0.0)
    np.testing.assert_allclose(a - clean, rng.gaussian(3, (400, 2), std=0.05, dtype=np.float64), atol=1e-6)


def test_mlp_parameters_and_init():
    m = SpiralsMLP(seed=1)
    names = [n for n, _ in named_parameters(m)]
    assert names == ["w1", "b1", "w2", "b2", "w3", "b3"]
    assert m.w1.shape == (64, 2) and m.w2.shape == (64, 64) and m.w3.shape == (2, 64) and m.b3.shape == (2,)
    assert np.abs(m.w2.data).max() <= 1 / 8 and np.abs(m.b1.data).max() <= 1 / np.sqrt(2)
    np.testing.assert_array_equal(m.w2.data, SpiralsMLP(seed=1).w2.data)
    assert not np.array_equal(m.w2.data, SpiralsMLP(seed=2).w2.data)


def test_sgd_learns_spirals():
    from threadpoolctl import threadpool_limits
    X, y = make_spirals()
    m = SpiralsMLP(seed=0)
    first = None
    with threadpool_limits(1):  # 400x64 GEMMs: threads only add contention
        for _ in range(1000):
            loss = cross_entropy(m(X), y)
            loss.backward()
            first = loss.item() if first is None else first
            for p in m.parameters():
                p.data -= 0.5 * p.grad
                p.grad = None
    assert loss.item() < 0.5 * first
    assert accuracy(m, X, y) > 0.8
