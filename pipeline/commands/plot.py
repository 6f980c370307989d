"""`fucina plot RUN_DIR`: redraw a run's loss curve from its metrics.jsonl."""
NAME = "plot"
HELP = "draw RUN_DIR/loss.png (train loss and eval metric against step) from metrics.jsonl"


def add_arguments(parser):
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", metavar="PNG", help="write the image here instead of RUN_DIR/loss.png")


def run(args) -> int:
    from ..runtime.metrics import plot_run
    print(plot_run(args.run_dir, out=args.out))
    return 0
