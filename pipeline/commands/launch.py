"""`fucina launch <job>`: run a job as a supervised multiprocess pipeline (or inline)."""
from __future__ import annotations

import json
import os
import sys

from ..errors import UserError
from ..jobs import ES_JOBS, JOBS, get_job
from ..jobs.spec import add_flags, from_args, to_dict
from ..runtime.transport import free_port_pair
from ._args import add_threads_flag, check_job_inputs, default_run_dir

NAME = "launch"
HELP = "run a built-in job (spirals, lm, finetune, es-spirals, ...) as a multiprocess pipeline of workers"
DESCRIPTION = ("Start the scheduler, loader, optimizer, checkpointer and N trainers as subprocesses - for an ES "
               "job the scheduler and N es_members - (or run the same tasks inline with --inprocess). Final "
               "parameters are bit-identical for --inprocess, any --trainers N, and stopped+resumed runs. "
               "Every job field is a flag.")


def add_arguments(parser):
    sub = parser.add_subparsers(dest="job", metavar="JOB", required=True)
    for name in [*JOBS, *ES_JOBS]:
        job_cls = get_job(name)
        doc = job_cls.__doc__ if name in ES_JOBS else sys.modules[job_cls.__module__].__doc__
        p = sub.add_parser(name, help=_summary(doc), description=doc, formatter_class=parser.formatter_class)
        workers = "es_members" if name in ES_JOBS else "trainers"
        if name in ES_JOBS:
            p.add_argument("--members", "--trainers", type=int, default=1, dest="trainers", metavar="N",
                           help="es_member processes: each keeps a replica of the parameters and scores a chunk of "
                                "every iteration's population (one compute thread each unless --threads)")
        else:
            p.add_argument("--trainers", type=int, default=1,
                           help="trainer processes (one compute thread each unless --threads)")
            p.add_argument("--remote-trainers", type=int, default=0, metavar="N",
                           help="of the --trainers, N run as remote trainers (tcp with --port: parameters, batches "
                                "and gradients travel as frames instead of shared memory; see docs/cluster.md)")
        p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help=f"place the {workers} as Ray actors (one CPU each) on the cluster at ADDRESS (default: "
                            "RAY_ADDRESS, else a local Ray); needs the extra [ray] (pip install -e '.[ray]' in a "
                            "checkout, pip install 'fucina[ray]' from an index); the other roles run here, over tcp "
                            "(--port, a free one if not given; --host must be reachable from the nodes)")
        p.add_argument("--inprocess", action="store_true", help="run every task inline in this process (same bits)")
        p.add_argument("--resume", metavar="DIR",
                       help="continue from a checkpoint dir or a run dir's latest checkpoint")
        p.add_argument("--run-dir", metavar="DIR",
                       help="run directory (default: runs/<job>-<time>, which runs/<job>-latest then points to; "
                            "or the resumed run's dir)")
        add_threads_flag(p, 1, "each worker process (and of the --inprocess run)")
        p.add_argument("--port", type=int, default=None,
                       help="use tcp://HOST:PORT (+1 for events) instead of ipc:// sockets")
        p.add_argument("--host", default="127.0.0.1", help="interface the tcp:// sockets bind (loopback unless told)")
        p.add_argument("--liveness", type=float, default=60.0 if name in ES_JOBS else 5.0,
                       help="seconds without a heartbeat before a worker is declared lost and its work re-run"
                            + (" (an es_member's first chunk includes its numba compilation)" if name in ES_JOBS
                               else ""))
        p.add_argument("--json", action="store_true",
                       help="print only a JSON summary (" + ("iterations, params_sha256, member_evals_per_s, ..."
                                                             if name in ES_JOBS else
                                                             "steps, final_loss, params_sha256, ...") + ")")
        p.add_argument("--quiet", action="store_true", help="no live progress")
        add_flags(p, job_cls.Spec)


