"""`fucina es-finetune` on the runtime (es_member processes): the adapters' sha256 is the in-process run's
for 1 and 2 members, with a member SIGKILLed mid-run, and stopped and resumed (tiny Q8_0 fixture)."""
import json
import os

import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")
# population 6 over 2 members: chunks of 3 cut an antithetic pair, the case a chunked materialize must get right
COMMON = ("--population", "6", "--batch", "2", "--max-new-tokens", "2", "--threads", "0", "--shuffle",
          "--anchor-decay", "l2", "--anchor-lambda", "5")


def _run(capsys, *argv):
    with threadpool_limits(1):
        rc = main(["es-finetune", "--model", MODEL, *COMMON, *argv, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1]), out.err


@pytest.mark.slow
def test_in_process_one_two_killed_and_resumed_members_give_the_same_adapters(tmp_path, capsys, monkeypatch):
    inproc, _ = _run(capsys, "--iterations", "4")
    one, err = _run(capsys, "--iterations", "4", "--workers", "1", "--out", str(tmp_path / "one"))
    assert "1 es_member processes on the runtime" in err
    two, _ = _run(capsys, "--iterations", "4", "--workers", "2", "--out", str(tmp_path / "two"))
    monkeypatch.setenv("FUCINA_FAULT", "es_member:eval:2")
    killed, _ = _run(capsys, "--iterations", "4", "--workers", "2", "--out", str(tmp_path / "killed"))
    monkeypatch.delenv("FUCINA_FAULT")
    events = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "worker_lost" for e in events), "the fault did not fire"
    half, _ = _run(capsys, "--iterations", "2", "--workers", "2", "--out", str(tmp_path / "first"),
                   "--save", str(tmp_path / "half"))
    assert half["adapters_sha256"] != inproc["adapters_sha256"]
    resumed, err = _run(capsys, "--iterations", "4", "--workers", "2", "--out", str(tmp_path / "second"),
                        "--load", str(tmp_path / "half"))
    assert "resumed" in err
    for run in (one, two, killed, resumed):
        assert run["adapters_sha256"] == inproc["adapters_sha256"]
        assert run["final_loss"] == inproc["final_loss"]
    for run in (one, two, killed):
        assert run["reward_stats"] == inproc["reward_stats"]
    assert resumed["reward_stats"] == inproc["reward_stats"][2:]
