"""The headline demo: `fucina finetune` with its DEFAULTS drives the pirate loss down >= 90% and
the AFTER answer to a training prompt starts with "Ahoy!" — on the committed tiny llama, qwen2 and
gemma3 fixtures (random weights; seconds), and (slow) on the model `fucina launch lm` trains from scratch."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


FIXTURES = {"llama": "llama-mini-f32.gguf", "qwen2": "qwen2-mini-f32.gguf", "gemma3": "gemma3-gemma-mini-f32.gguf"}


@pytest.mark.parametrize("arch", sorted(FIXTURES))
def test_pirate_finetune_on_a_tiny_fixture(arch, tmp_path, capsys):
    from pipeline.cli import main
    model = os.path.join(ROOT, "tests", "fixtures", FIXTURES[arch])
    assert main(["finetune", "--model", model, "--json", "--save", str(tmp_path / "lora")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["final_loss"] <= 0.1 * summary["initial_loss"], summary
    assert summary["after"].startswith("Ahoy!"), summary
    assert not summary["before"].startswith("Ahoy!"), summary


@pytest.mark.slow
def test_pirate_finetune_on_the_launch_lm_model(tmp_path):
    fucina = [sys.executable, "-m", "pipeline.cli"]
    run_dir = tmp_path / "lm"
    subprocess.run(fucina + ["launch", "lm", "--inprocess", "--run-dir", str(run_dir), "--quiet"],
                   cwd=ROOT, check=True, timeout=1800, capture_output=True)
    model = run_dir / "model.gguf"
    assert model.is_file()
    out = subprocess.run(fucina + ["finetune", "--model", str(model), "--json", "--save", str(tmp_path / "lora")],
                         cwd=ROOT, check=True, timeout=1800, capture_output=True, text=True)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["final_loss"] <= 0.1 * summary["initial_loss"], summary
    assert summary["after"].startswith("Ahoy!"), summary
    assert not summary["before"].startswith("Ahoy!"), summary
    state = json.loads((tmp_path / "lora" / "trainer_state.json").read_text())
    assert state["config"]["lora"]["alpha"] == 16.0
