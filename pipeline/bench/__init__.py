"""Benchmarks: `fucina bench <name>`, one module per bench in this package.

A bench module defines NAME, HELP, add_arguments(parser) and
run(args) -> list[dict] of result rows: {"case", "ms", "gbps"?, "baselines":
{name: ms}, "notes"?, ...}. The shared driver prints a table of ms and ratios
(ratio = baseline_ms / ms; above 1 means Fucina is faster) or, with --json, one
JSON document {"bench", "machine", "results": rows} (see `report`). Benchmarks are commands, never tests.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time

from ..runtime.peak import cpu_model


def median_ms(fn, repeat=5, warmup=1):
    """Median wall time of fn() in milliseconds over `repeat` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timed(fn, repeat=5, warmup=1):
    """(median wall ms, median process-CPU ms) of fn() over `repeat` runs after `warmup`.
    CPU time (all threads of this process) is the figure to trust on a shared machine."""
    for _ in range(warmup):
        fn()
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append((time.perf_counter() - w) * 1e3)
        cpus.append((time.process_time() - c) * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def machine(threads=None):
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads if threads is not None else int(os.environ.get("NUMBA_NUM_THREADS", os.cpu_count() or 1)),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import numpy
        import numba
        info["numpy"] = numpy.__version__
        info["numba"] = numba.__version__
        from pipeline.kernels.blas import backend
        info["blas"] = backend()  # the library under the tiled GEMMs (pipeline/kernels/blas.py)
    except ImportError:
        pass
    try:
        import torch  # noqa: F401
        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def report(bench, rows, as_json=False, threads=None, out=None):
    """Print rows as a table or as the shared JSON shape; returns the JSON dict."""
    import sys
    out = out or sys.stdout
    doc = {"bench": bench, "machine": machine(threads), "results": rows}
    if as_json:
        print(json.dumps(doc), file=out)
        return doc
    blas = f", BLAS {doc['machine']['blas']}" if doc["machine"].get("blas") else ""
    print(f"# fucina bench {bench} — {doc['machine']['cpu']}, {doc['machine']['threads']} thread(s){blas}", file=out)
    for r in rows:
        line = f"{r['case']:<36} {r['ms']:>10.3f} ms"
        if r.get("gbps") is not None:
            line += f" {r['gbps']:>8.2f} GB/s"
        for name, ms in (r.get("baselines") or {}).items():
            if ms:
                line += f"   {name} {ms:.3f} ms (x{ms / r['ms']:.2f})"
        if r.get("notes"):
            line += f"   [{r['notes']}]"
        print(line, file=out)
    print("ratio = baseline_ms / ms (above 1: Fucina is faster)", file=out)
    return doc
