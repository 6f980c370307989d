"""Every differentiable op against central finite differences (float64)."""
import numba
import numpy as np
import pytest

import pipeline.autograd as ag
from pipeline.autograd import OpError, Tensor
from pipeline.threads import numba_threads


@pytest.mark.parametrize("op", [ag.add, ag.sub, ag.mul, ag.div])
def test_binary_broadcasting(gradcheck, rand, op):
    a, b = rand(3, 4), rand(4) + (3.0 if op is ag.div else 0.0)
    gradcheck(op, a, b)
    gradcheck(op, rand(2, 1, 4), rand(3, 1) + (3.0 if op is ag.div else 0.0))


@pytest.mark.parametrize("name", ["neg", "exp", "tanh", "sigmoid", "silu", "relu", "gelu", "gelu_tanh", "log", "pow"])
def test_unary(gradcheck, rand, name):
    x = rand(4, 5)
    if name == "relu":
        x = np.where(np.abs(x) < 0.05, 0.3, x)  # keep away from the kink
    fn = {"gelu_tanh": lambda t: ag.gelu(t, approximate="tanh"),
          "log": ag.log, "pow": lambda t: ag.pow(t, 3.0)}.get(name, getattr(ag, name, None))
    if name == "log":
        x = np.abs(x) + 0.5
    gradcheck(fn, x)


def test_gelu_matches_formula(rand):
    x = rand(50)
    from math import erf, sqrt
    exact = np.array([v * 0.5 * (1 + erf(v / sqrt(2))) for v in x])
    np.testing.assert_allclose(ag.gelu(Tensor(x, dtype=np.float64)).data, exact, rtol=1e-12)


def test_sigmoid_no_overflow():
    out = ag.sigmoid(Tensor(np.array([-1000.0, 0.0, 1000.0], np.float32))).data
    np.testing.assert_array_equal(out, [0.0, 0.5, 1.0])


def test_matmul_shapes(gradcheck, rand):
    gradcheck(ag.matmul, rand(3, 4), rand(4, 2))
    gradcheck(ag.matmul, rand(2, 3, 4), rand(4, 5))      # broadcast batch
    gradcheck(ag.matmul, rand(2, 1, 3, 4), rand(5, 4, 2))
    gradcheck(ag.matmul, rand(4), rand(4, 3))              # 1-D promoted
    gradcheck(ag.matmul, rand(3, 4), rand(4))


def test_linear(gradcheck, rand):
    gradcheck(ag.linear, rand(2, 3, 4), rand(5, 4), rand(5))
    gradcheck(lambda x, w: ag.linear(x, w), rand(3, 4), rand(5, 4))
    x, w, b = rand(3, 4), rand(5, 4), rand(5)
    np.testing.assert_allclose(
        ag.linear(Tensor(x, dtype=np.float64), Tensor(w, dtype=np.float64), Tensor(b, dtype=np.float64)).data,
        x @ w.T + b)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs NUMBA_NUM_THREADS >= 2")
def test_float32_linear_tiles_bits_independent_of_threads_and_within_the_summation_bound():
    """A float32 product big enough to run in tiles on our threads (pipeline.kernels.nn.matmul_nn): forward and both
    gradients are the same bits at 1 and 2 threads, and within K * 2^-24 * (|a| @ |b|) of float64."""
    r = np.random.default_rng(3)
    x, w, g = (r.standard_normal(s).astype(np.float32) for s in ((2, 128, 512), (640, 512), (2, 128, 640)))

    def run():
        xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        y = ag.linear(xt, wt)
        y.backward(g)
        return y.data, xt.grad, wt.grad

    with numba_threads(1):
        one = run()
    with numba_threads(2):
        two = run()
    x2, g2 = x.reshape(-1, 512).astype(np.float64), g.reshape(-1, 640).astype(np.float64)
    w64 = w.astype(np.float64)
    for got_1, got_2, (a, b) in zip(one, two, ((x2, w64.T), (g2, w64), (g2.T, x2))):
        np.testing.assert_array_equal(got_1, got_2)
        bound = a.shape[1] * 2.0 ** -24 * (np.abs(a) @ np.abs(b))
        assert np.all(np.abs(got_1.reshape(bound.shape) - a @ b) <= bound)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_sum_mean(gradcheck, rand, reduce):
    op = getattr(ag, reduce)
    x = rand(2, 3, 4)
    gradcheck(lambda t: op(t), x)
    gradcheck(lambda t: op(t, axis=1), x)
    gradcheck(lambda t: op(t, axis=(0, 2), keepdims=True), x)
    gradcheck(lambda t: op(t, axis=-1), x)


