import subprocess
import sys

import pytest


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


def test_zero_threads_leaves_the_pools_and_negative_is_one_clear_error():
    import numba
    import pytest

    from pipeline.errors import UserError
    from pipeline.threads import pin_env, pin_threads
    before = numba.get_num_threads()
    assert pin_threads(0) is None and numba.get_num_threads() == before
    assert pin_env(0, {"OMP_NUM_THREADS": "7"}) == {"OMP_NUM_THREADS": "7"}
    with pytest.raises(UserError, match="--threads must be >= 0"):
        pin_threads(-1)


def test_the_threads_flag_is_defined_once():
    """Every --threads (commands, workers, benches) comes from pipeline/threads.py add_threads_flag (beside
    pin_threads, which applies it; workers and the runtime take it from there, not from commands/)."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    defined = [str(p.relative_to(root)) for d in ("pipeline", "workers", "scripts")
               for p in (root / d).rglob("*.py") if 'add_argument("--threads"' in p.read_text()]
    assert defined == ["pipeline/threads.py"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_block_is_reused_without_page_faults():
    """After reuse_freed_memory, a 64 MB temporary allocated again (as each training step does) lands on the
    pages of the freed one: fresh subprocesses count the second allocation's minor page faults, none with the
    setting, hundreds (2 MB pages) to 16,384 (4 KB pages) with glibc's default, which maps it anew."""
    def faults(setting):
        code = ("import resource, numpy as np\n"
                + ("from pipeline.threads import reuse_freed_memory\nassert reuse_freed_memory()\n" if setting
                   else "")
                + "a = np.ones(16 << 20, np.float32); del a\n"
                "f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
                "b = np.ones(16 << 20, np.float32)\n"
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)\n")
        return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    default = faults(False)
    assert default >= 32 and faults(True) < default / 4
