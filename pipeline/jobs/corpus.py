"""The built-in corpus: CPython's own documentation, as bytes.

pydoc topics (`pydoc_data.topics`, the text behind `help('FOR')`) plus the
docstrings of a fixed list of stdlib modules and their public members: real
English prose and code, present on every machine with Python, no download.

Deterministic for a given Python build: topics in sorted order, modules in
list order, members sorted by name, documents separated by a blank line.
Trade-off: the text differs slightly between Python versions, so the corpus
digest is recorded in checkpoints rather than assumed.

The docstrings are read in a fresh interpreter (`python -I -S` running this
file), never in the calling process: a process that patched a stdlib member
(pytest replaces `threading.excepthook`, a library may wrap `logging`) would
otherwise train on different bytes than its own worker processes.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import warnings

MODULES = ("builtins", "collections", "itertools", "functools", "json", "re", "os", "pathlib", "string",
           "textwrap", "heapq", "bisect", "random", "statistics", "math", "datetime", "argparse", "logging",
           "subprocess", "threading", "dataclasses", "typing", "contextlib", "shutil", "csv")


def _docstrings(module_name):
    try:
        mod = importlib.import_module(module_name)
    except ImportError:
        return []
    docs = [inspect.getdoc(mod) or ""]
    with warnings.catch_warnings():  # e.g. typing.io/typing.re warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in sorted(n for n in dir(mod) if not n.startswith("_")):
            obj = getattr(mod, name, None)
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 40:
                    docs.append(f"{module_name}.{name}\n{doc}")
    return docs


def _all_docstrings() -> list:
    return [d for m in MODULES for d in _docstrings(m)]


@functools.lru_cache(maxsize=1)
def clean_docstrings() -> tuple:
    """The docstrings of MODULES as an unpatched interpreter of this Python sees them (see the module doc)."""
    out = subprocess.run([sys.executable, "-I", "-S", os.path.abspath(__file__)], capture_output=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"corpus: the docstring reader failed: {out.stderr.decode(errors='replace')[-500:]}")
    return tuple(json.loads(out.stdout.decode("utf-8")))


@functools.lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    from pydoc_data.topics import topics
    docs = [topics[k] for k in sorted(topics)]
    docs.extend(clean_docstrings())
    return "\n\n".join(d.strip() for d in docs if d.strip()).encode("utf-8")


def corpus_digest() -> str:
    return hashlib.sha256(corpus_bytes()).hexdigest()[:16]


def stdlib_documents() -> list:
    """The pretrain job's built-in corpus: the documents above (pydoc topics, docstrings) plus the source of
    every top-level module of this Python's standard library (Lib/*.py, ~4.7 MB on 3.11), in sorted order.

    Several MB of English and Python, one document each, with no download; its digest is recorded like the
    byte corpus's, since it differs between Python builds."""
    import glob
    import sysconfig

    from pydoc_data.topics import topics
    docs = [topics[k] for k in sorted(topics)]
    docs.extend(clean_docstrings())
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as fh:  # a stray non-UTF-8 byte must not stop the job
            docs.append(fh.read())
    return [d.strip() for d in docs if d.strip()]


if __name__ == "__main__":  # the fresh interpreter of clean_docstrings()
    sys.stdout.write(json.dumps(_all_docstrings()))
