"""Checkpoints written before today's code still resume, and today's writers produce the same bytes.

tests/goldens/checkpoints/ (tools/gen_checkpoint_goldens.py) holds a spirals AdamW checkpoint and an ES
checkpoint with f32/f16/bf16 slots; they were first written by the pre-merge writers (pipeline/train/checkpoint.py
and pipeline/es/checkpoint.py's own copy of the protocol) and byte-compared with the merged one.
"""
import importlib.util
import pathlib

import numpy as np

from pipeline import optim
from pipeline.es.checkpoint import load_es_checkpoint, save_es_checkpoint
from pipeline.models.spirals import SpiralsMLP
from pipeline.runtime.ckpt import load_checkpoint, save_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "goldens" / "checkpoints"
_spec = importlib.util.spec_from_file_location("gen_checkpoint_goldens", ROOT / "tools" / "gen_checkpoint_goldens.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def _same_files(a: pathlib.Path, b: pathlib.Path):
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_the_committed_adamw_checkpoint_resumes_and_resaves_byte_for_byte(tmp_path):
    reference, _ = gen.adamw_model()
    model = SpiralsMLP(seed=123, hidden=4)  # another init: every value must come from the file
    opt = optim.AdamW(model.named_parameters(), lr=0.01)
    state = load_checkpoint(GOLDEN / "adamw", model, opt)
    assert state.step == 3
    for (name, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        assert np.array_equal(a.data, b.data), name
    _same_files(save_checkpoint(tmp_path / "adamw", state, model, opt), GOLDEN / "adamw")


def test_the_committed_es_checkpoint_resumes_and_resaves_byte_for_byte(tmp_path):
    reference = gen.es_trainer()
    fresh = gen.es_trainer(update=False)
    load_es_checkpoint(GOLDEN / "es", fresh)
    assert fresh.iteration == reference.iteration == 1
    for (name, a), (_, b) in zip(reference.named_arrays(), fresh.named_arrays()):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    _same_files(save_es_checkpoint(tmp_path / "es", fresh, run_config={"note": "golden"}), GOLDEN / "es")
