"""ops.attention's backward recomputing the probabilities (ATTN_RECOMPUTE_MIN_KEYS) gives the bits of the
backward that kept them: outputs and q/k/v gradients, causal with GQA, a sliding window and packed segments."""
import numpy as np
import pytest

from pipeline.autograd import ops
from pipeline.autograd.tensor import Tensor


def _run(monkeypatch, threshold, seq, **kw):
    monkeypatch.setattr(ops, "ATTN_RECOMPUTE_MIN_KEYS", threshold)
    g = np.random.default_rng(0)
    q, k, v = (Tensor(g.standard_normal((2, seq, h, 16)).astype(np.float32), requires_grad=True)
               for h in (6, 2, 2))
    out = ops.attention(q, k, v, causal=True, **kw)
    (out * Tensor(g.standard_normal(out.shape).astype(np.float32))).sum().backward()
    return [out.data, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("kw", [{}, {"window": 50}, {"segments": np.repeat([0, 1, 2], [70, 90, 40])}],
                         ids=["causal", "window", "segments"])
def test_recomputed_probabilities_give_the_kept_bits(monkeypatch, kw):
    kept = _run(monkeypatch, None, 200, **kw)
    again = _run(monkeypatch, 0, 200, **kw)
    for a, b in zip(kept, again):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
