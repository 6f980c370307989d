"""The machine's measured f32 peak, for the progress line's "N% of peak" (a step's estimated GFLOP/s over it).

The peak is one core's f32 BLAS rate on a 1024^3 sgemm (the shape `fucina bench llm`'s machine row times), best of
3 after a warm-up, times the cores this process may run on: the training kernels run single-threaded BLAS tiles
on every core (pipeline/threads.py), so that is the most they could reach. It costs ~0.2-0.4 s, so it is
measured once per machine and cached in $XDG_CACHE_HOME/fucina/peak.json (~/.cache/...), keyed by the CPU model,
the core count and numpy's version. A machine busy with other work measures a lower peak (and then shows a
higher share): delete the file to measure again, or set FUCINA_PEAK_GFLOPS to a number (your own measurement)
or to 0 (no share shown, nothing measured).
"""
from __future__ import annotations

import json
import os
import platform
import time

PEAK_ENV = "FUCINA_PEAK_GFLOPS"


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fucina", "peak.json")


def measure_core_gflops(n: int = 1024, repeat: int = 3) -> float:
    """One core's f32 BLAS GFLOP/s on an n^3 sgemm (best of `repeat`, after one warm-up product)."""
    import numpy as np
    from threadpoolctl import threadpool_limits
    a = np.ones((n, n), np.float32)
    best = float("inf")
    with threadpool_limits(1, user_api="blas"):
        a @ a
        for _ in range(repeat):
            t0 = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e9


def peak_gflops(measure=measure_core_gflops) -> float | None:
    """The machine's f32 peak in GFLOP/s: FUCINA_PEAK_GFLOPS if set (0: None, nothing measured), else the cached
    measurement for this CPU, else measured now (and cached; an unwritable cache is only not written)."""
    given = os.environ.get(PEAK_ENV, "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            from ..errors import UserError
            raise UserError(f"{PEAK_ENV}={given!r}: not a number (GFLOP/s; 0 turns the share off)") from None
        return value if value > 0 else None
    import numpy as np
    key = f"{cpu_model()}|{cores()} cores|numpy {np.__version__}"
    path = cache_path()
    try:
        with open(path) as fh:
            cached = json.load(fh)
        if isinstance(cached, dict) and isinstance(cached.get(key), (int, float)) and cached[key] > 0:
            return float(cached[key])
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    value = measure() * cores()
    cached[key] = round(value, 1)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(cached, fh, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
    return value


def share_text(gflop_per_s, peak) -> str:
    """'12% of peak' for the progress line ('' without a peak or an estimate)."""
    if not peak or gflop_per_s is None:
        return ""
    return f"{100.0 * gflop_per_s / peak:.0f}% of peak"
