"""ES fine-tuning rewards: the built-in rules, exact match, a user's reward file (in-process and in member
processes), clear errors for bad specs and bad return values, and greedy decoding with the adapters applied."""
import json
import math
import os

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.es.rewards import RewardFunctionError, normalize_answer, parse_reward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")
SMALL = ("--population", "4", "--batch", "2", "--max-new-tokens", "6", "--threads", "0", "--eval-samples", "2")
# distinct characters of the completion: a reward the random fixture's greedy answers actually vary in
DISTINCT = "def reward(prompt, completion, reference):\n    return float(len(set(completion)))\n"


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with threadpool_limits(1):
        yield


def _run(capsys, *argv):
    rc = main(["es-finetune", "--model", MODEL, *SMALL, *argv, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out.strip().splitlines()[-1]) if rc == 0 else None), out.err


def test_normalisation_and_exact():
    assert normalize_answer("  Paris,\n  the   CAPITAL!! ") == "paris, the capital"
    assert normalize_answer("Straße.") == normalize_answer("STRASSE")  # casefold, not lower
    exact = parse_reward("exact")
    assert exact("q", " ahoy  MATEY. ", "Ahoy matey") == 1.0
    assert exact("q", "ahoy matey, arr", "Ahoy matey") == 0.0


def test_rules():
    fmt = parse_reward("rule:format")
    assert fmt("", "<think>sum it</think>\n<answer>4</answer>\n", "") == 1.0
    assert fmt("", "<answer>4</answer>", "") == 0.0
    assert fmt("", "so <think>x</think><answer>4</answer>", "") == 0.0
    length = parse_reward("rule:length=10,20")
    assert [length("", "x" * n, "") for n in (10, 15, 20)] == [1.0, 1.0, 1.0]
    assert length("", "x" * 5, "") == 0.5 and length("", "x" * 30, "") == 0.5 and length("", "", "") == 0.0
    regex = parse_reward("rule:regex=[Aa]hoy")
    assert regex("", "well, ahoy", "") == 1.0 and regex("", "hello", "") == 0.0


@pytest.mark.parametrize("spec, words", [
    ("rule:length=5", "LO,HI"), ("rule:length=9,3", "LO <= HI"), ("rule:regex=(", "does not compile"),
    ("rule:shape", "unknown rule"), ("bleu", "unknown reward"), ("nofile.py:reward", "no such file"),
    ("x.txt:reward", "PATH.py:FUNC"),
])
def test_bad_reward_specs_are_clear_errors(spec, words):
    with pytest.raises(UserError, match="--reward") as e:
        parse_reward(spec)
    assert words in str(e.value)


def test_user_reward_function_checks(tmp_path):
    f = tmp_path / "rewards.py"
    f.write_text("import math\n"
                 "def good(p, c, r):\n    return len(c) / 2\n"
                 "def nan(p, c, r):\n    return math.nan\n"
                 "def text(p, c, r):\n    return 'high'\n"
                 "def flag(p, c, r):\n    return True\n"
                 "value = 3\n")
    assert parse_reward(f"{f}:good")("p", "abc", "r") == 1.5
    for name, what in (("nan", "nan"), ("text", "str"), ("flag", "bool")):
        with pytest.raises(RewardFunctionError, match=f"reward function {f}:{name} returned {what}"):
            parse_reward(f"{f}:{name}")("p", "abc", "r")
    with pytest.raises(UserError, match="defines no function 'value'"):
        parse_reward(f"{f}:value")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UserError, match="importing .*broken.py failed: RuntimeError: boom"):
        parse_reward(f"{broken}:reward")


