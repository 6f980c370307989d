"""Checkpoints with the real optimizers (pipeline/optim): resume, permutations, mismatches."""
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pipeline import optim
from pipeline.autograd import Tensor, cross_entropy
from pipeline.errors import CheckpointError, ConfigMismatchError, DTypeMismatchError
from pipeline.models.spirals import SpiralsMLP, make_spirals
from pipeline.runtime.ckpt import checkpoint_dir, load_checkpoint, save_checkpoint
from pipeline.train.optimizer_state import load_optimizer, read_optimizer, save_optimizer
from pipeline.train.trainer_state import TrainerState

X, Y = make_spirals(n_per_arm=32)
X = Tensor(X)


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with threadpool_limits(1):
        yield


def train(model, opt, steps):
    for _ in range(steps):
        cross_entropy(model(X), Y).backward()
        opt.step()
        opt.zero_grad()


def named(model, order):
    return [(n, getattr(model, n)) for n in order]


ORDER = ["w1", "b1", "w2", "b2", "w3", "b3"]
PERMUTED = ["b3", "w2", "b1", "w3", "w1", "b2"]
MAKERS = {
    "adamw": lambda ps: optim.AdamW(ps, lr=0.01),
    "adamw-bf16": lambda ps: optim.AdamW(ps, lr=0.01, state_dtype="bf16"),
    "sgd": lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "muon": lambda ps: optim.Muon(ps, lr=0.02),
    "apollo": lambda ps: optim.Apollo(ps, lr=0.01, rank=4, update_proj_gap=3),
    "lion": lambda ps: optim.Lion(ps, lr=1e-3),
}


def final_params(model):
    return {n: t.data.copy() for n, t in model.named_parameters()}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_permuted_named_registration_resumes_bit_exact(tmp_path, kind):
    make = MAKERS[kind]
    model = SpiralsMLP(seed=0)
    opt = make(named(model, ORDER))
    train(model, opt, 4)
    save_checkpoint(checkpoint_dir(tmp_path, 4), TrainerState(step=4), model, opt)
    train(model, opt, 4)
    resumed = SpiralsMLP(seed=7)
    opt2 = make(named(resumed, PERMUTED))
    assert load_checkpoint(checkpoint_dir(tmp_path, 4), resumed, opt2).step == 4
    train(resumed, opt2, 4)
    a, b = final_params(model), final_params(resumed)
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)


def test_swapped_unnamed_same_shape_params_diverge(tmp_path):
    model = SpiralsMLP(seed=0)
    opt = optim.AdamW([getattr(model, n) for n in ORDER], lr=0.01)
    train(model, opt, 4)
    save_checkpoint(checkpoint_dir(tmp_path, 4), TrainerState(step=4), model, opt)
    train(model, opt, 4)
    swapped = ["w1", "b2", "w2", "b1", "w3", "b3"]  # b1 and b2 are both [64]: positional names swap
    resumed = SpiralsMLP(seed=7)
    opt2 = optim.AdamW([getattr(resumed, n) for n in swapped], lr=0.01)
    load_checkpoint(checkpoint_dir(tmp_path, 4), resumed, opt2)  # loads fine: shapes agree
    train(resumed, opt2, 4)
    a, b = final_params(model), final_params(resumed)
    assert max(float(np.abs(a[n] - b[n]).max()) for n in a) > 0


def saved(tmp_path, opt_maker, steps=2):
    model = SpiralsMLP(seed=0)
    opt = opt_maker(named(model, ORDER))
    train(model, opt, steps)
    save_optimizer(tmp_path / "optimizer.safetensors", opt)
    return tmp_path / "optimizer.safetensors"


def test_bf16_state_into_f32_optimizer_is_a_dtype_mismatch(tmp_path):
    path = saved(tmp_path, MAKERS["adamw-bf16"])
    assert read_optimizer(path)["tensors"]["w1.exp_avg"].dtype == ml_dtypes.bfloat16
    with pytest.raises(DTypeMismatchError, match=r"optimizer\.safetensors: field 'config\.state_dtype' is 'bf16'"):
        load_optimizer(path, optim.AdamW(named(SpiralsMLP(seed=1), ORDER), lr=0.01))
    path = saved(tmp_path, MAKERS["adamw"])  # and the other way round
    with pytest.raises(DTypeMismatchError, match="'f32' in the checkpoint, configured 'bf16'"):
        load_optimizer(path, MAKERS["adamw-bf16"](named(SpiralsMLP(seed=1), ORDER)))


def test_other_optimizer_type_is_refused(tmp_path):
    path = saved(tmp_path, MAKERS["adamw"])
    with pytest.raises(ConfigMismatchError, match=r"field 'type'.*'adamw'.*'lion'"):
        load_optimizer(path, MAKERS["lion"](named(SpiralsMLP(seed=1), ORDER)))


