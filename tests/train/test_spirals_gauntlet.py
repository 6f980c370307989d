"""The two-spirals gauntlet and `fucina spirals` (few steps; the full run is marked slow)."""
import json
import pathlib
import subprocess
import sys

import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main
from pipeline.runtime.ckpt import checkpoint_dir, is_committed
from pipeline.train.gauntlet import RECIPES, run_recipe
from pipeline.train.state_dict import load_state_dict
from pipeline.train.trainer_state import TrainerState

ROOT = pathlib.Path(__file__).resolve().parents[2]
REPLAY = """
import sys
from pipeline.threads import pin_threads
pin_threads(int(sys.argv[3]))  # the project's thread knob: numba and kernel-pool threads (BLAS held at one)
from pipeline.autograd import Tensor
from pipeline.models.spirals import SpiralsMLP, make_spirals
from pipeline.runtime.ckpt import checkpoint_dir, load_checkpoint
from pipeline.train.gauntlet import RECIPES, train
from pipeline.train.state_dict import model_state_dict, save_state_dict
recipe, run = RECIPES[sys.argv[1]], sys.argv[2]
X, y = make_spirals()
model = SpiralsMLP(seed=99)
opt, schedule = recipe.make(model)
start = load_checkpoint(checkpoint_dir(run, 10), model, opt).step
train(model, opt, schedule, recipe, Tensor(X), y, start, 20, 20)
save_state_dict(run + "/replayed.safetensors", model_state_dict(model))
"""


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    """As the command does: 400-row matmuls only lose from a second BLAS thread.

    The command also caps numba's threads; both are restored for the tests after these."""
    import numba
    numba_threads = numba.get_num_threads()
    with threadpool_limits(1):
        yield
    numba.set_num_threads(numba_threads)


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_resumes_bit_exact(tmp_path, name):
    r = run_recipe(RECIPES[name], tmp_path, steps=16)
    assert r["bit_exact"] and r["resume_max_abs_diff"] == 0.0
    assert r["resume_from"] == 8
    assert r["inference_accuracy"] == r["accuracy"]  # the frozen model got exactly the trained weights
    assert is_committed(checkpoint_dir(tmp_path / name, 8)) and is_committed(checkpoint_dir(tmp_path / name, 16))


@pytest.mark.parametrize("name,sabotage", [("adamw", "swap-biases"), ("muon", "swap-biases"),
                                           ("groups", "swap-biases"), ("groups", "restart-schedule")])
def test_the_gate_catches_a_broken_resume(tmp_path, name, sabotage):
    r = run_recipe(RECIPES[name], tmp_path, steps=16, sabotage=sabotage)
    assert not r["bit_exact"] and r["resume_max_abs_diff"] > 0.0


@pytest.mark.parametrize("name", ["groups"])
def test_resume_in_another_process_with_two_threads_is_bit_exact(tmp_path, name):
    """The checkpoint carries everything: a new interpreter with 2 compute threads replays the same bits."""
    run_recipe(RECIPES[name], tmp_path, steps=20)
    run = tmp_path / name
    subprocess.run([sys.executable, "-c", REPLAY, name, str(run), "2"], cwd=ROOT, check=True, timeout=300)
    final = load_state_dict(pathlib.Path(checkpoint_dir(run, 20)) / "model.safetensors")
    replayed = load_state_dict(run / "replayed.safetensors")
    assert final.keys() == replayed.keys()
    assert all(final[n].tobytes() == replayed[n].tobytes() for n in final)


def test_sentinel_records_the_run(tmp_path):
    run_recipe(RECIPES["groups"], tmp_path, steps=6, seed=3)
    state = TrainerState.read(pathlib.Path(checkpoint_dir(tmp_path / "groups", 3)) / "trainer_state.json")
    assert state.step == 3 and state.seeds == {"data": 3, "init": 3}
    assert state.schedule == {"name": "warmup_cosine", "total": 6}
    assert state.config["recipe"] == "groups"


def test_command_json_shape_and_exit_code(tmp_path, capsys):
    rc = main(["spirals", "--steps", "6", "--optimizer", "adamw,lion", "--optimizer", "sgd", "--json",
               "--run-dir", str(tmp_path)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in doc["runs"]] == ["sgd", "adamw", "lion"]
    for r in doc["runs"]:
        assert {"name", "loss", "accuracy", "resume_max_abs_diff", "inference_accuracy"} <= set(r)
        assert r["resume_max_abs_diff"] == 0.0 and 0.0 <= r["accuracy"] <= 1.0
    assert is_committed(checkpoint_dir(tmp_path / "lion", 3))
    # a reused run dir (holding a later step) still resumes from the halfway checkpoint
    assert main(["spirals", "--steps", "6", "--optimizer", "lion", "--json", "--run-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["resume_from"] == 3


def test_command_text_and_failing_gate(capsys):
    assert main(["spirals", "--steps", "6", "--optimizer", "adam"]) == 0
    out = capsys.readouterr().out
    assert "[adam] resume from step 3: max |delta param| = 0 (bit-exact)" in out
    assert main(["spirals", "--steps", "6", "--optimizer", "adam", "--sabotage", "swap-biases"]) == 1
    captured = capsys.readouterr()
    assert "NOT bit-exact" in captured.out and "resume NOT bit-exact for adam" in captured.err


def test_command_min_accuracy_fails_weak_runs_but_not_sgd(capsys):
    assert main(["spirals", "--steps", "4", "--optimizer", "sgd", "--min-accuracy", "0.99"]) == 0
    assert main(["spirals", "--steps", "4", "--optimizer", "adam", "--min-accuracy", "0.99"]) == 1
    assert "accuracy below 0.99 for adam" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--optimizer", "adagrad"], "unknown --optimizer adagrad"),
    (["--steps", "1"], "--steps must be >= 2"),
])
def test_command_bad_input_is_one_line(capsys, argv, message):
    assert main(["spirals", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.slow
def test_full_gauntlet_reaches_the_accuracy_bar(capsys):
    """The README job: 2000 steps, every recipe bit-exact, all but the SGD family >= 99%."""
    assert main(["spirals", "--json", "--min-accuracy", "0.99"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert len(runs) == len(RECIPES)
    for r in runs:
        assert r["resume_max_abs_diff"] == 0.0
        if not RECIPES[r["name"]].sgd_family:
            assert r["accuracy"] >= 0.99 and r["inference_accuracy"] >= 0.99
