"""`fucina finetune`: LoRA fine-tuning of a frozen GGUF model on SFT data.

Prints the config, a BEFORE greedy answer to a held prompt, one line per
optimizer step (loss, tokens/s, a progress bar), then the AFTER answer; saves a
checkpoint directory (adapters.safetensors, optimizer.safetensors,
trainer_state.json written last). `--verify-grads` replaces the run with the
gradient checks on the real model and exits non-zero if one fails.
"""
from __future__ import annotations

import json
import sys
import time

from ..errors import UserError
from ..llm.chat import add_chat_template_argument
from ._args import InputFile

NAME = "finetune"
HELP = "LoRA fine-tune a frozen (quantized) GGUF model on SFT data (pairs, alpaca, chat messages, ShareGPT)"
DESCRIPTION = (HELP + ". With no --data it trains the built-in five-pair pirate dataset "
               "(\"Ahoy! ... matey.\"); watch the loss fall and the AFTER answer change style.")


def add_arguments(p):
    p.add_argument("--model", required=True, type=InputFile("GGUF file"),
                   help="GGUF model to fine-tune: llama, qwen2, qwen3 or gemma3 architecture "
                        "(for a first run, the model.gguf `fucina launch lm` saves)")
    add_data_arguments(p)
    add_chat_template_argument(p)
    p.add_argument("--shuffle", action="store_true", help="shuffled sample order (Fisher-Yates per epoch, seeded by --data-seed)")
    p.add_argument("--seed", type=int, default=42, help="seed of the adapter init and dropout streams")
    p.add_argument("--data-seed", type=int, default=None, help="seed of the shuffled order (default: --seed)")
    p.add_argument("--steps", type=int, default=30, help="train until this many optimizer steps in total (a resumed run continues from its checkpoint)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (the delta is scaled by alpha/rank)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (a resumed run keeps the checkpoint's); "
                   "the default suits the small model of `fucina launch lm`, use ~1e-3 for Qwen3-0.6B")
    p.add_argument("--warmup", type=int, default=0, help="linear learning-rate warm-up over this many optimizer steps")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip, once per window (0 = off)")
    p.add_argument("--targets", default="q,k,v,o,gate,up,down",
                   help="comma-separated projections to adapt, any of q,k,v,o,gate,up,down (q,v is the classic choice for large models)")
    p.add_argument("--accum-steps", type=int, default=5,
                   help="samples per optimizer step, token-weighted (default 5: the whole pirate set per step; a resumed run keeps the checkpoint's)")
    p.add_argument("--seq-max", type=int, default=256, help="truncate samples to this many input tokens")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout probability on the adapter input, in [0, 1)")
    p.add_argument("--state-dtype", choices=("f32", "bf16"), default="f32", help="dtype of the AdamW moments")
    p.add_argument("--checkpoint-layers", action="store_true", help="recompute each layer in backward (less memory, same bits)")
    p.add_argument("--save", metavar="DIR", help="write the final checkpoint directory here")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="also save DIR/checkpoint-step-N every N optimizer steps (needs --save)")
    p.add_argument("--load", metavar="DIR", help="resume from a checkpoint directory (adapters, optimizer, step counter, loader position)")
    p.add_argument("--trainers", type=int, default=0, metavar="N", help="run each window's micro-batches on N trainer processes (0 = in this process); same bits")
    p.add_argument("--threads", type=int, default=0, help="BLAS/numba threads per process (0 = leave as is)")
    p.add_argument("--prompt", default=None, help="held prompt for the BEFORE/AFTER answers (default: the first training instruction)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="length of the BEFORE/AFTER greedy answers (tokens; bytes on a byte-level model)")
    p.add_argument("--verify-grads", action="store_true", help="instead of training: zero-structure, grad-norm audit, Taylor and frozen-base checks; exit 1 on failure")
    p.add_argument("--json", action="store_true", help="print one JSON summary line on stdout (progress goes to stderr)")


def add_data_arguments(p):
    """The --data flags, shared with es-finetune."""
    from ..llm.data import FORMATS, MAX_RECORD_BYTES
    p.add_argument("--data", type=InputFile("JSONL file"),
                   help="JSONL file of samples (default: the built-in pirate pairs); formats in --format")
    p.add_argument("--format", choices=("auto",) + FORMATS, default="auto",
                   help="the --data format: instruction/response pairs, alpaca (instruction, input, output), chat "
                        "messages or ShareGPT conversations; auto = read from the first record's fields")
    p.add_argument("--instruction-key", default="instruction", help="JSONL key holding the instruction (pairs)")
    p.add_argument("--response-key", default="response", help="JSONL key holding the response (pairs)")
    p.add_argument("--max-record-bytes", type=int, default=MAX_RECORD_BYTES, metavar="N",
                   help="refuse a JSONL line over N bytes before parsing it")


def load_data(args):
    from ..llm.data import load_jsonl
    return load_jsonl(args.data, args.instruction_key, args.response_key, format=args.format,
                      max_record_bytes=args.max_record_bytes)


def _targets(text):
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _check_args(args):
    for flag, value, low in (("--steps", args.steps, 0), ("--accum-steps", args.accum_steps, 1), ("--seq-max", args.seq_max, 1),
                             ("--trainers", args.trainers, 0), ("--save-every", args.save_every, 0), ("--max-new-tokens", args.max_new_tokens, 0)):
        if value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    if args.save_every and not args.save:
        raise UserError("--save-every needs --save DIR (the periodic checkpoints go to DIR/checkpoint-step-N)")
    if args.lr <= 0:
        raise UserError(f"--lr must be positive, got {args.lr}")


def build(args, log):
    """Model, tokenizer, samples, trainer, optimizer, loader and session from the flags (+ --load)."""
    from ..llm import data as sft
    from ..llm.finetune import Session, Trainer, TrainerPool, check_resume_config, lora_config
    from ..llm.chat import ChatTemplate
    from ..llm.gguf import open_gguf
    from ..models.registry import load_model
    from ..optim import AdamW
    from ..train.checkpoint import load_checkpoint, read_sentinel

    state = None
    if args.load:
        state = read_sentinel(args.load)
        args.accum_steps = state.accum_steps  # the checkpoint's window and lr win over the flags
        args.lr = float(state.schedule.get("lr", args.lr))
        args.warmup = int(state.schedule.get("warmup", args.warmup))
    gg = open_gguf(args.model)
    model = load_model(gg)
    tokenizer = _load_tokenizer(gg)
    encoder, template = sft.RawEncoder(tokenizer), ChatTemplate.from_gguf(gg, getattr(args, "chat_template", None))
    if args.data:
        pairs, source = load_data(args), args.data
    else:
        pairs, source = list(sft.PIRATE_PAIRS), "pirate pair"
    options = sft.EncodeOptions(seq_max=args.seq_max)
    samples = sft.encode_all(encoder, template, pairs, options, source=source)
    trainer_kwargs = dict(targets=_targets(args.targets), rank=args.rank, alpha=args.alpha, dropout=args.dropout,
                          seed=args.seed, checkpoint_layers=args.checkpoint_layers)
    trainer = Trainer(model, **trainer_kwargs)
    optimizer = AdamW(trainer.named_parameters(), lr=args.lr, weight_decay=0.0, state_dtype=args.state_dtype)
    order = "shuffled" if args.shuffle else "sequential"
    data_seed = args.seed if args.data_seed is None else args.data_seed
    loader = sft.Loader(len(samples), order, seed=data_seed)
    if state is not None:
        check_resume_config(state.config, trainer, f"{args.load}/trainer_state.json")
        load_checkpoint(args.load, model=trainer, optimizer=optimizer, accum_steps=state.accum_steps)
        trainer.step = state.step
        loader = sft.Loader.from_state(len(samples), order, state.loader)
        log(f"resumed {args.load}: optimizer step {state.step // state.accum_steps}, micro-batch {state.step}, "
            f"loader epoch {loader.epoch} index {loader.index}; accum_steps {args.accum_steps} and lr {args.lr:g} from the checkpoint")
    pool = TrainerPool(args.trainers, args.model, trainer_kwargs, threads=max(1, args.threads or 1)) if args.trainers else None
    session = Session(trainer, optimizer, samples, loader, accum_steps=args.accum_steps, clip=args.clip,
                      lr=args.lr, warmup=args.warmup, pool=pool)
    run_config = {"model": str(args.model), "lora": lora_config(trainer), "lr": args.lr, "accum_steps": args.accum_steps,
                  "seq_max": args.seq_max, "state_dtype": args.state_dtype, "data": args.data or "builtin:pirate",
                  "order": order, "checkpoint_layers": args.checkpoint_layers}
    return session, tokenizer, encoder, template, pairs, options, run_config


def _load_tokenizer(gg):
    """Tokenizer.from_gguf, also accepting a pure byte vocab without merges (what `fucina launch lm`
    writes: token b is byte b, one token per byte), which from_gguf currently refuses."""
    from ..llm.tokenizer import Tokenizer, _bytes_to_unicode
    md = gg.metadata
    tokens = md.get("tokenizer.ggml.tokens") or []
    byte_chars = [_bytes_to_unicode()[b] for b in range(256)]
    if md.get("tokenizer.ggml.merges") or tokens[:256] != byte_chars:
        return Tokenizer.from_gguf(gg)
    eot = tokens.index("<|im_end|>") if "<|im_end|>" in tokens else md.get("tokenizer.ggml.eot_token_id")
    return Tokenizer(tokens, md.get("tokenizer.ggml.token_type", [1] * len(tokens)), [],
                     bos_id=md.get("tokenizer.ggml.bos_token_id"), eos_id=md.get("tokenizer.ggml.eos_token_id"),
                     eot_id=eot, pad_id=md.get("tokenizer.ggml.padding_token_id"),
                     add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)), source=str(gg.path))


