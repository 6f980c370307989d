"""The pirate demo through export and llama.cpp, on fixtures big enough to learn it (slow; llama.cpp serves).

`fucina finetune` teaches the built-in pirate set (loss down >= 90%, the AFTER answer starts with "Ahoy!") to
a llama model shaped as Llama 3 files are (tools/make_tiny_model.py "llama3": Llama 3 rope_freqs, tied head)
and to a gemma3 model ("gemma-unit": seven layers, both window kinds, a window of 16 shorter than the chat
prompt, embeddings scaled as trained Gemma's), both F16; the merged export, and its llama-quantize-style
Q4_K_M mix (`export-gguf --dtype q4_k_m`), are then served by llama.cpp, which answers the training prompt
in the style. (On the "gemma" shape, embeddings of std 1, the Q8_0 and Q4_K_M exports answer "\n...": our
logits and llama.cpp's agree there to ~1e-3, so it is the fixture's drowned margin, not a reading bug.)
"""
import json
import sys
from pathlib import Path

import pytest

from pipeline.cli import main as fucina
from test_export_loop import PROMPT, _llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_tiny_model as mk  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.parity, pytest.mark.needs("llama_cpp")]


@pytest.mark.parametrize("arch,shape", [("llama", "llama3"), ("gemma3", "gemma-unit")])
def test_pirate_finetune_export_answers_in_llama_cpp(tmp_path, capsys, arch, shape):
    from pipeline.llm.chat import render_chatml
    from pipeline.llm.gguf import open_gguf
    from pipeline.llm.tokenizer import Tokenizer
    base = mk.make(tmp_path, arch, shape, "F16", seed=0)
    run, merged, q4km = tmp_path / "run", tmp_path / "merged-f16.gguf", tmp_path / "tuned-q4_k_m.gguf"
    capsys.readouterr()
    assert fucina(["finetune", "--model", str(base), "--steps", "200", "--lr", "3e-3",
                   "--targets", "q,k,v,o,gate,up,down", "--json", "--save", str(run)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["final_loss"] <= 0.1 * summary["initial_loss"], summary
    assert summary["after"].startswith("Ahoy!") and not summary["before"].startswith("Ahoy!"), summary
    assert fucina(["export-gguf", "--from-gguf", str(base), "--adapters", str(run), "--out", str(merged)]) == 0
    assert fucina(["export-gguf", "--from-gguf", str(merged), "--dtype", "q4_k_m", "--out", str(q4km)]) == 0
    gg = open_gguf(q4km)
    assert gg.architecture == arch
    assert {"Q4_K", "Q6_K"} <= {gg.tensor_type(n) for n in gg.tensor_names}
    tok = Tokenizer.from_gguf(gg)
    ids = tok.encode(render_chatml([{"role": "user", "content": PROMPT}]))
    for served in (merged, q4km):
        _, answer = _llama(served, ids, tmp_path)
        assert tok.decode(answer).startswith("Ahoy!"), (served.name, tok.decode(answer))
