"""`fucina export-gguf`: merge LoRA adapters into a dense GGUF, transcode/quantize a GGUF, or write an adapter GGUF.

Four modes, chosen by the flags (merge and quantize are separate passes by
design, so the final file has exactly one quantization in its history):

  merge      --from-gguf BASE --adapters RUN_DIR [--alpha A] --out MERGED.gguf   (a quantized BASE needs
             --dequantize: merged weights re-quantized to their own type, or all matrices to --dtype)
  transcode  --from-gguf SRC [--dtype q4_k] --out OUT.gguf   (no --dtype: verbatim, byte-identical copy)
  adapter    --adapters RUN_DIR --base BASE.gguf [--alpha A] --lora-out ADAPTER.gguf
  checkpoint --from-checkpoint CHECKPOINT_DIR [--dtype f32|f16] --out MODEL.gguf   (a pretrain or sft
             checkpoint, with the run's tokenizer embedded)
"""
from __future__ import annotations

import importlib
from collections import Counter

from pipeline.commands._args import RawDescriptionHelpFormatter
from pipeline.errors import UserError
from pipeline.llm.export import load_adapters, merge, resolve_alpha, write_lora_gguf
from pipeline.llm.gguf_write import FILE_TYPES, TARGETS, transcode

NAME = "export-gguf"
HELP = ("merge LoRA adapters into a dense GGUF, transcode/quantize a GGUF (llama.cpp byte-exact), "
        "or write a LoRA adapter GGUF")
DESCRIPTION = __doc__.split("\n", 1)[1].strip() + (
    "\n\nThe adapter file stores A and B but NOT alpha: pass --alpha with the training-time value, "
    "or let it default to config.lora.alpha recorded in the checkpoint's trainer_state.json.")


def add_arguments(parser):
    parser.formatter_class = RawDescriptionHelpFormatter
    parser.add_argument("--from-gguf", metavar="GGUF",
                        help="source GGUF: the dense base to merge into, or the file to transcode")
    parser.add_argument("--from-checkpoint", metavar="DIR",
                        help="a pretrain or sft checkpoint directory (checkpoint-step-N/) to write as a dense GGUF "
                             "with the run's tokenizer; --dtype f32 or f16 (default: the run's gguf_dtype)")
    parser.add_argument("--adapters", metavar="DIR",
                        help="fine-tune checkpoint directory (adapters.safetensors + trainer_state.json)")
    parser.add_argument("--alpha", metavar="A",
                        help="LoRA alpha used in training (scale = alpha/rank). It is NOT stored in the adapter file; "
                             "default: config.lora.alpha from the checkpoint's trainer_state.json")
    parser.add_argument("--out", metavar="GGUF", help="output GGUF for merge or transcode")
    parser.add_argument("--dtype", choices=sorted(TARGETS), type=str.lower,
                        help="transcode matrix weights to this type (llama-quantize policy; norms and 1-D tensors keep "
                             "their type; K-quants need rows %% 256 == 0, else the source type is kept and reported; "
                             "already-quantized tensors are copied verbatim). Omit for a verbatim copy")
    parser.add_argument("--dequantize", action="store_true",
                        help="with --adapters and a quantized --from-gguf: dequantize each adapted weight, merge in "
                             "f32 and re-quantize it to its own type (the file keeps its mix; with --dtype every "
                             "matrix weight takes that type instead); prints the measured cost, the KL of the "
                             "merged model against the base with the adapters unmerged, on a few held-out prompts")
    parser.add_argument("--lora-out", metavar="GGUF",
                        help="write a llama.cpp LoRA adapter GGUF here (needs --adapters and --base)")
    parser.add_argument("--base", metavar="GGUF",
                        help="with --lora-out: the base model the adapter is for (names, shapes, architecture); "
                             "defaults to --from-gguf")


