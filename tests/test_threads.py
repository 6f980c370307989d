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
