"""numba kernels on plain numpy arrays.

Threading layer: numba's default OpenMP layer busy-waits between parallel
regions and fights OpenBLAS's spinning threads for the same cores (measured:
attention fwd+bwd at 2 threads 0.5-6 s with omp vs 0.06-0.12 s with
workqueue on a loaded 2-core machine). We therefore default to the workqueue
layer; set NUMBA_THREADING_LAYER to override. Workqueue does not allow two
Python threads to run parallel kernels at once: Fucina runs parallel kernels
from one thread per process.
"""
import os

os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

import numba  # noqa: E402

numba.config.THREADING_LAYER = os.environ["NUMBA_THREADING_LAYER"]
