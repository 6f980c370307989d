"""`fucina bench llm` and `bench finetune` take a gemma3 file (smoke test on the tiny fixture: rows come back,
no timing assertions; the Gemma-3-270M-shaped file for real numbers is tools/make_gemma3_270m_shaped.py)."""
import json
from pathlib import Path

from pipeline.cli import main

MODEL = str(Path(__file__).resolve().parents[1] / "fixtures" / "gemma3-gemma-mini-f32.gguf")


def test_bench_llm_and_finetune_run_on_gemma3(capsys):
    assert main(["bench", "llm", "--model", MODEL, "--json", "--no-llama", "--repeat", "1",
                 "--decode-tokens", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert rows and all(r["ms"] > 0 for r in rows)
    assert main(["bench", "finetune", "--model", MODEL, "--json", "--seq", "24", "--steps", "1", "--no-torch",
                 "--no-trainers"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["case"] for r in rows] == ["step/in-process"] and rows[0]["supervised_tok_s"] > 0
