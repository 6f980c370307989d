"""Shared test fixtures: optional oracles skip cleanly when absent."""
import importlib.util
import os

import pytest

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
    config.addinivalue_line("markers", "needs(module): parity test needs this importable module (torch, llama_cpp, ...)")
