"""pipeline/kernels/workpool.py and kernels/handoff.py: the single-thread BLAS guard nests, dispatches run every task
(Python or native), the hand-off spins only briefly."""
import numba
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from pipeline.kernels import handoff, workpool


def _blas_threads():
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_single_thread_blas_nests_and_restores_at_the_outermost_exit():
    with threadpool_limits(2, user_api="blas"):
        outside = _blas_threads()
        with workpool.single_thread_blas():
            assert set(_blas_threads()) == {1}
            with workpool.single_thread_blas():
                assert set(_blas_threads()) == {1}
            assert set(_blas_threads()) == {1}  # an inner exit does not restore
        assert _blas_threads() == outside


def test_single_thread_blas_restores_after_an_error():
    with threadpool_limits(2, user_api="blas"):
        outside = _blas_threads()
        try:
            with workpool.single_thread_blas():
                raise KeyError("boom")
        except KeyError:
            pass
        assert _blas_threads() == outside
        with workpool.single_thread_blas():
            assert set(_blas_threads()) == {1}


def test_run_dynamic_runs_every_index_once_and_split_range_covers_the_range():
    from pipeline.threads import numba_threads
    with numba_threads(2):
        seen = []
        workpool.run_dynamic(50, seen.append)  # list.append is atomic under the GIL
        assert sorted(seen) == list(range(50))
        pieces = []
        workpool.split_range(37, 2, lambda i0, i1: pieces.append((i0, i1)))
        assert sorted(pieces) == [(0, 19), (19, 37)]


def test_an_error_on_a_worker_reaches_the_caller_and_the_pool_keeps_working():
    import pytest
    from pipeline.threads import numba_threads

    def fail_on_worker(i0, i1):
        if i0:
            raise KeyError("worker piece")

    with numba_threads(2):
        with pytest.raises(KeyError, match="worker piece"):
            workpool.split_range(10, 2, fail_on_worker)
        pieces = []
        workpool.split_range(10, 2, lambda i0, i1: pieces.append((i0, i1)))
        assert sorted(pieces) == [(0, 5), (5, 10)]


