"""Engine bookkeeping: accumulation, adoption of fresh gradient buffers, no aliasing."""
import numpy as np

import pipeline.autograd as ag
from pipeline.autograd import Tensor


def test_shared_upstream_gradient_is_never_aliased():
    a = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
    b = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
    ag.sum(ag.add(a, b) * 2.0).backward()  # add hands the same array to both parents
    assert not np.shares_memory(a.grad, b.grad)
    a.grad += 1.0
    np.testing.assert_array_equal(b.grad, 2.0)


def test_caller_gradient_is_copied():
    c = Tensor(np.ones(6, np.float32), requires_grad=True)
    g = np.ones((2, 3), np.float32)
    ag.reshape(c, 2, 3).backward(g)
    assert not np.shares_memory(c.grad, g)
    g[:] = 5.0
    np.testing.assert_array_equal(c.grad, 1.0)


def test_accumulation_adds_across_backwards():
    x = Tensor(np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32), requires_grad=True)
    labels = np.array([0, 1, 2, 3])
    ag.cross_entropy(x, labels).backward()
    first = x.grad.copy()
    ag.cross_entropy(x, labels).backward()
    np.testing.assert_allclose(x.grad, 2 * first, rtol=1e-6)


def test_no_grad_builds_no_graph():
    w = Tensor(np.ones(3, np.float32), requires_grad=True)
    with ag.no_grad():
        y = ag.tanh(w * 2.0)
    assert not y.requires_grad and y._parents == ()
