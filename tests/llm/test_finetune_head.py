"""The LoRA step's output head read in its file format (pipeline/finetune/model.HeadRows): the same bits as the
dense f32 copy it replaced (head_ce, the whole LoRA loss and gradients), and no [C, H] f32 array made on the way."""
import tracemalloc

import numpy as np
import pytest

from pipeline.finetune.model import HeadRows, LoraModel
from pipeline.kernels import headce
from pipeline.kernels.quantize import quantize
from pipeline.llm.quants import FORMATS, QT, FrozenWeight
from pipeline.threads import numba_threads

FIXTURE = "tests/fixtures/qwen3-tied-q4_k_s.gguf"


def frozen(qt, c, h, seed=0):
    """A FrozenWeight [c, h] of format qt with random values."""
    w = (np.random.default_rng(seed).standard_normal((c, h)) / np.sqrt(h)).astype(np.float32)
    if qt == QT.F32:
        raw = w
    elif qt == QT.F16:
        raw = w.astype(np.float16)
    elif qt == QT.BF16:
        raw = (w.view(np.uint32) >> 16).astype(np.uint16)
    else:
        raw = quantize(w, qt.name)
    return FrozenWeight(FORMATS[qt], raw, (c, h), "output.weight")


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.Q4_1, QT.F16, QT.BF16, QT.F32], ids=lambda q: q.name)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_head_ce_from_rows_has_the_dense_bits(qt, eps):
    fw = frozen(qt, 3000, 256, seed=int(qt))
    x = np.random.default_rng(1).standard_normal((19, 256)).astype(np.float32)
    y = np.random.default_rng(2).integers(0, 3000, 19)
    grid = dict(segment_rows=1024, chunk_rows=300)  # a partial last chunk and a partial last segment
    want = headce.head_ce(x, fw.dequantize(), y, eps, **grid)
    for threads in (1, 2):
        with numba_threads(threads):
            got = headce.head_ce(x, HeadRows(fw), y, eps, **grid)
        np.testing.assert_array_equal(got[0].view(np.uint64), want[0].view(np.uint64))
        np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))


def _loss_and_grads(tr, tokens, labels):
    tr.zero_grad()
    loss = tr.loss(tokens, labels, reduction="sum", loss_scale=0.01)
    loss.backward()
    return loss.data.copy(), {n: p.grad.copy() for n, p in tr.named_parameters()}


def test_lora_loss_and_grads_equal_the_dense_head_path():
    """The LoRA step on a tied Q4_K_S model (its head the Q8_0/Q6_K embedding table) with B != 0: loss and every
    adapter gradient bitwise equal to the step with the dense f32 head copy (the previous path)."""
    tr = LoraModel.from_gguf(FIXTURE, targets=("q", "v", "down"), rank=4, alpha=8.0, seed=3)
    assert isinstance(tr._head.weight, FrozenWeight) and tr._head.weight.format.quantized
    for n, p in tr.named_parameters():
        p.data[...] = np.random.default_rng(len(n)).standard_normal(p.shape).astype(np.float32) * 0.05
    g = np.random.default_rng(0)
    tokens = g.integers(0, tr.config.vocab_size, 40)
    labels = g.integers(0, tr.config.vocab_size, 40)
    labels[:9] = -100
    loss, grads = _loss_and_grads(tr, tokens, labels)
    assert tr._head._dense is None  # the training step made no dense copy
    tr._head._dense = tr._head.weight.dequantize()  # the previous path: the resident f32 copy
    step = tr.step
    tr.step = 0
    loss_dense, grads_dense = _loss_and_grads(tr, tokens, labels)
    assert tr.step == step
    np.testing.assert_array_equal(loss.view(np.uint32), loss_dense.view(np.uint32))
    for n in grads:
        np.testing.assert_array_equal(grads[n].view(np.uint32), grads_dense[n].view(np.uint32), err_msg=n)


def test_head_path_memory_is_a_few_chunks_not_the_dense_head():
    """A 131072 x 128 Q8_0 head (64 MB as f32): the head CE's forward and backward allocate a few MB (per-segment
    chunk buffers, logits of one chunk, [N, H] accumulators), far below the dense copy the step used to hold."""
    c, h, n = 131072, 128, 48
    fw = frozen(QT.Q8_0, c, h, seed=4)
    from pipeline.autograd.losses import linear_cross_entropy
    from pipeline.autograd.tensor import Tensor
    x = Tensor(np.random.default_rng(5).standard_normal((n, h)).astype(np.float32), requires_grad=True)
    labels = np.random.default_rng(6).integers(0, c, n)
    dense_bytes = c * h * 4
    tracemalloc.start()
    try:
        loss = linear_cross_entropy(x, HeadRows(fw), labels, reduction="sum")
        loss.backward()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"head CE peak traced {peak / 2**20:.1f} MB vs dense {dense_bytes / 2**20:.0f} MB")
    assert x.grad is not None and np.isfinite(x.grad).all() and np.isfinite(loss.item())
    assert peak < dense_bytes / 8, peak
    # the control: tracemalloc does see numpy buffers, so the dense copy would have counted
    tracemalloc.start()
    try:
        fw.dequantize()
        dense_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert dense_peak >= dense_bytes


def test_checkpointed_layers_give_the_plain_steps_bits_on_a_quantized_model():
    """checkpoint_layers on a Q4_K_S model: loss and grads bitwise those of the plain step (the checkpointed forward
    runs with gradients on, so its products are the f32 ones the recompute uses, not the no-grad integer dots)."""
    from pipeline.models.registry import load_model
    model = load_model(FIXTURE)
    g = np.random.default_rng(0)
    tokens = g.integers(0, model.config.vocab_size, 40)
    labels = g.integers(0, model.config.vocab_size, 40)
    out = []
    for ck in (False, True):
        tr = LoraModel(model, targets=("q", "v"), rank=4, alpha=8.0, seed=3, checkpoint_layers=ck)
        for n, p in tr.named_parameters():
            p.data[...] = np.random.default_rng(len(n)).standard_normal(p.shape).astype(np.float32) * 0.05
        out.append(_loss_and_grads(tr, tokens, labels))
    np.testing.assert_array_equal(out[0][0].view(np.uint32), out[1][0].view(np.uint32))
    for n in out[0][1]:
        np.testing.assert_array_equal(out[0][1][n].view(np.uint32), out[1][1][n].view(np.uint32), err_msg=n)
