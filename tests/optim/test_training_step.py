"""Clipping, gradient scaling, schedules, and gradient accumulation through the autograd engine."""
import math

import numba
import numpy as np
import pytest

from pipeline.kernels import rng
from pipeline.autograd import cross_entropy, matmul, parameter
from pipeline.optim import (SGD, AdamW, LrSchedule, Muon, OptimizerConfigError, OptimizerSet, clip_grad_norm,
                            context_at, scale_gradients, warmup_cosine_factor, warmup_hold_linear_cooldown)
from pipeline.optim.clip import grad_norm


def params_with_grads(scale=1.0):
    ps = [parameter(rng.gaussian(i, shape)) for i, shape in enumerate([(30, 7), (7,), (200, 9)])]
    for i, p in enumerate(ps):
        p.grad = rng.gaussian(50 + i, p.shape) * np.float32(scale)
    return ps


# --- clipping ------------------------------------------------------------------------

def test_clip_matches_torch_semantics():
    ps = params_with_grads(3.0)
    before = [p.grad.copy() for p in ps]
    total = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in before))
    norm = clip_grad_norm(ps, 1.0)
    assert norm == pytest.approx(total, rel=1e-12)  # returns the PRE-clip norm
    coef = np.float32(1.0 / (total + 1e-6))
    for p, g in zip(ps, before):
        assert np.array_equal(p.grad, g * coef)
    assert grad_norm(ps) == pytest.approx(1.0, rel=1e-5)


def test_clip_below_the_bound_changes_nothing():
    ps = params_with_grads(1e-3)
    before = [p.grad.copy() for p in ps]
    clip_grad_norm(ps, 10.0)
    assert all(np.array_equal(p.grad, g) for p, g in zip(ps, before))
    with pytest.raises(OptimizerConfigError, match="max_norm"):
        clip_grad_norm(ps, 0.0)


def test_set_clip_is_global_across_members():
    ps = params_with_grads(5.0)
    ref = [p.grad.copy() for p in ps]
    s = OptimizerSet(AdamW(ps[:1]), SGD(ps[1:]))
    norm = s.clip_grad_norm(1.0)
    ref_ps = params_with_grads(5.0)
    assert norm == clip_grad_norm(ref_ps, 1.0)  # same as clipping all parameters together
    for p, r in zip(ps, ref_ps):
        assert np.array_equal(p.grad, r.grad)
    assert not np.array_equal(ps[0].grad, ref[0])


def test_clip_norm_is_thread_count_invariant():
    big = parameter(np.zeros((400, 1000), np.float32))
    big.grad = rng.gaussian(3, big.shape)
    norms = []
    for threads in (1, 2):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        norms.append(grad_norm([big]))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert norms[0] == norms[1]


def test_scale_gradients():
    ps = params_with_grads()
    before = [p.grad.copy() for p in ps]
    scale_gradients(ps, 0.25)
    assert all(np.array_equal(p.grad, g * np.float32(0.25)) for p, g in zip(ps, before))


# --- schedules --------------------------------------------------------------------------

