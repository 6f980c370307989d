"""Cross-entropy: PyTorch goldens, finite differences, fused vs composed, edge cases."""
import json
import pathlib

import numpy as np
import pytest

import pipeline.autograd as ag
from pipeline.autograd import OpError, Tensor

GOLDENS = pathlib.Path(__file__).resolve().parent.parent / "goldens" / "ce"
CASES = json.loads((GOLDENS / "meta.json").read_text())["cases"]


@pytest.fixture(scope="module")
def goldens():
    with np.load(GOLDENS / "ce_goldens.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cross_entropy_matches_torch_goldens(goldens, name):
    case = CASES[name]
    logits = Tensor(goldens[f"{name}/logits"], requires_grad=True)
    loss = ag.cross_entropy(logits, goldens[f"{name}/labels"], ignore_index=case["ignore_index"],
                            reduction=case["reduction"], label_smoothing=case["label_smoothing"])
    np.testing.assert_allclose(loss.data, goldens[f"{name}/loss"], rtol=1e-6, atol=0)
    upstream = goldens[f"{name}/upstream"]
    loss.backward(upstream if case["reduction"] == "none" else None)
    ref = goldens[f"{name}/grad"]
    np.testing.assert_allclose(logits.grad, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("name", sorted(k for k, c in CASES.items() if c["classes"] <= 100))
def test_linear_cross_entropy_matches_torch_goldens(goldens, name):
    # logits = x @ I.T: the fused op on an identity weight is plain cross-entropy
    case = CASES[name]
    x = Tensor(goldens[f"{name}/logits"], requires_grad=True)
    eye = Tensor(np.eye(case["classes"], dtype=np.float32))
    loss = ag.linear_cross_entropy(x, eye, goldens[f"{name}/labels"], ignore_index=case["ignore_index"],
                                   reduction=case["reduction"], label_smoothing=case["label_smoothing"])
    np.testing.assert_allclose(loss.data, goldens[f"{name}/loss"], rtol=1e-6)
    loss.backward(goldens[f"{name}/upstream"] if case["reduction"] == "none" else None)
    ref = goldens[f"{name}/grad"]
    np.testing.assert_allclose(x.grad, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_finite_differences(gradcheck, rand, reduction, eps):
    labels = np.array([[0, 3, -100], [2, 2, 1]])
    gradcheck(lambda t: ag.cross_entropy(t, labels, reduction=reduction, label_smoothing=eps), rand(2, 3, 4))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_finite_differences(gradcheck, rand, reduction):
    labels = np.array([0, 4, -100, 2, 1])
    gradcheck(lambda x, w: ag.linear_cross_entropy(x, w, labels, reduction=reduction, label_smoothing=0.1),
              rand(5, 3), rand(6, 3))


@pytest.mark.parametrize("chunk_rows", [None, 1, 3, 64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_matches_composed(rand, chunk_rows, reduction):
    x0, w0 = rand(2, 5, 8).astype(np.float32), rand(13, 8).astype(np.float32)
    labels = np.array([[1, 12, -100, 0, 5], [7, 7, 2, -100, 11]])
    up = rand(2, 5).astype(np.float32) if reduction == "none" else None
    res = []
    for fused in (False, True):
        x, w = Tensor(x0, requires_grad=True), Tensor(w0, requires_grad=True)
        if fused:
            loss = ag.linear_cross_entropy(x, w, labels, reduction=reduction, label_smoothing=0.05,
                                           chunk_rows=chunk_rows)
        else:
            loss = ag.cross_entropy(ag.linear(x, w), labels, reduction=reduction, label_smoothing=0.05)
        loss.backward(up)
        res.append((loss.data, x.grad, w.grad))
    # No bitwise claim: the fused path multiplies only the supervised rows, and a BLAS may pick another kernel
    # (another summation order) for another row count -- OpenBLAS does, one ulp apart on this shape.
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_skips_ignored_rows_exactly(rand, reduction):
    """Ignored rows never enter the GEMMs: the loss and gradients equal a run on the
    supervised rows alone, and the ignored rows' input gradient is exactly zero."""
    x0, w0 = rand(7, 8).astype(np.float32), rand(13, 8).astype(np.float32)
    labels = np.array([-100, 3, -100, -100, 12, 0, 5])
    keep = labels != -100
    x, w = Tensor(x0, requires_grad=True), Tensor(w0, requires_grad=True)
    loss = ag.linear_cross_entropy(x, w, labels, reduction=reduction)
    loss.backward()
    xs, ws = Tensor(np.ascontiguousarray(x0[keep]), requires_grad=True), Tensor(w0, requires_grad=True)
    ref = ag.linear_cross_entropy(xs, ws, labels[keep], reduction=reduction)
    ref.backward()
    np.testing.assert_array_equal(loss.data, ref.data)
    np.testing.assert_array_equal(x.grad[keep], xs.grad)
    np.testing.assert_array_equal(x.grad[~keep], 0.0)
    np.testing.assert_array_equal(w.grad, ws.grad)


def test_fused_keeps_no_logits_in_graph(rand):
    x = Tensor(rand(4, 3).astype(np.float32), requires_grad=True)
    w = Tensor(rand(5, 3).astype(np.float32), requires_grad=True)
    loss = ag.linear_cross_entropy(x, w, np.array([0, 1, 2, 3]))
    assert loss._parents == (x, w)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_is_zero_loss_zero_grad(rand, fused, reduction):
    x = Tensor(rand(3, 4).astype(np.float32), requires_grad=True)
    labels = np.full(3, -100)
    if fused:
        loss = ag.linear_cross_entropy(x, Tensor(np.eye(4, dtype=np.float32)), labels, reduction=reduction)
    else:
        loss = ag.cross_entropy(x, labels, reduction=reduction)
    np.testing.assert_array_equal(loss.data, np.zeros(loss.shape, np.float32))
    loss.backward(np.ones(loss.shape, np.float32))
    np.testing.assert_array_equal(x.grad, np.zeros((3, 4), np.float32))


def test_mean_is_serial_sum_over_valid_rows(rand):
    logits = rand(9, 5).astype(np.float32)
    labels = np.array([0, 1, -100, 2, 3, 4, -100, 0, 1])
    per_row = ag.cross_entropy(Tensor(logits), labels, reduction="none").data
    total = ag.cross_entropy(Tensor(logits), labels, reduction="sum").data
    mean = ag.cross_entropy(Tensor(logits), labels, reduction="mean").data
    np.testing.assert_allclose(total, per_row.astype(np.float64).sum(), rtol=1e-6)
    np.testing.assert_allclose(mean, total / 7, rtol=1e-6)
    assert per_row[2] == 0 and per_row[6] == 0


@pytest.mark.parametrize("fn", ["ce", "lce"])
def test_bad_labels(fn):
    logits = Tensor(np.zeros((3, 4), np.float32))
    call = (lambda lab: ag.cross_entropy(logits, lab)) if fn == "ce" else \
        (lambda lab: ag.linear_cross_entropy(logits, np.eye(4, dtype=np.float32), lab))
    with pytest.raises(OpError, match=r"label 4 at position 1 is out of range \[0, 4\)"):
        call(np.array([0, 4, 1]))
    with pytest.raises(OpError, match="label -1"):
        call(np.array([0, -1, 1]))
    with pytest.raises(OpError, match="labels must be integers, got dtype float32"):
        call(np.array([0, 1, 1], np.float32))
    with pytest.raises(OpError, match=r"labels shape \(2,\) must equal the leading shape \(3,\)"):
        call(np.array([0, 1]))


def test_bad_options():
    logits = Tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(OpError, match="reduction"):
        ag.cross_entropy(logits, np.array([0, 1]), reduction="avg")
    with pytest.raises(OpError, match="label_smoothing"):
        ag.cross_entropy(logits, np.array([0, 1]), label_smoothing=1.0)
    with pytest.raises(OpError, match=r"linear_cross_entropy: x \(2, 3\) and weight \(4, 5\)"):
        ag.linear_cross_entropy(logits, np.zeros((4, 5), np.float32), np.array([0, 1]))


# --- frozen head: one pass over w (pipeline/kernels/headce.py) vs the two-pass path -------------

@pytest.fixture
def head_calls(monkeypatch):
    """Record the row count of every one-pass head call linear_cross_entropy makes."""
    from pipeline.autograd import losses
    calls = []
    real = losses.head_ce

    def counting(X, *args, **kwargs):
        calls.append(X.shape[0])
        return real(X, *args, **kwargs)

    monkeypatch.setattr(losses, "head_ce", counting)
    return calls


def small_grid(monkeypatch):
    """Several segments and a partial last chunk even for a small vocabulary."""
    from pipeline.kernels import headce
    monkeypatch.setattr(headce, "SEGMENT_ROWS", 128)
    monkeypatch.setattr(headce, "CHUNK_ROWS", 48)


def run_head(x0, w0, labels, frozen, loss_scale=None, up=None, **kw):
    x = Tensor(x0, requires_grad=True)
    w = w0 if frozen else Tensor(w0, requires_grad=True)  # a trainable w takes the two-pass path
    loss = ag.linear_cross_entropy(x, w, labels, **kw)
    if loss_scale is not None:
        loss = loss * np.float32(loss_scale)
    loss.backward(up)
    return loss.data, x.grad


@pytest.mark.parametrize("chunk_rows", [None, 3])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduction,loss_scale", [("mean", None), ("sum", 0.25), ("none", None)])
def test_frozen_head_matches_two_pass_path(monkeypatch, head_calls, chunk_rows, eps, reduction, loss_scale):
    small_grid(monkeypatch)
    r = np.random.default_rng(7)
    x0 = r.standard_normal((2, 9, 16)).astype(np.float32)
    w0 = (r.standard_normal((500, 16)) * 0.5).astype(np.float32)
    labels = r.integers(0, 500, (2, 9))
    labels[0, [1, 4]] = -100
    labels[1, 8] = 499  # the last class, in the last (partial) chunk
    up = r.standard_normal((2, 9)).astype(np.float32) if reduction == "none" else None
    kw = dict(reduction=reduction, label_smoothing=eps, chunk_rows=chunk_rows)
    fast = run_head(x0, w0, labels, True, loss_scale, up, **kw)
    assert head_calls and sum(head_calls) == 16 and max(head_calls) <= (chunk_rows or 16)
    n_fast = len(head_calls)
    two_pass = run_head(x0, w0, labels, False, loss_scale, up, **kw)
    assert len(head_calls) == n_fast  # the trainable-w run did not take the one-pass path
    np.testing.assert_allclose(fast[0], two_pass[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(fast[1], two_pass[1], rtol=0, atol=2e-6 * np.abs(two_pass[1]).max())
    np.testing.assert_array_equal(fast[1][0, [1, 4]], 0.0)  # ignored rows: exactly zero gradient


def test_frozen_head_all_ignored_and_fallbacks(head_calls, rand):
    x0, w0 = rand(4, 8).astype(np.float32), rand(13, 8).astype(np.float32)
    loss, gx = run_head(x0, w0, np.full(4, -100), True, reduction="mean")
    assert loss == 0 and not gx.any() and head_calls == []
    with ag.no_grad():  # no gradient wanted: the plain forward
        ag.linear_cross_entropy(Tensor(x0, requires_grad=True), w0, np.arange(4))
    ag.linear_cross_entropy(Tensor(x0, requires_grad=True, dtype=np.float64), Tensor(w0, dtype=np.float64),
                            np.arange(4))
    assert head_calls == []
    ag.linear_cross_entropy(Tensor(x0, requires_grad=True), w0, np.arange(4))
    assert head_calls == [4]


@pytest.mark.skipif(__import__("numba").config.NUMBA_NUM_THREADS < 2, reason="needs NUMBA_NUM_THREADS >= 2")
def test_frozen_head_thread_count_bitwise(monkeypatch):
    import numba
    small_grid(monkeypatch)
    r = np.random.default_rng(3)
    x0 = r.standard_normal((21, 16)).astype(np.float32)
    w0 = r.standard_normal((700, 16)).astype(np.float32)
    labels = r.integers(0, 700, 21)
    labels[5] = -100
    out, prev = [], numba.get_num_threads()
    try:
        for threads in (1, 2):
            numba.set_num_threads(threads)
            out.append(run_head(x0, w0, labels, True, reduction="sum"))
    finally:
        numba.set_num_threads(prev)
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)
