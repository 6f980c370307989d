"""Scheduler role: binds the control ROUTER and the events PUB, runs the plan.

Exits 0 when the run is done (after telling every worker to shut down), so
under honcho (which stops all processes when the first exits) the scheduler is
the one that ends a Procfile run. Exit 1 on a failed task, 2 on bad input.
"""
import argparse
import json
import logging
import os
import sys
import uuid

from pipeline.threads import add_threads_flag
from pipeline.errors import FucinaError
from pipeline.jobs import get_job
from pipeline.jobs.spec import build, check_fields, load_toml
from pipeline.runtime import ckpt
from pipeline.runtime import security
from pipeline.runtime.es_scheduler import ESScheduler
from pipeline.runtime.scheduler import ROLE_WAIT_S, RunFailed, Scheduler
from pipeline.runtime.shm import exit_on_signals
from pipeline.runtime.transport import ipc_endpoints, tcp_endpoints
from pipeline.threads import pin_threads


def build_parser():
    p = argparse.ArgumentParser(prog="python -m workers.scheduler", description=__doc__)
    p.add_argument("--job", required=True,
                   help="built-in job name (spirals, lm, pretrain, sft, finetune, es-spirals, es-finetune)")
    p.add_argument("--config", help="TOML file of job fields")
    p.add_argument("--spec-json", help="job fields as a JSON object (what `fucina launch` passes)")
    p.add_argument("--run-dir", required=True, help="run directory (checkpoints, metrics.jsonl, sockets)")
    p.add_argument("--run-id", default=None, help="shared-memory name prefix for this run (default: random)")
    p.add_argument("--trainers", type=int, default=1,
                   help="trainers (es_members for an ES job) to wait for before starting")
    p.add_argument("--resume", default=None,
                   help="checkpoint dir or run dir to resume from; 'auto': the run dir's latest checkpoint if any")
    p.add_argument("--port", type=int, default=None, help="use tcp:// on this port (+1 for events) instead of ipc://")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind for tcp:// (loopback unless told otherwise)")
    add_threads_flag(p, 1, "the scheduler (the final evaluation; an ES run's own replica)")
    p.add_argument("--liveness", type=float, default=5.0, help="seconds of silence before a worker is declared lost")
    p.add_argument("--key", default=None, metavar="FILE",
                   help="tcp:// only: the run's scheduler.key (default: make fresh keys, RUN_DIR/scheduler.key "
                        "and RUN_DIR/worker.key, the file workers need)")
    p.add_argument("--role-wait", type=float, default=ROLE_WAIT_S,
                   help="seconds the run may lack a role (loader, optimizer, checkpointer, any trainer) "
                        "before it fails")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="WARNING")
    exit_on_signals()
    pin_threads(args.threads)
    try:
        job_cls = get_job(args.job)
        values = load_toml(args.config, job_cls.Spec) if args.config else {}
        if args.spec_json:
            values.update(check_fields(json.loads(args.spec_json), job_cls.Spec, "--spec-json"))
        job = job_cls(build(job_cls.Spec, values))
        os.makedirs(args.run_dir, exist_ok=True)
        if args.resume == "auto":  # Procfile runs: continue the run dir's run if it has one
            args.resume = ckpt.latest_checkpoint(args.run_dir)
        if not args.resume and ckpt.latest_checkpoint(args.run_dir):
            raise FucinaError(f"{args.run_dir} already holds checkpoints: pass --resume {args.run_dir} "
                              f"to continue that run, or choose another --run-dir")
        resume = ckpt.resolve(args.resume) if args.resume else None
        endpoints = tcp_endpoints(args.port, args.host) if args.port else ipc_endpoints(args.run_dir)
        key, described = None, {}
        if args.port:
            key_path = args.key or security.create_run_keys(args.run_dir)[0]
            key = security.load_server_key(key_path)
            described["worker_key"] = os.path.join(os.path.abspath(os.path.dirname(key_path)), security.CLIENT_FILE)
        run_id = args.run_id or uuid.uuid4().hex[:10]
        tmp = os.path.join(args.run_dir, "run.json.tmp")
        with open(tmp, "w") as fh:  # renamed into place: a reader never sees half a run.json
            json.dump({"run_id": run_id, "job": job.name, "endpoints": endpoints.to_wire(),
                       "scheduler_pid": os.getpid(), "trainers": args.trainers, **described}, fh, indent=1)
        os.replace(tmp, os.path.join(args.run_dir, "run.json"))
        scheduler_class = ESScheduler if getattr(job, "kind", "") == "es" else Scheduler
        sched = scheduler_class(job, args.run_dir, run_id, endpoints, trainers=args.trainers, resume=resume,
                          log=lambda m: print(m, file=sys.stderr, flush=True), liveness_s=args.liveness, key=key,
                          role_wait_s=args.role_wait)
        sched.serve()  # writes summary.json
    except RunFailed as e:
        print(f"scheduler: {e}", file=sys.stderr)
        return 1
    except FucinaError as e:
        print(f"scheduler: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit):
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
