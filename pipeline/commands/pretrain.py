"""`fucina pretrain`: the pretrain job (a GPT from scratch with a BPE trained on your text) on the runtime."""
from __future__ import annotations

import argparse

from . import launch

NAME = "pretrain"
HELP = "pretrain a d4/d6/d8 GPT from scratch on your text (BPE tokenizer, Muon, bits per byte, model.gguf)"
DESCRIPTION = ("`fucina launch pretrain` with the corpus and tokenizer prepared first: read --data (or the "
               "built-in corpus), train or load the tokenizer and cache the token stream, then run the job on "
               "the multiprocess runtime (--inprocess: inline). Same bits for any --trainers N and resumed runs. "
               "The run dir gets metrics.jsonl, checkpoints, pretrain.png, samples.jsonl and model.gguf.")


def add_launch_flags(parser, job):
    """The flags of `fucina launch JOB` (one definition: launch's), on this parser."""
    source = argparse.ArgumentParser(formatter_class=parser.formatter_class)
    launch.add_arguments(source)
    jobs = next(a for a in source._actions if isinstance(a, argparse._SubParsersAction))
    for action in jobs.choices[job]._actions:
        if not isinstance(action, argparse._HelpAction):
            parser._add_action(action)


def add_arguments(parser):
    add_launch_flags(parser, "pretrain")


def run(args) -> int:
    from ..jobs import get_job
    from ..jobs.spec import from_args
    from ._args import check_job_inputs
    job_cls = get_job("pretrain")
    spec = from_args(job_cls.Spec, args)
    check_job_inputs(spec)  # FIFOs, devices and over-long lines refused before the corpus is read
    job = job_cls(spec)  # a bad --data fails here; workers then find the caches warm
    if not (args.json or args.quiet):
        c = job.corpus
        print(f"fucina pretrain: corpus {c.digest} ({c.source}): {len(c.train_docs)} training / "
              f"{len(c.val_docs)} held-out documents, {c.n_bytes:,} bytes; {len(job.train):,} training tokens; "
              f"tokenizer {job.tokenizer_path} ({job.config.vocab_size} tokens); {job.steps} steps of "
              f"{job.batch_tokens:,} tokens")
    args.job = "pretrain"
    return launch.run(args)
