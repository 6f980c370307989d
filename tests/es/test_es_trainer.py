"""ESTrainer: update algebra parity (goldens), perturb/restore contracts, shaping, registration, checkpoints."""
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pipeline.kernels import es_noise
from pipeline.autograd import Module, Tensor
from pipeline.errors import ConfigMismatchError, DTypeMismatchError
from pipeline.es import ESConfig, ESConfigError, ESStateError, ESTrainer, RewardError, centered_ranks, z_score
from pipeline.es import noise as streams
from pipeline.es.checkpoint import load_es_checkpoint, save_es_checkpoint

GOLDEN = Path(__file__).parent.parent / "goldens" / "es" / "update.json"


def _trainer(dtypes=("float32",), **cfg):
    g = np.random.default_rng(3)
    tr = ESTrainer(**{"sigma": 0.05, "population": 6, "seed": 11, **cfg})
    arrays = []
    for k, dt in enumerate(dtypes):
        a = g.standard_normal((3, 5)).astype(np.float32).astype(np.dtype(dt))
        tr.add_param(a, f"p{k}")
        arrays.append(a)
    return tr, arrays


def _rewards_from(arrays):
    return float(sum(np.sin(a.astype(np.float64)).sum() for a in arrays))


# ---------------------------------------------------------------- parity with the numpy transcription
@pytest.mark.parametrize("case", json.loads(GOLDEN.read_text())["cases"], ids=lambda c: c["name"])
def test_update_algebra_matches_goldens(case):
    cfg = {k: v for k, v in case["config"].items()}
    tr = ESTrainer(ESConfig(**cfg))
    arrays = []
    for p in case["params"]:
        a = np.array(p["init"], dtype=np.float32).astype(np.dtype(p["dtype"]))
        tr.add_param(a, p["name"])
        arrays.append(a)
    tr.capture_anchor()
    for rewards in case["rewards"]:
        stats = tr.update([float(r) for r in rewards])
    assert stats["nonfinite"] == 0 and tr.iteration == len(case["rewards"])
    for a, want, p in zip(arrays, case["expected"], case["params"]):
        ulp = float(ml_dtypes.finfo(np.dtype(p["dtype"])).eps)
        np.testing.assert_allclose(a.astype(np.float32).reshape(-1), np.array(want, np.float32),
                                   rtol=4 * ulp, atol=1e-6, err_msg=f"{case['name']}: {p['name']}")


# ---------------------------------------------------------------- perturb / restore
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_perturb_equals_materialized_replica(dtype):
    tr, arrays = _trainer((dtype, "float32"), restore_mode="snapshot")  # regenerate drifts theta by ulps
    rows = tr.materialize_members([0, 3, 5])
    for i, m in enumerate([0, 3, 5]):
        tr.perturb(m)
        got = np.concatenate([a.astype(np.float32).reshape(-1) for a in arrays])
        assert np.array_equal(got, rows[i])
        tr.restore(m)


def test_perturbation_is_sigma_eps_of_the_member_stream():
    tr, (a,) = _trainer()
    before = a.copy()
    tr.perturb(2)
    key = streams.draw_keys(11, 0, [2], 1, "iid")[0, 0]
    eps = es_noise.gaussian_fill_fast(int(key), np.empty(a.size, np.float32)).reshape(a.shape)
    assert np.array_equal(a, before + np.float32(0.05) * eps)
    tr.restore(2)
    np.testing.assert_allclose(a, before, atol=1e-6)


def test_snapshot_restore_is_bitwise_and_regenerate_drifts_at_most_an_ulp():
    for mode in ("snapshot", "regenerate"):
        tr, arrays = _trainer(("float32", "bfloat16"), restore_mode=mode, sigma=0.3)
        before = [a.copy() for a in arrays]
        for m in range(6):
            tr.perturb(m)
            tr.restore(m)
        for a, b in zip(arrays, before):
            if mode == "snapshot":
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
            else:  # each round trip may round (x + t) - t once at the precision of |x| + |t| (t ~ 0.3 * |eps|)
                tol = 6 * 2.0 * np.finfo(np.float32).eps if a.dtype == np.float32 else 6 * 2.0 * 2.0**-8
                np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=0, atol=tol)


def test_evaluating_without_restore_is_an_error():
    tr, _ = _trainer()
    tr.perturb(0)
    with pytest.raises(ESStateError, match="member 0 is still applied"):
        tr.perturb(1)
    with pytest.raises(ESStateError, match="still applied"):
        tr.update([0.0] * 6)
    with pytest.raises(ESStateError, match="applied member is 0"):
        tr.restore(1)
    tr.restore(0)
    with pytest.raises(ESStateError, match="no member is applied"):
        tr.restore()
    with pytest.raises(ESStateError, match="out of range"):
        tr.perturb(6)


def test_evaluator_exception_restores_before_propagating():
    tr, (a,) = _trainer(restore_mode="snapshot")
    before = a.copy()

    def evaluate(member):
        if member == 3:
            raise KeyError("boom")
        return 0.0

    with pytest.raises(KeyError, match="boom"):
        tr.step(evaluate)
    assert tr.active_member is None and tr.iteration == 0
    assert np.array_equal(a, before)