def test_greedy_decoding_with_the_kv_cache_applies_the_adapters():
    """The lock-step KV-cache decoder with the live adapters (k = 1) gives the trainer's own (cache-free,
    full-recompute) greedy tokens."""
    from pipeline.es.batched import member_generations
    from pipeline.finetune.model import LoraModel
    trainer = LoraModel.from_gguf(MODEL, targets=("q", "v", "down"), rank=4, seed=1)
    prompt = np.array([1, 5, 9, 2, 7], dtype=np.int64)
    [[base]] = member_generations(trainer, {}, 1, [prompt], 8)
    gen = np.random.default_rng(0)
    for _, p in trainer.named_parameters():
        p.data[...] = gen.standard_normal(p.data.shape).astype(np.float32)
    [[adapted]] = member_generations(trainer, {}, 1, [prompt], 8)
    assert adapted == trainer.generate(prompt, 8)
    assert adapted != base  # the adapters changed the answer, so they are in the decoder's projections


def test_user_reward_raises_the_reward_and_member_processes_call_it(tmp_path, capsys):
    f = tmp_path / "distinct.py"
    log = tmp_path / "pids.txt"
    f.write_text(f"import os\n{DISTINCT}\n"
                 f"def logged(prompt, completion, reference):\n"
                 f"    with open({str(log)!r}, 'a') as fh:\n        fh.write(f'{{os.getpid()}}\\n')\n"
                 f"    return reward(prompt, completion, reference)\n")
    common = ("--iterations", "4", "--population", "8", "--sigma", "0.5", "--alpha", "0.5")
    rc, s, err = _run(capsys, *common, "--reward", f"{f}:reward")
    assert rc == 0, err
    assert s["reward"] == f"{f}:reward" and len(s["reward_stats"]) == 4
    first = s["reward_stats"][0]
    assert first["min"] <= first["mean"] <= first["max"] and first["std"] > 0
    assert s["final_reward"] > s["initial_reward"], s
    assert "min" in err and "max" in err and "reward on 2 training prompts" in err
    rc, fanned, err = _run(capsys, *common, "--reward", f"{f}:logged", "--workers", "2",
                          "--out", str(tmp_path / "run"))
    assert rc == 0, err
    assert fanned["adapters_sha256"] == s["adapters_sha256"] and fanned["reward_stats"] == s["reward_stats"]
    pids = set(log.read_text().split())
    assert len(pids - {str(os.getpid())}) == 2  # both member processes imported and called it


def test_a_bad_return_stops_the_run_with_one_error(tmp_path, capsys):
    f = tmp_path / "bad.py"
    f.write_text("def reward(prompt, completion, reference):\n    return float('inf')\n")
    rc, _, err = _run(capsys, "--iterations", "1", "--reward", f"{f}:reward")
    assert rc == 2 and f"reward function {f}:reward returned inf" in err
    assert "Traceback" not in err
    rc, _, err = _run(capsys, "--iterations", "1", "--reward", "countdown")
    assert rc == 2 and "--task countdown" in err


def test_exact_reward_runs(capsys):
    rc, s, err = _run(capsys, "--iterations", "1", "--reward", "exact")
    assert rc == 0, err
    assert s["initial_reward"] == 0.0 and math.isfinite(s["reward_means"][0])  # a random model is never exact


def test_a_member_imports_a_reward_file_only_when_its_own_environment_lists_it(tmp_path):
    """The file comes to a member in the scheduler's run description: a message alone never makes it run code."""
    from pipeline.finetune.es import REWARD_FILES_ENV, ESFinetuneJob, check_reward_files
    from pipeline.jobs.spec import build
    f = tmp_path / "mine.py"
    f.write_text("def reward(p, c, r):\n    return 1.0\n")
    job = ESFinetuneJob(build(ESFinetuneJob.Spec, {"model": "m.gguf", "reward": f"{f}:reward", "population": 2}))
    assert job.reward_files() == [os.path.realpath(f)]
    with pytest.raises(UserError, match=f"{REWARD_FILES_ENV}="):
        check_reward_files(job, {})
    with pytest.raises(UserError, match="lists it"):
        check_reward_files(job, {REWARD_FILES_ENV: str(tmp_path / "other.py")})
    check_reward_files(job, {REWARD_FILES_ENV: os.pathsep.join(["/nowhere.py", str(f)])})
    plain = ESFinetuneJob(build(ESFinetuneJob.Spec, {"model": "m.gguf", "reward": "rule:format", "population": 2}))
    check_reward_files(plain, {})
