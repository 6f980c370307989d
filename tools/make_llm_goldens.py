"""Record llama.cpp's outputs on the committed tiny Qwen3 fixtures (tests/goldens/llm/).

The parity tests run llama.cpp live when llama-cpp-python is installed; these
goldens keep the same checks alive without it. For each fixture: the token ids
of a mixed corpus (parse_special on), the per-position logits of one prompt
(f32 KV cache), and a 32-token greedy continuation. Versions are recorded.

    python tools/make_llm_goldens.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "llm"))

FIXTURES = ["qwen3-mini-f32.gguf", "qwen3-mini-q8_0.gguf", "qwen3-tied-q4_k_s.gguf"]
PROMPT = "The forge glows; def f(x): return x * 2  # café 你好 🔥"


def main():
    import llama_cpp
    from test_parity_llama import CORPUS, llama
    out = ROOT / "tests" / "goldens" / "llm"
    out.mkdir(parents=True, exist_ok=True)
    doc = {"generator": "tools/make_llm_goldens.py", "llama_cpp_python": llama_cpp.__version__,
           "numpy": np.__version__, "prompt": PROMPT, "corpus": CORPUS, "fixtures": {}}
    arrays = {}
    for name in FIXTURES:
        path = ROOT / "tests" / "fixtures" / name
        quantized = "f32" not in name
        oracle = llama(path, quantized=quantized)
        ids = oracle.tokenize(PROMPT.encode(), add_bos=False, special=True)
        oracle.eval(ids)
        arrays[name] = np.array(oracle.scores[: len(ids)], dtype=np.float32)
        oracle.reset()
        greedy = [t for _, t in zip(range(32), oracle.generate(ids, temp=0.0, top_k=1))]
        doc["fixtures"][name] = {
            "prompt_ids": ids, "greedy32": [int(t) for t in greedy],
            "corpus_ids": [oracle.tokenize(t.encode(), add_bos=False, special=True) for t in CORPUS]}
    np.savez_compressed(out / "llama_cpp_logits.npz", **arrays)
    (out / "llama_cpp.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
