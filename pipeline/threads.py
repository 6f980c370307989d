"""Pin BLAS / OpenMP / numba thread counts for this process.

Each worker process calls `pin_threads(n)` first thing, so N workers on an
N-core machine do not oversubscribe the cores. The environment variables only
take effect before numpy/numba load their thread pools, so `pin_threads` both
sets them (for children) and limits the already-loaded pools.

`n` is the number of compute threads: numba's and the kernel pool's
(pipeline/kernels/workpool.py), which split work on grids fixed by the shapes, so the
bits never depend on n. BLAS is always held at ONE thread: multi-threaded
OpenBLAS sums in a thread-count-dependent order (on AMD EPYC a 384x512 float32
product differs in the last bits between 1 and 2 threads), and the big
products run as single-threaded BLAS tiles on our own threads instead.
n = 0 (or None) leaves the pools as they are: what `--threads 0` means for
every command (the flag is pipeline/commands/_args.py add_threads_flag).
"""
from __future__ import annotations

import contextlib
import os

_ENV = ("OMP_NUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS")
_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def pin_env(n: int, env=None):
    """Return (or update) an environment dict with every compute-thread knob set to n (BLAS's to 1);
    n = 0 leaves it as it is."""
    env = os.environ if env is None else env
    if not _pinned(n):
        return env
    for k in _ENV:
        env[k] = str(int(n))
    for k in _BLAS_ENV:
        env[k] = "1"
    return env


def pin_threads(n: int):
    """numba (and the kernel pool) at n threads, BLAS at one, in this process (and its children).

    NUMBA_NUM_THREADS is only written before numba is imported: numba reads it
    once, and changing it afterwards makes its next compile fail. After import,
    numba.set_num_threads does the limiting instead. n = 0 (or None): nothing
    is touched, -> None.
    """
    import sys

    if not _pinned(n):
        return None
    n = int(n)
    numba_loaded = "numba" in sys.modules
    for k in _ENV:
        if k != "NUMBA_NUM_THREADS" or not numba_loaded:
            os.environ[k] = str(n)
    for k in _BLAS_ENV:
        os.environ[k] = "1"
    from threadpoolctl import threadpool_limits
    threadpool_limits(1, user_api="blas")
    threadpool_limits(n, user_api="openmp")
    import numba
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    reuse_freed_memory()
    return n


def reuse_freed_memory() -> bool:
    """glibc malloc: serve allocations below 1 GiB from the heap and never trim it, so a step's large
    temporaries (logits, activations, their gradients: 10-100 MB each, every step) reuse freed pages instead
    of a fresh mmap whose every page faults again. glibc maps blocks above 32 MB afresh each time, and on
    these VMs a page fault costs ~9 us: the CE backward's 64 MB output measured 9 ms from reused pages and
    72-155 ms from new ones; a d6 step takes 3-7% less CPU. Peak RSS is what it was (the same blocks at the
    same time); the freed memory stays with the process until it exits. -> whether glibc took the setting
    (False elsewhere: other C libraries keep their own policy)."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))


def _pinned(n) -> bool:
    """False for 0/None (leave the pools alone); a negative count is a bad --threads."""
    if n is None or int(n) == 0:
        return False
    if int(n) < 0:
        from .errors import UserError
        raise UserError(f"--threads must be >= 0 (0: leave the thread pools as they are), got {n}")
    return True


@contextlib.contextmanager
def numba_threads(n: int):
    """numba (and so every kernel pool) at n threads inside, capped at NUMBA_NUM_THREADS;
    the previous count is restored on exit. For 1-thread vs N-thread comparisons."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(before)


def add_threads_flag(parser, default=1, what="this process", also="", many=False):
    """The one --threads flag of every command, worker and bench: pipeline.threads.pin_threads(args.threads)
    applies it. `what` names whose threads they are; `also` adds what else takes the count (torch, llama.cpp).
    many=True (a bench measuring several counts): a comma-separated list of counts >= 1, args.threads a list."""
    if many:
        parser.add_argument("--threads", type=_thread_counts, default=default, metavar="N[,N...]",
                            help=f"compute threads of {what}, one or more counts >= 1 (1,2): numba and the kernel "
                                 f"pool on N threads, BLAS on one{also}")
        return
    parser.add_argument("--threads", type=int, default=default, metavar="N",
                        help=f"compute threads of {what}: numba and the kernel pool on N threads, BLAS on one "
                             f"(the bits are the same for any N){also}; 0 = leave the thread pools as they are "
                             f"(numba starts with one thread per core)")


def _thread_counts(text):
    import argparse
    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected thread counts >= 1, comma-separated (1,2), got {text!r}")
    return counts
