"""Golden bytes for the quantization encoders and golden type lists for the `_K_M` mixes, made by llama.cpp.

Usage:  python tools/gen_quant_goldens.py [--out tests/goldens/quant]

For each input case (random gaussian, real-looking small weights with
outliers, rows and half-rows of zeros, huge outliers, subnormals, constant
rows) it stores the float32 input and the bytes ggml writes for Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (no importance matrix: the path
`llama_model_quantize` takes), F16 and BF16, calling `ggml_quantize_chunk` /
`ggml_fp32_to_{fp16,bf16}_row` from the libggml-base that llama-cpp-python
ships (quant_goldens.npz). Then it writes tiny F32 Qwen3 GGUFs
(tools/make_tiny_model.py) in MIX_SHAPES, quantizes each with
`llama_model_quantize` to Q4_K_M and Q5_K_M, and records every tensor's
(name, shape, type) as llama.cpp chose it (mix_types.json). Our encoders and
planner are never called here. The generating versions go into meta.json.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

GGML_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}  # ggml_type
MIX_FTYPES = ("Q4_K_M", "Q5_K_M")
SEED = 20261129


def ggml_base():
    """ctypes handle on llama-cpp-python's libggml-base with the three entry points typed."""
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    for fn in (lib.ggml_fp32_to_fp16_row, lib.ggml_fp32_to_bf16_row):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


def ggml_quantize(lib, x: np.ndarray, qtype: str, block_bytes: int, block_values: int) -> np.ndarray:
    """llama.cpp's bytes for float32 rows x [rows, n]."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // block_values * block_bytes), np.uint8)
    n = lib.ggml_quantize_chunk(GGML_TYPES[qtype], x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
    assert n == out.size, (qtype, n, out.size)
    return out


def ggml_half(lib, x: np.ndarray, kind: str) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros(x.shape, np.uint16)
    getattr(lib, f"ggml_fp32_to_{kind}_row")(x.ctypes.data, out.ctypes.data, x.size)
    return out


def cases(rng) -> dict[str, np.ndarray]:
    """The input catalogue: 4 rows of 512 (two K-quant super-blocks, 16 Q8_0 blocks) each."""
    shape = (4, 512)
    gauss = rng.standard_normal(shape).astype(np.float32)
    real = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    real.flat[rng.integers(0, real.size, 12)] *= 200  # activation-style outlier channels
    zeros = rng.standard_normal(shape).astype(np.float32)
    zeros[0] = 0
    zeros[1, :256] = 0
    zeros[2, ::2] = 0
    zeros[3, :32] = 0
    huge = rng.standard_normal(shape).astype(np.float32)
    huge[0, 7] = 1e30
    huge[1, 100] = -3e38
    huge[2, 300] = 65504 * 200  # the block's fp16 scale overflows
    huge[3] *= 1e-30
    subnormal = (rng.standard_normal(shape) * 1e-39).astype(np.float32)
    subnormal[1] = (rng.standard_normal(512) * 1e-44).astype(np.float32)
    subnormal[2, :256] = (rng.standard_normal(256) * 1e-6).astype(np.float32)
    mixed = (rng.standard_t(3, shape) * 10.0 ** rng.uniform(-6, 4, (4, 1))).astype(np.float32)
    constant = np.full(shape, 0.3, np.float32)
    constant[1] = -0.3
    constant[2] = np.abs(rng.standard_normal(512)).astype(np.float32)  # all positive: min clamps to 0
    constant[3] = -constant[2]
    return {"gauss": gauss, "real": real, "zeros": zeros, "huge": huge, "subnormal": subnormal,
            "mixed": mixed, "constant": constant}


def mix_shapes():
    """make_tiny_model shapes whose row lengths reach every branch of the _M mixes: 8 and 9 layers (the
    "more bits" pattern), ffn rows of 320 (K-quant fallbacks to Q5_0/Q5_1/Q8_0) and 336 (to F16), a
    tied and an untied output, hidden 320 (output -> Q8_0)."""
    from make_tiny_model import Shape
    return {
        "untied_ffn320": Shape(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, ffn=320, tied=False),
        "tied_ffn336": Shape(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, ffn=336, tied=True),
        "hidden320": Shape(hidden=320, layers=9, heads=5, kv_heads=1, head_dim=64, ffn=512, tied=False),
    }


def mix_types(workdir: Path) -> dict:
    """{case: {"layers": n, "tensors": {ftype: [[name, shape, type], ...]}}} as llama_model_quantize writes them."""
    import llama_cpp
    from gguf import GGUFReader
    from make_tiny_model import write_gguf

    result = {}
    for case, shape in mix_shapes().items():
        src = write_gguf(workdir / f"{case}-f32.gguf", shape, seed=1)
        per_ftype = {}
        for ftype in MIX_FTYPES:
            dst = workdir / f"{case}-{ftype}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.nthread = 1
            if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
                raise RuntimeError(f"llama_model_quantize {case} -> {ftype} failed")
            reader = GGUFReader(dst)
            per_ftype[ftype] = [[t.name, [int(d) for d in reversed(t.shape.tolist())], t.tensor_type.name]
                                for t in reader.tensors]
        result[case] = {"layers": shape.layers, "tensors": per_ftype}
    return result


def versions() -> dict:
    import gguf
    import llama_cpp

    return {"llama_cpp_python": llama_cpp.__version__, "numpy": np.__version__,
            "gguf": getattr(gguf, "__version__", "0.19"), "python": platform.python_version(),
            "oracle": "ggml_quantize_chunk / ggml_fp32_to_{fp16,bf16}_row in llama-cpp-python's libggml-base.so; "
                      "llama_model_quantize for mix_types.json",
            "seed": SEED}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "goldens" / "quant"),
                    help="output directory (default: tests/goldens/quant)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pipeline.kernels.quantize import BLOCK  # geometry only; the bytes come from ggml

    lib = ggml_base()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for case, x in cases(np.random.default_rng(SEED)).items():
        arrays[f"{case}/input"] = x
        for qtype, (values, nbytes) in BLOCK.items():
            arrays[f"{case}/{qtype}"] = ggml_quantize(lib, x, qtype, nbytes, values)
        arrays[f"{case}/f16"] = ggml_half(lib, x, "fp16")
        arrays[f"{case}/bf16"] = ggml_half(lib, x, "bf16")
    np.savez_compressed(out / "quant_goldens.npz", **arrays)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with tempfile.TemporaryDirectory() as work:
        mixes = mix_types(Path(work))
    (out / "mix_types.json").write_text(json.dumps(mixes, indent=1) + "\n")
    (out / "meta.json").write_text(json.dumps(versions(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(arrays)} arrays and {sum(len(c['tensors']) for c in mixes.values())} type lists to {out}")


if __name__ == "__main__":
    main()