def test_dispatches_from_two_threads_at_once_each_run_all_their_tasks():
    import threading
    from pipeline.threads import numba_threads
    results, barrier = {}, threading.Barrier(2)

    def caller(name):
        barrier.wait()
        for _ in range(200):  # enough rounds that the two callers' dispatches overlap
            seen = []
            workpool.run_dynamic(8, seen.append)
            assert sorted(seen) == list(range(8))
        results[name] = True

    with numba_threads(2):
        threads = [threading.Thread(target=caller, args=(name,)) for name in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert results == {"a": True, "b": True}


def test_a_forked_child_dispatches_on_its_own_workers():
    import multiprocessing
    import pytest
    from pipeline.threads import numba_threads
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    with numba_threads(2):
        workpool.run_dynamic(4, lambda i: None)  # the parent's pool exists before the fork
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.apply_async(_pieces_in_child, (20,)).get(timeout=120) == list(range(20))  # a hang fails


def _pieces_in_child(n):
    import numba
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    seen = []
    workpool.run_dynamic(n, seen.append)
    return sorted(seen)


def test_threads_follows_numba_set_num_threads_on_every_thread():
    import threading
    import numba
    from pipeline.threads import numba_threads
    top = numba.config.NUMBA_NUM_THREADS
    for n in sorted({1, top}):
        with numba_threads(n):
            assert workpool.threads() == numba.get_num_threads() == n
    seen = []
    thread = threading.Thread(target=lambda: seen.append((workpool.threads(), numba.get_num_threads())))
    with numba_threads(1):
        thread.start()
        thread.join()
    assert seen[0][0] == seen[0][1]  # numba's count is per thread: a new thread reads its own


def test_an_idle_pool_stops_spinning():
    """After a dispatch the waiting threads spin for at most the spin bound, then sleep: a process that
    waits (for input, say) burns no CPU. A burning worker would add ~0.3 s of CPU time over the 0.3 s wait."""
    import time
    from pipeline.threads import numba_threads
    with numba_threads(2):
        for _ in range(50):  # long enough for the spin budgets to grow to their bound
            workpool.run_dynamic(4, lambda i: None)
        time.sleep(0.05)
        cpu = time.process_time()
        time.sleep(0.3)
        assert time.process_time() - cpu < 0.1


def test_spinning_or_not_a_dispatch_runs_every_task():
    from pipeline.threads import numba_threads
    try:
        with numba_threads(2):
            for spin_us in (0, 50):
                workpool.set_spin_us(spin_us)
                for _ in range(100):
                    seen = []
                    workpool.run_dynamic(6, seen.append)
                    assert sorted(seen) == list(range(6))
    finally:
        workpool.set_spin_us(float(__import__("os").environ.get("FUCINA_SPIN_US", "200")))


def test_handoff_cells_post_and_wait():
    """The cell protocol on one thread: a wait for a post already made returns at once whatever the spin, and
    a post with no sleeper asks nobody to release a lock."""
    cell = handoff.new_cell()
    assert not handoff.post(cell)
    assert handoff.wait(cell, 1, 0, handoff.new_cell()) and handoff.wait(cell, 1, 10 ** 6, handoff.new_cell())
    assert cell[handoff.SEQ] == 1 and cell[handoff.SLEEPING] == 0


def test_native_products_from_two_threads_at_once_give_the_serial_bits():
    """Two threads' integer products at once: one has the workers, the other runs its job alone; both give
    the bits of a serial call."""
    import sys
    import threading
    from pathlib import Path
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from pipeline.kernels import qint
    from pipeline.threads import numba_threads
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "llm"))
    from test_gguf_dequant import random_blocks
    raw = random_blocks(QT.Q4_K, 96, 256, seed=3)
    x = np.random.default_rng(4).standard_normal((1, 256)).astype(np.float32)
    with numba_threads(1):
        want = qint.matmul_t_many([(int(QT.Q4_K), raw)], x)[0]
    bad, barrier = [], threading.Barrier(2)

    def caller():
        barrier.wait()
        for _ in range(100):
            if not np.array_equal(qint.matmul_t_many([(int(QT.Q4_K), raw)], x)[0], want):
                bad.append(1)

    with numba_threads(2):
        threads = [threading.Thread(target=caller) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not bad and not any(t.is_alive() for t in threads)


def _count_calls(address):
    """A native job: cell[0] += 1 (how many threads ran it)."""
    handoff.atomic_add(numba.carray(handoff.i64_pointer(address), 1), 0, 1)


def _native_counts(threads, rounds=50):
    """How many calls each of `rounds` native dispatches made, spinning and not."""
    import numpy as np
    from numba import types
    from pipeline.threads import numba_threads
    job = numba.cfunc(types.void(types.int64))(_count_calls)
    counts = set()
    try:
        with numba_threads(threads):
            for spin_us in (0, 200):
                workpool.set_spin_us(spin_us)
                for _ in range(rounds):
                    cell = np.zeros(1, np.int64)
                    workpool.run_native(job.address, cell.ctypes.data, threads)
                    counts.add(int(cell[0]))
    finally:
        workpool.set_spin_us(float(__import__("os").environ.get("FUCINA_SPIN_US", "200")))
    return counts


def test_a_native_job_runs_once_on_each_thread():
    assert _native_counts(1) == {1}
    if numba.config.NUMBA_NUM_THREADS >= 2:
        assert _native_counts(2) == {2}  # the caller and the worker, every dispatch


@pytest.mark.slow
def test_without_a_futex_waiters_sleep_on_locks(tmp_path):
    """Where there is no futex (not Linux) waiters sleep on Python locks: the same dispatches, in a fresh
    process that compiles the hand-off as for such a platform (its own numba cache)."""
    import os
    import subprocess
    import sys
    code = ("import platform; platform.system = lambda: 'Darwin'\n"
            "from pipeline.kernels import handoff; assert not handoff.FUTEX\n"
            "import test_workpool as t\n"
            "t.test_run_dynamic_runs_every_index_once_and_split_range_covers_the_range()\n"
            "t.test_spinning_or_not_a_dispatch_runs_every_task()\n"
            "t.test_a_native_job_runs_once_on_each_thread()\n"
            "t.test_an_idle_pool_stops_spinning()\n"
            "print('ok')\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(os.path.dirname(here))]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]


def test_a_held_pool_spins_past_its_budget():
    """workpool.hold: a waiter with no spin budget gives up at once, unless the hold cell is held; then it spins
    until the post comes (from another thread, 20 ms later) instead of going to sleep."""
    import threading
    import time
    hold, cell = handoff.new_cell(), handoff.new_cell()
    assert not handoff.spin_until(cell, 1, 0, hold)  # no budget, not held: gives up
    handoff.add(hold, handoff.SEQ, 1)
    poster = threading.Thread(target=lambda: (time.sleep(0.02), handoff.post(cell)))
    poster.start()
    assert handoff.spin_until(cell, 1, 0, hold)  # held: spun on until the post
    poster.join()
    handoff.add(hold, handoff.SEQ, -1)
    assert hold[handoff.SEQ] == 0
    with workpool.hold(), workpool.hold():  # nested holds count
        assert workpool._HOLD[handoff.SEQ] == 2
    assert workpool._HOLD[handoff.SEQ] == 0
