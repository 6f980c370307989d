"""tools/make_addition_task.py: the real-model ES task's files (docs/es_finetune.md) are what the table says."""
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import make_addition_task  # noqa: E402


def test_held_out_pairs_are_disjoint_from_training_and_the_checker_takes_the_last_integer(tmp_path):
    make_addition_task.main(["--out-dir", str(tmp_path), "--train", "64", "--heldout", "128", "--max", "50"])
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert len(train) == 64 and len(held) == 128
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in held}
    assert len({r["instruction"] for r in held}) == 128
    a, b = (int(x) for x in held[0]["instruction"].split("?")[0].split("is ")[1].split(" + "))
    assert held[0]["response"] == str(a + b)
    spec = importlib.util.spec_from_file_location("lastint", tmp_path / "lastint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.reward("", "12 + 1 = 13", "13") == 1.0
    assert mod.reward("", "12 + 1 = 23", "13") == 0.0
    assert mod.reward("", "1,013", "1013") == 1.0 and mod.reward("", "no number", "13") == 0.0