def test_warmup_cosine_factor():
    assert warmup_cosine_factor(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine_factor(9, 100, 10, 0.1) == 1.0
    assert warmup_cosine_factor(10, 100, 10, 0.1) == 1.0
    assert warmup_cosine_factor(55, 100, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert warmup_cosine_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine_factor(500, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine_factor(3, 5, 10, 0.2) == pytest.approx(0.4)
    assert warmup_cosine_factor(20, 5, 10, 0.2) == 0.2


def test_seed_004_schedule_table():
    total = int(330e6 // 32768)
    assert total == 10070
    rows = {s: (round(warmup_hold_linear_cooldown(s, total, 200, 0.3), 3), context_at(s, total, 512, True))
            for s in [0, 99, 199, 1006, 1007, 3021, 7048, 8500, 10069]}
    assert rows[0] == (0.005, 128) and rows[99] == (0.5, 128) and rows[199] == (1.0, 128)
    assert rows[1006] == (1.0, 128) and rows[1007] == (1.0, 256) and rows[3021] == (1.0, 512)
    assert rows[7048] == (1.0, 512) and rows[8500] == (0.52, 512) and rows[10069] == (0.0, 512)
    assert context_at(5, 100, 512, False) == 512 and context_at(0, 100, 128, True) == 64


def test_lr_schedule_captures_bases_including_the_muon_fallback():
    ps = params_with_grads()
    muon = Muon([ps[0], ps[1]], lr=0.02)
    adam = AdamW([ps[2]], lr=1e-3)
    sched = LrSchedule(OptimizerSet(muon, adam))
    sched.apply(0.5)
    assert (muon.lr, muon.fallback.lr, adam.lr) == (0.01, 1.5e-4, 5e-4)
    sched.apply(warmup_cosine_factor(0, 10, 4))
    assert muon.fallback.lr == pytest.approx(3e-4 / 4)
    with pytest.raises(OptimizerConfigError, match="already attached"):
        sched.attach(adam)


# --- gradient accumulation ------------------------------------------------------------------

V, D = 11, 6


def token_batches(n_micro, rows):
    """Micro-batches of (features, labels) with uneven supervised counts (-100 = ignored)."""
    out = []
    for k in range(n_micro):
        x = rng.gaussian(200 + k, (rows, D))
        labels = (rng.at_values(300 + k, np.arange(rows)) % V).astype(np.int64)
        labels[: (k * 3) % rows] = -100  # micro-batch k hides a different number of tokens
        out.append((x, labels))
    return out


def make_model():
    return parameter(rng.gaussian(7, (D, V)) * np.float32(0.3)), parameter(rng.gaussian(8, (V,)) * np.float32(0.1))


def loss_of(W, b, x, labels, reduction, scale=1.0):
    logits = matmul(x, W) + b
    loss = cross_entropy(logits, labels, reduction=reduction)
    return loss * scale if scale != 1.0 else loss


def test_accumulated_sum_over_total_valid_equals_the_big_batch():
    batches = token_batches(4, 8)
    total_valid = sum(int((lab != -100).sum()) for _, lab in batches)
    W, b = make_model()
    for x, lab in batches:  # N backwards ADD into the grads
        loss_of(W, b, x, lab, "sum", 1.0 / total_valid).backward()
    W2, b2 = make_model()
    X = np.concatenate([x for x, _ in batches])
    L = np.concatenate([lab for _, lab in batches])
    loss_of(W2, b2, X, L, "mean").backward()  # one big batch, true token mean
    for a, ref in ((W.grad, W2.grad), (b.grad, b2.grad)):
        assert np.abs(a - ref).max() <= 1e-5 * np.abs(ref).max()
    # mean-of-means weights micro-batches, not tokens: measurably different
    W3, b3 = make_model()
    for x, lab in batches:
        loss_of(W3, b3, x, lab, "mean", 1.0 / len(batches)).backward()
    assert np.abs(W3.grad - W2.grad).max() > 1e-3 * np.abs(W2.grad).max()


def test_clip_once_per_window_and_mid_window_clipping_is_wrong():
    batches = token_batches(3, 8)
    total_valid = sum(int((lab != -100).sum()) for _, lab in batches)

    def window(clip_each_micro):
        W, b = make_model()
        opt = SGD([("W", W), ("b", b)], lr=0.1)  # SGD: the step is proportional to the gradient
        for x, lab in batches:
            loss_of(W, b, x, lab, "sum", 3.0 / total_valid).backward()
            if clip_each_micro:
                opt.clip_grad_norm(0.5)
        if not clip_each_micro:
            opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
        return W.data.copy(), W

    right, W = window(False)
    assert W.grad is None
    wrong, _ = window(True)
    W0, _ = make_model()
    assert np.abs(wrong - right).max() > 0.01 * np.abs(right - W0.data).max()

    # the correct window equals clipping the big-batch gradient once
    W2, b2 = make_model()
    opt = SGD([("W", W2), ("b", b2)], lr=0.1)
    X = np.concatenate([x for x, _ in batches])
    L = np.concatenate([lab for _, lab in batches])
    loss_of(W2, b2, X, L, "mean", 3.0).backward()
    opt.clip_grad_norm(0.5)
    opt.step()
    assert np.abs(W2.data - right).max() <= 1e-5 * np.abs(right).max()
