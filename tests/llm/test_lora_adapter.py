"""LoRA adapter: init structure, fused delta vs numpy reference, gradients, merges, refusals."""
import numpy as np
import pytest

from pipeline.kernels.rng import kaiming_uniform, uniform
from pipeline.autograd import Tensor
from pipeline.errors import UserError
from pipeline.llm.lora import LoraAdapter, dropout_keep_mask, lora_delta


def _x(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_init_a_is_seeded_kaiming_and_b_is_zero():
    ad = LoraAdapter(12, 6, rank=4, alpha=8, seed=7, prefix="layers.0.q")
    np.testing.assert_array_equal(ad.lora_a.data, kaiming_uniform(7, (4, 12), fan_in=12))
    assert np.abs(ad.lora_a.data).max() <= 1 / np.sqrt(12)
    assert (ad.lora_b.data == 0).all() and ad.lora_b.shape == (6, 4)
    assert ad.scale == np.float32(2.0)
    assert [n for n, _ in ad.named_parameters()] == ["layers.0.q.lora_a", "layers.0.q.lora_b"]
    other = LoraAdapter(12, 6, rank=4, seed=8)
    assert not np.array_equal(other.lora_a.data, ad.lora_a.data)


def test_zero_b_means_exact_base_output():
    ad = LoraAdapter(8, 5, rank=2, dropout=0.3)
    base = Tensor(_x((3, 5)))
    y = ad.apply(Tensor(_x((3, 8))), base, dropout_seed=11)
    np.testing.assert_array_equal(y.data, base.data)


@pytest.mark.parametrize("rank,dropout", [(0, 0.0), (6, 0.0), (2.5, 0.0), (2, 1.0), (2, -0.1)])
def test_invalid_rank_and_dropout_rejected(rank, dropout):
    with pytest.raises(UserError, match="rank|dropout"):
        LoraAdapter(8, 5, rank=rank, dropout=dropout, prefix="layers.1.v")


def _reference_delta(x, a, b, scale, mask=None):
    xd = x if mask is None else x * mask
    return scale * (xd @ a.T) @ b.T


def test_delta_matches_numpy_reference_with_and_without_dropout():
    ad = LoraAdapter(8, 5, rank=3, alpha=6, dropout=0.25, seed=3)
    ad.lora_b.data[:] = _x((5, 3), seed=4)
    x = _x((2, 4, 8))
    np.testing.assert_allclose(ad.delta(Tensor(x)).data, _reference_delta(x, ad.lora_a.data, ad.lora_b.data, 2.0),
                               rtol=1e-5, atol=1e-6)
    mask = dropout_keep_mask(99, (8, 8), 0.25).reshape(2, 4, 8)
    # the mask contract: keep iff uniform(at(seed, i)) < 1 - p, scaled by 1/(1-p)
    u = uniform(99, (2, 4, 8), dtype=np.float64)
    np.testing.assert_array_equal(mask, np.where(u < 0.75, np.float32(1 / 0.75), 0).astype(np.float32))
    np.testing.assert_allclose(ad.delta(Tensor(x), dropout_seed=99).data,
                               _reference_delta(x, ad.lora_a.data, ad.lora_b.data, 2.0, mask), rtol=1e-5, atol=1e-6)
    assert 0 < (mask == 0).sum() < mask.size


def _loss_of(x, a, b, w, seed, p):
    y = lora_delta(x, a, b, np.float32(1.5), p, seed)
    return (y * Tensor(w)).sum()


@pytest.mark.parametrize("seed,p", [(None, 0.0), (5, 0.3)])
def test_gradients_match_finite_differences(seed, p):
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((3, 6)).astype(np.float32), requires_grad=True)
    a = Tensor(rng.standard_normal((2, 6)).astype(np.float32), requires_grad=True)
    b = Tensor(rng.standard_normal((4, 2)).astype(np.float32), requires_grad=True)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    _loss_of(x, a, b, w, seed, p).backward()
    for t in (x, a, b):
        num = np.zeros(t.shape)
        for i in np.ndindex(t.shape):
            keep = t.data[i]
            vals = []
            for eps in (1e-2, -1e-2):
                t.data[i] = keep + eps
                with np.errstate(all="ignore"):
                    delta = lora_delta(Tensor(x.data), Tensor(a.data), Tensor(b.data), np.float32(1.5), p, seed)
                    vals.append(float(np.sum(delta.data.astype(np.float64) * w)))
            t.data[i] = keep
            num[i] = (vals[0] - vals[1]) / 2e-2
        np.testing.assert_allclose(t.grad, num, rtol=2e-3, atol=2e-3)


def test_zero_structure_at_init():
    ad = LoraAdapter(6, 4, rank=2)
    x = Tensor(_x((5, 6)))
    (ad.delta(x) * Tensor(_x((5, 4), 2))).sum().backward()
    assert (ad.lora_a.grad == 0).all()          # B == 0  =>  dL/dA == 0 exactly
    assert np.abs(ad.lora_b.grad).sum() > 0     # while dL/dB != 0


def test_merge_into_f32_in_place_equals_forward():
    ad = LoraAdapter(8, 5, rank=2, alpha=4, seed=1)
    ad.lora_b.data[:] = _x((5, 2), seed=9)
    w = _x((5, 8), seed=10)
    x = _x((3, 8), seed=11)
    expected = x @ w.T + ad.delta(Tensor(x)).data
    merged = ad.merge_into(w)
    assert merged is w
    np.testing.assert_allclose(x @ w.T, expected, rtol=1e-5, atol=1e-5)


def test_merge_into_refusals():
    ad = LoraAdapter(8, 5, rank=2)
    with pytest.raises(UserError, match="requires grad"):
        ad.merge_into(Tensor(_x((5, 8)), requires_grad=True))
    with pytest.raises(UserError, match="quantized.*compounds the quantization error.*quantize the RESULT"):
        ad.merge_into(np.zeros((5, 18), dtype=np.uint8))
    with pytest.raises(UserError, match="float32"):
        ad.merge_into(np.zeros((5, 8), dtype=np.float16))
    with pytest.raises(UserError, match="shape"):
        ad.merge_into(np.zeros((8, 5), dtype=np.float32))
    ro = np.zeros((5, 8), dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(UserError, match="read-only"):
        ad.merge_into(ro)

    class FakeQuant:
        class format:
            quantized = True
    with pytest.raises(UserError, match="compounds"):
        ad.merged_f16(FakeQuant())


def test_merged_f16_returns_new_array():
    ad = LoraAdapter(8, 5, rank=2, seed=2)
    ad.lora_b.data[:] = _x((5, 2), seed=3)
    w16 = _x((5, 8), seed=4).astype(np.float16)
    before = w16.copy()
    out = ad.merged_f16(w16)
    assert out.dtype == np.float16 and out is not w16
    np.testing.assert_array_equal(w16, before)
    np.testing.assert_array_equal(
        out, (before.astype(np.float32) + ad.scale * ad.lora_b.data @ ad.lora_a.data).astype(np.float16))