def _answer(trainer, tokenizer, encoder, template, prompt, options, max_new):
    from ..llm.data import encode_prompt
    ids = encode_prompt(encoder, template, prompt, options)
    return tokenizer.decode(trainer.generate(ids, max_new, stop_ids=template.stop_ids))


def _bar(done, total, width=20):
    filled = width if total == 0 else int(width * done / total)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def run(args):
    from ..llm.finetune import adapters_sha256
    from ..threads import pin_threads

    _check_args(args)
    if args.threads:
        pin_threads(args.threads)
    out = sys.stderr if args.json else sys.stdout

    def log(msg):
        print(msg, file=out, flush=True)

    session, tokenizer, encoder, template, pairs, options, run_config = build(args, log)
    trainer = session.trainer
    try:
        log(f"fucina finetune: {args.model} ({trainer.config.layers} layers, hidden {trainer.config.hidden}); "
            f"LoRA rank {trainer.rank} alpha {trainer.alpha:g} on {','.join(trainer.targets)}: "
            f"{trainer.n_parameters():,} trainable parameters; {len(pairs)} pairs; lr {args.lr:g}; "
            f"accum {args.accum_steps}; {'trainers ' + str(args.trainers) if args.trainers else 'in-process'}")
        if args.verify_grads:
            from ..llm.finetune import verify_grads
            ok = verify_grads(session, log)
            return 0 if ok else 1
        prompt = args.prompt or pairs[0].instruction
        before = _answer(trainer, tokenizer, encoder, template, prompt, options, args.max_new_tokens)
        log(f"BEFORE  {prompt!r} -> {before!r}")
        first = session.macro_step
        losses, t_start, tokens_total, supervised_total = [], time.perf_counter(), 0, 0
        while session.macro_step < args.steps:
            t0 = time.perf_counter()
            loss, n_tok, n_sup = session.window()
            dt = time.perf_counter() - t0
            losses.append(loss)
            tokens_total += n_tok
            supervised_total += n_sup
            step = session.macro_step
            log(f"step {step:4d}/{args.steps}  loss {loss:8.4f}  {n_tok / dt:7.1f} tok/s  {n_sup / dt:6.1f} sup tok/s  "
                f"{dt * 1e3:7.0f} ms  {_bar(step - first, args.steps - first)}")
            if args.save_every and step % args.save_every == 0 and step < args.steps:
                from ..train.checkpoint import step_dir
                session.save(step_dir(args.save, step), run_config)
        elapsed = time.perf_counter() - t_start
        after = _answer(trainer, tokenizer, encoder, template, prompt, options, args.max_new_tokens)
        log(f"AFTER   {prompt!r} -> {after!r}")
        if not losses:
            log(f"nothing to do: the run is already at step {session.macro_step} of --steps {args.steps}")
        else:
            drop = 100.0 * (1.0 - losses[-1] / losses[0]) if losses[0] else 0.0
            log(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({drop:.1f}% lower) in {len(losses)} steps, "
                f"{elapsed:.1f} s, {supervised_total / elapsed:.1f} supervised tok/s")
        if args.save:
            session.save(args.save, run_config)
            log(f"saved {args.save} (adapters.safetensors, optimizer.safetensors, trainer_state.json)")
        if args.json:
            print(json.dumps({"initial_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
                              "before": before, "after": after, "steps": session.macro_step,
                              "adapters_sha256": adapters_sha256(trainer),
                              "ms_per_step": 1e3 * elapsed / max(1, len(losses)),
                              "supervised_tokens_per_s": supervised_total / elapsed if losses else None}))
        return 0
    finally:
        if session.pool is not None:
            session.pool.close()
