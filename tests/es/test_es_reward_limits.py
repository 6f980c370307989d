"""Rewards as user code under limits, composite rewards, and a tied population reported, not silent.

A user's reward that raises, hangs, floods stdout, returns 10**400 / a non-number, or has the wrong signature
ends in one line naming it (rc 2 from the CLI, no traceback); `--reward A@w --reward B` scores w*A + B; an
iteration whose members all score the same says so, with the reward, the value and what to try."""
import json
import os
import time

import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.es.rewards import (RewardFunctionError, describe, join_specs, parse_reward, split_specs,
                                 user_reward_files)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")
SMALL = ("--population", "4", "--batch", "2", "--max-new-tokens", "6", "--threads", "0", "--eval-samples", "2")
USER = """import sys, time
def good(prompt, completion, reference):
    return len(completion) / 2
def boom(prompt, completion, reference):
    raise ZeroDivisionError('division by zero')
def huge(prompt, completion, reference):
    return 10 ** 400
def listy(prompt, completion, reference):
    return [1.0]
def two(prompt, completion):
    return 1.0
def kw_only(prompt, completion, *, reference):
    return 1.0
def flexible(*args):
    return 2.0
def sleepy(prompt, completion, reference):
    time.sleep(60)
    return 1.0
def stubborn(prompt, completion, reference):
    try:
        time.sleep(60)
    except Exception:
        return 5.0
    return 1.0
def chatty(prompt, completion, reference):
    for _ in range(2000):
        print('x' * 1000)
        sys.stderr.write('y' * 1000)
    return 0.5
def quits(prompt, completion, reference):
    sys.exit(3)
"""


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with threadpool_limits(1):
        yield


@pytest.fixture()
def user(tmp_path):
    f = tmp_path / "user_rewards.py"
    f.write_text(USER)
    return str(f)


def test_an_exception_names_the_reward_the_sample_and_the_exception(user):
    fn = parse_reward(f"{user}:boom")
    with pytest.raises(RewardFunctionError) as e:
        fn("the prompt", "the answer", "ref", 7)
    msg = str(e.value)
    assert f"reward function {user}:boom raised ZeroDivisionError: division by zero on sample 7" in msg
    assert "'the prompt'" in msg and "'the answer'" in msg and "\n" not in msg
    with pytest.raises(RewardFunctionError, match="raised SystemExit: 3 on sample 0"):
        parse_reward(f"{user}:quits")("p", "c", "r", 0)


@pytest.mark.parametrize("name, words", [("huge", "returned an int of 401 digits (too large for a float) on "
                                                   "sample 2"),
                                         ("listy", "returned list [1.0] on sample 2")])
def test_a_value_that_is_not_a_finite_float_is_refused(user, name, words):
    with pytest.raises(RewardFunctionError) as e:
        parse_reward(f"{user}:{name}")("p", "c", "r", 2)
    assert words in str(e.value) and "it must return a finite float" in str(e.value)


def test_a_wrong_signature_is_refused_at_load_time(user):
    for name in ("two", "kw_only"):
        with pytest.raises(UserError, match=rf"{name}\(.*\) cannot be called as {name}\(prompt, completion, "
                                            r"reference\)"):
            parse_reward(f"{user}:{name}")
    assert parse_reward(f"{user}:flexible")("p", "c", "r") == 2.0  # *args takes the three strings


def test_a_hanging_reward_is_stopped_by_the_timeout(user):
    for name in ("sleepy", "stubborn"):  # `except Exception` in the user's code does not swallow the timeout
        t0 = time.perf_counter()
        with pytest.raises(RewardFunctionError, match=f"{name} took longer than --reward-timeout 0.2 s on sample 1"):
            parse_reward(f"{user}:{name}", timeout=0.2)("p", "c", "r", 1)
        assert time.perf_counter() - t0 < 30  # bounded: the call would sleep 60 s
    assert parse_reward(f"{user}:good", timeout=0.2)("p", "abcd", "r") == 2.0  # the alarm is disarmed after


def test_printed_output_is_captured_and_bounded(user, capfd):
    assert parse_reward(f"{user}:chatty")("p", "c", "r") == 0.5
    out = capfd.readouterr()
    assert out.out == ""  # nothing reached stdout: the JSON line of --json stays the only one there
    assert f"[reward {user}:chatty printed]" in out.err and "more characters dropped" in out.err
    assert len(out.err) < 6000  # 4 MB printed, 4096 characters passed on


