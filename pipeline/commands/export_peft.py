"""`fucina export-peft`: write a fine-tune's LoRA adapters as a Hugging Face PEFT directory (the model family's
Hugging Face module names)."""
from __future__ import annotations

from pipeline.llm.export import load_adapters, resolve_alpha, write_peft

NAME = "export-peft"
HELP = ("write LoRA adapters as a PEFT directory (adapter_config.json + adapter_model.safetensors, the model "
        "family's Hugging Face module names)")


def add_arguments(parser):
    parser.add_argument("--adapters", metavar="DIR", required=True,
                        help="fine-tune checkpoint directory (adapters.safetensors + trainer_state.json)")
    parser.add_argument("--out", metavar="DIR", required=True, help="output directory for the PEFT adapter")
    parser.add_argument("--alpha", metavar="A",
                        help="LoRA alpha used in training (not stored in the adapter file); default: config.lora.alpha "
                             "from the checkpoint's trainer_state.json")
    parser.add_argument("--base-model", default="", metavar="NAME",
                        help="base_model_name_or_path to record in adapter_config.json (e.g. Qwen/Qwen3-0.6B)")


def run(args):
    adapters = load_adapters(args.adapters)
    alpha = resolve_alpha(args.alpha, adapters)
    print(f"export-peft: adapters={args.adapters} alpha={alpha:g} rank={adapters.rank} "
          f"targets={','.join(adapters.targets)}")
    write_peft(adapters, alpha, args.out, args.base_model)
    print(f"wrote {args.out}/adapter_config.json and adapter_model.safetensors ({2 * len(adapters.pairs)} tensors)")
    return 0
