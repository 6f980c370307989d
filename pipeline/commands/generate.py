"""`fucina generate`: stream a continuation of a prompt from a GGUF model."""
import argparse
import sys
import time

from ..errors import UserError
from ..llm.chat import add_chat_template_argument
from ._args import InputFile, add_lora_arguments, add_threads_flag

NAME = "generate"
HELP = "generate text from a GGUF model (streams tokens; greedy by default)"
DESCRIPTION = ("Generate a continuation of --prompt with a GGUF model. Temperature 0 (the default) is "
               "deterministic greedy decoding; otherwise sampling is seeded by --seed.")


def add_thread_arguments(parser):
    add_threads_flag(parser, 0, "the kernels", also="; --blas-threads overrides BLAS's count")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="OpenBLAS threads for prefill GEMMs (default 1: its spinning workers fight numba's)")


def apply_threads(args):
    """Pin numba and BLAS thread counts for this process (see docs/models.md, 'Threads')."""
    from threadpoolctl import threadpool_limits

    from ..threads import pin_threads
    pin_threads(args.threads)
    if args.blas_threads < 1:
        raise UserError(f"--blas-threads must be at least 1, got {args.blas_threads}")
    threadpool_limits(args.blas_threads, user_api="blas")


def add_sampling_arguments(parser):
    parser.add_argument("--model", required=True, type=InputFile("GGUF file"),
                        help="path to a GGUF model file (llama, qwen2, qwen3 or gemma3 architecture)")
    parser.add_argument("--max-tokens", type=int, default=128, help="maximum number of new tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                        help="chat templates with a thinking switch (Qwen3): --think / --no-think set enable_thinking; "
                             "unset, the template's default, as llama.cpp renders it")
    parser.add_argument("--system", default=None, help="optional system message for --chat")
    add_chat_template_argument(parser)
    add_lora_arguments(parser)
    add_thread_arguments(parser)


def add_arguments(parser):
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the model's chat template (the GGUF's, else ChatML) as llama.cpp does")
    add_sampling_arguments(parser)
    parser.add_argument("--stats", action="store_true", help="print token counts and speed to stderr at the end")


def sampling_from(args):
    from ..llm.generate import Sampling
    return Sampling(args.temperature, args.top_k, args.top_p, args.seed)


def load(args):
    """The LoadedModel of --model with --chat-template and --lora/--lora-scale applied."""
    from ..llm.generate import LoadedModel
    return LoadedModel(args.model, chat_template=getattr(args, "chat_template", None), lora=getattr(args, "lora", None),
                       lora_scale=getattr(args, "lora_scale", None), log=lambda m: print(m, file=sys.stderr))


def run(args):
    from ..llm.generate import generate
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    apply_threads(args)
    lm = load(args)
    ids = lm.encode_prompt(args.prompt, chat=args.chat, system=args.system, enable_thinking=args.think)
    stream = lm.tokenizer.stream()
    t0, n = time.perf_counter(), 0
    for token in generate(lm.model, ids, args.max_tokens, sampling_from(args), stop_ids=lm.stop_ids()):
        n += 1
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    if args.stats:
        dt = time.perf_counter() - t0
        print(f"[{len(ids)} prompt tokens, {n} generated, {n / dt:.1f} tok/s overall]", file=sys.stderr)
    return 0
