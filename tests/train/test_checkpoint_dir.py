"""The checkpoint directory protocol, with a stand-in optimizer (tests/train/conftest.py)."""
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pipeline.autograd import Module, Tensor
from pipeline.errors import CheckpointError, ConfigMismatchError, DTypeMismatchError
from pipeline.runtime import ckpt
from pipeline.runtime.ckpt import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from pipeline.train.optimizer_state import load_optimizer, read_optimizer, save_optimizer
from pipeline.train.trainer_state import TrainerState


class Net(Module):
    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.w1 = Tensor(rng.standard_normal((3, 2)).astype(np.float32), requires_grad=True)
        self.b1 = Tensor(rng.standard_normal(3).astype(np.float32), requires_grad=True)
        self.b2 = Tensor(rng.standard_normal(3).astype(np.float32), requires_grad=True)


def fake_grads(model, step):
    """Deterministic, parameter-dependent gradients (so slot mix-ups show)."""
    for i, (_, t) in enumerate(model.named_parameters()):
        t.grad = (np.tanh(t.data) * np.float32(0.3 + 0.1 * i) + np.float32(0.01 * step)).astype(np.float32)


def train(model, opt, start, stop):
    for step in range(start, stop):
        fake_grads(model, step)
        opt.step()
        opt.zero_grad()


def register(opt, model, order=("w1", "b1", "b2"), named=True):
    for name in order:
        opt.add_param(getattr(model, name), name if named else None)


def params(model):
    return {n: t.data.copy() for n, t in model.named_parameters()}


def max_abs_diff(a, b):
    return max(float(np.max(np.abs(a[n] - b[n]))) for n in a)


def run_with_resume(tmp_path, fake_momentum, resumed_order, named, state_dtype="f32"):
    model = Net(0)
    opt = fake_momentum(state_dtype=state_dtype)
    register(opt, model, named=named)
    train(model, opt, 0, 5)
    save_checkpoint(checkpoint_dir(tmp_path, 5), TrainerState(step=5, seeds={"init": 0}), model, opt)
    train(model, opt, 5, 10)
    fresh, fresh_opt = Net(1), fake_momentum(state_dtype=state_dtype)
    register(fresh_opt, fresh, order=resumed_order, named=named)
    state = load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_opt)
    train(fresh, fresh_opt, state.step, 10)
    return max_abs_diff(params(model), params(fresh))


@pytest.mark.parametrize("state_dtype", ["f32", "bf16"])
def test_resume_is_bit_exact(tmp_path, fake_momentum, state_dtype):
    assert run_with_resume(tmp_path, fake_momentum, ("w1", "b1", "b2"), True, state_dtype) == 0.0


def test_permuted_named_registration_resumes_bit_exact(tmp_path, fake_momentum):
    assert run_with_resume(tmp_path, fake_momentum, ("b2", "w1", "b1"), named=True) == 0.0


def test_swapped_unnamed_params_are_caught_by_the_gate(tmp_path, fake_momentum):
    """b1 and b2 have the same shape: loading passes, the moments land in the wrong slots."""
    assert run_with_resume(tmp_path, fake_momentum, ("w1", "b1", "b2"), named=False) == 0.0
    assert run_with_resume(tmp_path / "swapped", fake_momentum, ("w1", "b2", "b1"), named=False) > 0.0


def test_directory_layout_and_sentinel(tmp_path, fake_momentum):
    model, opt = Net(0), fake_momentum()
    register(opt, model)
    train(model, opt, 0, 2)
    d = save_checkpoint(checkpoint_dir(tmp_path, 2), TrainerState(step=2, loader={"epoch": 0, "index": 2}), model, opt)
    assert sorted(p.name for p in d.iterdir()) == ["model.safetensors", "optimizer.safetensors", "trainer_state.json"]
    raw = json.loads((d / "trainer_state.json").read_text())
    assert raw["step"] == 2 and raw["loader"] == {"epoch": 0, "index": 2} and raw["accum_steps"] == 1
    save_checkpoint(d, TrainerState(step=2), model, opt, adapters=True)
    assert sorted(p.name for p in d.iterdir()) == ["adapters.safetensors", "optimizer.safetensors",
                                                   "trainer_state.json"]
    save_checkpoint(d, TrainerState(step=2), model)  # a re-save without optimizer leaves none behind
    assert sorted(p.name for p in d.iterdir()) == ["model.safetensors", "trainer_state.json"]


