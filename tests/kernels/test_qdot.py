"""Decode matvec kernels (pipeline/kernels/qdot.py): bitwise equal to a numpy emulation of their contract.

The contract: lane l (0..31) accumulates, in f32 and block order, w[k] * x[k] for
k = l mod 32, where w is the exact gguf-py dequantized weight; the 32 lanes are
then summed as a tree (lane l + lane l+16, then l + l+8, ... down to one). The emulation below does
exactly that in numpy, so any change of operation order, FMA contraction or lane layout in the IR shows up.
"""
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, quants

from pipeline.kernels import dequant, qdot
from pipeline.threads import numba_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "llm"))
from test_gguf_dequant import SCALE_OFFSETS, random_blocks  # noqa: E402

FORMATS = list(SCALE_OFFSETS)  # every block format


def lane_reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """f32 [m, n_rows]: 32 sequential f32 lane sums of w * x, then a halving tree over the lanes."""
    prod = w[None, :, :] * x[:, None, :]                        # f32 [m, rows, n]
    groups = prod.reshape(x.shape[0], w.shape[0], -1, 32)
    acc = np.zeros(groups.shape[:2] + (32,), np.float32)
    for g in range(groups.shape[2]):
        acc += groups[:, :, g]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_matvec_bitwise_equals_lane_emulation(qt):
    raw = random_blocks(qt, 37, 768, seed=3)
    x = np.random.default_rng(4).standard_normal((3, 768)).astype(np.float32)
    w = quants.dequantize(raw, qt).astype(np.float32)
    got = np.empty((3, 37), np.float32)
    qdot.matvec_range(int(qt), raw, x, got, 0, 37)
    np.testing.assert_array_equal(got.view(np.uint32), lane_reference(w, x).view(np.uint32))
    ref = x.astype(np.float64) @ w.astype(np.float64).T  # and it is a good dot product
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_row_range_and_thread_count(qt):
    raw = random_blocks(qt, 100, 512, seed=5)
    x = np.random.default_rng(6).standard_normal((1, 512)).astype(np.float32)
    out = np.full((1, 100), np.nan, np.float32)
    qdot.matvec_range(int(qt), raw, x, out, 10, 30)  # writes only its rows
    assert np.isnan(out[:, :10]).all() and np.isnan(out[:, 30:]).all() and np.isfinite(out[:, 10:30]).all()
    outs = []
    for n in (1, 2):
        with numba_threads(n):
            outs.append(dequant.matvec_rows(int(qt), raw, x))
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    np.testing.assert_array_equal(outs[0][:, 10:30], out[:, 10:30])


def test_matvec_many_equals_one_by_one():
    weights = [(int(QT.Q4_K), random_blocks(QT.Q4_K, 70, 512, seed=7)),
               (int(QT.Q6_K), random_blocks(QT.Q6_K, 9, 512, seed=8)),
               (int(QT.Q8_0), random_blocks(QT.Q8_0, 33, 512, seed=9))]
    x = np.random.default_rng(10).standard_normal((2, 512)).astype(np.float32)
    for n in (1, 2):
        with numba_threads(n):
            for (qt, raw), got in zip(weights, dequant.matvec_many(weights, x)):
                np.testing.assert_array_equal(got.view(np.uint32), dequant.matvec_rows(qt, raw, x).view(np.uint32))


COLD_PROBE = """
import sys, numpy as np
sys.path.insert(0, sys.argv[2])
from test_gguf_dequant import random_blocks
from gguf import GGMLQuantizationType as QT
from pipeline.kernels import dequant, qgemm
x = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)
out = {}
for qt in (QT.Q4_K, QT.Q6_K, QT.IQ4_XS):
    raw = random_blocks(qt, 40, 512, seed=int(qt))
    out[qt.name + "_mv"] = dequant.matvec_rows(int(qt), raw, x)
    out[qt.name + "_dq"] = dequant.dequantize_rows(int(qt), raw, 512)
    out[qt.name + "_mm"] = qgemm.matmul(int(qt), raw, np.ones((3, 40), np.float32), (40, 512))
np.savez(sys.argv[1], **out)
"""


def test_cold_and_warm_numba_cache_give_identical_bits(tmp_path):
    """The IR intrinsics must compile to the same arithmetic fresh and from numba's cache."""
    import os
    import shutil
    import subprocess
    root = Path(__file__).resolve().parents[2]
    tree = tmp_path / "tree"
    shutil.copytree(root / "pipeline", tree / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tree), NUMBA_CACHE_DIR=str(tmp_path / "numba_cache"))
    outs = []
    for name in ("cold", "warm"):
        path = tmp_path / f"{name}.npz"
        r = subprocess.run([sys.executable, "-c", COLD_PROBE, str(path), str(root / "tests" / "llm")],
                           cwd=tree, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append(np.load(path))
    assert sorted(outs[0].files) == sorted(outs[1].files) and len(outs[0].files) == 9
    for key in outs[0].files:
        np.testing.assert_array_equal(outs[0][key].view(np.uint32), outs[1][key].view(np.uint32), err_msg=key)


@pytest.mark.parametrize("bf16", [False, True], ids=["f16", "bf16"])
def test_half_matvec_bitwise_equals_lane_emulation(bf16):
    """16-bit rows: whole 32-column groups in the lanes, the ragged tail added after the tree."""
    r = np.random.default_rng(11)
    w32 = r.standard_normal((21, 100)).astype(np.float32)
    if bf16:
        bits = (w32.view(np.uint32) >> 16).astype(np.uint16)
        w = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        bits = w32.astype(np.float16).view(np.uint16)
        w = bits.view(np.float16).astype(np.float32)
    x = r.standard_normal((2, 100)).astype(np.float32)
    ref = lane_reference(w[:, :96], x[:, :96])
    for k in range(96, 100):
        ref += w[None, :, k] * x[:, None, k]
    got = dequant.matvec_half(bits, x, bf16=bf16)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
