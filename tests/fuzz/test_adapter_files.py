"""Adapter checkpoints from elsewhere (export-gguf/export-peft --adapters): hostile names and recorded
values are one UserError/CheckpointError naming the file, never ValueError/OverflowError."""
import struct

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.errors import FucinaError, UserError
from pipeline.llm.export import load_adapters, resolve_alpha
from pipeline.train.state_dict import atomic_write_bytes, save_state_dict
from pipeline.train.trainer_state import TrainerState


def _checkpoint(directory, names, config=None):
    directory.mkdir()
    save_state_dict(directory / "adapters.safetensors", {n: np.zeros((2, 2), np.float32) for n in names})
    atomic_write_bytes(directory / "trainer_state.json", TrainerState(step=0, config=config or {}).to_json().encode())
    return directory


def test_a_layer_index_past_int_parsing_is_not_an_adapter_name(tmp_path):
    layer = "9" * 5000  # int() refuses more than 4300 digits
    d = _checkpoint(tmp_path / "c", [f"layers.{layer}.q.lora_a", f"layers.{layer}.q.lora_b"])
    with pytest.raises(UserError, match="adapters.safetensors: tensor 'layers.9999.* is not an adapter name"):
        load_adapters(d)


@pytest.mark.parametrize("alpha", [10**400, -(10**400), [16], float("inf")], ids=["1e400", "-1e400", "list", "inf"])
def test_a_recorded_alpha_out_of_range_is_named(tmp_path, alpha):
    config = {"lora": {"alpha": alpha}} if not isinstance(alpha, float) else {"lora_alpha": alpha}
    d = _checkpoint(tmp_path / "c", ["layers.0.q.lora_a", "layers.0.q.lora_b"])
    adapters = load_adapters(d)
    adapters.config = config
    with pytest.raises(FucinaError, match="trainer_state.json: config.lora(.|_)alpha: alpha must be a"):
        resolve_alpha(None, adapters)


def test_a_sane_recorded_alpha_is_used(tmp_path):
    d = _checkpoint(tmp_path / "c", ["layers.0.q.lora_a", "layers.0.q.lora_b"], config={"lora": {"alpha": 32}})
    assert resolve_alpha(None, load_adapters(d)) == 32.0


@pytest.mark.parametrize("header", [b"[" * 100_000 + b"]" * 100_000,
                                    b'{"layers.0.q.lora_a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}',
                                    b'{"layers.0.q.lora_a": {"dtype": "F32", "shape": [18446744073709551616], '
                                    b'"data_offsets": [0, 8]}}'], ids=["deep", "dtype-list", "shape-2^64"])
def test_a_hostile_adapter_file_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, header):
    d = _checkpoint(tmp_path / "c", ["layers.0.q.lora_a", "layers.0.q.lora_b"], config={"lora": {"alpha": 16}})
    (d / "adapters.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    assert main(["export-peft", "--adapters", str(d), "--out", str(tmp_path / "peft")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{d / 'adapters.safetensors'}: " in err
    assert not (tmp_path / "peft").exists()
