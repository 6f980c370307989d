"""Shared test fixtures: optional oracles skip cleanly when absent."""
import importlib.util
import os
import pathlib
import sys

import pytest

_SHORT_BASETEMP = None

# Test modules are imported in importlib mode (basenames repeat across folders);
# helper modules beside the tests (e.g. tests/llm/test_export_fixtures.py) stay
# importable by plain name because each test folder is on sys.path.
for _d in sorted(p for p in pathlib.Path(__file__).parent.iterdir()
                 if p.is_dir() and p.name not in ("goldens", "fixtures", "__pycache__")):
    if str(_d) not in sys.path:
        sys.path.append(str(_d))

os.environ.setdefault("FUCINA_TEST", "1")


def has_module(name):
    return importlib.util.find_spec(name) is not None


# The longest tests of the slow suite (minutes each: whole doc pages, numba recompiling the integer kernels for
# another ISA) start first, so xdist's workers do not end on them one after the other.
LONG_FIRST = ("tests/test_doc_commands.py::test_documented_commands_all_of_them",
              "tests/kernels/test_qint.py::test_portable_ir_and_the_4_row_gemm")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))  # stable: the rest keep their order
    for item in items:
        if "parity" in item.keywords:
            needs = [m.args[0] for m in item.iter_markers("needs")]
            missing = [n for n in needs if not has_module(n)]
            if missing:
                item.add_marker(pytest.mark.skip(reason=f"oracle not installed: {', '.join(missing)}"))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """A short base temp dir: the runs under test bind ipc:// sockets at RUN_DIR/sockets/*.sock (at most ~100
    characters in all), and pytest's /tmp/pytest-of-USER/pytest-N (plus xdist's popen-gwN) leaves too little of
    that to the test's own names. Made per session (concurrent sessions never share one), removed after a
    passing session; workers get their subdirectory of it from xdist."""
    global _SHORT_BASETEMP
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        import tempfile
        _SHORT_BASETEMP = config.option.basetemp = tempfile.mkdtemp(prefix="pt-", dir="/tmp")
    config.addinivalue_line("markers",
                            "needs(module): parity test needs this importable module (torch, llama_cpp, ...)")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core this process may use, at most 4 - the tests are
    mostly one busy thread each (Python, numba's compiler, subprocesses), so two cores run two at once; more
    workers than that only multiply numba's cold compiles and memory. `-n 0` runs them in one process."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 4))


def pytest_unconfigure(config):
    if _SHORT_BASETEMP and not hasattr(config, "workerinput") and getattr(config, "_fucina_passed", False):
        import shutil
        shutil.rmtree(_SHORT_BASETEMP, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    session.config._fucina_passed = exitstatus == 0
