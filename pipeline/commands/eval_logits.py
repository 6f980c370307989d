"""`fucina eval-logits`: token ids and the logits of every position (parity work)."""
import json
import sys

import numpy as np

from ..errors import UserError
from ._args import InputFile, add_lora_arguments

NAME = "eval-logits"
HELP = "print the token ids and per-position logits of a text or id list (JSON with --json)"
DESCRIPTION = ("Run one forward pass of a GGUF model over --text or --tokens and print the logits of every "
               "position. --json prints {\"tokens\": [...], \"logits\": [[...], ...]}.")


def add_arguments(parser):
    parser.add_argument("--model", required=True, type=InputFile("GGUF file"),
                        help="path to a GGUF model file (llama, qwen2, qwen3 or gemma3 architecture)")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to tokenize (special tokens such as <|im_start|> are parsed)")
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--top", type=int, default=5, help="without --json: show the top-N logits per position")
    from .generate import add_thread_arguments
    add_lora_arguments(parser)
    add_thread_arguments(parser)
    parser.add_argument("--llama-numerics", action="store_true",
                        help="round activations like llama.cpp's CPU kernels (tighter parity on quantized files)")


def parse_tokens(text):
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UserError(f"--tokens must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError("--tokens is empty")
    return ids


def run(args):
    from ..llm.generate import LoadedModel
    from .generate import apply_threads
    apply_threads(args)
    lm = LoadedModel(args.model, llama_numerics=args.llama_numerics, lora=args.lora, lora_scale=args.lora_scale,
                     log=lambda m: print(m, file=sys.stderr))
    if args.tokens is not None:
        ids = parse_tokens(args.tokens)
    else:
        if not args.text:
            raise UserError("--text is empty")
        ids = lm.require_tokenizer().encode(args.text)
    logits = lm.model.infer(np.array(ids), all_logits=True)
    if args.json:
        json.dump({"tokens": ids, "logits": [[float(v) for v in row] for row in logits]}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    tok = lm.tokenizer
    for pos, (tid, row) in enumerate(zip(ids, logits)):
        top = np.argsort(-row, kind="stable")[: args.top]
        # the token's own bytes (llama.cpp's token_to_piece): decode() would strip a SentencePiece "▁" prefix
        piece = repr(tok.token_bytes(tid, special=True).decode("utf-8", "replace")) if tok else str(tid)
        best = ", ".join(f"{int(t)}:{row[t]:.4f}" for t in top)
        print(f"{pos:4d} {tid:7d} {piece:>16}  top: {best}")
    return 0
