"""`fucina monitor`: attach to a running job's metrics and events."""
NAME = "monitor"
HELP = "attach to a running job: live progress, metrics, events (Ctrl-C detaches; the run goes on)"
DESCRIPTION = (HELP + ". On a terminal it draws a live view; otherwise (a pipe, a log file, CI) it prints one plain "
               "line per step and per event, or JSON lines with --jsonl. It ends with the run (exit 0); a run "
               "that has finished, or that nothing publishes for, is reported after --wait seconds (exit 1).")


def add_arguments(parser):
    from workers.monitor import add_arguments as worker_arguments
    worker_arguments(parser)


def run(args) -> int:
    from workers.monitor import watch
    return watch(args)