def test_step_in_place_equals_replica_update():
    """The two evaluation shapes give the same bits (snapshot restore keeps theta exact)."""
    tr1, arr1 = _trainer(("float32", "float16"), restore_mode="snapshot")
    tr2, arr2 = _trainer(("float32", "float16"), restore_mode="snapshot")
    for _ in range(3):
        tr1.step(lambda m: _rewards_from(arr1))
        rows = tr2.materialize_members(range(6))
        tr2.update([_rewards_from([v.reshape(a.shape) for v, a in zip(tr2.split(r).values(), arr2)]) for r in rows])
    for a, b in zip(arr1, arr2):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("antithetic", [False, True])
def test_noise_cache_gives_the_same_update_bits(antithetic):
    plain, pa = _trainer(antithetic=antithetic)
    cached, ca = _trainer(antithetic=antithetic)
    cached.cache_noise = True
    for it in range(3):
        members = [[0, 1, 2, 3, 4, 5], [3, 0], []][it]  # whole, partial and no cached draws
        cached.materialize_members(members)
        r = [float(np.sin(k + it)) for k in range(6)]
        plain.update(r)
        cached.update(r)
        assert np.array_equal(pa[0], ca[0])


# ---------------------------------------------------------------- noise contract
def test_noise_is_a_pure_function_of_seed_iteration_member_slot():
    a, _ = _trainer()
    b, _ = _trainer()
    assert np.array_equal(a.materialize_members([4]), b.materialize_members([4]))
    c, _ = _trainer(seed=12)
    assert not np.array_equal(a.materialize_members([4]), c.materialize_members([4]))
    keys = streams.draw_keys(11, 0, [0, 1], 2, "iid")
    assert len(set(keys.ravel().tolist())) == 4
    assert not np.array_equal(streams.draw_keys(11, 1, [0], 1, "iid"), keys[:1, :1])


def test_antithetic_pairs_share_one_draw_with_opposite_signs():
    tr, (a,) = _trainer(antithetic=True)
    rows = tr.materialize_members([2, 3])
    theta = a.reshape(-1)
    key = streams.draw_keys(11, 0, [1], 1, "iid")[0, 0]  # members 2 and 3 are draw 1
    eps = es_noise.gaussian_fill_fast(int(key), np.empty(a.size, np.float32))
    assert np.array_equal(rows[0], theta + np.float32(0.05) * eps)
    assert np.array_equal(rows[1], theta + np.float32(-0.05) * eps)
    singles = np.concatenate([tr.materialize_members([m]) for m in range(6)])
    assert np.array_equal(tr.materialize_members(range(6)), singles)  # the paired kernel gives the same bits
    with pytest.raises(ESConfigError, match="even"):
        ESTrainer(population=5, antithetic=True)


def test_antithetic_update_folds_pairs():
    """(C+ - C-) * eps_k summed over pairs == the unfolded sum with eps_{2k+1} = -eps_{2k} (f32 tolerance)."""
    tr, (a,) = _trainer(antithetic=True, alpha=0.1)
    theta = a.reshape(-1).copy()
    rows = tr.materialize_members(range(6))
    eps = (rows - theta) / np.float32(0.05)
    r = np.array([0.3, -1.0, 2.0, 0.5, 0.1, 0.1])
    want = theta + 0.1 * (z_score(r)[:, None] * eps).sum(0) / 6
    tr.update(r)
    np.testing.assert_allclose(a.reshape(-1), want, rtol=1e-5, atol=1e-5)


def test_correlated_scheme_reuses_one_stream_across_slots():
    tr = ESTrainer(sigma=1.0, population=4, noise="correlated")
    x, y, z = np.zeros(8, np.float32), np.zeros(8, np.float32), np.zeros(5, np.float32)
    tr.add_param(x, "x").add_param(y, "y").add_param(z, "z")
    tr.perturb(1)
    assert np.array_equal(x, y) and np.array_equal(x[:5], z)
    tr.restore(1)
    iid = ESTrainer(sigma=1.0, population=4)
    x2, y2 = np.zeros(8, np.float32), np.zeros(8, np.float32)
    iid.add_param(x2, "x").add_param(y2, "y")
    iid.perturb(1)
    assert not np.array_equal(x2, y2)


# ---------------------------------------------------------------- shaping
def test_z_score_uses_float64_population_std():
    r = np.array([1.0, 2.0, 4.0, 7.0])
    np.testing.assert_array_equal(z_score(r), (r - r.mean()) / (np.sqrt(((r - r.mean()) ** 2).mean()) + 1e-8))


def test_equal_rewards_make_no_step_under_z_score():
    tr, (a,) = _trainer()
    before = a.copy()
    tr.update([3.0] * 6)
    assert np.array_equal(a, before) and tr.iteration == 1


