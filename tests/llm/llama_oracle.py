"""llama.cpp (llama-cpp-python) as the tests' oracle: one place for the ways they open it. Every folder of tests/
is on sys.path (conftest.py), so any test imports it by name; a child process gets it through CHILD_PRELUDE.

llama.cpp's repacked "extra buffer" CPU kernels are another arithmetic for block formats, and their AMX int8 path
dies with SIGILL on VMs that advertise AMX without enabling it, so `llama` opens a model without them unless asked.
`plain_llama` is the set-up that `--llama-numerics` reproduces bit for bit: plain CPU buffers, an f32 KV cache, no
flash attention, one batch for the whole context, every position's logits kept (without logits_all
llama-cpp-python 0.3.x leaves `scores` all zero)."""
import contextlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the first lines of a `python -c` child that opens llama.cpp: `llama` importable as here
CHILD_PRELUDE = f"import sys\nsys.path.insert(0, {str(HERE)!r})\nfrom llama_oracle import llama\n"


@contextlib.contextmanager
def extra_bufts(enabled=False):
    """llama_cpp with every model opened inside using (or not) the extra buffer types; yields the module."""
    import llama_cpp
    import llama_cpp.llama as ll
    orig = ll.llama_cpp.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = enabled
        return p

    ll.llama_cpp.llama_model_default_params = params
    try:
        yield llama_cpp
    finally:
        ll.llama_cpp.llama_model_default_params = orig


def llama(path, use_extra_bufts=False, **kw):
    """llama_cpp.Llama(path, verbose=False, **kw), by default without the extra buffer types (module docstring)."""
    with extra_bufts(use_extra_bufts) as llama_cpp:
        return llama_cpp.Llama(model_path=str(path), **{"verbose": False, **kw})


def plain_llama(path, n_ctx=256, n_threads=2):
    return llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, n_threads=n_threads,
                 type_k=0, type_v=0, flash_attn=False)


def ggml_cpu():
    """llama-cpp-python's libggml-cpu (ctypes, its fp16 tables filled by ggml_cpu_init), or a pytest skip."""
    import ctypes

    import llama_cpp
    import pytest
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(lib_dir.glob("libggml-cpu*.so")) + sorted(lib_dir.glob("libggml-cpu*.dylib"))
    if not found:
        pytest.skip(f"no libggml-cpu in {lib_dir}")
    lib = ctypes.CDLL(str(found[0]))
    lib.ggml_cpu_init()  # fills the fp16 tables the vec functions read
    return lib