def test_max(gradcheck, rand):
    x = rand(3, 5)
    gradcheck(lambda t: ag.max(t, axis=1), x)
    gradcheck(lambda t: ag.max(t), x)
    gradcheck(lambda t: ag.max(t, axis=0, keepdims=True), x)


def test_max_ties_split_evenly():
    t = Tensor(np.array([1.0, 3.0, 3.0, 2.0], np.float32), requires_grad=True)
    ag.max(t).backward()
    np.testing.assert_array_equal(t.grad, [0, 0.5, 0.5, 0])


def test_shape_ops(gradcheck, rand):
    x = rand(2, 3, 4)
    gradcheck(lambda t: ag.reshape(t, 6, 4) * Tensor(np.arange(24.0).reshape(6, 4), dtype=np.float64), x)
    gradcheck(lambda t: ag.transpose(t, 0, 2), x)
    gradcheck(lambda t: ag.permute(t, 2, 0, 1), x)
    gradcheck(lambda t: t.T, x)


def test_index(gradcheck, rand):
    x = rand(4, 5)
    gradcheck(lambda t: t[1:3, ::2], x)
    gradcheck(lambda t: t[np.array([0, 2, 2, 3])], x)          # repeated rows accumulate
    gradcheck(lambda t: t[np.array([0, 1, 1]), np.array([4, 0, 0])], x)


def test_gather(gradcheck, rand):
    x = rand(3, 4)
    idx = np.array([[0, 0, 3], [1, 2, 2], [3, 3, 3]])
    gradcheck(lambda t: ag.gather(t, 1, idx), x)
    gradcheck(lambda t: ag.gather(t, 0, np.array([[0, 2, 1, 0], [2, 2, 2, 0]])), x)
    np.testing.assert_array_equal(ag.gather(Tensor(x), 1, idx).data, np.take_along_axis(x.astype(np.float32), idx, 1))


def test_embedding(gradcheck, rand):
    ids = np.array([[1, 3, 1], [0, 1, 4]])
    gradcheck(lambda tab: ag.embedding(ids, tab), rand(5, 3))


def test_concat_split(gradcheck, rand):
    gradcheck(lambda a, b, c: ag.concat([a, b, c], axis=1), rand(2, 1), rand(2, 3), rand(2, 2))
    x = rand(2, 7)
    def weighted(t):
        a, b, c = ag.split(t, [2, 4, 1], axis=1)
        return ag.concat([c * 2.0, a * 3.0, b], axis=1)
    gradcheck(weighted, x)
    pieces = ag.split(Tensor(x), 3, axis=1)
    assert [p.shape for p in pieces] == [(2, 3), (2, 3), (2, 1)]


@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_family(gradcheck, rand, axis):
    x = rand(3, 5)
    gradcheck(lambda t: ag.softmax(t, axis), x)
    gradcheck(lambda t: ag.log_softmax(t, axis), x)
    sm = ag.softmax(Tensor(x, dtype=np.float64), axis).data
    np.testing.assert_allclose(sm.sum(axis), 1.0, rtol=1e-12)
    np.testing.assert_allclose(np.exp(ag.log_softmax(Tensor(x, dtype=np.float64), axis).data), sm, rtol=1e-12)


def test_rms_norm(gradcheck, rand):
    gradcheck(lambda x, w: ag.rms_norm(x, w, eps=1e-5), rand(2, 3, 8), rand(8))
    gradcheck(lambda x: ag.rms_norm(x), rand(4, 6))
    x, w = rand(3, 8), rand(8)
    ref = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(ag.rms_norm(Tensor(x, dtype=np.float64), Tensor(w, dtype=np.float64)).data, ref,
                               rtol=1e-12)


