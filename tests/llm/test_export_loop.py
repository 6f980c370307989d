"""The whole loop, end to end: fine-tune -> merge -> quantize (q4_k) -> serve in Fucina and llama.cpp.

Marked slow (a 150-step fine-tune and several llama.cpp children) and parity
(llama.cpp is the second server). The base is a tiny random F16 model of each
registered architecture with a trained byte-level BPE, made by tools/make_tiny_model.py.
"""
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from llama_oracle import CHILD_PRELUDE

from pipeline.cli import main as fucina

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "What is the capital of France?"  # a training prompt of the built-in pirate set

_LLAMA = CHILD_PRELUDE + """
import json, numpy as np
model, lora, ids, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
llm = llama(model, n_ctx=256, logits_all=True, n_threads=2, type_k=0, type_v=0, **({"lora_path": lora} if lora else {}))
llm.eval(ids)
logits = np.array(llm.scores[:len(ids)], np.float32)
llm.reset()
answer = []
for t in llm.generate(ids, temp=0.0, top_k=1):
    if t == llm.token_eos() or len(answer) >= 16:
        break
    answer.append(int(t))
np.save(out, logits)
print(json.dumps(answer))
"""


def _llama(model, ids, tmp_path, lora=None):
    """(llama.cpp logits of every prompt position, its greedy answer token ids)."""
    import json
    out = tmp_path / "logits.npy"
    proc = subprocess.run([sys.executable, "-c", _LLAMA, str(model), str(lora or ""), json.dumps(ids), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return np.load(out), json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_finetune_merge_quantize_serve(tmp_path, capsys, arch):
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "tools" / "make_tiny_model.py")
    tiny = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tiny  # its dataclasses look their module up
    spec.loader.exec_module(tiny)
    from pipeline.llm.chat import render_chatml
    from pipeline.llm.gguf import open_gguf
    from pipeline.llm.tokenizer import Tokenizer
    from pipeline.models.registry import load_model

    base = tiny.write_gguf(tmp_path / "base-f16.gguf", tiny.SHAPES["tied"], seed=0, dtype="F16", arch=arch)
    run, merged, final, adapter = (tmp_path / "run", tmp_path / "merged-f16.gguf", tmp_path / "tuned-q4_k.gguf",
                                   tmp_path / "adapter.gguf")
    # 1. fine-tune  2. merge  3. quantize  (+ the adapter GGUF route)
    assert fucina(["finetune", "--model", str(base), "--steps", "200", "--lr", "3e-3",
                   "--targets", "q,k,v,o,gate,up,down", "--save", str(run)]) == 0
    assert fucina(["export-gguf", "--from-gguf", str(base), "--adapters", str(run), "--out", str(merged)]) == 0
    assert fucina(["export-gguf", "--from-gguf", str(merged), "--dtype", "q4_k", "--out", str(final)]) == 0
    assert fucina(["export-gguf", "--adapters", str(run), "--base", str(base), "--lora-out", str(adapter)]) == 0
    capsys.readouterr()

    tok = Tokenizer.from_gguf(open_gguf(final))
    ids = tok.encode(render_chatml([{"role": "user", "content": PROMPT}]))

    # 4a. llama.cpp serves the q4_k export and answers in the trained style
    q_logits, q_answer = _llama(final, ids, tmp_path)
    assert tok.decode(q_answer).startswith("Ahoy!"), tok.decode(q_answer)

    # 4b. Fucina serves the same file: top-1 identical at every prompt position, and `fucina generate` answers in style
    # (llama_numerics: round activations as llama.cpp's q4_k kernels do, so near-ties at untrained positions agree)
    ours = load_model(final, llama_numerics=True).infer(np.asarray(ids), all_logits=True)
    np.testing.assert_array_equal(ours.argmax(-1), q_logits.argmax(-1))
    assert fucina(["generate", "--model", str(final), "--chat", "--prompt", PROMPT, "--max-tokens", "16"]) == 0
    answer = capsys.readouterr().out.strip()
    assert answer.startswith("Ahoy!"), answer

    # 4c. the adapter GGUF route (base + adapter, unmerged) gives the merged model's greedy answer
    _, merged_answer = _llama(merged, ids, tmp_path)
    _, adapter_answer = _llama(base, ids, tmp_path, lora=adapter)
    assert adapter_answer == merged_answer
    assert tok.decode(merged_answer).startswith("Ahoy!")