def test_crash_between_data_and_sentinel_keeps_previous_latest(tmp_path, fake_momentum, monkeypatch):
    model, opt = Net(0), fake_momentum()
    register(opt, model)
    train(model, opt, 0, 4)
    save_checkpoint(checkpoint_dir(tmp_path, 4), TrainerState(step=4), model, opt)
    train(model, opt, 4, 8)
    real_write = ckpt.atomic_write_bytes

    def crash_on_sentinel(path, data):
        if path.name == ckpt.SENTINEL:
            raise KeyboardInterrupt("simulated crash before the commit")
        real_write(path, data)

    monkeypatch.setattr(ckpt, "atomic_write_bytes", crash_on_sentinel)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(checkpoint_dir(tmp_path, 8), TrainerState(step=8), model, opt)
    assert (Path(checkpoint_dir(tmp_path, 8)) / "model.safetensors").is_file()
    assert (Path(checkpoint_dir(tmp_path, 8)) / "optimizer.safetensors").is_file()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 4)
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        load_checkpoint(checkpoint_dir(tmp_path, 8), Net(1))
    # A crash while overwriting a committed directory uncommits it first.
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(checkpoint_dir(tmp_path, 4), TrainerState(step=4), model, opt)
    assert latest_checkpoint(tmp_path) is None


def test_latest_ignores_unparseable_sentinels_and_strays(tmp_path, fake_momentum):
    model = Net(0)
    for step in (3, 10, 7):
        save_checkpoint(checkpoint_dir(tmp_path, step), TrainerState(step=step), model)
    (tmp_path / "checkpoint-step-99").mkdir()
    (tmp_path / "checkpoint-step-99" / "trainer_state.json").write_text("{\"step\": 9")  # torn
    (tmp_path / "checkpoint-step-12").mkdir()
    (tmp_path / "notes-step-50").mkdir()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 10)
    assert latest_checkpoint(tmp_path / "absent") is None


def test_sentinel_missing_field_names_it(tmp_path):
    d = save_checkpoint(checkpoint_dir(tmp_path, 2), TrainerState(step=2), Net(0))
    raw = json.loads((d / "trainer_state.json").read_text())
    del raw["loader"]
    (d / "trainer_state.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: missing field 'loader'"):
        load_checkpoint(d, Net(1))
    assert latest_checkpoint(tmp_path) is None


