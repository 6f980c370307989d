"""`fucina bench es`: ES noise regeneration throughput and ES-spirals iteration time.

Cases (ms; ratio = baseline_ms / ms, above 1 means the case is faster):
  noise/gaussian        fill N float32 gaussians with pipeline.kernels.es_noise (the ES
                        mapping, all numba threads) vs numpy's default generator
                        (Ziggurat, one thread) and the exact scalar Box-Muller of
                        pipeline.kernels.rng; notes give values/s
  es-spirals/workers-1  median ms per ES iteration (population 128) with one
                        es-member worker process; baseline: the in-process run
  es-spirals/workers-2  the same with two workers; baseline: workers-1 (so the
                        ratio is the 1 -> 2 worker speed-up). Notes add the CPU
                        time of the busiest worker per iteration, which does not
                        depend on what else runs on the machine
  es-spirals/update     one replica's update with nothing cached (regenerating all
                        64 antithetic draws), the upper bound of what every
                        replica repeats (with the noise cache a worker
                        regenerates only the draws it did not score); baseline:
                        scoring all 128 members in one process (the part
                        workers split). Their ratio is what decided replicated
                        updates over publishing parameters (docs/es.md)
  es-finetune/nll-batched-wN
                        ms per es-finetune iteration (NLL reward: population x
                        --finetune-batch samples, then the update) with
                        --member-batch members per pass, on N es_member processes
                        of the runtime (0 = in-process; a runtime row is the
                        median wall time of an iteration after the first,
                        scheduler round trips included); baselines: the same iteration one
                        member at a time in place, and the plain batched forward
                        of the same rows (every member's samples as ONE batch
                        through the frozen weights: one GEMM per weight over all
                        rows, no adapters, the same fused CE). Notes give
                        member-evals/s and scored tokens/s, and the fraction of
                        the plain forward's throughput (the issue's target >= 0.8)
  es-finetune/generate-batched-wN
                        the same for a generation reward (rule:length, greedy up
                        to --finetune-new-tokens through the KV cache), members
                        decoding in lock-step; baselines: one member at a time,
                        and the plain lock-step decode of the same rows (all
                        members x prompts in one infer_rows pass per token, no
                        adapters)
  es-finetune/{nll,generate}-lowrank-wN
                        the same iteration with --search lowrank (EGGROLL, rank
                        1, --dequantize, sigma 1e-3): every projection matrix
                        perturbed by a rank-1 product, x.W shared by all
                        members; baselines: the plain batched forward / decode
                        of the same rows through the same (dequantized f32)
                        weights
Use --cases finetune --finetune-model <the Qwen3-0.6B-shaped Q4_K file of
tools/make_qwen3_06b_shaped.py> for the issue's figures; the default model is
the tiny Q8_0 test fixture (a smoke run, not a measurement).
"""
from __future__ import annotations

import argparse

import numpy as np

from ..bench import median_ms

NAME = "es"
HELP = "ES noise regeneration (values/s vs numpy) and es-spirals ms/iteration for in-process, 1 and 2 workers"


FIXTURE = "tests/fixtures/qwen3-mini-q8_0.gguf"


def _model_path(model):
    """--finetune-model, else the checkout's tiny test fixture (an installed package has no tests/)."""
    from pathlib import Path
    import pipeline
    from ..errors import UserError
    if model:
        return model
    path = Path(pipeline.__file__).resolve().parents[1] / FIXTURE
    if not path.is_file():
        raise UserError(f"bench es: --finetune-model GGUF is needed here (the default, {FIXTURE}, exists only "
                        "in a checkout of the repository)")
    return str(path)


