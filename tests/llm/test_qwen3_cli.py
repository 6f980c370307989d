"""`fucina generate / chat / eval-logits` as a user runs them (in-process through pipeline.cli.main)."""
import io
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.models.qwen3 import Qwen3

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MINI = str(FIXTURES / "qwen3-mini-f32.gguf")


def test_eval_logits_json_matches_model(capsys):
    assert main(["eval-logits", "--model", MINI, "--tokens", "5,17,200", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tokens"] == [5, 17, 200]
    ref = Qwen3.from_gguf(MINI).infer(np.array([5, 17, 200]), all_logits=True)
    np.testing.assert_allclose(np.array(doc["logits"]), ref, rtol=1e-6)


def test_eval_logits_text_table(capsys):
    assert main(["eval-logits", "--model", MINI, "--text", "Hello world", "--top", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) >= 2 and "top:" in lines[0]


def test_generate_greedy_is_repeatable(capsys):
    args = ["generate", "--model", MINI, "--prompt", "The quick brown", "--max-tokens", "12"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.strip()


def test_generate_chat_mode_runs(capsys):
    assert main(["generate", "--model", MINI, "--prompt", "hi", "--chat", "--max-tokens", "5",
                 "--temperature", "0.7", "--top-k", "10", "--top-p", "0.9", "--seed", "1", "--stats"]) == 0
    assert "generated" in capsys.readouterr().err


def test_chat_loop_reads_turns_until_exit():
    import argparse
    from pipeline.commands import chat
    args = argparse.Namespace(model=MINI, max_tokens=4, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                              think=False, system="be brief", threads=1, blas_threads=1)
    out = io.StringIO()
    assert chat.run(args, stdin=io.StringIO("hello\n/reset\nagain\n/exit\n"), stdout=out) == 0
    assert out.getvalue().count("\n") >= 2


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", MINI, "--prompt", ""], "the prompt is empty"),
    (["generate", "--model", "/nonexistent/m.gguf", "--prompt", "x"], "no such file"),
    (["generate", "--model", MINI, "--prompt", "x", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["generate", "--model", MINI, "--prompt", "x " * 400], "the model's context is 256"),
    (["eval-logits", "--model", MINI, "--tokens", "1,a"], "comma-separated integers"),
    (["eval-logits", "--model", MINI, "--tokens", "1,99999"], "out of range"),
    (["generate", "--model", MINI, "--prompt", "x", "--threads", "-1"], "--threads must be >= 0"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_truncated_model_names_the_file(tmp_path, capsys):
    p = tmp_path / "cut.gguf"
    p.write_bytes(Path(MINI).read_bytes()[:5000])
    assert main(["generate", "--model", str(p), "--prompt", "x"]) == 2
    assert "cut.gguf: not a readable GGUF" in capsys.readouterr().err
