"""`fucina bench es`: ES noise regeneration throughput and ES-spirals iteration time.

Cases (ms; ratio = baseline_ms / ms, above 1 means the case is faster):
  noise/gaussian        fill N float32 gaussians with kernels.es_noise (the ES
                        mapping, all numba threads) vs numpy's default generator
                        (Ziggurat, one thread) and the exact scalar Box-Muller of
                        kernels.rng; notes give values/s
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
"""
from __future__ import annotations

import numpy as np

from ..bench import median_ms

NAME = "es"
HELP = "ES noise regeneration (values/s vs numpy) and es-spirals ms/iteration for in-process, 1 and 2 workers"


def add_arguments(p):
    p.add_argument("--values", type=int, default=1 << 22, help="gaussians per noise fill (default 4M)")
    p.add_argument("--iterations", type=int, default=40, help="ES iterations timed per es-spirals case (default 40)")
    p.add_argument("--population", type=int, default=128, help="ES population for es-spirals (default 128)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions of the noise fill (median)")


def _spirals_ms(workers, iterations, population):
    from ..es.run import RunOptions, run_spirals
    from ..es.spirals import SpiralsTask, spirals_config
    task = SpiralsTask(spirals_config(population=population))
    result = run_spirals(task, RunOptions(workers=workers, max_iterations=iterations))
    return result["median_ms_per_iteration"], result["median_cpu_ms_per_iteration"]


def run(args):
    from kernels import es_noise, rng
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
    inproc_ms, inproc_cpu = _spirals_ms(0, args.iterations, args.population)
    one_ms, one_cpu = _spirals_ms(1, args.iterations, args.population)
    two_ms, two_cpu = _spirals_ms(2, args.iterations, args.population)
    per_s = lambda m: args.population / m * 1e3  # noqa: E731
    rows.append({"case": "es-spirals/workers-1", "ms": one_ms, "baselines": {"inprocess": inproc_ms},
                 "notes": f"{per_s(one_ms):.0f} member-evals/s, population {args.population}; CPU ms/iteration "
                          f"of the busiest scorer: in-process {inproc_cpu:.1f}, worker {one_cpu:.1f}"})
    rows.append({"case": "es-spirals/workers-2", "ms": two_ms, "baselines": {"workers_1": one_ms},
                 "notes": f"{per_s(two_ms):.0f} member-evals/s; wall speed-up 1->2 workers x{one_ms / two_ms:.2f}; "
                          f"busiest worker CPU {two_cpu:.1f} ms/iteration, CPU-time speed-up "
                          f"x{one_cpu / two_cpu:.2f} (what idle cores would give)"})
    rows.append({"case": "es-spirals/update", "ms": update_ms, "baselines": {"score_all_members": score_ms},
                 "notes": f"update = {100 * update_ms / (update_ms + score_ms):.0f}% of a one-process iteration"})
    return rows
