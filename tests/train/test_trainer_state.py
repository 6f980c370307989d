"""TrainerState: the sentinel's JSON form and its validation."""
import json

import pytest

from pipeline.errors import CheckpointError
from pipeline.train.trainer_state import FORMAT, TrainerState


def test_round_trip():
    s = TrainerState(step=12, accum_steps=4, seeds={"init": 1, "data": 2}, loader={"epoch": 1, "index": 7},
                     schedule={"name": "warmup_cosine", "total": 100, "warmup": 5, "min_factor": 0.1},
                     config={"lr": 0.1 + 0.2})
    back = TrainerState.from_json(s.to_json())
    assert back == s and back.macro_step == 3 and back.on_boundary
    assert json.loads(s.to_json())["format"] == FORMAT


@pytest.mark.parametrize("field", ["step", "accum_steps", "seeds", "loader", "schedule", "config"])
def test_each_missing_field_is_named(field):
    raw = json.loads(TrainerState(step=2).to_json())
    del raw[field]
    with pytest.raises(CheckpointError, match=rf"run/trainer_state\.json: missing field '{field}'"):
        TrainerState.from_json(json.dumps(raw), source="run/trainer_state.json")


@pytest.mark.parametrize("change,message", [
    ({"step": -1}, "'step' must be >= 0"),
    ({"step": 2.5}, "'step' must be an integer"),
    ({"step": True}, "'step' must be an integer"),
    ({"accum_steps": 0}, "'accum_steps' must be >= 1"),
    ({"loader": [1, 2]}, "'loader' must be a JSON object"),
    ({"seeds": {"init": 1.5}}, "seed 'init' must be an integer"),
    ({"format": "other/9"}, "field 'format' is 'other/9'"),
    ({"extra": 1}, "unknown field 'extra'"),
])
def test_bad_fields_are_named(change, message):
    raw = {**json.loads(TrainerState(step=2).to_json()), **change}
    with pytest.raises(CheckpointError, match=message):
        TrainerState.from_json(json.dumps(raw))


@pytest.mark.parametrize("text", ["", "{\"step\": 3", "[1, 2]", "null"])
def test_torn_or_foreign_text_is_not_a_sentinel(text):
    with pytest.raises(CheckpointError):
        TrainerState.from_json(text)


def test_constructor_validates_and_boundary_check():
    with pytest.raises(CheckpointError, match="'accum_steps' must be >= 1"):
        TrainerState(step=1, accum_steps=0)
    with pytest.raises(CheckpointError, match="step 5 is inside an accumulation window of 2"):
        TrainerState(step=5, accum_steps=2).require_boundary()


def test_unserialisable_config_is_a_clear_error():
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        TrainerState(step=1, config={"f": float("nan")}).to_json()
