"""Load a model.gguf in llama.cpp (llama-cpp-python) and in Fucina; compare token ids and logits.

    .venv/bin/python tools/check_gguf_llama.py runs/pretrain-latest/model.gguf [--text-file FILE]

Prints one JSON line: the token count, whether llama.cpp's ids equal Fucina's tokenizer's
(pipeline.llm.tokenizer.Tokenizer.from_gguf), the max |logit difference| over every position and the
logit scale (max |logit|). The default text is the held-out-like start of a stdlib module docstring
with ChatML specials. llama.cpp's AMX extra buffer types crash on some VMs, so they are turned off.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer
from pipeline.models.registry import load_model

DEFAULT_TEXT = ('"""Utilities for with-statement contexts.  See PEP 343."""\nimport abc\nimport os\n\n'
                "class AbstractContextManager(abc.ABC):\n    def __enter__(self):\n        return self\n"
                "<|im_start|>user\nThe for statement<|im_end|>\n")


def llama_logits(path, text):
    import llama_cpp
    import llama_cpp.llama_cpp as C
    defaults = C.llama_model_default_params

    def no_extra_bufts():
        p = defaults()
        p.use_extra_bufts = False
        return p
    C.llama_model_default_params = no_extra_bufts
    llm = llama_cpp.Llama(path, n_ctx=512, logits_all=True, verbose=False, n_threads=1, type_k=0, type_v=0)
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.eval(ids)
    return ids, np.array(llm.scores[:len(ids)], np.float32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--text-file", help="UTF-8 text to evaluate instead of the default")
    args = parser.parse_args(argv)
    text = open(args.text_file, encoding="utf-8").read() if args.text_file else DEFAULT_TEXT
    ids, theirs = llama_logits(args.gguf, text)
    ours_ids = Tokenizer.from_gguf(GGUFFile(args.gguf)).encode(text)
    ours = load_model(args.gguf).infer(np.array(ids), all_logits=True)
    print(json.dumps({"tokens": len(ids), "ids_equal": list(ids) == list(ours_ids),
                      "max_abs_logit_diff": float(np.abs(ours - theirs).max()),
                      "max_abs_logit": float(np.abs(ours).max())}))


if __name__ == "__main__":
    main()