def _summary(doc):
    """A job's docstring "`lm`: a small ... from scratch." -> "a small ... from scratch"."""
    first = doc.strip().split("\n\n", 1)[0].replace("\n", " ")
    return first.split(":", 1)[1].strip().rstrip(".") if first.startswith("`") else first


def _point_latest(run_dir, job, say):
    """Re-point the symlink runs/<job>-latest at a new default run dir, so commands can name the newest run."""
    link = os.path.join(os.path.dirname(run_dir), f"{job}-latest")
    if os.path.lexists(link) and not os.path.islink(link):
        say(f"  {link} exists and is not a symlink: left alone")
        return
    tmp = f"{link}.{os.getpid()}.tmp"
    os.symlink(os.path.basename(run_dir), tmp)
    os.replace(tmp, link)  # atomic: a reader sees the old run or the new one, never no link


def _run_dir(args):
    if args.run_dir:
        return args.run_dir
    if args.resume:
        from ..runtime import ckpt
        return os.path.dirname(os.path.abspath(ckpt.resolve(args.resume)))
    return default_run_dir(args.job)


def run(args) -> int:
    job_cls = get_job(args.job)
    spec = from_args(job_cls.Spec, args)
    check_job_inputs(spec)  # before any worker starts: one line naming the flag, not the scheduler's exit
    es = args.job in ES_JOBS
    if args.trainers < 1:
        raise UserError(f"--{'members' if es else 'trainers'} must be >= 1, got {args.trainers}")
    if es:
        args.remote_trainers = 0
        job_cls(spec).make_task()  # a bad ES setting (an odd antithetic population, ...) fails before anything starts
    total = (spec.iterations or None) if es else spec.steps  # es-spirals' 0: until the center converges
    if not 0 <= args.remote_trainers <= args.trainers:
        raise UserError(f"--remote-trainers must be between 0 and --trainers ({args.trainers}), "
                        f"got {args.remote_trainers}")
    if args.ray is not None:
        if args.inprocess:
            raise UserError("--ray places workers; --inprocess runs none: choose one")
        from ..runtime.ray_place import require_ray
        require_ray()  # before anything is written
        args.port = args.port or free_port_pair(args.host)
    if args.remote_trainers and not args.port and not args.inprocess:
        raise UserError("--remote-trainers needs --port P: remote trainers connect over tcp:// with the run's key")
    from ..runtime import ckpt
    if args.resume:
        args.resume = ckpt.resolve(args.resume)  # a bad --resume fails here, before anything is written
    run_dir = _run_dir(args)
    if not args.resume and ckpt.latest_checkpoint(run_dir):
        raise UserError(f"{run_dir} already holds checkpoints: pass --resume {run_dir} or choose another --run-dir")
    os.makedirs(run_dir, exist_ok=True)
    quiet = args.json or args.quiet
    say = (lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"fucina launch {args.job}: run dir {run_dir}")
    if not (args.run_dir or args.resume):
        _point_latest(run_dir, args.job, say)
    say(f"  spec {json.dumps(to_dict(spec))}")
    if args.inprocess and es:
        from ..es.run import run_es_inprocess
        from ..threads import pin_threads
        pin_threads(args.threads)
        summary = run_es_inprocess(job_cls(spec), run_dir, resume=args.resume, log=say)
    elif args.inprocess:
        from ..runtime.inprocess import run_inprocess
        from ..threads import pin_threads
        pin_threads(args.threads)
        with _progress(total, quiet) as on_step:
            summary = run_inprocess(job_cls(spec), run_dir, resume=args.resume, log=say, on_step=on_step)
        try:
            from ..runtime.metrics import plot_run
            summary["plot"] = plot_run(run_dir)
        except UserError:
            pass
    else:
        from ..finetune.es import REWARD_FILES_ENV
        from ..runtime.launch import Supervisor
        env = dict(os.environ)
        if es:  # a reward file named here is one the members spawned here may import
            env[REWARD_FILES_ENV] = os.pathsep.join(getattr(job_cls(spec), "reward_files", list)())
        sup = Supervisor(args.job, to_dict(spec), run_dir, trainers=args.trainers, resume=args.resume,
                         threads=args.threads, port=args.port, host=args.host, liveness=args.liveness, quiet=quiet,
                         remote_trainers=args.remote_trainers, ray=args.ray, env=env)
        with _progress(total, quiet, sup.events_endpoint, sup.client_key) as _:
            summary = sup.run()
    if args.json:
        print(json.dumps(summary))
    else:
        for key in ("steps", "iterations", "final_loss", "accuracy", "member_evals_per_s", "params_sha256",
                    "checkpoint", "plot", "sample", "gguf", "val_loss", "val_bpb", "samples", "pretrain_plot"):
            if summary.get(key) is not None:
                print(f"{key:>18}: {summary[key]}")
    return 0