def test_layer_norm(gradcheck, rand):
    gradcheck(ag.layer_norm, rand(2, 3, 6), rand(6), rand(6))
    gradcheck(lambda x: ag.layer_norm(x), rand(4, 5))
    gradcheck(lambda x, w: ag.layer_norm(x, w), rand(4, 5), rand(5))


def test_rope(gradcheck, rand):
    x = rand(2, 5, 3, 8)  # [batch, seq, heads, head_dim]
    gradcheck(lambda t: ag.rope(t, np.arange(5), theta=100.0), x)
    gradcheck(lambda t: ag.rope(t, np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])), x)


def test_rope_is_a_rotation(rand):
    x = rand(1, 4, 2, 6)
    out = ag.rope(Tensor(x, dtype=np.float64), np.arange(4) + 7).data
    # norms of each (i, i + h) pair are preserved; position 0 is the identity
    h = 3
    np.testing.assert_allclose(out[..., :h] ** 2 + out[..., h:] ** 2, x[..., :h] ** 2 + x[..., h:] ** 2, rtol=1e-6)
    np.testing.assert_allclose(ag.rope(Tensor(x, dtype=np.float64), np.zeros(4, int)).data, x, rtol=1e-12)


def _ref_attention(q, k, v, causal, offset):
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            s = q[b, :, h] @ k[b, :, kv].T / np.sqrt(D)
            if causal:
                s = np.where(np.arange(Sk)[None] > offset + np.arange(Sq)[:, None], -np.inf, s)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, kv]
    return out


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (6, 2), (3, 1)])
def test_attention_gqa(gradcheck, rand, hq, hkv):
    q, k, v = rand(2, 4, hq, 4), rand(2, 4, hkv, 4), rand(2, 4, hkv, 4)
    gradcheck(lambda a, b, c: ag.attention(a, b, c), q, k, v)
    out = ag.attention(*(Tensor(t, dtype=np.float64) for t in (q, k, v))).data
    np.testing.assert_allclose(out, _ref_attention(q, k, v, True, 0), rtol=1e-10)


def test_attention_offset_and_noncausal(gradcheck, rand):
    q, k, v = rand(1, 2, 4, 4), rand(1, 5, 2, 4), rand(1, 5, 2, 4)  # 2 new queries over a 5-long cache
    gradcheck(lambda a, b, c: ag.attention(a, b, c), q, k, v)                     # offset defaults to 3
    gradcheck(lambda a, b, c: ag.attention(a, b, c, offset=1), q, k, v)
    gradcheck(lambda a, b, c: ag.attention(a, b, c, causal=False), q, k, v)
    for causal, offset in ((True, 3), (True, 1), (False, 0)):
        out = ag.attention(*(Tensor(t, dtype=np.float64) for t in (q, k, v)), causal=causal, offset=offset).data
        np.testing.assert_allclose(out, _ref_attention(q, k, v, causal, offset), rtol=1e-10)


def test_dropout(gradcheck, rand):
    x = rand(6, 7)
    gradcheck(lambda t: ag.dropout(t, 0.3, seed=11), x)
    a = ag.dropout(Tensor(x, dtype=np.float64), 0.3, seed=11).data
    b = ag.dropout(Tensor(x, dtype=np.float64), 0.3, seed=11).data
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, ag.dropout(Tensor(x, dtype=np.float64), 0.3, seed=12).data)


def test_dropout_mask_from_rng():
    from pipeline.kernels import rng
    x = np.ones((50, 40), np.float32)
    out = ag.dropout(Tensor(x), 0.25, seed=5).data
    keep = rng.uniform(5, x.shape, dtype=np.float64) < 0.75
    np.testing.assert_array_equal(out != 0, keep)
    np.testing.assert_array_equal(out[keep], np.float32(1 / 0.75))
    assert 0.7 < keep.mean() < 0.8
    t = Tensor(x)
    assert ag.dropout(t, 0.0, seed=5) is t


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_to_16bit(dtype):
    import ml_dtypes
    x = Tensor(np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4), requires_grad=True)
    h = ag.to(x, dtype)
    assert h.dtype == np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    back = ag.to(h, "float32")
    (back * Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))).sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad, np.arange(12, dtype=np.float32).reshape(3, 4))


