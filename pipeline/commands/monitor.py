"""`fucina monitor`: attach to a running job's metrics and events."""
NAME = "monitor"
HELP = "attach to a running job: live progress, metrics, events (Ctrl-C detaches; the run goes on)"


def add_arguments(parser):
    from workers.monitor import add_arguments as worker_arguments
    worker_arguments(parser)


def run(args) -> int:
    from workers.monitor import watch
    return watch(args)
