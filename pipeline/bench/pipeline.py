"""`fucina bench pipeline`: the lm job's time per optimizer step, in-process vs 1 vs 2 trainers.

Each case is a real `fucina launch lm` subprocess (default model and batch)
run for a few steps; `ms` is the median of the per-step wall times the run
records in metrics.jsonl, after dropping warm-up steps. Cases:

  lm/inprocess            every task inline, 1 compute thread
  lm/trainers-1           the pipeline with one trainer (1 thread each)   baseline: inprocess
  lm/trainers-2           two trainers, 1 thread each                     baseline: trainers-1
  lm/trainers-1x2threads  one trainer with 2 BLAS/numba threads           baseline: trainers-1
  lm/messaging            per-step time not spent computing in trainers/optimizer (1 trainer)

Targets (issue 6): trainers-2 >= 1.6x trainers-1 on 2 cores; trainers-1 >= 0.9x inprocess.

With --remote it measures instead what a remote trainer (docs/cluster.md) adds
per optimizer step, on loopback tcp with CURVE, for the lm shape and the
pretrain presets: the scheduler's ROUTER ships parameters once and M batches
as frames (remote.py, the same calls the run makes), a DEALER on a thread
copies them in as the remote trainer does and answers each with a gradient
of the parameters' size, which the ROUTER copies into a slot. No compute: the
row is the wire cost alone; `bytes` over a link's bandwidth is what a real
network adds (docs/cluster.md has the arithmetic). Then the ES rows: real
`fucina es-spirals --workers 2` runs with the members on ipc:// and on
loopback tcp:// + CURVE (`ms` is the median iteration); per iteration only
member ids and float64 rewards cross, so the two should be close.
Trade-off: whole runs, not micro-benchmarks - startup is excluded, but
everything a user pays per step (messages, shared memory, scheduling) is in.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

NAME = "pipeline"
HELP = ("lm job step time: --inprocess vs --trainers 1 vs --trainers 2 vs 1 trainer x 2 threads; "
        "--remote: bytes and ms per step of shipping tensors to a remote trainer, ES iteration over tcp vs ipc")


def add_arguments(parser):
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per case")
    parser.add_argument("--warmup", type=int, default=4, help="leading steps left out of the median")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed in notes)")
    parser.add_argument("--cases", default="inprocess,trainers-1,trainers-2,trainers-1x2threads",
                        help="comma-separated subset of the cases to run")
    parser.add_argument("--remote", action="store_true",
                        help="instead: per-step bytes and ms of shipping parameters, batches and gradients to a "
                             "remote trainer over loopback tcp, for the lm shape and --presets; and es-spirals "
                             "iteration time with members over tcp vs ipc")
    parser.add_argument("--presets", default="tiny,d4,d6",
                        help="with --remote: the pretrain presets to measure (tiny, d4, d6, d8)")
    parser.add_argument("--finetune-model", metavar="GGUF", default=None,
                        help="with --remote: also the LoRA fine-tune shape of this GGUF (default LoRA settings of "
                             "`fucina finetune`: rank 8 on q,k,v,o,gate,up,down; the frozen model never travels)")


def _config():
    from ..jobs import get_job
    from ..jobs.spec import build
    job = get_job("lm")
    s = build(job.Spec, {})
    from ..jobs.lm_export import VOCAB_SIZE
    return {"vocab": VOCAB_SIZE, "hidden": s.hidden, "layers": s.layers, "heads": s.heads, "kv_heads": s.kv_heads,
            "head_dim": s.head_dim, "ffn": s.ffn, "seq": s.seq, "batch": s.batch, "micro_batches": s.micro_batches}


def _run(root, name, steps, *flags):
    run_dir = os.path.join(root, name)
    cmd = [sys.executable, "-m", "pipeline.cli", "launch", "lm", "--run-dir", run_dir, "--json", "--steps", str(steps),
           "--eval-every", "0", "--checkpoint-every", "0", "--sample-tokens", "0", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        from ..errors import FucinaError
        raise FucinaError(f"bench pipeline: case {name} failed:\n{out.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    return [r for r in records if r.get("kind") == "metrics"], run_dir


def _shapes_lm():
    """(parameter arrays, one micro-batch's arrays, micro-batches) of the default lm job."""
    from ..jobs import get_job
    from ..jobs.spec import build
    job_cls = get_job("lm")
    job = job_cls(build(job_cls.Spec, {}))
    return ([np.zeros(shape, dtype) for _, shape, dtype in job.param_layout()],
            [np.zeros(shape, dtype) for _, shape, dtype in job.batch_layout()], job.micro_batches)


def _shapes_pretrain(preset):
    """The same for a pretrain preset, with the default BPE vocabulary (no tokenizer is trained)."""
    from ..jobs.pretrain import PretrainSpec, model_config, window_lengths
    from ..jobs.spec import build
    from ..models.qwen3 import Qwen3
    s = build(PretrainSpec, {"preset": preset})
    _, _, _, seq, batch_tokens = s.shape()
    config = model_config(s, s.vocab_size)
    params = [np.zeros_like(t.data) for _, t in Qwen3.init_random(config, seed=0).named_parameters()]
    m = batch_tokens // s.micro_batches
    shortest = window_lengths(seq, s.seq_warmup)[0]
    return params, [np.zeros(m + m // shortest, np.int64), np.zeros(1, np.int64)], s.micro_batches


def _shapes_finetune(model):
    """The same for the finetune job on `model`: the adapters travel, the frozen GGUF stays on each host."""
    from ..jobs import get_job
    from ..jobs.spec import build
    job_cls = get_job("finetune")
    job = job_cls(build(job_cls.Spec, {"model": model}))
    return ([np.zeros(shape, dtype) for _, shape, dtype in job.param_layout()],
            [np.zeros(shape, dtype) for _, shape, dtype in job.batch_layout()], job.micro_batches)


def _ship(params, batch, micro_batches, steps):
    """Median ms of one step's traffic to a remote trainer over loopback tcp + CURVE; -> (ms, bytes by kind)."""
    import threading
    import time

    from ..runtime import remote, security
    from ..runtime.transport import DealerSocket, RouterSocket, ServerContext
    keydir = tempfile.mkdtemp(prefix="fucina-bench-keys-")
    server_path, client_path = security.create_run_keys(keydir)
    server = ServerContext(security.load_server_key(server_path))
    router = RouterSocket("tcp://127.0.0.1:0", server.ctx, server.key)
    dealer = DealerSocket(router.endpoint, key=security.load_client_key(client_path))
    held = {"params": [np.empty_like(a) for a in params], "batch": [np.empty_like(a) for a in batch]}
    gradient = [np.ones_like(a) for a in params]
    slot = [np.empty_like(a) for a in params]
    stop = threading.Event()

    def trainer():  # what RemoteTrainer does with frames, minus the compute
        while not stop.is_set():
            msg = dealer.recv(50)
            if not msg:
                continue
            remote.from_frames(dealer.buffers, held["params" if msg["kind"] == "params" else "batch"])
            if msg["kind"] == "grad":
                dealer.send("grad_done", msg["step"], worker="bench", gen=0, k=msg["k"], loss=0.0, rows=0, ms=0.0,
                            buffers=remote.to_frames(gradient)).wait()
    thread = threading.Thread(target=trainer, daemon=True)
    dealer.send("hello", role="trainer", worker="bench", pid=0, token="t", remote=True)
    identity, _ = router.recv(10000)
    thread.start()
    times = []
    try:
        for step in range(steps + 1):  # the first step connects and warms up: left out
            t0 = time.perf_counter()
            router.send(identity, "params", step, gen=0, tensors=[], buffers=remote.to_frames(params))
            for k in range(micro_batches):
                router.send(identity, "grad", step, gen=0, k=k, slot=k, batch=_NO_DESC, params=_NO_DESC,
                            grads=_NO_DESC, buffers=remote.to_frames(batch))
                got = None
                while got is None:
                    got = router.recv(10000)
                remote.from_frames(router.buffers, slot)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        stop.set()
        thread.join()
        dealer.close()
        router.close()
        server.close()
        import shutil
        shutil.rmtree(keydir, ignore_errors=True)
    nbytes = {"params": sum(a.nbytes for a in params), "batches": micro_batches * sum(a.nbytes for a in batch),
              "grads": micro_batches * sum(a.nbytes for a in params)}
    return statistics.median(times[1:]), nbytes


_NO_DESC = {"segment": "", "tensors": [], "owner": ""}


def _remote_rows(args):
    cases = {"lm": _shapes_lm}
    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        cases[f"pretrain-{preset}"] = lambda preset=preset: _shapes_pretrain(preset)
    if args.finetune_model:
        cases["finetune"] = lambda: _shapes_finetune(args.finetune_model)
    rows = []
    for name, shapes in cases.items():
        params, batch, micro_batches = shapes()
        ms, nbytes = _ship(params, batch, micro_batches, args.steps)
        total = sum(nbytes.values())
        gbit = total * 8 / 1e9 * 1e3  # ms per step on a 1 Gbit/s link, bandwidth alone
        rows.append({"case": f"remote/{name}", "ms": round(ms, 2), "baselines": {},
                     "config": {"micro_batches": micro_batches, **nbytes, "bytes_per_step": total},
                     "notes": f"{total / 1e6:.2f} MB/step (params {nbytes['params'] / 1e6:.2f} once, "
                              f"batches {nbytes['batches'] / 1e6:.3f}, grads {nbytes['grads'] / 1e6:.2f}); "
                              f"{total / 1e6 / (ms / 1e3):.0f} MB/s on loopback; >= {gbit:.0f} ms/step at 1 Gbit/s; "
                              f"load avg {os.getloadavg()[0]:.1f}"})
    return rows


def _es_rows(iterations, population=128, members=2):
    """Median ms per es-spirals iteration with `members` es_members on ipc:// vs loopback tcp:// + CURVE."""
    import shutil

    from ..runtime.transport import free_port_pair
    from ..errors import FucinaError
    root = tempfile.mkdtemp(prefix="fucina-bench-es-")
    cases = {"ipc": [], "tcp": ["--bind", f"tcp://127.0.0.1:{free_port_pair('127.0.0.1')}"]}
    ms, rows = {}, []
    try:
        for name, flags in cases.items():
            cmd = [sys.executable, "-m", "pipeline.cli", "es-spirals", "--workers", str(members), "--population",
                   str(population), "--max-iterations", str(iterations), "--progress-every", "0",
                   "--out", os.path.join(root, name), "--json", *flags]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise FucinaError(f"bench pipeline: ES case {name} failed:\n{out.stderr[-2000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            ms[name] = result["median_ms_per_iteration"]
            rows.append({"case": f"remote/es-members-{name}", "ms": round(ms[name], 2),
                         "baselines": {k: v for k, v in ms.items() if k != name},
                         "config": {"population": population, "members": members, "iterations": iterations},
                         "notes": f"median of {result['iterations_this_run']} iterations; per iteration member ids "
                                  f"out and {population} float64 rewards back, plus the catch-up rewards; "
                                  f"load avg {os.getloadavg()[0]:.1f}"})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def run(args):
    if args.remote:
        return _remote_rows(args) + _es_rows(max(args.steps, 10))
    config = _config()
    root = tempfile.mkdtemp(prefix="fucina-bench-pipeline-")
    every = {"inprocess": ["--inprocess", "--threads", "1"], "trainers-1": ["--trainers", "1", "--threads", "1"],
             "trainers-2": ["--trainers", "2", "--threads", "1"],
             "trainers-1x2threads": ["--trainers", "1", "--threads", "2"]}
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in every]
    if unknown:
        from ..errors import UserError
        raise UserError(f"bench pipeline: unknown case(s) {unknown}; cases: {', '.join(every)}")
    cases = {name: every[name] for name in wanted}
    steps, ms, dirs, load = {}, {}, {}, {}
    for name, flags in cases.items():
        records, dirs[name] = _run(root, name, args.steps, *flags)
        load[name] = os.getloadavg()[0]  # other jobs on the machine skew the ratios: say so
        steps[name] = records[args.warmup:] or records
        ms[name] = statistics.median(r["step_ms"] for r in steps[name])
    against = {"trainers-1": "inprocess", "trainers-2": "trainers-1", "trainers-1x2threads": "trainers-1"}
    baseline = {name: ({against[name]: ms[against[name]]} if against.get(name) in ms else {}) for name in cases}
    tokens = config["batch"] * config["seq"]
    rows = []
    for name in cases:
        rows.append({"case": f"lm/{name}", "ms": round(ms[name], 2), "baselines": baseline[name], "config": config,
                     "notes": f"{tokens * 1e3 / ms[name]:.0f} tokens/s; load avg {load[name]:.1f}"
                              + (f"; {dirs[name]}" if args.keep else "")})
    if "trainers-1" in steps:
        one = steps["trainers-1"]
        overhead = statistics.median(r["step_ms"] - r["roles"]["trainer"] - r["roles"]["optimizer"] for r in one)
        rows.append({"case": "lm/messaging", "ms": round(overhead, 2), "baselines": {}, "config": config,
                     "notes": "median per-step wall time minus trainer and optimizer compute (1 trainer)"})
    if not args.keep:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return rows
