"""Shared test fixtures: optional oracles skip cleanly when absent."""
import importlib.util
import os
import pathlib
import sys

import pytest

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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "parity" in item.keywords:
            needs = [m.args[0] for m in item.iter_markers("needs")]
            missing = [n for n in needs if not has_module(n)]
            if missing:
                item.add_marker(pytest.mark.skip(reason=f"oracle not installed: {', '.join(missing)}"))


def pytest_configure(config):
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
