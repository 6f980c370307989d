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
The hand-off is a pair of plain locks per worker (release to start it, acquire
to wait for it), not an executor's futures: decode makes 4 dispatches per
layer plus one per token, and a two-thread dispatch of empty tasks measured
49 us median through ThreadPoolExecutor against 33 us this way (docs/models.md). The workers serve one dispatch at a
time; a call made while another thread's dispatch holds them runs on its own
thread alone, which gives the same bits.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections.abc import Callable

import numba

_THREAD_NAME = "fucina-kernels"
_POOL = None  # the _Pool of this process, made on first use
_POOL_LOCK = threading.Lock()  # creating the pool
_BLAS = None  # threadpoolctl controller (the library lookup is slow: once)
_BLAS_LIMIT, _BLAS_DEPTH, _BLAS_LOCK = None, 0, threading.Lock()  # the outermost single_thread_blas


class _Worker:
    """One daemon thread that runs a job each time `start` releases its lock; `wait` returns its error, if any."""

    def __init__(self, index: int):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job, self._error = None, None
        threading.Thread(target=self._loop, name=f"{_THREAD_NAME}_{index}", daemon=True).start()

    def _loop(self):
        while True:
            self._go.acquire()
            try:
                self._job()
            except BaseException as error:  # re-raised on the dispatching thread
                self._error = error
            self._job = None
            self._done.release()

    def start(self, job: Callable[[], None]):
        self._job, self._error = job, None
        self._go.release()

    def wait(self) -> BaseException | None:
        self._done.acquire()
        return self._error


class _Pool:
    def __init__(self, size: int):
        self.workers = [_Worker(i) for i in range(size)]
        self.busy = threading.Lock()  # held by the thread whose dispatch the workers serve


def _pool() -> _Pool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _Pool(max(1, numba.config.NUMBA_NUM_THREADS - 1))
        return _POOL


def _forget_pool_after_fork():
    """A forked child has none of the parent's threads, and its copies of the locks may be held by a thread
    that no longer exists: it makes its own pool."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _dispatch(jobs: list, own: Callable[[], None]):
    """Each of `jobs` on a worker while the caller runs `own`; the first error (the caller's first) is raised
    after every job has finished. With the workers busy (another thread's dispatch) the caller runs them all."""
    pool = _pool()
    if not pool.busy.acquire(blocking=False):
        own()
        for job in jobs:
            job()
        return
    try:
        started = []
        try:
            for worker, job in zip(pool.workers, jobs):
                worker.start(job)
                started.append(worker)
            own()
            for job in jobs[len(started):]:  # more jobs than workers (a thread count above the pool's): the caller's
                job()
        finally:
            errors = [worker.wait() for worker in started]
    finally:
        pool.busy.release()
    for error in errors:
        if error is not None:
            raise error


_NUM_THREADS_READER = None  # numba's thread-local count as a C call, once its threading layer is up


def threads() -> int:
    """numba.get_num_threads() (this thread's setting) without the ~3 us threading-layer launch check it makes on
    every call (measured): a decode token asks ~3 times per dispatch. The check runs once, then the layer's
    own getter is called; a numba without that internal keeps the public call."""
    global _NUM_THREADS_READER
    if _NUM_THREADS_READER is None:
        from numba.np.ufunc import parallel
        count = numba.get_num_threads()  # launches the threading layer, which sets parallel._get_num_threads
        _NUM_THREADS_READER = getattr(parallel, "_get_num_threads", None) or numba.get_num_threads
        return count
    return _NUM_THREADS_READER()


def workers(n_tasks: int) -> int:
    """Threads worth using for n_tasks pieces: threads(), fewer for few pieces, 1 on a pool thread."""
    if threading.current_thread().name.startswith(_THREAD_NAME):
        return 1
    return max(1, min(threads(), n_tasks))


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

    _dispatch([work] * (n - 1), work)


def split_range(n: int, parts: int, fn):
    """fn(i0, i1) over [0, n) cut into at most `parts` contiguous pieces (the caller takes the first)."""
    parts = min(parts, workers(n)) if n else 1
    step = -(-n // parts) if n else 0
    if parts <= 1:
        fn(0, n)
        return
    _dispatch([functools.partial(fn, i0, min(n, i0 + step)) for i0 in range(step, n, step)],
              functools.partial(fn, 0, min(n, step)))


def run_tiles(n_tiles: int, tile):
    """run_dynamic with BLAS held at one thread: for tiles that each call BLAS."""
    with single_thread_blas():
        run_dynamic(n_tiles, tile)