def test_16bit_weight_as_constant_and_leaf():
    import ml_dtypes
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((3, 4)).astype(np.float32), requires_grad=True)
    w16 = rng.standard_normal((5, 4)).astype(ml_dtypes.bfloat16)
    y = ag.linear(x, w16)  # a plain array is a frozen constant
    assert y.dtype == np.float32
    y.sum().backward()
    np.testing.assert_allclose(x.grad, np.ones((3, 5), np.float32) @ w16.astype(np.float32), rtol=1e-6)
    leaf = Tensor(w16, requires_grad=True)
    ag.linear(x.detach(), leaf).sum().backward()
    assert leaf.grad.dtype == np.float32 and leaf.grad.shape == (5, 4)


def test_checkpoint_bitwise_equal(rand):
    x0, w0, v0 = rand(4, 6).astype(np.float32), rand(6, 6).astype(np.float32), rand(6).astype(np.float32)

    def block(x, v):
        h = ag.tanh(ag.linear(x, w, v))
        return ag.rms_norm(ag.dropout(h, 0.2, seed=3) + x)

    grads = []
    for use_ckpt in (False, True):
        w = Tensor(w0, requires_grad=True)  # captured by the block: still gets its gradient
        x, v = Tensor(x0, requires_grad=True), Tensor(v0, requires_grad=True)
        y = ag.checkpoint(block, x, v) if use_ckpt else block(x, v)
        (ag.sum(y * y)).backward()
        grads.append((x.grad, v.grad, w.grad, y.data))
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_only_captured_weights_trainable(rand):
    w = Tensor(rand(3, 3).astype(np.float32), requires_grad=True)
    x = Tensor(rand(2, 3).astype(np.float32))
    y = ag.checkpoint(lambda t: ag.linear(t, w), x)
    assert y.requires_grad
    y.sum().backward()
    np.testing.assert_allclose(w.grad, np.ones((2, 3), np.float32).T @ x.data, rtol=1e-6)


def test_checkpoint_keeps_no_intermediates(rand):
    x = Tensor(rand(2, 3).astype(np.float32), requires_grad=True)
    y = ag.checkpoint(lambda t: ag.tanh(ag.exp(t)), x)
    assert y._parents == (x,) and y._op == "checkpoint"


def test_constants_are_not_differentiated(rand):
    a = Tensor(rand(3).astype(np.float32), requires_grad=True)
    frozen = Tensor(rand(3).astype(np.float32))  # requires_grad False
    (a * frozen + np.ones(3, np.float32) * 2.0).sum().backward()
    np.testing.assert_array_equal(a.grad, frozen.data)
    assert frozen.grad is None


def test_backward_twice_raises(rand):
    a = Tensor(rand(3).astype(np.float32), requires_grad=True)
    y = ag.sum(ag.tanh(a))
    y.backward()
    with pytest.raises(ag.GraphError):
        y.backward()