def test_sentinel_bad_field_type_names_it(tmp_path):
    d = save_checkpoint(checkpoint_dir(tmp_path, 2), TrainerState(step=2), Net(0))
    raw = json.loads((d / "trainer_state.json").read_text())
    raw["seeds"] = {"init": "zero"}
    (d / "trainer_state.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"seed 'init' must be an integer"):
        load_checkpoint(d)


def test_non_boundary_save_and_resume_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="inside an accumulation window"):
        save_checkpoint(checkpoint_dir(tmp_path, 6), TrainerState(step=6, accum_steps=4), Net(0))
    assert not any(tmp_path.iterdir())
    d = save_checkpoint(checkpoint_dir(tmp_path, 8), TrainerState(step=8, accum_steps=4), Net(0))
    assert load_checkpoint(d, Net(1), accum_steps=4).macro_step == 2
    with pytest.raises(CheckpointError, match="not a multiple of this run's accum_steps=3"):
        load_checkpoint(d, Net(1), accum_steps=3)
    raw = json.loads((d / "trainer_state.json").read_text())
    raw["step"] = 6  # a hand-edited or foreign sentinel inside a window
    (d / "trainer_state.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="step 6 is inside an accumulation window of 4"):
        load_checkpoint(d, Net(1))


def test_other_optimizer_type_is_refused(tmp_path, fake_momentum):
    class OtherOpt(fake_momentum):
        type_name = "other"

    model, opt = Net(0), OtherOpt()
    register(opt, model)
    train(model, opt, 0, 2)
    d = save_checkpoint(checkpoint_dir(tmp_path, 2), TrainerState(step=2), model, opt)
    fresh_model, fresh = Net(1), fake_momentum()
    register(fresh, fresh_model)
    before = params(fresh_model)
    with pytest.raises(ConfigMismatchError, match=r"optimizer\.safetensors: field 'type'.*'other'.*'fake_momentum'"):
        load_checkpoint(d, fresh_model, fresh)
    assert max_abs_diff(before, params(fresh_model)) == 0.0  # weights not touched on failure


def test_structural_config_change_is_refused_but_lr_is_not(tmp_path, fake_momentum):
    model, opt = Net(0), fake_momentum(momentum=0.9)
    register(opt, model)
    train(model, opt, 0, 2)
    save_optimizer(tmp_path / "o.safetensors", opt)
    lr_changed = fake_momentum(lr=0.5, momentum=0.9)
    register(lr_changed, Net(1))
    load_optimizer(tmp_path / "o.safetensors", lr_changed)
    mom_changed = fake_momentum(momentum=0.5)
    register(mom_changed, Net(1))
    with pytest.raises(ConfigMismatchError, match=r"o\.safetensors: config field 'momentum'"):
        load_optimizer(tmp_path / "o.safetensors", mom_changed)


def test_bf16_state_into_f32_optimizer_is_refused(tmp_path, fake_momentum):
    model, opt = Net(0), fake_momentum(state_dtype="bf16")
    register(opt, model)
    train(model, opt, 0, 2)
    save_optimizer(tmp_path / "o.safetensors", opt)
    assert read_optimizer(tmp_path / "o.safetensors")["tensors"]["w1.momentum"].dtype == ml_dtypes.bfloat16
    f32 = fake_momentum(state_dtype="f32")
    register(f32, Net(1))
    with pytest.raises(DTypeMismatchError, match=r"o\.safetensors: field 'config\.state_dtype' is 'bf16'.*'f32'"):
        load_optimizer(tmp_path / "o.safetensors", f32)


def test_bf16_tensor_into_f32_slot_is_a_dtype_mismatch(tmp_path, fake_momentum):
    model, opt = Net(0), fake_momentum(state_dtype="bf16")
    register(opt, model)
    train(model, opt, 0, 2)
    opt.config["state_dtype"] = "f32"  # a file whose config claims f32 but holds bf16 tensors
    save_optimizer(tmp_path / "o.safetensors", opt)
    f32 = fake_momentum(state_dtype="f32")
    register(f32, Net(1))
    with pytest.raises(DTypeMismatchError, match=r"o\.safetensors: .*bfloat16"):
        load_optimizer(tmp_path / "o.safetensors", f32)


def test_truncated_optimizer_file_names_the_file(tmp_path, fake_momentum):
    model, opt = Net(0), fake_momentum()
    register(opt, model)
    train(model, opt, 0, 2)
    d = save_checkpoint(checkpoint_dir(tmp_path, 2), TrainerState(step=2), model, opt)
    blob = (d / "optimizer.safetensors").read_bytes()
    (d / "optimizer.safetensors").write_bytes(blob[: len(blob) // 2])
    fresh = fake_momentum()
    register(fresh, Net(1))
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: .*truncated"):
        load_checkpoint(d, Net(1), fresh)


def test_nested_optimizer_state_round_trips(tmp_path):
    """An OptimizerSet-like nesting, numpy scalars and exact floats survive the file."""

    class Nested:
        def __init__(self, sd=None):
            self.sd = sd

        def state_dict(self):
            return self.sd

        def load_state_dict(self, sd):
            self.sd = sd

    sd = {"type": "set", "members": [
        {"type": "adamw", "config": {"lr": 0.1 + 0.2, "betas": [0.9, 0.999]},
         "tensors": {"w.exp_avg": np.arange(4, dtype=np.float32)}, "scalars": {"w.step": np.int64(7)}},
        {"type": "adamw", "config": {"lr": 1e-3}, "tensors": {"b.exp_avg": np.ones(2, ml_dtypes.bfloat16)},
         "scalars": {"b.step": 7}}]}
    save_optimizer(tmp_path / "o.safetensors", Nested(sd))
    target = Nested({"type": "set"})
    load_optimizer(tmp_path / "o.safetensors", target)
    back = target.sd
    assert back["members"][0]["config"]["lr"] == 0.1 + 0.2
    assert back["members"][0]["scalars"]["w.step"] == 7
    assert back["members"][1]["tensors"]["b.exp_avg"].dtype == ml_dtypes.bfloat16
    assert np.array_equal(back["members"][0]["tensors"]["w.exp_avg"], np.arange(4, dtype=np.float32))


def test_not_an_optimizer_file(tmp_path):
    from pipeline.train.state_dict import save_state_dict
    save_state_dict(tmp_path / "w.safetensors", {"w": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match="not a Fucina optimizer state file"):
        read_optimizer(tmp_path / "w.safetensors")


def test_unwritable_places_are_clear_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot create the checkpoint directory"):
        save_checkpoint(tmp_path / "file" / "checkpoint-step-2", TrainerState(step=2), Net(0))
    d = tmp_path / "checkpoint-step-2"
    (d / "model.safetensors").mkdir(parents=True)  # a directory where the weights file goes
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot write"):
        save_checkpoint(d, TrainerState(step=2), Net(0))
    assert not (d / "trainer_state.json").exists()
    assert [p.name for p in d.iterdir()] == ["model.safetensors"]  # no temp file left behind
