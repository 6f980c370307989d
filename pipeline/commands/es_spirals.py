"""`fucina es-spirals`: train the spirals MLP from random init with pure ES."""
from __future__ import annotations

import json
import signal
import sys

from ..errors import UserError

NAME = "es-spirals"
HELP = "train the spirals MLP from random init with evolution strategies (no backward), in-process or over workers"
DESCRIPTION = """Pure ES (no gradients anywhere) on the two-spirals MLP until 100% training
accuracy. Members are scored in-process or by es-member worker processes
(local, or remote ones joining over tcp:// with `python -m workers.es_member
--connect tcp://HOST:PORT`). The final sha256 of the parameters is the same
for any number of workers, in-process, after a stop-and-resume, and when a
worker dies mid-run."""


def add_arguments(p):
    p.add_argument("--workers", type=int, default=1, help="local es-member worker processes")
    p.add_argument("--inprocess", action="store_true", help="score members in this process (no workers)")
    p.add_argument("--remote-workers", type=int, default=0,
                   help="also wait for this many workers to connect to --bind (e.g. from other hosts)")
    p.add_argument("--bind", default=None,
                   help="coordinator endpoint, e.g. tcp://0.0.0.0:5555 (default: a private ipc:// socket)")
    p.add_argument("--key-dir", default=None,
                   help="tcp:// only: where this run's fresh CURVE keys go (default: --out, else a private temp dir); "
                        "remote workers need its worker.key: --key DIR/worker.key")
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
    p.add_argument("--out", default=None, help="run directory for checkpoint-step-N/ directories")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N iterations into --out (0: never)")
    p.add_argument("--resume", default=None, help="resume from this checkpoint (or the latest one in this run dir)")
    p.add_argument("--progress-every", type=int, default=500, help="print progress every N iterations (0: quiet)")
    p.add_argument("--liveness", type=float, default=10.0,
                   help="seconds of silence before a worker is declared dead (must exceed the longest task, "
                        "including a worker's first-call numba compilation)")
    p.add_argument("--kill-worker-at", type=int, default=None,
                   help="fault-injection demo: SIGKILL one local worker at this iteration")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(args) -> int:
    from ..es.run import RunOptions, run_spirals
    from ..es.spirals import SpiralsTask, spirals_config

    if args.save_every and not args.out:
        raise UserError("--save-every needs --out DIR")
    if args.workers < 0 or args.remote_workers < 0:
        raise UserError("--workers/--remote-workers must be >= 0")
    es = spirals_config(population=args.population, sigma=args.sigma, alpha=args.alpha, seed=args.seed,
                        antithetic=not args.no_antithetic, shaping=args.shaping, noise=args.noise)
    task = SpiralsTask(es, model_seed=args.model_seed, data_seed=args.data_seed, reward=args.reward)
    workers = 0 if args.inprocess else args.workers
    if workers == 0 and args.remote_workers == 0 and not args.inprocess:
        raise UserError("--workers 0 needs --inprocess or --remote-workers N")
    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    log(f"es-spirals: {'in-process' if workers + args.remote_workers == 0 else f'{workers} local + {args.remote_workers} remote worker(s)'}"
        f", {es.to_dict()}, model_seed {args.model_seed}")
    opts = RunOptions(workers=workers, remote_workers=args.remote_workers, bind=args.bind,
                      max_iterations=args.max_iterations, save_every=args.save_every, out=args.out,
                      resume=args.resume, progress_every=args.progress_every, liveness=args.liveness,
                      key_dir=args.key_dir,
                      kill_worker_at=args.kill_worker_at, log=log)
    signal.signal(signal.SIGTERM, _terminate)  # SIGTERM unwinds like Ctrl-C: workers are shut down, sockets removed
    result = run_spirals(task, opts)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"iterations {result['iterations']}  accuracy {result['accuracy']:.4f}  CE {result['ce']:.4f}  "
              f"wall {result['wall_s']:.1f}s  {result['member_evals_per_s']:.0f} member-evals/s  "
              f"({result['ms_per_iteration']:.1f} ms/iteration)")
        print(f"sha256 {result['sha256']}")
    return 0
