"""`fucina bench <name>`: run one benchmark (modules in pipeline/bench/)."""
import importlib
import pkgutil

from .. import bench as bench_pkg
from ..bench import report

NAME = "bench"
HELP = "run a benchmark and print ms and ratios against side-by-side baselines"


def _benches():
    for info in sorted(pkgutil.iter_modules(bench_pkg.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"{bench_pkg.__name__}.{info.name}")


def add_arguments(parser):
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for mod in _benches():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP, formatter_class=parser.formatter_class)
        p.add_argument("--json", action="store_true",
                       help='print one JSON document: {"bench", "machine", "results": [{"case", "ms", "baselines"}]}')
        mod.add_arguments(p)
        p.set_defaults(_bench=mod)


def run(args):
    rows = args._bench.run(args)
    report(args._bench.NAME, rows, as_json=args.json, threads=getattr(args, "threads", None))
    return 0