@pytest.mark.parametrize("call, words", [
    (lambda: ag.matmul(Tensor(np.zeros((2, 3))), Tensor(np.zeros((4, 5)))), ["matmul", "(2, 3)", "(4, 5)"]),
    (lambda: ag.linear(Tensor(np.zeros((2, 3))), Tensor(np.zeros((4, 5)))), ["linear", "(2, 3)", "(4, 5)"]),
    (lambda: ag.add(Tensor(np.zeros((2, 3))), Tensor(np.zeros((4,)))), ["add", "(2, 3)", "(4,)"]),
    (lambda: ag.reshape(Tensor(np.zeros((2, 3))), 4, 2), ["reshape", "(2, 3)"]),
    (lambda: ag.embedding(np.array([0.5]), Tensor(np.zeros((4, 2)))), ["embedding", "float64"]),
    (lambda: ag.embedding(np.array([7]), Tensor(np.zeros((4, 2)))), ["embedding", "[0, 4)"]),
    (lambda: ag.attention(*(Tensor(np.zeros((1, 2, h, 4))) for h in (3, 2, 2))), ["attention", "3", "2"]),
    (lambda: ag.rms_norm(Tensor(np.zeros((2, 3))), Tensor(np.zeros(4))), ["rms_norm", "(4,)", "(2, 3)"]),
    (lambda: ag.dropout(Tensor(np.zeros(3)), 1.0, 0), ["dropout", "p"]),
    (lambda: ag.concat([Tensor(np.zeros((2, 3))), Tensor(np.zeros((3, 3)))], axis=1), ["concat"]),
    (lambda: ag.split(Tensor(np.zeros((2, 3))), [1, 1], axis=1), ["split", "3"]),
    (lambda: ag.to(Tensor(np.zeros(3)), "int8"), ["to"]),
])
def test_bad_inputs_name_op_and_shapes(call, words):
    with pytest.raises(OpError) as e:
        call()
    for w in words:
        assert w in str(e.value)


def test_index_out_of_range_is_an_index_error():
    with pytest.raises(IndexError, match="index"):
        Tensor(np.zeros((2, 3)))[5]


def test_attention_query_blocks_match_one_block(monkeypatch):
    from pipeline.autograd import ops
    r = np.random.default_rng(9)
    arrays = [r.standard_normal((2, sq, h, 8)) for sq, h in ((150, 6), (170, 2), (170, 2))]  # 3 blocks, offset 20
    g = r.standard_normal((2, 150, 6, 8)).astype(np.float32)
    res = []
    for block in (64, 10**6):
        monkeypatch.setattr(ops, "_ATTN_QBLOCK", block)
        ts = [Tensor(a, requires_grad=True, dtype=np.float64) for a in arrays]
        out = ag.attention(*ts)
        out.backward(g)
        res.append([out.data] + [t.grad for t in ts])
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(res[0][0], _ref_attention(*arrays, True, 20), rtol=1e-10)


def test_sqrt_abs_clamp_where_stack(gradcheck, rand):
    x = rand(4, 5)
    x = np.where(np.abs(x) < 0.05, 0.4, x)  # away from the kinks
    gradcheck(lambda t: ag.sqrt(t), np.abs(x) + 0.1)
    gradcheck(lambda t: ag.abs(t), x)
    gradcheck(lambda t: ag.clamp(t, -0.5, 0.7), np.where(np.abs(np.abs(x) - 0.6) < 0.1, 0.2, x))
    cond = x > 0
    gradcheck(lambda a, b: ag.where(cond, a, b), rand(4, 5), rand(5))
    gradcheck(lambda a, b, c: ag.stack([a, b, c], axis=1), rand(2, 3), rand(2, 3), rand(2, 3))
    np.testing.assert_array_equal(ag.stack([Tensor(x), Tensor(x)], -1).data, np.stack([x, x], -1).astype(np.float32))
    with pytest.raises(OpError, match="where: cond must be a boolean"):
        ag.where(x, x, x)


def test_float32_kernel_paths_match_float64(rand):
    """float32 sigmoid/SiLU/RoPE run numba kernels (float64 stays numpy): same values and gradients."""
    x = rand(2, 5, 3, 8)
    g = rand(2, 5, 3, 8)
    pos = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    for fn in (ag.sigmoid, ag.silu, lambda t: ag.rope(t, pos, theta=100.0), lambda t: ag.rope(t, np.arange(5))):
        res = []
        for dt in (np.float32, np.float64):
            t = Tensor(x.astype(dt), requires_grad=True, dtype=dt)
            out = fn(t)
            out.backward(g.astype(np.float32))
            res.append((out.data.astype(np.float64), t.grad))
        np.testing.assert_allclose(res[0][0], res[1][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(res[0][1], res[1][1], rtol=1e-5, atol=1e-6)
