"""`fucina sft`: full-parameter SFT of a pretrained model.gguf on chat JSONL (the `sft` job on the runtime)."""
from __future__ import annotations

from . import launch
from .pretrain import add_launch_flags

NAME = "sft"
HELP = "full-parameter supervised fine-tuning of a pretrained model.gguf on chat JSONL (assistant turns only)"
DESCRIPTION = ("`fucina launch sft`: every weight of --model trained on --data (messages, ShareGPT, alpaca or "
               "instruction/response JSONL) rendered by the model's chat template, loss on the assistant turns "
               "only; same bits for any --trainers N and resumed runs; model.gguf at the end "
               "(`fucina chat --model RUN_DIR/model.gguf` talks to it).")


def add_arguments(parser):
    add_launch_flags(parser, "sft")


def run(args) -> int:
    args.job = "sft"
    return launch.run(args)
