"""`fucina chat`: an interactive chat loop over a GGUF model, prompted as llama.cpp's chat completion prompts."""
import sys

from .generate import add_sampling_arguments, apply_threads, load, sampling_from

NAME = "chat"
HELP = "interactive chat with a GGUF model (type /exit or Ctrl-D to quit, /reset to clear)"
DESCRIPTION = ("Chat with a GGUF model. Each turn re-renders the whole conversation through the chat "
               "template and decodes the reply greedily (or sampled with --temperature).")


def add_arguments(parser):
    add_sampling_arguments(parser)


def run(args, stdin=None, stdout=None):
    from ..errors import UserError
    from ..llm.generate import generate
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    apply_threads(args)
    lm = load(args)
    tok = lm.require_tokenizer()
    sampling = sampling_from(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        ids = lm.encode_chat(history, enable_thinking=args.think)
        stream, reply = tok.stream(), []
        try:
            for token in generate(lm.model, ids, args.max_tokens, sampling, stop_ids=lm.stop_ids()):
                if token in lm.stop_ids():
                    break
                reply.append(token)
                stdout.write(stream.push(token))
                stdout.flush()
        except UserError as e:  # e.g. the conversation outgrew the context: say so, keep the loop
            stdout.write(f"\n[{e}; /reset to start over]\n")
            history.pop()
            continue
        stdout.write(stream.flush() + "\n")
        history.append({"role": "assistant", "content": tok.decode(reply)})
