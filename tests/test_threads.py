import subprocess
import sys


def test_pin_threads_after_numba_import_keeps_compiling():
    code = (
        "import numba, numpy as np\n"
        "from pipeline.threads import pin_threads\n"
        "pin_threads(1)\n"
        "@numba.njit\n"
        "def f(a):\n    return a.sum()\n"
        "assert f(np.ones(3)) == 3.0\n"
        "assert numba.get_num_threads() == 1\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_pin_threads_holds_blas_at_one_thread():
    """n compute threads for numba and the kernel pool; BLAS at one (its threaded sums depend on the count)."""
    code = (
        "import numba\n"
        "from threadpoolctl import threadpool_info\n"
        "from pipeline.threads import pin_threads\n"
        "pin_threads(2)\n"
        "blas = [i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas']\n"
        "assert blas and set(blas) == {1}, blas\n"
        "assert numba.get_num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
