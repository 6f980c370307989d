"""The JSON inside checkpoints (trainer_state.json, the optimizer state's metadata): malformed or hostile
input is one CheckpointError naming the file and field, never RecursionError/ValueError/TypeError."""
import json

import numpy as np
import pytest
from fuzz_cases import EDGE_VALUES, MUTATIONS, mutate
from hypothesis import given
from hypothesis import strategies as st
from hypothesis_profiles import LONG, QUICK

from pipeline import optim
from pipeline.autograd import Tensor
from pipeline.errors import CheckpointError
from pipeline.train.optimizer_state import read_optimizer
from pipeline.train.state_dict import save_state_dict
from pipeline.train.trainer_state import TrainerState
from pipeline import untrusted
from pipeline.untrusted import nesting_depth

VALID = TrainerState(step=4, accum_steps=2, seeds={"init": 1, "data": 2}, loader={"epoch": 0, "index": [1, 2]},
                     config={"lora": {"alpha": 16.0, "targets": ["q", "v"]}}).to_json()


@pytest.mark.parametrize("change,match", [
    ({"config": {"deep": json.loads("[" * 60 + "]" * 60)}}, None),             # deep but within the limit: read
    ({"step": 2**63}, "'step' must be >= 0 and < 2\\^63"),
    ({"accum_steps": 2**64}, "'accum_steps' must be >= 1 and < 2\\^63"),
    ({"seeds": {"init": -1}}, "seed 'init' must be an integer in \\[0, 2\\^64\\), got -1"),   # np.uint64 would raise
    ({"seeds": {"init": 2**64}}, "seed 'init' must be an integer in \\[0, 2\\^64\\)"),
])
def test_trainer_state_ranges(change, match):
    text = json.dumps({**json.loads(VALID), **change})
    if match is None:
        assert TrainerState.from_json(text).config == change["config"]
    else:
        with pytest.raises(CheckpointError, match=f"^t.json: field {match}|^t.json: {match}"):
            TrainerState.from_json(text, source="t.json")


@pytest.mark.parametrize("text,match", [
    ('{"config": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested 100001 levels deep, the limit is 64"),
    ('{"step": ' + "7" * 5000 + "}", "not valid JSON \\(Exceeds the limit"),
    ('{"step": 1, "step": 2}', "not valid JSON \\(duplicate key 'step'\\)"),
])
def test_trainer_state_json_is_bounded(text, match):
    with pytest.raises(CheckpointError, match=f"^t.json: {match}"):
        TrainerState.from_json(text, source="t.json")


def _optimizer_file(path, state_json):
    save_state_dict(path, {"w.exp_avg": np.zeros(2, np.float32)},
                    metadata={"format": "fucina.optimizer_state/1", "type": "adamw", "state": state_json})
    return path


@pytest.mark.parametrize("state,match", [
    ("[" * 10_000 + "]" * 10_000, "corrupt optimizer state metadata: JSON nested 10000 levels deep"),
    ('{"type": "adamw", "tensors": {"w.exp_avg": {"__tensor__": ["w"]}}}', "refers to tensor \\['w'\\]"),
    ('{"type": "adamw", "a": {"__tensor__": "w.exp_avg"}, "b": {"__tensor__": "w.exp_avg"}}', "referred to twice"),
    ('{"type": ["adamw"], "t": {"__tensor__": "w.exp_avg"}}', "field 'type' is not a string"),
])
def test_optimizer_state_metadata_is_bounded(tmp_path, state, match):
    path = _optimizer_file(tmp_path / "optimizer.safetensors", state)
    with pytest.raises(CheckpointError, match=match) as err:
        read_optimizer(path)
    assert str(err.value).startswith(f"{path}: ")


def test_a_real_optimizer_state_round_trips_through_the_bounded_reader(tmp_path):
    from pipeline.train.optimizer_state import save_optimizer
    w = Tensor(np.ones(3, np.float32), requires_grad=True)
    opt = optim.AdamW([("w", w)], lr=0.1)
    w.grad = np.ones(3, np.float32)
    opt.step()
    save_optimizer(tmp_path / "o.safetensors", opt)
    state = read_optimizer(tmp_path / "o.safetensors")
    assert state["type"] == "adamw" and state["scalars"] == {"w.step": 1}


@pytest.mark.parametrize("text,depth", [("", 0), ('{"a": [1, {"b": "[[[{"}]}', 3), ('["\\"]', 1),
                                        ('"\\\\"[[[', 3), ('[["x', 2), ("]]][", 0),
                                        ("[[]][[[[]]]]", 4), ('[[["]]]"[[[', 6)])
def test_nesting_depth_skips_strings(text, depth, monkeypatch):
    """Brackets in strings do not count; nor, past an unterminated string or a stray ']', where the decoder
    stops with its error, what it never reaches. The same across chunk boundaries."""
    assert nesting_depth(text) == depth
    monkeypatch.setattr(untrusted, "_CHUNK", 2)
    assert nesting_depth(text) == depth


values = st.one_of(st.sampled_from(EDGE_VALUES), st.integers(0, 255))
edits = st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, len(VALID)), values), min_size=1, max_size=3)


def read_or_refuse(text):
    try:
        state = TrainerState.from_json(text, source="t.json")
    except CheckpointError as e:
        assert str(e).startswith("t.json: ")
        return
    state.validate("reread")  # what parsed is a state every consumer may rely on


@QUICK
@given(edits=edits)
def test_mutated_trainer_state_reads_or_raises_checkpoint_error(edits):
    read_or_refuse(mutate(VALID.encode(), edits).decode("utf-8", "replace"))


@pytest.mark.slow
@LONG
@given(edits=edits)
def test_mutated_trainer_state_long(edits):
    read_or_refuse(mutate(VALID.encode(), edits).decode("utf-8", "replace"))
