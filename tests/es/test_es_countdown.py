"""The built-in Countdown task: a deterministic problem set whose every problem is solvable, a safe parser
(no eval), exact-rational checking, the partial credit, and `fucina es-finetune --task countdown` end to end."""
import json
import os
from fractions import Fraction

import pytest

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.es import countdown
from pipeline.es.countdown import PARTIAL_CREDIT, countdown_reward, parse_expression, problem, problems

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")


def test_problems_are_deterministic_independent_and_solvable():
    a = problems(7, 40)
    assert a == problems(7, 40) and a[:10] == problems(7, 10)
    assert problem(7, 33) == a[33] and problems(8, 40) != a
    for p in a:
        assert len(p.numbers) == countdown.N_NUMBERS and all(1 <= n <= 99 for n in p.numbers)
        assert 0 < p.target <= countdown.MAX_TARGET
        value, used = parse_expression(p.solution)
        assert value == p.target and len(used) >= 2
        assert countdown_reward(p.prompt, f"<answer>{p.solution}</answer>", p.reference) == 1.0
        assert str(p.target) in p.prompt and "<answer>" in p.prompt


def test_parser_is_exact_and_refuses_anything_else():
    assert parse_expression("(1 + 2) * 3") == (Fraction(9), [1, 2, 3])
    assert parse_expression("7 / 2 * 2")[0] == 7  # exact rationals: no float rounding
    assert parse_expression("10 / 3 + 10 / 3 + 10 / 3")[0] == 10
    assert parse_expression("1 - 2 - 3")[0] == -4  # left associative
    assert parse_expression("4 / (2 - 2)")[0] is None  # division by zero: no value
    for bad in ("", "1 +", "(1 + 2", "1 2", "-1 + 3", "2 ** 3", "1.5 * 2", "__import__('os')", "x", "((" * 40 + "1"):
        with pytest.raises(countdown._Malformed):
            parse_expression(bad)


def test_reward_credits():
    ref = "numbers 3 7 25 50 target 150"
    assert countdown_reward("", "<answer>(50 - 25) * 7 - 25</answer>", ref) == 0.0  # 25 used twice
    assert countdown_reward("", "<answer>3 * 50</answer>", ref) == 1.0
    assert countdown_reward("", "think... <answer>1</answer> no: <answer>50 * 3</answer>", ref) == 1.0  # the last
    assert countdown_reward("", "<answer>3 * 7 + 25</answer>", ref) == PARTIAL_CREDIT  # well formed, wrong value
    assert countdown_reward("", "<answer>50 / (7 - 7)</answer>", ref) == 0.0  # 7 twice
    assert countdown_reward("", "<answer>50 / (3 - 3)</answer>", ref) == 0.0  # 3 twice
    assert countdown_reward("", "<answer>50 * 4</answer>", ref) == 0.0  # 4 not given
    assert countdown_reward("", "3 * 50", ref) == 0.0  # no answer tag
    assert countdown_reward("", "<answer>" + " + ".join(["3"] * 80) + "</answer>", ref) == 0.0  # too long
    with pytest.raises(UserError, match="not a countdown problem"):
        countdown_reward("", "<answer>1</answer>", "Paris")


def test_es_finetune_task_countdown_runs(tmp_path, capsys):
    rc = main(["es-finetune", "--model", MODEL, "--task", "countdown", "--task-size", "6", "--population", "4",
               "--batch", "2", "--max-new-tokens", "4", "--iterations", "2", "--threads", "0", "--eval-samples", "2",
               "--save", str(tmp_path / "cd"), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    s = json.loads(out.out.strip().splitlines()[-1])
    assert s["reward"] == "countdown" and len(s["reward_stats"]) == 2
    assert 0.0 <= s["initial_reward"] <= 1.0 and "6 problems" in out.err
    state = json.loads((tmp_path / "cd" / "trainer_state.json").read_text())
    assert state["config"]["data"] == "builtin:countdown:0:6" and state["config"]["reward"] == "countdown"
    rc = main(["es-finetune", "--model", MODEL, "--task", "countdown", "--reward", "exact", "--iterations", "1"])
    assert rc == 2 and "--reward countdown" in capsys.readouterr().err


def test_difficulty_knob_draws_easier_problems_and_keeps_the_default_set():
    easy = problems(3, 50, n_numbers=2, max_number=9)
    assert easy == problems(3, 50, 2, 9) and easy[:7] == problems(3, 7, 2, 9)
    for p in easy:
        assert len(p.numbers) == 2 and all(1 <= n <= 9 for n in p.numbers)
        assert countdown_reward(p.prompt, f"<answer>{p.solution}</answer>", p.reference) == 1.0
    six = problems(3, 10, n_numbers=6, max_number=999)
    assert all(len(p.numbers) == 6 and all(1 <= n <= 999 for n in p.numbers) for p in six)
    # the knob's defaults are the set the task drew before it existed (the docs' example problem)
    assert problem(0, 1) == problem(0, 1, countdown.N_NUMBERS, countdown.MAX_NUMBER)
    assert problem(0, 1).numbers == (49, 94, 1, 59) and problem(0, 1).target == 108
    for n_numbers, max_number, flag in ((1, 9, "--task-numbers"), (7, 9, "--task-numbers"),
                                        (2, 0, "--task-max-number"), (2, 1000, "--task-max-number")):
        with pytest.raises(UserError, match=flag):
            problems(0, 1, n_numbers, max_number)


def test_es_finetune_refuses_a_bad_difficulty_before_loading(capsys):
    rc = main(["es-finetune", "--model", MODEL, "--task", "countdown", "--task-numbers", "9", "--iterations", "1"])
    assert rc == 2 and "--task-numbers must be in 2..6, got 9" in capsys.readouterr().err


def test_make_countdown_sft_writes_the_easy_problems(tmp_path):
    import importlib.util
    path = os.path.join(ROOT, "tools", "make_countdown_sft.py")
    spec = importlib.util.spec_from_file_location("make_countdown_sft", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "easy.jsonl"
    tool.main(["--out", str(out), "--seed", "5", "--size", "12", "--numbers", "2", "--max-number", "9"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["instruction"] for r in rows] == [p.prompt for p in problems(5, 12, 2, 9)]
    assert [r["response"] for r in rows] == [f"<answer>{p.solution}</answer>" for p in problems(5, 12, 2, 9)]
    with pytest.raises(UserError, match="--task-max-number"):
        tool.main(["--out", str(tmp_path / "bad.jsonl"), "--max-number", "0"])
    assert not (tmp_path / "bad.jsonl").exists()  # nothing half-written