def test_composite_rewards_are_the_weighted_sum(user):
    spec = join_specs([f"{user}:good@0.5", "rule:regex=<answer>@0.2", "rule:length=1,3"])
    assert split_specs(spec) == [(f"{user}:good", 0.5, True), ("rule:regex=<answer>", 0.2, True),
                                 ("rule:length=1,3", 1.0, False)]
    fn = parse_reward(spec)
    assert fn("p", "<answer>", "r") == 0.5 * 4.0 + 0.2 * 1.0 + 0.0  # 8 characters: the length slope floors at 0
    assert fn("p", "ab", "r") == 0.5 * 1.0 + 0.0 + 1.0
    assert describe(spec) == f"0.5*{user}:good + 0.2*rule:regex=<answer> + 1*rule:length=1,3"
    assert describe("countdown") == "countdown" and user_reward_files(spec) == [user]
    with pytest.raises(UserError, match="nll .*does not compose"):
        join_specs(["nll", "exact"])
    assert split_specs("rule:regex=a@b") == [("rule:regex=a@b", 1.0, False)]  # no number after @: no weight


def _run(capsys, *argv):
    rc = main(["es-finetune", "--model", MODEL, *SMALL, *argv, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out.strip().splitlines()[-1]) if rc == 0 else None), out.err


def test_a_raising_reward_ends_the_run_rc2_in_one_line(user, capsys):
    rc, _, err = _run(capsys, "--iterations", "1", "--reward", f"{user}:boom")
    assert rc == 2 and "Traceback" not in err
    [line] = [ln for ln in err.splitlines() if "raised" in ln]
    assert f"{user}:boom raised ZeroDivisionError: division by zero on sample 0" in line
    rc, _, err = _run(capsys, "--iterations", "1", "--reward", f"{user}:two")
    assert rc == 2 and "cannot be called as two(prompt, completion, reference)" in err
    rc, _, err = _run(capsys, "--iterations", "1", "--reward", f"{user}:sleepy", "--reward-timeout", "0.2")
    assert rc == 2 and "took longer than --reward-timeout 0.2 s" in err and "Traceback" not in err


def test_a_tied_population_is_reported_and_composing_gives_a_signal(user, capsys):
    """rule:length=5,40 scores every answer of the random fixture 1.0: the run says so; composed with a
    reward the answers vary in, the members differ and ES steps."""
    rc, s, err = _run(capsys, "--iterations", "2", "--reward", "rule:length=5,40")
    assert rc == 0, err
    assert s["tied_iterations"] == [1, 2]
    assert "iteration 1: all 4 members scored rule:length=5,40 = 1; z-score shaping gives every member " \
           "coefficient 0, so ES took no step" in err
    assert "larger --sigma" in err and "2 of 2 iterations had every member tie" in err
    rc, s, err = _run(capsys, "--iterations", "2", "--sigma", "0.5", "--alpha", "0.5",
                      "--reward", "rule:length=5,40@0.5", "--reward", f"{user}:good")
    assert rc == 0, err
    assert s["reward"] == f"rule:length=5,40@0.5\n{user}:good" and s["tied_iterations"] == []
    assert s["reward_stats"][0]["std"] > 0 and "members scored" not in err
    assert "reward 0.5*rule:length=5,40 + 1*" in err


def test_a_tie_is_in_the_runtime_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    rc, s, err = _run(capsys, "--iterations", "1", "--reward", "rule:length=5,40", "--workers", "1",
                      "--out", str(out))
    assert rc == 0, err
    assert s["tied_iterations"] == [1] and "all 4 members scored" in err
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    [rec] = [r for r in recs if r.get("kind") == "es_metrics"]
    assert rec["tied"] is True and rec["reward_min"] == rec["reward_max"] == 1.0


def test_a_reward_raising_in_a_member_process_ends_the_run_rc2_naming_it(tmp_path, capsys):
    f = tmp_path / "member_only.py"  # FUCINA_REWARD_FILES is set only for the members es-finetune spawns
    f.write_text("import os\ndef reward(prompt, completion, reference):\n"
                 "    if os.environ.get('FUCINA_REWARD_FILES'):\n        raise ValueError('bad in member')\n"
                 "    return 1.0\n")
    rc, _, err = _run(capsys, "--iterations", "1", "--reward", f"{f}:reward", "--workers", "1",
                      "--out", str(tmp_path / "run"))
    assert rc == 2 and "Traceback" not in err
    assert f"reward function {f}:reward raised ValueError: bad in member on sample 0" in err
