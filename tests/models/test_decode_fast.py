"""pipeline/kernels/decode.layer (one numba call per layer for a one-token decode) gives the general inference path's
bits: qwen3 (q/k norms, NeoX RoPE), llama (interleaved RoPE) and gemma3 (post-norms, tanh GELU, sliding
window, local/global RoPE) layouts, Q4_K/Q6_K/Q8_0 weights (both activation partners in one product group), at
1 and 2 threads, and the general path still runs whatever the fast one does not cover."""
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.kernels import quantize
from pipeline.llm.quants import FORMATS, FrozenWeight
from pipeline.models.decoder import FrozenLinear
from pipeline.models.registry import load_model
from pipeline.threads import numba_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_tiny_model as mk  # noqa: E402

MIX = {"q": "Q4_K", "k": "Q6_K", "v": "Q8_0", "o": "Q4_K", "gate": "Q4_K", "up": "Q8_0", "down": "Q6_K"}


def quantized_model(tmp_path, arch, shape="tied"):
    """The tiny F32 model of `arch`, its projections re-encoded in MIX's block formats (pipeline/kernels/quantize)."""
    from gguf import GGMLQuantizationType as QT
    model = load_model(mk.make(tmp_path, arch, shape, "F32", seed=3))
    for blk in model.blocks:
        for target, kind in MIX.items():
            proj = blk.projection(target)
            dense = proj.weight.dequantize()
            fmt = FORMATS[QT[kind]]
            setattr(blk.attn if target in ("q", "k", "v", "o") else blk.mlp, target,
                    FrozenLinear(FrozenWeight(fmt, quantize.quantize(dense, kind), dense.shape, proj.weight.name)))
    return model


def decode(model, tokens, general=False):
    if general:
        model._decode_token = lambda ids, cache: None  # the general path for every token
    cache = model.new_cache(8)
    out = [model.infer(np.array([5, 17, 42]), cache)]
    for t in tokens:
        out.append(model.infer(np.array([t]), cache))  # grows the cache past its capacity of 8
    if general:
        del model._decode_token
    return np.stack(out)


@pytest.mark.parametrize("arch, shape", [("qwen3", "tied"), ("llama", "tied"), ("gemma3", "gemma")])
def test_fast_decode_gives_the_general_paths_bits(tmp_path, arch, shape):
    model = quantized_model(tmp_path, arch, shape)
    tokens = [3, 99, 7, 250, 11, 64, 2, 31] * 3  # 27 positions: past gemma's sliding window of 16
    want = decode(model, tokens, general=True)
    assert "_decode" not in model.__dict__  # the general path made no plan
    for threads in (1, 2):
        with numba_threads(threads):
            got = decode(model, tokens)
        assert model.__dict__["_decode"].threads in (1, threads)  # the fast path ran (1: the workers were busy)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_layer_the_fast_path_does_not_cover_takes_the_general_path(tmp_path):
    model = quantized_model(tmp_path, "qwen3")
    model.blocks[1].mlp.down.bias = np.zeros(model.config.hidden, np.float32)  # a bias: not covered
    cache = model.new_cache()
    model.infer(np.array([5, 17]), cache)
    model.infer(np.array([3]), cache)
    assert "_decode" not in model.__dict__
    model.blocks[1].mlp.down.bias = None
    first = model.infer(np.array([4]), cache)
    plan = model.__dict__["_decode"]
    model.blocks[0].attn.q.weight.raw = model.blocks[0].attn.q.weight.raw.copy()  # a replaced raw: a new plan
    second = model.infer(np.array([4]), cache)
    assert model.__dict__["_decode"] is not plan and np.isfinite(first).all() and np.isfinite(second).all()
