"""`fucina es-spirals`: train the spirals MLP from random init with pure ES."""
from __future__ import annotations

import json
import os
import sys

from ..errors import UserError
from ._args import default_run_dir

NAME = "es-spirals"
HELP = "train the spirals MLP from random init with evolution strategies (no backward), in-process or over workers"
DESCRIPTION = """Pure ES (no gradients anywhere) on the two-spirals MLP until 100% training
accuracy, as a job of the pipeline runtime: the scheduler hands (iteration,
member) tasks to es_member worker processes (local, or remote ones joining
over tcp:// with `python -m workers.es_member --connect tcp://HOST:PORT --key
RUN_DIR/worker.key`), or scores them in this process (--inprocess). The final
sha256 of the parameters is the same for any number of workers, in-process,
after a stop-and-resume, and when a worker dies mid-run. `fucina monitor
RUN_DIR` watches a running one."""


def add_arguments(p):
    p.add_argument("--workers", "--members", type=int, default=1, dest="workers",
                   help="local es_member worker processes")
    p.add_argument("--inprocess", action="store_true", help="score members in this process (no workers)")
    p.add_argument("--remote-workers", type=int, default=0,
                   help="also wait for this many workers to connect to --bind (e.g. from other hosts)")
    p.add_argument("--bind", default=None,
                   help="scheduler endpoint tcp://HOST:PORT (events on PORT+1; CURVE keys are made fresh in the "
                        "run dir, remote workers need its worker.key); default: the run dir's ipc:// sockets")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="place the --members as Ray actors (one CPU each) on the cluster at ADDRESS (default: "
                        "RAY_ADDRESS, else a local Ray), connecting back over tcp (--bind, else a free loopback "
                        "port); needs the extra [ray] (pip install -e '.[ray]' in a checkout)")
    p.add_argument("--seed", type=int, default=0, help="ES noise seed")
    p.add_argument("--model-seed", type=int, default=0, help="SpiralsMLP init seed")
    p.add_argument("--data-seed", type=int, default=0, help="spirals data noise seed")
    p.add_argument("--reward", choices=["nll", "acc"], default="nll",
                   help="nll: -mean CE; acc: accuracy + 0.1*exp(-CE), bounded")
    p.add_argument("--population", type=int, default=128, help="ES population")
    p.add_argument("--sigma", type=float, default=None, help="perturbation scale (default: tuned, see docs/es.md)")
    p.add_argument("--alpha", type=float, default=None, help="step size (default: tuned, see docs/es.md)")
    p.add_argument("--no-antithetic", action="store_true", help="independent members instead of (+eps, -eps) pairs")
    p.add_argument("--shaping", choices=["z_score", "centered_ranks"], default="z_score",
                   help="fitness shaping")
    p.add_argument("--noise", choices=["iid", "correlated"], default="iid", help="noise scheme")
    p.add_argument("--max-iterations", type=int, default=None,
                   help="stop after this many iterations even if not converged (an absolute count)")
    p.add_argument("--out", default=None,
                   help="run directory: checkpoint-step-N/, metrics.jsonl, summary.json, sockets "
                        "(default: runs/es-spirals-<time>, or the resumed run's dir)")
    p.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N iterations (0: only the final one)")
    p.add_argument("--resume", default=None, help="resume from this checkpoint (or the latest one in this run dir)")
    p.add_argument("--progress-every", type=int, default=500,
                   help="--inprocess: print progress every N iterations (0: quiet)")
    p.add_argument("--liveness", type=float, default=10.0,
                   help="seconds of silence before a worker is declared dead (must exceed the longest task, "
                        "including a worker's first-call numba compilation)")
    p.add_argument("--kill-worker-at", type=int, default=None,
                   help="fault-injection demo: one es_member SIGKILLs itself at this iteration (it is re-spawned)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def spec_of(args) -> dict:
    """The es-spirals job fields the flags give (pipeline/es/run.py ESSpiralsSpec)."""
    from ..es.spirals import ALPHA, SIGMA
    return {"iterations": args.max_iterations or 0, "population": args.population,
            "sigma": SIGMA if args.sigma is None else args.sigma, "alpha": ALPHA if args.alpha is None else args.alpha,
            "seed": args.seed, "model_seed": args.model_seed, "data_seed": args.data_seed, "reward": args.reward,
            "antithetic": not args.no_antithetic, "shaping": args.shaping, "noise": args.noise,
            "save_every": args.save_every}


def run_dir_of(args, name) -> str:
    """--out, else the resumed run's dir, else runs/<name>-<time>; refuses a dir holding another run."""
    from ..runtime import ckpt
    if args.resume:
        args.resume = ckpt.resolve(args.resume)  # a bad --resume fails here, before anything is written
    run_dir = args.out or (os.path.dirname(os.path.abspath(args.resume)) if args.resume
                           else default_run_dir(name))
    if not args.resume and ckpt.latest_checkpoint(run_dir):
        raise UserError(f"{run_dir} already holds checkpoints: pass --resume {run_dir} or choose another --out")
    return run_dir


def tcp_bind(bind: str | None) -> tuple[str, int | None]:
    """--bind tcp://HOST:PORT -> (host, port); None -> ipc:// (port None)."""
    if bind is None:
        return "127.0.0.1", None
    host, sep, port = bind.removeprefix("tcp://").rpartition(":")
    if not bind.startswith("tcp://") or not sep or not port.isdigit():
        raise UserError(f"--bind {bind!r}: give tcp://HOST:PORT")
    return host, int(port)


def run(args) -> int:
    from ..jobs import get_job
    from ..jobs.spec import build

    if args.workers < 0 or args.remote_workers < 0:
        raise UserError("--workers/--remote-workers must be >= 0")
    workers = 0 if args.inprocess else args.workers
    if workers == 0 and args.remote_workers == 0 and not args.inprocess:
        raise UserError("--workers 0 needs --inprocess or --remote-workers N")
    if args.remote_workers and args.bind is None:
        raise UserError("--remote-workers needs --bind tcp://HOST:PORT (remote workers connect over tcp://)")
    if args.ray is not None:
        if args.inprocess:
            raise UserError("--ray places members; --inprocess runs none: choose one")
        from ..runtime.ray_place import require_ray
        from ..runtime.transport import free_port_pair
        require_ray()  # before anything is written
        args.bind = args.bind or f"tcp://127.0.0.1:{free_port_pair('127.0.0.1')}"
    job_cls = get_job(NAME)
    spec = spec_of(args)
    job = job_cls(build(job_cls.Spec, spec))
    job.make_task()  # a bad ES setting (an odd antithetic population, ...) fails here, before anything starts
    host, port = tcp_bind(args.bind)
    run_dir = run_dir_of(args, NAME)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    placed = "Ray-placed" if args.ray is not None else "local"
    mode = "in-process" if args.inprocess else f"{workers} {placed} + {args.remote_workers} remote worker(s)"
    log(f"es-spirals: {mode}, run dir {run_dir}, {json.dumps(spec)}")
    if args.inprocess:
        from ..es.run import run_es_inprocess
        from ..threads import pin_threads
        pin_threads(1)
        result = run_es_inprocess(job, run_dir, resume=args.resume, log=log, progress_every=args.progress_every)
    else:
        from ..runtime.launch import Supervisor
        env = dict(os.environ)
        if args.kill_worker_at is not None:
            env["FUCINA_FAULT"] = f"es_member:eval:{args.kill_worker_at}"
        sup = Supervisor(NAME, spec, run_dir, trainers=workers + args.remote_workers, resume=args.resume,
                         port=port, host=host, liveness=args.liveness, env=env, local_workers=workers, ray=args.ray)
        if args.remote_workers:
            key = f" --key {os.path.join(sup.run_dir, 'worker.key')}" if port else ""
            log(f"waiting for {args.remote_workers} remote worker(s): python -m workers.es_member "
                f"--connect tcp://{host}:{port}{key}")
        result = sup.run()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"iterations {result['iterations']}  accuracy {result['accuracy']:.4f}  CE {result['ce']:.4f}  "
              f"wall {result['wall_s']:.1f}s  {result['member_evals_per_s']:.0f} member-evals/s  "
              f"({result['ms_per_iteration']:.1f} ms/iteration)")
        print(f"sha256 {result['sha256']}")
    return 0