def from_checkpoint(args):
    from pipeline.jobs import get_job
    from pipeline.runtime import ckpt
    if not args.out:
        raise UserError("--from-checkpoint needs --out MODEL.gguf")
    if args.adapters or args.from_gguf or args.lora_out or args.alpha is not None:
        raise UserError("--from-checkpoint takes only --out and --dtype")
    if args.dtype not in (None, "f32", "f16"):
        raise UserError(f"--from-checkpoint writes f32 or f16; quantize in a second pass: export-gguf --from-gguf "
                        f"{args.out} --dtype {args.dtype} --out FINAL")
    where = ckpt.resolve(args.from_checkpoint)  # a checkpoint, or a run dir: its newest checkpoint
    state = ckpt.read_state(where)
    job = state.config.get("job")
    export = getattr(importlib.import_module(get_job(job).__module__), "gguf_from_checkpoint", None)
    if export is None:
        raise UserError(f"{args.from_checkpoint}: a checkpoint of job {job!r}; --from-checkpoint exports pretrain "
                        "and sft checkpoints")
    path = export(where, state, args.out, args.dtype and args.dtype.upper())
    print(f"wrote {path}: {where} (job {job}, step {state.step // state.accum_steps})")
    return 0


def run(args):
    if args.from_checkpoint:
        return from_checkpoint(args)
    if args.lora_out:
        base = args.base or args.from_gguf
        if not args.adapters or not base:
            raise UserError("--lora-out needs --adapters DIR and --base BASE.gguf")
        if args.out or args.dtype:
            raise UserError("--lora-out writes only the adapter; "
                            "run merge/transcode (--out/--dtype) as a separate command")
        adapters = load_adapters(args.adapters)
        alpha = resolve_alpha(args.alpha, adapters)
        print(f"export-gguf: adapter GGUF  adapters={args.adapters} base={base} alpha={alpha:g} rank={adapters.rank}")
        write_lora_gguf(adapters, alpha, base, args.lora_out)
        print(f"wrote {args.lora_out}: {len(adapters.pairs)} lora_a/lora_b pairs "
              f"(targets {','.join(adapters.targets)})")
        return 0
    if not args.from_gguf or not args.out:
        raise UserError("need --from-gguf SRC and --out OUT (or --adapters, --base and --lora-out for an adapter GGUF)")
    if args.adapters:
        if args.dtype and not args.dequantize:
            raise UserError("merge and --dtype are separate passes by design (one quantization in the file's history): "
                            "merge first into a dense --out, then run export-gguf --from-gguf MERGED --dtype "
                            f"{args.dtype} --out FINAL (or pass --dequantize to do both in one pass)")
        adapters = load_adapters(args.adapters)
        alpha = resolve_alpha(args.alpha, adapters)
        print(f"export-gguf: merge  base={args.from_gguf} adapters={args.adapters} alpha={alpha:g} "
              f"rank={adapters.rank} scale={alpha / adapters.rank:g}")
        names = merge(args.from_gguf, adapters, alpha, args.out, dequantize=args.dequantize, dtype=args.dtype)
        kept = f"every tensor re-encoded to {args.dtype} where its rows fit" if args.dtype else \
            "every tensor keeps its stored type, everything unmerged copied verbatim"
        print(f"wrote {args.out}: merged {len(names)} weights; {kept}")
        if args.dequantize:
            from pipeline.llm.export import merge_cost
            cost = merge_cost(args.from_gguf, adapters, alpha, args.out)
            print(f"measured cost: KL(base+adapter || merged) mean {cost['kl_mean']:.3g} nats/token, max "
                  f"{cost['kl_max']:.3g}, top-1 agreement {100 * cost['top1_agree']:.1f}% over {cost['positions']} "
                  f"positions of {cost['prompts']} held-out prompts")
        return 0
    if args.dequantize:
        raise UserError("--dequantize only applies with --adapters (a merge into a quantized base)")
    if args.alpha is not None:
        raise UserError("--alpha only applies with --adapters")
    print(f"export-gguf: transcode  {args.from_gguf} -> {args.out}  dtype={args.dtype or 'verbatim'}")
    rows = transcode(args.from_gguf, args.out, args.dtype, log=lambda line: print(f"  {line}"))
    converted = sum(1 for r in rows if r[1] != r[2])
    if not args.dtype:
        print(f"wrote {args.out}: {len(rows)} tensors, {converted} converted")
        return 0
    kept = Counter(reason for *_, reason in rows if reason != "converted")
    print(f"wrote {args.out}: {converted} of {len(rows)} tensors converted to {TARGETS[args.dtype].name}"
          + "".join(f"; {n} {reason}" for reason, n in kept.items())
          + f"; general.file_type {FILE_TYPES[args.dtype].name}")
    return 0