def test_centered_ranks_break_ties_by_member_index():
    c = centered_ranks([5.0, 1.0, 5.0, 1.0, 9.0])
    np.testing.assert_array_equal(c, np.array([2, 0, 3, 1, 4]) / 4 - 0.5)
    assert c.min() == -0.5 and c.max() == 0.5


def test_nonfinite_rewards_count_as_the_worst_finite_one():
    tr, (a,) = _trainer()
    ref, (b,) = _trainer()
    stats = tr.update([1.0, float("nan"), 3.0, float("inf"), 2.0, -float("inf")])
    ref.update([1.0, 1.0, 3.0, 1.0, 2.0, 1.0])
    assert stats["nonfinite"] == 3 and math.isfinite(stats["reward_mean"])
    assert np.array_equal(a, b)


def test_all_nonfinite_rewards_refuse_the_iteration():
    tr, (a,) = _trainer()
    before = a.copy()
    with pytest.raises(RewardError, match="all 6 rewards are non-finite"):
        tr.update([float("nan")] * 6)
    with pytest.raises(RewardError, match="expected 6 rewards"):
        tr.update([1.0] * 5)
    assert np.array_equal(a, before) and tr.iteration == 0


# ---------------------------------------------------------------- anchored weight decay
def test_anchor_decay_l2_and_l1():
    for kind in ("l2", "l1"):
        tr, (a,) = _trainer(anchor_decay=kind, anchor_lambda=2.0, alpha=0.1)
        plain, (b,) = _trainer(alpha=0.1)
        anchor = a.copy()
        tr.capture_anchor()
        r = [0.3, -1.0, 2.0, 0.5, 0.1, 0.7]
        tr.update(r)
        plain.update(r)
        d = b - anchor
        want = anchor + (d * np.float32(1 - 0.2) if kind == "l2"
                         else np.sign(d) * np.maximum(np.abs(d) - np.float32(0.2), 0))
        np.testing.assert_allclose(a, want, rtol=1e-6, atol=1e-7)
        if kind == "l1":
            assert (a == anchor).any()  # soft-thresholding zeroes small deltas exactly
    tr, _ = _trainer(anchor_decay="l2", anchor_lambda=1.0)
    with pytest.raises(ESStateError, match="capture_anchor"):
        tr.update([0.0, 1, 2, 3, 4, 5])


# ---------------------------------------------------------------- registration
def test_registry_registers_frozen_and_low_precision_tensors_once():
    class Net(Module):
        def __init__(self):
            self.w = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
            self.frozen = Tensor(np.zeros(4, np.float16), requires_grad=False)
            self.blocks = [self.w]  # tied: the same tensor twice

    tr = ESTrainer(population=4)
    tr.add_registry(Net())
    assert tr.names == ["w", "frozen"] and tr.dim == 10
    with pytest.raises(ESConfigError, match="cannot take gaussian noise"):
        tr.add_param(np.zeros(3, np.int32), "ids")
    a = np.zeros(6, np.float32)
    tr.add_param(a, "a")
    with pytest.raises(ESConfigError, match="shares memory"):
        tr.add_param(a[:3], "view")
    with pytest.raises(ESConfigError, match="sigma"):
        ESTrainer(sigma=-1.0)
    assert ESTrainer().config.alpha == 0.0005 and ESTrainer().config.population == 30


# ---------------------------------------------------------------- checkpoints
def test_checkpoint_resume_is_bit_exact(tmp_path):
    full, fa = _trainer(("float32", "bfloat16"))
    for _ in range(4):
        full.update([_rewards_from([v]) for v in full.materialize_members(range(6))])
    half, ha = _trainer(("float32", "bfloat16"))
    for _ in range(2):
        half.update([_rewards_from([v]) for v in half.materialize_members(range(6))])
    save_es_checkpoint(tmp_path / "ck", half, run_config={"note": "test"})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["model.safetensors", "trainer_state.json"]
    state = json.loads((tmp_path / "ck" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["config"]["es_iteration"] == 2 and state["config"]["es_antithetic"] is False
    fresh, fr = _trainer(("float32", "bfloat16"))
    load_es_checkpoint(tmp_path / "ck", fresh)
    assert fresh.iteration == 2
    for _ in range(2):
        fresh.update([_rewards_from([v]) for v in fresh.materialize_members(range(6))])
    for a, b in zip(fa, fr):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_checkpoint_load_refuses_mismatches(tmp_path):
    tr, _ = _trainer()
    save_es_checkpoint(tmp_path / "ck", tr)
    other, (a,) = _trainer(sigma=0.07)
    before = a.copy()
    with pytest.raises(ConfigMismatchError, match="'es_sigma' is 0.05 in the checkpoint, 0.07 in this run"):
        load_es_checkpoint(tmp_path / "ck", other)
    assert np.array_equal(a, before)
    wrong_dtype, _ = _trainer(("float16",))
    with pytest.raises(DTypeMismatchError, match="'p0' is F32 in the file, F16 registered"):
        load_es_checkpoint(tmp_path / "ck", wrong_dtype)
