"""One pool of plain Python threads for every GIL-releasing kernel: dequant, matvec, GEMM tiles, row kernels.

Trade-off: numba's own parallel launch and OpenBLAS's threads spin-wait after
their work, which steals the core from whatever runs next on a 2-core machine
(measured: a parallel RMSNorm launch slowed the next tiled GEMM from 5.5 to
9.3 ms; 2-thread OpenBLAS on a small batched matmul took 23 ms instead of 6.9).
Threads here block instead of spinning, so work is split over them explicitly
and BLAS runs single-threaded inside (`single_thread_blas`). Every helper
leaves the result independent of who computes which piece: each index is
computed by the same serial code whatever the split, so bits never depend on
the thread count. Calls made from a pool thread (a row kernel inside a GEMM
tile) run serially, so a pool thread never waits on the pool.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading

import numba

_THREAD_NAME = "fucina-kernels"
_POOL = None  # (pid, executor): a pool inherited through fork has no threads, so it is per process
_BLAS = None  # threadpoolctl controller (the library lookup is slow: once)
_BLAS_LIMIT, _BLAS_DEPTH, _BLAS_LOCK = None, 0, threading.Lock()  # the outermost single_thread_blas


def _pool():
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        from concurrent.futures import ThreadPoolExecutor
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=max(1, numba.config.NUMBA_NUM_THREADS - 1),
                                                 thread_name_prefix=_THREAD_NAME))
    return _POOL[1]


def workers(n_tasks: int) -> int:
    """Threads worth using for n_tasks pieces: numba.get_num_threads(), fewer for few pieces, 1 on a pool thread."""
    if threading.current_thread().name.startswith(_THREAD_NAME):
        return 1
    return max(1, min(numba.get_num_threads(), n_tasks))


@contextlib.contextmanager
def single_thread_blas():
    """Context manager: BLAS limited to one thread inside, restored when the outermost
    one exits. Nested uses (every tiled product inside a training step that holds
    one) cost a counter instead of threadpoolctl's ~60 us library round trip."""
    global _BLAS, _BLAS_LIMIT, _BLAS_DEPTH
    with _BLAS_LOCK:
        if _BLAS_DEPTH == 0:
            if _BLAS is None:
                from threadpoolctl import ThreadpoolController
                _BLAS = ThreadpoolController().select(user_api="blas")
            _BLAS_LIMIT = _BLAS.limit(limits=1)
        _BLAS_DEPTH += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS_DEPTH -= 1
            if _BLAS_DEPTH == 0:
                _BLAS_LIMIT.restore_original_limits()
                _BLAS_LIMIT = None


def run_dynamic(n_tasks: int, task):
    """task(i) for i in range(n_tasks); each thread (the caller is one) takes the next undone index."""
    n = workers(n_tasks)
    if n == 1:
        for i in range(n_tasks):
            task(i)
        return
    counter = itertools.count()  # next() is atomic under the GIL

    def work():
        for i in iter(counter.__next__, None):
            if i >= n_tasks:
                return
            task(i)

    futures = [_pool().submit(work) for _ in range(n - 1)]
    work()
    for f in futures:
        f.result()


def split_range(n: int, parts: int, fn):
    """fn(i0, i1) over [0, n) cut into at most `parts` contiguous pieces (the caller takes the first)."""
    parts = min(parts, workers(n)) if n else 1
    step = -(-n // parts) if n else 0
    if parts <= 1:
        fn(0, n)
        return
    futures = [_pool().submit(fn, i0, min(n, i0 + step)) for i0 in range(step, n, step)]
    fn(0, min(n, step))
    for f in futures:
        f.result()


def run_tiles(n_tiles: int, tile):
    """run_dynamic with BLAS held at one thread: for tiles that each call BLAS."""
    with single_thread_blas():
        run_dynamic(n_tiles, tile)
