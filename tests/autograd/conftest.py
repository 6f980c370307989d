"""Finite-difference gradient checking shared by the autograd tests."""
import numpy as np
import pytest

from pipeline.autograd import Tensor


def numeric_grad(f, arrays, i, eps=1e-6):
    """Central differences of the scalar f(*arrays) w.r.t. arrays[i] (float64)."""
    x = arrays[i]
    g = np.zeros_like(x, dtype=np.float64)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        orig = x[idx]
        x[idx] = orig + eps
        up = f(*arrays)
        x[idx] = orig - eps
        down = f(*arrays)
        x[idx] = orig
        g[idx] = (up - down) / (2 * eps)
    return g


def check_grad(op, *arrays, wrt=None, rtol=2e-4, atol=2e-5, seed=0):
    """Compare the engine's gradient of sum(op(*tensors) * R) with central
    differences in float64, for every input index in `wrt` (default: all)."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    wrt = range(len(arrays)) if wrt is None else wrt
    out_shape = op(*[Tensor(a, dtype=np.float64) for a in arrays]).shape
    R = np.random.default_rng(seed).standard_normal(out_shape)

    def scalar(*arrs):
        return float((op(*[Tensor(a, dtype=np.float64) for a in arrs]).data.astype(np.float64) * R).sum())

    ts = [Tensor(a.copy(), requires_grad=i in wrt, dtype=np.float64) for i, a in enumerate(arrays)]
    out = op(*ts)
    out.backward(R.astype(np.float32))
    for i in wrt:
        num = numeric_grad(scalar, arrays, i)
        assert ts[i].grad is not None, f"input {i} got no gradient"
        assert ts[i].grad.dtype == np.float32
        np.testing.assert_allclose(ts[i].grad, num, rtol=rtol, atol=atol, err_msg=f"gradient of input {i}")


@pytest.fixture
def gradcheck():
    return check_grad


@pytest.fixture
def rand():
    r = np.random.default_rng(1234)
    return lambda *shape: r.standard_normal(shape)
