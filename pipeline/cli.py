"""The `fucina` command line: one subcommand per module in pipeline/commands/.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and
`run(args) -> int`. Discovery is automatic, so adding a command is adding a file.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import pkgutil
import sys

from . import commands
from .commands._args import HelpFormatter, check_input_files
from .errors import FucinaError


def _command_modules(only=None):
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or (only is not None and info.name != only):
            continue
        yield importlib.import_module(f"{commands.__name__}.{info.name}")


def _chosen_module(argv):
    """The command module `argv` names (its first word, `es-finetune` -> es_finetune), or None: a run then
    imports that command's module alone, not every command's (their imports - the ES trainer, ZeroMQ, the
    runtime - cost `fucina generate` ~6 MB and 0.15-0.2 s); --help, --version and unknown words get the full parser."""
    words = sys.argv[1:] if argv is None else list(argv)
    if not words or words[0].startswith("-"):
        return None
    name = words[0].replace("-", "_")
    if name.startswith("_") or name not in {info.name for info in pkgutil.iter_modules(commands.__path__)}:
        return None
    return name if importlib.import_module(f"{commands.__name__}.{name}").NAME == words[0] else None


def build_parser(only=None):
    """The `fucina` parser: every command, or (only: a command module's name) that command alone."""
    parser = argparse.ArgumentParser(
        prog="fucina",
        description="Fucina: CPU-first training — autograd, optimizers, GGUF fine-tuning, ES, multiprocess pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"fucina {importlib.metadata.version('fucina')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in _command_modules(only):
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=HelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _innermost_parser(parser, args):
    """The parser of the (sub)subcommand that was chosen: `fucina launch lm` -> the `launch lm` parser."""
    while True:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subparsers[0].dest, None) if subparsers else None
        if chosen is None:
            return parser
        parser = subparsers[0].choices[chosen]


# the commands whose first call on a fresh clone compiles numba kernels in this process: they say so on stderr
# when numba compiles (pipeline/compile_notice.py), and nothing on a warm cache
COMPILE_NOTICE = ("generate", "chat", "eval-logits", "eval", "finetune", "es-finetune")


def main(argv=None) -> int:
    parser = build_parser(_chosen_module(argv))
    try:
        args, unknown = parser.parse_known_args(argv)
        chosen = _innermost_parser(parser, args)
        if unknown:  # answered with the chosen subcommand's usage, not the top-level one
            chosen.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as done:  # --help, --version or a usage error, already printed: its status, for callers too
        return done.code or 0
    try:
        check_input_files(chosen, args)
        if args.command not in COMPILE_NOTICE:
            return int(args._run(args) or 0)
        from .compile_notice import compile_notice
        with compile_notice():
            return int(args._run(args) or 0)
    except FucinaError as e:
        print(f"fucina {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the machine said no (a full disk, a read-only run dir): one line naming the file
        where = f"{e.filename}: " if e.filename else ""
        print(f"fucina {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fucina {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
