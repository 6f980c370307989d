"""kernels/workpool.py: the single-thread BLAS guard nests."""
from threadpoolctl import threadpool_info, threadpool_limits

from kernels import workpool


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
