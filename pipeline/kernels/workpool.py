"""One pool of plain Python threads for every GIL-releasing kernel: dequant, matvec, GEMM tiles, row kernels.

Trade-off: numba's own parallel launch and OpenBLAS's threads spin-wait after
their work, which steals the core from whatever runs next on a 2-core machine
(measured: a parallel RMSNorm launch slowed the next tiled GEMM from 5.5 to
9.3 ms; 2-thread OpenBLAS on a small batched matmul took 23 ms instead of 6.9).
So work is split over these threads explicitly, BLAS runs single-threaded
inside (`single_thread_blas`), and the threads spin only briefly and only
while waiting on each other (below). Every helper
leaves the result independent of who computes which piece: each index is
computed by the same serial code whatever the split, so bits never depend on
the thread count. Calls made from a pool thread (a row kernel inside a GEMM
tile) run serially, so a pool thread never waits on the pool.
The hand-off (pipeline/kernels/handoff.py) is an int64 cell per direction and worker: the waiting thread spins on it
inside a numba nogil function for at most FUCINA_SPIN_US microseconds (default 200, `set_spin_us`), then
sleeps on a plain lock, which a poster releases only when the cell says its waiter sleeps. A model forward
holds the pool (`hold`): its waiting threads then spin past that bound, since a forward's products come a few
hundred microseconds apart at most; an idle process stops spinning within the bound. Decode's products are
native jobs (`run_native`, or posted from native code through `native_workers`): a worker calls them from
inside its spin loop, without taking the GIL. A lock-woken worker measured 33-87 us per empty dispatch
(docs/models.md, 'Threads'). The workers serve one dispatch at a time; a call made while another thread's
dispatch holds them runs on its own thread alone, which gives the same bits.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable

import numba
import numpy as np

from . import handoff

_THREAD_NAME = "fucina-kernels"
_IN_POOL = threading.local()  # .yes on the pool's own threads (cheaper to ask than the thread's name)
_POOL = None  # the _Pool of this process, made on first use
_POOL_LOCK = threading.Lock()  # creating the pool
_BLAS = None  # threadpoolctl controller (the library lookup is slow: once)
_BLAS_LIMIT, _BLAS_DEPTH, _BLAS_LOCK = None, 0, threading.Lock()  # the outermost single_thread_blas


_SPIN_TICKS = None  # cycle-counter ticks a waiting thread spins before it sleeps (set with the pool)
_HOLD = handoff.new_cell()  # _HOLD[SEQ] > 0: a forward is running, waiting threads spin on (`hold`)
_NO_CELLS = np.zeros((0, 2 * handoff.CELL), np.int64)


@contextlib.contextmanager
def hold():
    """Context manager: the pool's waiting threads keep spinning (no futex sleep) until the outermost exits.
    A model forward holds it: its products come a few hundred microseconds apart at most, and a worker woken
    from its sleep for each one cost decode 2x (measured, docs/BENCHMARKS.md). Spinning yields the core every
    64 polls, so a runnable thread on a loaded machine still gets it."""
    handoff.add(_HOLD, handoff.SEQ, 1)
    try:
        yield
    finally:
        handoff.add(_HOLD, handoff.SEQ, -1)


def set_spin_us(microseconds: float):
    """How long a waiting pool thread spins before it sleeps (0: sleep at once); the cycle counter is
    calibrated against the clock the first time."""
    global _SPIN_TICKS
    _SPIN_TICKS = max(0, int(microseconds * _ticks_per_us()))


@functools.cache
def _ticks_per_us() -> float:
    handoff.cycles()  # compiled (or loaded from the cache) before the clock starts
    t0, c0 = time.perf_counter_ns(), handoff.cycles()
    time.sleep(0.002)
    t1, c1 = time.perf_counter_ns(), handoff.cycles()
    return max(0.0, (c1 - c0) * 1e3 / max(1, t1 - t0))  # 0 where there is no cycle counter: no spinning


def _spin_ticks() -> int:
    if _SPIN_TICKS is None:
        set_spin_us(float(os.environ.get("FUCINA_SPIN_US", "200")))
    return _SPIN_TICKS


class _Signal:
    """One hand-off cell, and the lock its waiter sleeps on once its spin is over where there is no futex."""

    def __init__(self, cell):
        self.cell = cell
        self.lock = threading.Lock()
        self.lock.acquire()

    def post(self):
        if handoff.post(self.cell):
            self.lock.release()

    def wait(self, target: int):
        if not handoff.wait(self.cell, target, _spin_ticks(), _HOLD):
            self.lock.acquire()


class _Worker:
    """One daemon thread that runs each job `start` / `start_native` posts; `wait` returns its error, if any."""

    def __init__(self, index: int, go, done):
        self._go, self._done = _Signal(go), _Signal(done)  # go[SEQ] counts the jobs posted, done[SEQ] the finished
        self._job, self._error = None, None
        threading.Thread(target=self._loop, name=f"{_THREAD_NAME}_{index}", daemon=True).start()

    def _loop(self):
        _IN_POOL.yes = True
        seen = 0
        while True:
            what, seen = handoff.serve(self._go.cell, self._done.cell, seen, _spin_ticks(), _HOLD)
            if what == handoff.TIMEOUT:
                self._go.lock.acquire()
            elif what == handoff.WAKE_CALLER:
                self._done.lock.release()
            else:
                try:
                    self._job()
                except BaseException as error:  # re-raised on the dispatching thread
                    self._error = error
                self._job = None
                self._done.post()

    def start(self, job: Callable[[], None]):
        self._job, self._error = job, None
        self._post(handoff.PYTHON, 0, 0)

    def start_native(self, fn: int, arg: int):
        self._error = None
        self._post(handoff.NATIVE, fn, arg)

    def _post(self, kind, fn, arg):
        if handoff.post_job(self._go.cell, kind, fn, arg):
            self._go.lock.release()

    def wait(self) -> BaseException | None:
        self._done.wait(int(self._go.cell[handoff.SEQ]))  # every job posted so far (by Python or handoff.dispatch)
        return self._error


class _Pool:
    def __init__(self, size: int):
        # worker i's go cell is row 2i, its done cell row 2i + 1 (rows of 128 bytes, so no two share a line):
        # native code (handoff.dispatch) posts and waits on the rows directly
        self.cells = np.zeros((2 * size, 2 * handoff.CELL), np.int64)
        self.workers = [_Worker(i, self.cells[2 * i, :handoff.CELL], self.cells[2 * i + 1, :handoff.CELL])
                        for i in range(size)]
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
    _HOLD[handoff.SEQ] = 0  # the holds were the parent's threads', none of which exists here


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


@contextlib.contextmanager
def native_workers():
    """Context manager -> (cells, n, ticks, hold) for native code that dispatches its own jobs with
    handoff.dispatch: the pool's cell rows, how many workers it may post to (threads() - 1; 0 on one thread, on a
    pool thread, without a futex, or when another thread's dispatch holds the workers, and the caller then
    runs every job alone, which gives the same bits), the spin budget and the hold cell. The workers are this
    thread's until the context exits."""
    n = workers(threads()) - 1
    pool = _pool() if n > 0 and handoff.FUTEX else None
    if pool is None or not pool.busy.acquire(blocking=False):
        yield _NO_CELLS, 0, _spin_ticks(), _HOLD
        return
    try:
        yield pool.cells, min(n, len(pool.workers)), _spin_ticks(), _HOLD
    finally:
        pool.busy.release()


def run_native(fn: int, arg: int, n_threads: int):
    """The native job fn(arg) (a cfunc address, pipeline/kernels/handoff.py) on up to n_threads threads at once, the
    caller one of them: each call takes the job's pieces from a shared counter until none are left, so the
    pieces' results do not depend on who runs them. One thread (or the workers busy with another thread's
    dispatch): the caller runs it alone."""
    n = min(n_threads, workers(n_threads))
    pool = _pool() if n > 1 else None
    if pool is None or not pool.busy.acquire(blocking=False):
        handoff.run_native(fn, arg)
        return
    started = pool.workers[:n - 1]
    try:
        for worker in started:
            worker.start_native(fn, arg)
        handoff.run_native(fn, arg)
    finally:
        for worker in started:
            worker.wait()
        pool.busy.release()


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
    if getattr(_IN_POOL, "yes", False):
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