def add_arguments(p):
    p.add_argument("--cases", choices=("all", "noise-spirals", "finetune"), default="all",
                   help="which rows: all, the noise + es-spirals rows, or the es-finetune rows")
    p.add_argument("--finetune-model", default=None, metavar="GGUF",
                   help=f"es-finetune model (default: {FIXTURE} of a checkout)")
    p.add_argument("--finetune-population", type=int, default=16, help="es-finetune population (default 16)")
    p.add_argument("--finetune-batch", type=int, default=2, help="samples every member scores (default 2)")
    p.add_argument("--member-batch", type=int, default=8, help="members per batched pass (default 8)")
    p.add_argument("--finetune-workers", default="0,1,2",
                   help="comma-separated member-process counts for the batched rows (default 0,1,2)")
    p.add_argument("--finetune-searches", default="ab,lowrank",
                   help="comma-separated ES searches for the es-finetune rows: ab (LoRA), lowrank (EGGROLL)")
    p.add_argument("--finetune-one-at-a-time", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the iteration one member at a time (the slow baseline; default on)")
    p.add_argument("--finetune-new-tokens", type=int, default=16, help="greedy tokens per generation reward")
    p.add_argument("--values", type=int, default=1 << 22, help="gaussians per noise fill (default 4M)")
    p.add_argument("--iterations", type=int, default=40, help="ES iterations timed per es-spirals case (default 40)")
    p.add_argument("--population", type=int, default=128, help="ES population for es-spirals (default 128)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions of the noise fill (median)")


def _spirals_ms(workers, iterations, population):
    """Median ms per iteration of an es-spirals run (0 workers: in-process; timed once the members are in)."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="fucina-bench-es-") as run_dir:
        spec = {"iterations": iterations, "population": population}
        if workers == 0:
            from ..es.run import run_es_inprocess
            from ..jobs import get_job
            from ..jobs.spec import build
            from ..threads import pin_threads
            pin_threads(1)
            job_cls = get_job("es-spirals")
            result = run_es_inprocess(job_cls(build(job_cls.Spec, spec)), run_dir, log=lambda m: None)
        else:
            from ..runtime.launch import Supervisor
            result = Supervisor("es-spirals", spec, run_dir, trainers=workers, quiet=True).run()
    return result["median_ms_per_iteration"]


LOWRANK = dict(search="lowrank", dequantize=True, noise_rank=1, sigma=1e-3, alpha=5e-4)  # the EGGROLL rows' run


def _finetune_build(model, args, member_batch=0, reward="nll", search="ab"):
    """(the ES run, tokens per member, model file name) of one es-finetune bench case."""
    from pathlib import Path
    from ..es import ESConfig
    from ..finetune.build import open_text, scorer_of
    from ..finetune.es import ESFinetune
    from ..finetune.model import LoraModel
    from ..llm import data as sft
    model = _model_path(model)
    text = open_text(model)
    samples = sft.encode_all(text.encoder, text.template, sft.PIRATE_PAIRS)
    kwargs = dict(targets=("q", "v"), rank=8, seed=42)
    trainer = LoraModel.from_gguf(model, **kwargs)
    scorer = scorer_of(reward, samples, sft.PIRATE_PAIRS, text, None, args.finetune_new_tokens, 10.0, model)
    low = search == "lowrank"
    cfg = ESConfig(sigma=LOWRANK["sigma"] if low else 0.05, alpha=LOWRANK["alpha"] if low else 0.05,
                   population=args.finetune_population, antithetic=True, seed=1, restore_mode="snapshot")
    run = ESFinetune(trainer, samples, sft.Loader(len(samples)), cfg, batch=args.finetune_batch, scorer=scorer,
                     member_batch=member_batch, search=search, dequantize=low, noise_rank=LOWRANK["noise_rank"])
    tokens = sum(len(samples[i % len(samples)].inputs) for i in range(args.finetune_batch))
    return run, tokens, Path(model).name


def _interleaved(fns, repeat):
    """[(median wall ms, median process-CPU ms)] per fn, the fns called in turn `repeat` times after one warm-up
    call each: a change of the machine's load hits every fn alike, so their ratio holds on a shared machine."""
    import time
    for fn in fns:
        fn()
    wall, cpu = [[] for _ in fns], [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[i].append((time.perf_counter() - t0) * 1e3)
            cpu[i].append((time.process_time() - c0) * 1e3)
    return [(float(np.median(w)), float(np.median(c))) for w, c in zip(wall, cpu)]


def _finetune_runtime_ms(model, args, member_batch, workers, reward, search="ab"):
    """Median ms per iteration of the es-finetune job on the runtime with `workers` es_members.

    The same flags as _finetune_run's in-process iteration; the first
    iteration (state transfers, first calls) is not timed."""
    import tempfile
    from ..finetune.spec import ESFinetuneSpec
    from ..jobs.spec import build, to_dict
    from ..runtime.launch import Supervisor
    from ..runtime.metrics import read_metrics
    spec = to_dict(build(ESFinetuneSpec, dict(
        model=str(_model_path(model)), population=args.finetune_population, batch=args.finetune_batch, reward=reward,
        member_batch=member_batch, es_seed=1, max_new_tokens=args.finetune_new_tokens, iterations=args.repeat + 1,
        **(LOWRANK if search == "lowrank" else {}))))
    with tempfile.TemporaryDirectory(prefix="fucina-bench-es-") as run_dir:
        Supervisor("es-finetune", spec, run_dir, trainers=workers, liveness=60.0, quiet=True).run()
        step_ms = [r["step_ms"] for r in read_metrics(run_dir) if r.get("kind") == "es_metrics"][1:]
    return float(np.median(step_ms))


def _plain_forward(run, reward, args):
    """The plain batched forward of an iteration's rows (the population x batch, no adapters)."""
    from ..autograd.tensor import Tensor, no_grad
    from ..llm.generate import greedy_rows
    from ..llm.quants import matmul_t_many
    trainer, pop = run.trainer, args.finetune_population
    idx = [i % len(run.scorer) for i in range(args.finetune_batch)]
    if reward != "nll":
        prompts = [run.scorer.items[i].prompt_ids for i in idx] * pop
        return lambda: greedy_rows(trainer.model, prompts, args.finetune_new_tokens, run.scorer.stop_ids)

    def project(i, targets, x):  # one product per weight over every member's rows
        ws = [trainer.frozen(i, t) for t in targets]
        ys = matmul_t_many([w.weight for w in ws], x.data.reshape(-1, ws[0].shape[1]))
        for w, y in zip(ws, ys):
            if w.bias is not None:
                y += w.bias
        return [Tensor(y.reshape(*x.shape[:-1], -1)) for y in ys]

    def forward():
        with no_grad():
            for s in (run.samples[i] for i in idx):
                h = trainer.embedded(s.inputs, rows=pop)
                for i in range(trainer.config.layers):
                    h = trainer.block(i, h, np.arange(len(s.inputs)), project)
                h = trainer.final_norm(Tensor(h.data.reshape(-1, trainer.config.hidden)))
                trainer.head_loss(h, np.tile(np.asarray(s.labels), pop), "sum")

    return forward


def finetune_rows(args):
    """The es-finetune rows: NLL and a generation reward, batched (interleaved with the plain batched forward of the
    same rows, wall and CPU) vs one member at a time, in-process and on N es_members, per search."""
    pop = args.finetune_population
    rows = []
    per_s = lambda ms: pop / ms * 1e3
    for search in args.finetune_searches.split(","):
        for reward, label in (("nll", "nll"), ("rule:length=1,400", "generate")):
            one_ms = None
            if args.finetune_one_at_a_time:
                one_ms = median_ms(_finetune_build(args.finetune_model, args, 0, reward, search)[0].iteration_step,
                                   repeat=args.repeat)
            run, tokens, name = _finetune_build(args.finetune_model, args, args.member_batch, reward, search)
            (es_ms, es_cpu), (plain_ms, plain_cpu) = _interleaved(
                [run.iteration_step, _plain_forward(run, reward, args)], args.repeat)
            if reward != "nll":
                tokens = args.finetune_batch * args.finetune_new_tokens  # at most: a row may stop early
            kind = "batched" if search == "ab" else search
            for workers in (int(w) for w in args.finetune_workers.split(",")):
                if workers:
                    ms = _finetune_runtime_ms(args.finetune_model, args, args.member_batch, workers, reward, search)
                    how = "wall, the runtime's median iteration against the plain forward's interleaved median"
                else:
                    ms = es_ms
                    how = (f"interleaved with it; in CPU time {plain_cpu / es_cpu:.2f} ({es_cpu:.0f} vs "
                           f"{plain_cpu:.0f} ms)")
                one = "" if one_ms is None else (f" vs one at a time {per_s(one_ms):.2f} "
                                                 f"({per_s(one_ms) * tokens:.0f} tokens/s)")
                rows.append({"case": f"es-finetune/{label}-{kind}-w{workers}", "ms": ms,
                             "baselines": {**({} if one_ms is None else {"one_at_a_time": one_ms}),
                                           "plain_batched_forward": plain_ms},
                             "notes": f"{name}, {reward}, search {search}, population {pop} x {args.finetune_batch} "
                                      f"samples"
                                      f"{'' if reward == 'nll' else f', <= {args.finetune_new_tokens} new tokens'}, "
                                      f"member batch {args.member_batch}: {per_s(ms):.2f} member-evals/s "
                                      f"({per_s(ms) * tokens:.0f} tokens/s){one}; {plain_ms / ms:.2f} of the plain "
                                      f"batched forward's throughput ({plain_ms:.0f} ms; {how}; the iteration also "
                                      f"draws the noise and updates)"})
    return rows


def run(args):
    if args.cases == "finetune":
        return finetune_rows(args)
    rows = _noise_spirals_rows(args)
    return rows + finetune_rows(args) if args.cases == "all" else rows


def _noise_spirals_rows(args):
    from pipeline.kernels import es_noise, rng
    out = np.empty(args.values, dtype=np.float32)
    ms = median_ms(lambda: es_noise.gaussian_fill_fast(7, out), repeat=args.repeat)
    generator = np.random.default_rng(7)
    numpy_ms = median_ms(lambda: generator.standard_normal(args.values, dtype=np.float32, out=out), repeat=args.repeat)
    exact_ms = median_ms(lambda: rng.gaussian_fill(7, out), repeat=args.repeat)
    rows = [{"case": "noise/gaussian", "ms": ms, "baselines": {"numpy_default_rng": numpy_ms, "rng_exact": exact_ms},
             "notes": f"{args.values / ms / 1e3:.3g} M values/s (numpy {args.values / numpy_ms / 1e3:.3g} M/s)"}]
    from threadpoolctl import threadpool_limits
    from ..es.spirals import SpiralsTask, spirals_config
    task = SpiralsTask(spirals_config(population=args.population))
    rewards = np.random.default_rng(0).standard_normal(args.population)
    with threadpool_limits(1):
        score_ms = median_ms(lambda: task.rewards(range(args.population)), repeat=args.repeat)
        update_ms = median_ms(lambda: task.trainer.update(rewards), repeat=args.repeat)
    inproc_ms = _spirals_ms(0, args.iterations, args.population)
    one_ms = _spirals_ms(1, args.iterations, args.population)
    two_ms = _spirals_ms(2, args.iterations, args.population)
    per_s = lambda m: args.population / m * 1e3  # noqa: E731
    rows.append({"case": "es-spirals/workers-1", "ms": one_ms, "baselines": {"inprocess": inproc_ms},
                 "notes": f"{per_s(one_ms):.0f} member-evals/s, population {args.population} (median iteration "
                          f"on the runtime, 1 es_member; the scheduler's replica updates in parallel)"})
    rows.append({"case": "es-spirals/workers-2", "ms": two_ms, "baselines": {"workers_1": one_ms},
                 "notes": f"{per_s(two_ms):.0f} member-evals/s; wall speed-up 1->2 members x{one_ms / two_ms:.2f}"})
    rows.append({"case": "es-spirals/update", "ms": update_ms, "baselines": {"score_all_members": score_ms},
                 "notes": f"update = {100 * update_ms / (update_ms + score_ms):.0f}% of a one-process iteration"})
    return rows
