"""`fucina eval`: held-out greedy evaluation with its standard errors, of the base model or with the adapters of
an es-finetune / finetune checkpoint; the same numbers in-process and on W workers, the same numbers es-finetune
reports for its centre, clear errors."""
import json
import math
import os

import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main
from pipeline.es.evaluate import shards, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")
TASK = ("--task", "countdown", "--task-numbers", "2", "--task-max-number", "9", "--task-seed", "7",
        "--max-new-tokens", "6", "--threads", "0")
DISTINCT = "def reward(prompt, completion, reference):\n    return float(len(set(completion)))\n"


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with threadpool_limits(1):
        yield


def _main(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, (json.loads(out.out.strip().splitlines()[-1]) if rc == 0 else None), out.err


def test_summary_and_standard_errors():
    s = summarize([1.0, 0.0, 0.1, 1.0])
    assert s["n"] == 4 and s["solved"] == 2 and s["accuracy"] == 0.5
    assert s["accuracy_se"] == math.sqrt(0.25 / 4)
    assert math.isclose(s["mean_reward"], 0.525)
    assert math.isclose(s["mean_reward_se"], 0.55 / 2)  # sample std (ddof 1) / sqrt(n)
    assert shards(5, 2) == [(0, 3), (3, 5)] and shards(2, 4) == [(0, 1), (1, 2)]


def test_eval_of_an_es_checkpoint_matches_the_run_and_workers(tmp_path, capsys):
    f = tmp_path / "distinct.py"
    f.write_text(DISTINCT)
    reward = f"{f}:reward"
    rc, es, err = _main(capsys, "es-finetune", "--model", MODEL, *TASK, "--task-size", "4", "--eval-samples", "4",
                        "--population", "4", "--batch", "2", "--iterations", "3", "--sigma", "0.5", "--alpha", "0.5",
                        "--reward", reward, "--save", str(tmp_path / "es"), "--json")
    assert rc == 0, err
    assert es["final_reward"] != es["initial_reward"]  # the adapters changed the answers
    rc, base, err = _main(capsys, "eval", "--model", MODEL, *TASK, "--n", "4", "--reward", reward, "--json")
    assert rc == 0, err
    assert base["mean_reward"] == es["initial_reward"] and len(base["rewards"]) == 4
    rc, tuned, err = _main(capsys, "eval", "--model", MODEL, *TASK, "--n", "4", "--reward", reward, "--json",
                           "--lora", str(tmp_path / "es"))
    assert rc == 0, err
    assert tuned["mean_reward"] == es["final_reward"]  # eval scores exactly what es-finetune's centre scored
    assert "+-" in err and "solved" in err
    rc, fanned, err = _main(capsys, "eval", "--model", MODEL, *TASK, "--n", "4", "--reward", reward, "--json",
                            "--lora", str(tmp_path / "es"), "--workers", "2", "--batch", "1")
    assert rc == 0, err
    assert fanned["rewards"] == tuned["rewards"] and fanned["workers"] == 2


def test_eval_of_a_finetune_run_dir_with_data(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {w}", "response": w}) + "\n"
                            for w in ("ahoy", "arr", "matey")))
    rc = main(["finetune", "--model", MODEL, "--data", str(data), "--steps", "2", "--lr", "0.5", "--threads", "0",
               "--save", str(tmp_path / "ft"), "--save-every", "1", "--max-new-tokens", "2"])
    capsys.readouterr()
    assert rc == 0
    common = ("eval", "--model", MODEL, "--data", str(data), "--n", "3", "--reward", "exact",
              "--reward", "rule:length=1,4@0.5", "--max-new-tokens", "4", "--threads", "0", "--json")
    rc, base, err = _main(capsys, *common)
    assert rc == 0, err
    rc, tuned, err = _main(capsys, *common, "--lora", str(tmp_path / "ft"))
    assert rc == 0, err
    assert len(tuned["rewards"]) == 3 and tuned["reward"] == "exact\nrule:length=1,4@0.5"
    assert "0.5*rule:length=1,4" in err
    _bad_run_dirs_are_one_error(capsys, tmp_path, tmp_path / "ft" / "checkpoint-step-1")


def _bad_run_dirs_are_one_error(capsys, tmp_path, good):
    """--lora that cannot be these adapters: another model's shapes or family, a truncated adapters file, an unreadable
    trainer_state.json, a directory with no checkpoint: one error naming it, rc 2, nothing scored."""
    import shutil
    corrupt, broken, empty = (tmp_path / n for n in ("corrupt", "broken", "empty"))
    for d in (corrupt, broken):
        shutil.copytree(good, d)
    (corrupt / "adapters.safetensors").write_bytes((good / "adapters.safetensors").read_bytes()[:100])
    (broken / "trainer_state.json").write_text('{"step": ')
    empty.mkdir()
    other = os.path.join(ROOT, "tests", "fixtures", "qwen3-tied-q4_k_s.gguf")  # wider: the shapes differ
    llama = os.path.join(ROOT, "tests", "fixtures", "llama-mini-f32.gguf")  # the same shapes, another family
    for model, lora, words in ((other, good, "expected float32"), (llama, good, "trained on a qwen3 model"),
                               (MODEL, corrupt, "corrupt safetensors"),
                               (MODEL, broken, "no valid trainer_state.json"), (MODEL, empty, "neither a committed")):
        rc, _, err = _main(capsys, "eval", "--model", model, "--task", "countdown", "--n", "2", "--max-new-tokens", "2",
                           "--threads", "0", "--lora", str(lora))
        assert rc == 2 and str(lora) in err and words in err and "Traceback" not in err, err
        assert "items scored" not in err


@pytest.mark.parametrize("argv, words", [
    (("--n", "2"), "give --task countdown or --data"),
    (("--task", "countdown", "--reward", "nll"), "not an answer reward"),
    (("--task", "countdown", "--lora", "/nonexistent"), "/nonexistent"),
    (("--task", "countdown", "--n", "0"), "--n must be >= 1"),
])
def test_bad_eval_arguments_are_one_error(capsys, argv, words):
    rc, _, err = _main(capsys, "eval", "--model", MODEL, *argv, "--max-new-tokens", "2")
    assert rc == 2 and words in err and "Traceback" not in err


def test_data_without_reward_and_too_few_records(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "hi", "response": "ho"}) + "\n")
    rc, _, err = _main(capsys, "eval", "--model", MODEL, "--data", str(data))
    assert rc == 2 and "needs --reward" in err
    rc, _, err = _main(capsys, "eval", "--model", MODEL, "--data", str(data), "--reward", "exact", "--n", "5")
    assert rc == 2 and "holds 1 records" in err
