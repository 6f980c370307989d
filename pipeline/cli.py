"""The `fucina` command line: one subcommand per module in pipeline/commands/.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and
`run(args) -> int`. Discovery is automatic, so adding a command is adding a file.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import commands
from .errors import FucinaError


def _command_modules():
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        yield importlib.import_module(f"{commands.__name__}.{info.name}")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="fucina",
        description="Fucina: CPU-first training — autograd, optimizers, GGUF fine-tuning, ES, multiprocess pipeline.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except FucinaError as e:
        print(f"fucina {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fucina {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