@pytest.mark.parametrize("maker,changed,field", [
    (MAKERS["apollo"], lambda ps: optim.Apollo(ps, lr=0.01, rank=2, update_proj_gap=3), "rank"),
    (MAKERS["muon"], lambda ps: optim.Muon(ps, lr=0.02, scale="match_rms_adamw"), "scale"),
])
def test_structural_config_change_names_the_field(tmp_path, maker, changed, field):
    path = saved(tmp_path, maker)
    with pytest.raises(ConfigMismatchError, match=rf"optimizer\.safetensors: .*config\.{field}"):
        load_optimizer(path, changed(named(SpiralsMLP(seed=1), ORDER)))


def test_lr_is_not_validated(tmp_path):
    path = saved(tmp_path, MAKERS["adamw"])
    load_optimizer(path, optim.AdamW(named(SpiralsMLP(seed=1), ORDER), lr=0.5))


def test_renamed_slot_is_a_clear_error(tmp_path):
    path = saved(tmp_path, MAKERS["adamw"])
    model = SpiralsMLP(seed=1)
    pairs = [("fc1" if n == "w1" else n, t) for n, t in named(model, ORDER)]
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: .*'fc1'"):
        load_optimizer(path, optim.AdamW(pairs, lr=0.01))


def test_optimizer_set_round_trip(tmp_path):
    def make(model):
        decay = optim.AdamW([(n, getattr(model, n)) for n in ("w1", "w2", "w3")], lr=0.01, weight_decay=0.1)
        no_decay = optim.AdamW([(n, getattr(model, n)) for n in ("b1", "b2", "b3")], lr=0.01, weight_decay=0.0)
        return optim.OptimizerSet(decay, no_decay)

    model = SpiralsMLP(seed=0)
    opt = make(model)
    train(model, opt, 3)
    save_checkpoint(checkpoint_dir(tmp_path, 3), TrainerState(step=3), model, opt)
    assert "0.w1.exp_avg" in read_optimizer(Path(checkpoint_dir(tmp_path, 3)) / "optimizer.safetensors")["tensors"]
    train(model, opt, 3)
    resumed = SpiralsMLP(seed=5)
    opt2 = make(resumed)
    load_checkpoint(checkpoint_dir(tmp_path, 3), resumed, opt2)
    train(resumed, opt2, 3)
    a, b = final_params(model), final_params(resumed)
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)
    lone = optim.OptimizerSet(optim.AdamW(named(SpiralsMLP(seed=1), ORDER), lr=0.01))
    with pytest.raises(ConfigMismatchError, match="members"):
        load_optimizer(Path(checkpoint_dir(tmp_path, 3)) / "optimizer.safetensors", lone)


def test_bf16_params_resume_bit_exact_through_their_f32_masters(tmp_path):
    """16-bit leaves: the file keeps them bf16, the optimizer file keeps the f32 masters."""
    BF16 = np.dtype(ml_dtypes.bfloat16)

    def make_model(seed):
        rng = np.random.default_rng(seed)
        return {"w": Tensor(rng.standard_normal((8, 4)).astype(np.float32).astype(BF16), requires_grad=True),
                "b": Tensor(rng.standard_normal(8).astype(np.float32).astype(BF16), requires_grad=True)}

    def steps(model, opt, start, stop):
        for k in range(start, stop):
            for name, t in model.items():
                t.grad = (np.sin(t.data.astype(np.float32) * (k + 1)) * 0.1).astype(np.float32)
            opt.step()
            opt.zero_grad()

    model = make_model(0)
    opt = optim.AdamW(list(model.items()), lr=0.01)
    steps(model, opt, 0, 3)
    d = save_checkpoint(checkpoint_dir(tmp_path, 3), TrainerState(step=3), model, opt)
    assert read_optimizer(d / "optimizer.safetensors")["tensors"]["w.master"].dtype == np.float32
    steps(model, opt, 3, 6)
    resumed = make_model(1)
    opt2 = optim.AdamW(list(resumed.items()), lr=0.01)
    load_checkpoint(d, resumed, opt2)
    assert resumed["w"].data.dtype == BF16
    steps(resumed, opt2, 3, 6)
    assert all(model[n].data.tobytes() == resumed[n].data.tobytes() for n in model)
    f32_model = {n: Tensor(t.data.astype(np.float32), requires_grad=True) for n, t in make_model(2).items()}
    with pytest.raises(DTypeMismatchError,
                       match=r"model\.safetensors: tensor '(w|b)' is BF16 in the file, F32 in the model"):
        load_checkpoint(d, f32_model)