class _progress:
    """A rich progress bar fed by in-process steps, or by the run's PUB socket."""

    SHOWN = ("run_started", "checkpoint_committed", "checkpoint_retry", "worker_lost", "run_restarting", "early_stop")

    def __init__(self, total, quiet, endpoint=None, key=None):
        self.total, self.quiet, self.endpoint, self.key = total, quiet, endpoint, key
        self.stop, self.peak = None, None

    def __enter__(self):
        if self.quiet:
            return lambda record: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
        self.bar = Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
        self.task = self.bar.add_task("train", total=self.total, info="")
        from ..runtime.peak import peak_gflops
        self.peak = peak_gflops()  # cached per machine: measured (~0.3 s) the first time only
        self.bar.start()
        if self.endpoint:
            self._follow()
        return self.update

    def update(self, record):
        if record.get("kind") == "es_metrics":
            info = (f"reward {record['reward_mean']:.4f} (std {record['reward_std']:.4f})  "
                    f"{record['evals_per_s']:.0f} member-evals/s")
            if record.get("eval") is not None:
                info += f"  {record.get('eval_name', 'eval')} {record['eval']:.4f}"
            self.bar.update(self.task, completed=record["step"], info=info)
            return
        from ..runtime.peak import share_text
        loss = "-" if record.get("loss") is None else f"{record['loss']:.4f}"  # every micro-batch skipped
        info = f"loss {loss}  "
        if record.get("eval") is not None:  # beside the loss: a narrow terminal cuts the line's end, never these
            info += f"{record.get('eval_name') or 'eval'} {record['eval']:.4f}  "
        info += f"lr {record['lr']:.2e}  |g| {record['grad_norm']:.3f}  {record.get('tokens_per_s', 0):.0f} tok/s"
        share = share_text(record.get("gflop_per_s"), self.peak)
        if share:
            info += f" ({share})"
        self.bar.update(self.task, completed=record["step"], info=info)

    @staticmethod
    def event_line(msg) -> str:
        """One shown event. run_started is published before a resumed run has loaded its checkpoint, so its
        step is not the run's: it is printed without one."""
        detail = ", ".join(f"{k}={v}" for k, v in msg["detail"].items() if k != "sample")
        where = "" if msg["event"] == "run_started" else f"step {msg['step']}: "
        return f"{where}{msg['event']} {detail}".rstrip()

    def _follow(self):
        import threading

        from rich.markup import escape

        from ..runtime.transport import Subscriber
        self.stop = threading.Event()

        def loop():
            sub = Subscriber(self.endpoint, key=self.key)
            try:
                while not self.stop.is_set():
                    msg = sub.recv(200)
                    if msg and msg["kind"] in ("metrics", "es_metrics"):
                        self.update(msg)
                    elif msg and msg["event"] in self.SHOWN:
                        self.bar.console.print(f"[dim]{escape(self.event_line(msg))}[/dim]")
            finally:
                sub.close()
        threading.Thread(target=loop, daemon=True).start()

    def __exit__(self, *exc):
        if self.stop:
            self.stop.set()
        if not self.quiet:
            self.bar.stop()
        return False
