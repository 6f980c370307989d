"""numba kernels on plain numpy arrays.

Threading layer: numba's default OpenMP layer busy-waits between parallel
regions and fights OpenBLAS's spinning threads for the same cores (measured:
attention fwd+bwd at 2 threads 0.5-6 s with omp vs 0.06-0.12 s with
workqueue on a loaded 2-core machine). We therefore default to the workqueue
layer; set NUMBA_THREADING_LAYER to override. Workqueue does not allow two
Python threads to run parallel kernels at once: Fucina runs parallel kernels
from one thread per process.

Compiled-code cache: numba revalidates a cached function by its own source file only, not by the
intrinsics and helpers it inlines from other files (qint.py's kernels are mostly pipeline/kernels/qblocks.py's IR), so
after an update that changed only qblocks.py the old machine code would still load, with the old bits. The
cache therefore lives in a directory named by a digest of every pipeline/kernels/*.py (`source_digest`): under
pipeline/kernels/__pycache__ (earlier digests' directories there are removed), or under NUMBA_CACHE_DIR when the user
set it.
"""
import hashlib
import os
import shutil

os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

import numba  # noqa: E402

numba.config.THREADING_LAYER = os.environ["NUMBA_THREADING_LAYER"]

_HERE = os.path.dirname(os.path.abspath(__file__))


def source_digest(folder: str = _HERE) -> str:
    """16 hex digits of sha256 over the names and bytes of the folder's .py files, in name order."""
    digest = hashlib.sha256()
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".py")):
        digest.update(name.encode() + b"\0")
        with open(os.path.join(folder, name), "rb") as fh:
            digest.update(fh.read() + b"\0")
    return digest.hexdigest()[:16]


def _cache_dir() -> str:
    """base/numba-<digest>, base = NUMBA_CACHE_DIR as the user set it or pipeline/kernels/__pycache__ (where earlier
    digests' directories are removed). A child process inherits NUMBA_CACHE_DIR as set here, and the base it
    came from as FUCINA_NUMBA_CACHE_BASE; a NUMBA_CACHE_DIR changed since is the user's again."""
    stamp = f"numba-{source_digest()}"
    user = os.environ.get("NUMBA_CACHE_DIR", "")
    if user and user == os.environ.get("FUCINA_NUMBA_CACHE_DIR"):
        user = os.environ.get("FUCINA_NUMBA_CACHE_BASE", "")
    os.environ["FUCINA_NUMBA_CACHE_BASE"] = base = user
    if base:
        return os.path.join(base, stamp)
    base = os.path.join(_HERE, "__pycache__")
    if os.path.isdir(base):
        for old in os.listdir(base):
            if old.startswith("numba-") and old != stamp:
                shutil.rmtree(os.path.join(base, old), ignore_errors=True)
    return os.path.join(base, stamp)  # unwritable (a read-only install): numba falls back to its own places


# through the environment: numba re-reads its config from the NUMBA_* variables whenever one of them changed
# since (compiler.py's reload_config), which would reset a value set on numba.config alone
os.environ["NUMBA_CACHE_DIR"] = os.environ["FUCINA_NUMBA_CACHE_DIR"] = numba.config.CACHE_DIR = _cache_dir()
