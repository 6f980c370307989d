"""Argument helpers shared by the command modules: the help formatter, the input-file check, --threads.

Not a command (the leading underscore keeps pipeline/cli.py's discovery away).
"""
from __future__ import annotations

import argparse
import os
import re

from ..errors import UserError
from ..threads import add_threads_flag  # noqa: F401 (the commands import it from here too)

_MENTIONS_DEFAULT = re.compile(r"\bdefault", re.I)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default once: appended by argparse only when the help text does not state it
    already, and never for an absent default (None), an off switch (False) or a required flag."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        absent = action.default is None or action.default is False or action.default == ""
        if (absent or _MENTIONS_DEFAULT.search(help_text) or action.required
                or action.default is argparse.SUPPRESS or not action.option_strings):
            return help_text
        return super()._get_help_string(action)


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """HelpFormatter that keeps the description's own line breaks (a usage table in the description)."""


class InputFile:
    """The argparse type of a flag that names an existing regular file ("GGUF file", "JSONL file").

    Parsing keeps the string; check_input_files tests the paths once parsing is done, so a wrong path is
    one error line (a UserError, like every other bad input) rather than argparse's usage dump.
    """

    def __init__(self, what):
        self.what = what

    def __call__(self, path):
        return path

    def check(self, flag, path):
        from ..untrusted import not_a_regular_file
        problem = not_a_regular_file(path, self.what)  # missing, a directory, a FIFO, a device: which one
        if problem:
            raise UserError(f"{flag} {problem}")


def progress_log(args):
    """A command's progress printer: to stderr under --json (stdout then carries only the JSON line), else stdout."""
    import sys
    out = sys.stderr if getattr(args, "json", False) else sys.stdout

    def log(msg):
        print(msg, file=out, flush=True)

    return log


def check_input_files(parser, args):
    """Raise UserError for the first InputFile flag of `parser` whose path is missing or not a file."""
    for action in parser._actions:
        path = getattr(args, action.dest, None)
        if isinstance(action.type, InputFile) and path is not None:
            action.type.check(action.option_strings[0], path)


def check_corpus_files(data: str, flag: str = "--data"):
    """Every file of a --data corpus list (pretrain, tokenizer train) is a regular file and every text file
    streams cleanly (pipeline.llm.data.read_text: no line over its cap, UTF-8), checked before the corpus is
    read: a FIFO would block its reading, /dev/zero never end, and a 2 GB one-line file was read whole (4 GB)
    before anything refused it. JSONL files are streamed by their own reader (read_jsonl)."""
    from ..jobs.pretrain_data import _expand
    from ..llm.data import read_text
    from ..untrusted import not_a_regular_file
    for entry in (e.strip() for e in data.split(",")):
        if not entry:
            continue
        if os.path.lexists(entry) and not os.path.isdir(entry):
            problem = not_a_regular_file(entry, "text or JSONL file")
            if problem:
                raise UserError(f"{flag} {problem}")
        for path in _expand(entry):
            problem = not_a_regular_file(path, "text or JSONL file")
            if problem:
                raise UserError(f"{flag} {problem}")
            if not path.endswith(".jsonl"):
                read_text(path, keep=False)


# the job fields that name one input file (pretrain's `data` is a corpus list: check_corpus_files)
JOB_INPUT_FILES = {"model": "GGUF file", "tokenizer": "tokenizer.json"}


def check_job_inputs(spec):
    """The input files a job spec names (--model, --data, --tokenizer), checked as InputFile flags are: a
    FIFO, a device or a directory is named as such before the job opens it (or starts its workers); and its
    --tensorboard DIR (check_tensorboard)."""
    from ..untrusted import not_a_regular_file
    fields = dict(JOB_INPUT_FILES, data="JSONL file")
    for name, what in fields.items():
        path = getattr(spec, name, "")
        if not path:
            continue
        if name == "data" and hasattr(spec, "text_field"):  # a corpus: files, directories, globs
            check_corpus_files(path)
            continue
        problem = not_a_regular_file(path, what)
        if problem:
            raise UserError(f"--{name} {problem}")
    check_tensorboard(spec)


def check_tensorboard(spec):
    """--tensorboard DIR is created and proven writable before the run starts: a run is refused (one line naming
    the path) rather than trained without the curves it was asked for, or failed in its scheduler process."""
    path = getattr(spec, "tensorboard", "")
    if path:
        from ..runtime.tensorboard import check_dir
        check_dir(path)


def default_run_dir(name: str, root: str = "runs") -> str:
    """runs/NAME-YYYYmmdd-HHMMSS for a run given no directory; -2, -3, ... when that name is taken (two runs
    started in the same second must not share a directory: the second would find the first's checkpoints)."""
    import time
    base = os.path.join(root, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def add_lora_arguments(parser):
    """--lora PATH (repeatable) and --lora-scale S for the serving commands."""
    parser.add_argument("--lora", action="append", metavar="PATH", default=None,
                        help="apply a LoRA fine-tune without merging it: a `fucina finetune` run or checkpoint "
                             "directory, or a llama.cpp LoRA adapter GGUF (export-gguf --lora-out); repeatable")
    parser.add_argument("--lora-scale", action="append", type=float, metavar="S", default=None,
                        help="scale of the adapter's delta, as llama.cpp's --lora-scaled (default 1: the trained "
                             "delta alpha/rank * B A); one for all --lora, or one per --lora in order")
