"""`fucina eval` on a real pretrained GGUF (SmolLM2-135M-Instruct Q4_1): the base model solves some one-digit
additions, and 1 and 2 workers give the same rewards. Slow; needs FUCINA_REAL_GGUFS (tools/fetch_real_ggufs.py)."""
import json
import os

import pytest

from pipeline.cli import main

REAL = os.environ.get("FUCINA_REAL_GGUFS")
MODEL = os.path.join(REAL or "", "SmolLM2-135M-Instruct.Q4_1.gguf")
LASTINT = ("import re\ndef reward(prompt, completion, reference):\n"
           "    found = re.findall(r'-?\\d+', completion.replace(',', ''))\n"
           "    return 1.0 if found and found[-1] == reference.strip() else 0.0\n")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (REAL and os.path.isfile(MODEL)), reason="FUCINA_REAL_GGUFS with SmolLM2")]


def test_real_model_eval_solves_some_and_workers_agree(tmp_path, capsys):
    data = tmp_path / "add.jsonl"
    sums = [(3, 4), (2, 5), (6, 1), (8, 1)]
    data.write_text("".join(json.dumps({"instruction": f"What is {a} + {b}? Answer with just the number.",
                                        "response": str(a + b)}) + "\n" for a, b in sums))
    (tmp_path / "lastint.py").write_text(LASTINT)
    argv = ["eval", "--model", MODEL, "--data", str(data), "--reward", f"{tmp_path / 'lastint.py'}:reward",
            "--n", "4", "--max-new-tokens", "10", "--json"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["solved"] >= 1, one  # a pretrained instruct model adds one-digit numbers, some of the time
    assert main(argv + ["--workers", "2"]) == 0
    two = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert two["rewards"] == one["rewards"]
