"""The tiled integer GEMM (pipeline/kernels/qtile.py), K-quant and 32-element kinds: bitwise its numpy model (int64
block totals, long-double FMAs), for any row grouping, tile cut and thread count; close to llama.cpp's vec_dot
arithmetic (qint_gemm.py) and to the dequantized product."""
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pipeline.kernels import qint, qint_gemm, qtile
from pipeline.threads import numba_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "llm"))
from test_gguf_dequant import random_blocks  # noqa: E402
from test_qint import block_integers, fma32, ref_quantize_q8_0, ref_quantize_q8_1, ref_quantize_q8_k  # noqa: E402


FORMATS = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.IQ4_XS, QT.Q2_K]  # Q3_K, IQ4_XS: in Q6_K's layout
B32 = [QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_1, QT.Q5_1]  # the 32-element kinds (Q4_1/Q5_1 against Q8_1 activations)


def tiled_model(qt, raw, x):
    """The module docstring's arithmetic in numpy: T and M exact in int64, each fma rounded once from long
    double, out = acc - accm in f32 (Q6_K: no mins, accm 0)."""
    n = x.shape[1]
    q, yd = ref_quantize_q8_k(x)
    w, scale, wd, extra = block_integers(qt, raw, n)
    rows, blocks = raw.shape[0], n // 256
    out = np.empty((x.shape[0], rows), np.float32)
    for i in range(x.shape[0]):
        totals = (w * scale * q[i]).reshape(rows, blocks, 256).sum(axis=-1).astype(np.float32)  # exact, sitofp
        acc, accm = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        for b in range(blocks):
            acc = fma32((yd[i, b] * wd[:, b]).astype(np.float32), totals[:, b], acc)
        if extra is not None:
            dmin, mins = extra
            group = 256 // mins.shape[-1]  # the mins' sub-block: 32 elements (Q4_K/Q5_K), 16 (Q2_K)
            sums = q[i].reshape(blocks, mins.shape[-1], group).sum(axis=-1)                     # [blocks, subs]
            m = (mins * sums).sum(axis=-1).astype(np.float32)                                   # [rows, blocks]
            for b in range(blocks):
                accm = fma32((yd[i, b] * dmin[:, b]).astype(np.float32), m[:, b], accm)
        out[i] = acc - accm
    return out


def b32_model(qt, raw, x):
    """The 32-element kinds in numpy: per block T = sum(x * w) exact in int64 (the kernel's (x + 128) . w - 128 *
    sum(w)), acc = fma(f32(d_x * d_w), f32(T), acc) rounded once from long double; the activations are Q8_0's
    (fp16 scales, as llama.cpp's). Q4_1/Q5_1: Q8_1 activations, then acc = fma(m_w, s_x, acc) per block."""
    n = x.shape[1]
    if qt in (QT.Q4_1, QT.Q5_1):
        q, yd, ys = ref_quantize_q8_1(x)
    else:
        (q, yd), ys = ref_quantize_q8_0(x), None
    w, _, wd, m = block_integers(qt, raw, n)
    rows, blocks = raw.shape[0], n // 32
    out = np.empty((x.shape[0], rows), np.float32)
    for i in range(x.shape[0]):
        totals = (w * q[i]).reshape(rows, blocks, 32).sum(axis=-1).astype(np.float32)  # exact: |T| < 2^24
        acc = np.zeros(rows, np.float32)
        for b in range(blocks):
            acc = fma32((yd[i, b] * wd[:, b]).astype(np.float32), totals[:, b], acc)
            if ys is not None:
                acc = fma32(m[:, b], np.full(rows, ys[i, b], np.float32), acc)
        out[i] = acc
    return out


def ggml_model(qt, raw, x):
    """llama.cpp's AVX2 tiled epilogue (llama-numerics): per block r = f32(d_r * f32(T)), r = fma(-dmin_r,
    f32(M), r), acc = fma(r, d_i, acc)."""
    n = x.shape[1]
    q, yd = ref_quantize_q8_k(x)
    w, scale, wd, extra = block_integers(qt, raw, n)
    rows, blocks = raw.shape[0], n // 256
    out = np.empty((x.shape[0], rows), np.float32)
    for i in range(x.shape[0]):
        totals = (w * scale * q[i]).reshape(rows, blocks, 256).sum(axis=-1).astype(np.float32)
        if extra is not None:
            dmin, mins = extra
            sums = q[i].reshape(blocks, mins.shape[-1], 256 // mins.shape[-1]).sum(axis=-1)
            m = (mins * sums).sum(axis=-1).astype(np.float32)
        acc = np.zeros(rows, np.float32)
        for b in range(blocks):
            r = (wd[:, b] * totals[:, b]).astype(np.float32)
            if extra is not None:
                r = fma32(-dmin[:, b].astype(np.float32), m[:, b], r)
            acc = fma32(r, np.full(rows, yd[i, b], np.float32), acc)
        out[i] = acc
    return out


def tiled(qt, raw, x, ggml_avx2=False):
    return qtile.matmul_t_many([(int(qt), raw, qtile.pack(int(qt), raw))], x, ggml_avx2)[0]


@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_ggml_avx2_variant_bitwise_equals_its_model(qt):
    raw = random_blocks(qt, 37, 768, seed=3)
    x = np.random.default_rng(4).standard_normal((5, 768)).astype(np.float32)
    x[1, :256] *= 1e-3
    with np.errstate(invalid="ignore"):
        want = ggml_model(qt, raw, x)
    np.testing.assert_array_equal(tiled(qt, raw, x, True).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_tiled_gemm_bitwise_equals_its_model(qt):
    """37 weight rows (a partial last tile), 2 * ROWS + 3 activation rows (a tail taken one row at a time), a
    quiet block and an all-zero one; and within a few f32 roundings of vec_dot's arithmetic."""
    raw = random_blocks(qt, 37, 768, seed=3)
    x = np.random.default_rng(4).standard_normal((2 * qtile.ROWS + 3, 768)).astype(np.float32)
    x[1, :256] *= 1e-3
    x[5, 256:512] = 0.0
    got = tiled(qt, raw, x)
    with np.errstate(invalid="ignore"):  # the model's 0 * inf on the zero block, masked to q = 0 there
        want = tiled_model(qt, raw, x)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    vec_dot = (qint_gemm if qint_gemm.supports(qt) else qint).matmul_t_many([(int(qt), raw)], x)[0]
    np.testing.assert_allclose(got, vec_dot, rtol=0, atol=1e-5 * float(np.abs(vec_dot).max()))


@pytest.mark.parametrize("qt", FORMATS, ids=lambda q: q.name)
def test_largest_weights_and_activations_stay_exact(qt):
    """Every quant, scale and min at its top (Q6_K: its int8 scales at -128 and +127, the weights at -32 and
    +31) and activations at +-127: the largest integer totals and, for Q6_K, the largest unsigned activations
    (+128) against the most negative weights."""
    size = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210, QT.Q3_K: 110, QT.IQ4_XS: 136, QT.Q2_K: 84}[qt]
    raw = random_blocks(qt, 20, 512, seed=8).reshape(20, 2, size)
    if qt == QT.Q2_K:  # weights 3 with scales and mins 15, then scales 15 and mins 0
        raw[:, :, 16:80], raw[:10, :, :16], raw[10:, :, :16] = 0xFF, 0xFF, 0x0F
    elif qt == QT.IQ4_XS:  # weights 113 with scales 31, then -127 with scales -32: the widest sums
        raw[:10, :, 2:], raw[10:, :, 2:] = 0xFF, 0x00
    elif qt == QT.Q3_K:  # weights 3 with scales 31, then weights -4 (no high bits) with scales -32
        raw[:10, :, :108], raw[10:, :, :108] = 0xFF, 0x00
    elif qt == QT.Q6_K:
        raw[:10, :, :208], raw[10:, :, :192] = 0xFF, 0x00  # weights 31 (scales -1) / -32 ...
        raw[10:, :, 192:208] = np.array([0x80, 0x7F] * 8, np.uint8)  # ... with scales -128 and 127
    else:
        raw[..., 4:] = 0xFF
    raw = raw.reshape(20, -1)
    x = np.ones((qtile.ROWS + 1, 512), np.float32)
    x[1::2] = -1.0
    np.testing.assert_array_equal(tiled(qt, raw, x).view(np.uint32), tiled_model(qt, raw, x).view(np.uint32))


@pytest.mark.parametrize("qt", B32, ids=lambda q: q.name)
def test_b32_tiles_bitwise_equals_their_model(qt):
    """37 weight rows (a partial last tile), 640 inputs (20 blocks: not a whole K-quant block), 2 * ROWS + 3
    activation rows (a tail one row at a time), a quiet block and an all-zero one; within a few f32 roundings of
    the dequantized weights times the dequantized Q8_0 activations (float64; Q4_1/Q5_1's mins times Q8_1's
    block sums), and of vec_dot's arithmetic."""
    raw = random_blocks(qt, 37, 640, seed=3)
    x = np.random.default_rng(4).standard_normal((2 * qtile.ROWS + 3, 640)).astype(np.float32)
    x[1, :32] *= 1e-3
    x[5, 96:128] = 0.0
    got = tiled(qt, raw, x)
    np.testing.assert_array_equal(got.view(np.uint32), b32_model(qt, raw, x).view(np.uint32))
    q, yd = ref_quantize_q8_0(x)
    w, _, wd, m = block_integers(qt, raw, 640)
    xq = q.reshape(len(x), -1, 32) * yd[..., None].astype(np.float64)
    exact = xq.reshape(len(x), 640) @ (w.reshape(37, -1, 32) * wd[..., None].astype(np.float64)).reshape(37, 640).T
    if m is not None:  # Q4_1/Q5_1's mins against Q8_1's block sums s (llama.cpp's fp16 d * sum(q))
        exact += ref_quantize_q8_1(x)[2].astype(np.float64) @ m.T.astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5 * float(np.abs(exact).max()))
    vec_dot = qint_gemm.matmul_t_many([(int(qt), raw)], x)[0]
    np.testing.assert_allclose(got, vec_dot, rtol=0, atol=1e-5 * float(np.abs(vec_dot).max()))


@pytest.mark.parametrize("qt", B32, ids=lambda q: q.name)
def test_b32_largest_weights_and_activations_bitwise_equals_their_model(qt):
    """The weights at their ends (Q8_0: -128 and 127; Q4_0: -8, 7; Q5_0: -16, 15) against activations +-127:
    the largest totals, the largest unsigned activations (+128 offset) on the most negative weights (Q8_0's
    pair sums would saturate vpmaddubsw's i16: its kind takes wide sums without VNNI)."""
    size = {QT.Q8_0: 34, QT.Q4_0: 18, QT.Q5_0: 22, QT.Q4_1: 20, QT.Q5_1: 24}[qt]
    at = 4 if qt in (QT.Q4_1, QT.Q5_1) else 2  # the weights' bytes after the fp16 fields
    raw = random_blocks(qt, 20, 256, seed=8).reshape(20, 8, size)
    raw[:10, :, at:] = 0xFF if qt != QT.Q8_0 else 0x7F
    raw[10:, :, at:] = 0x00 if qt != QT.Q8_0 else 0x80
    raw = raw.reshape(20, -1)
    x = np.full((qtile.ROWS + 1, 256), 127.0, np.float32)
    x[1::2] = -127.0
    np.testing.assert_array_equal(tiled(qt, raw, x).view(np.uint32), b32_model(qt, raw, x).view(np.uint32))


def test_b32_thread_count_and_grouping_keep_the_bits():
    """A 32-element weight beside K-quant ones in one dispatch (each with its own activations), more tiles than
    a piece, 1 vs 2 threads; a row's bits the same in any group and alone."""
    raw8, raw5 = random_blocks(QT.Q8_0, 16 * qtile.PIECE_TILES + 20, 256, seed=5), random_blocks(QT.Q5_0, 24, 256)
    raw_k = random_blocks(QT.Q4_K, 24, 256, seed=6)
    weights = [(int(qt), raw, qtile.pack(int(qt), raw)) for qt, raw in ((QT.Q8_0, raw8), (QT.Q4_K, raw_k),
                                                                        (QT.Q5_0, raw5))]
    x = np.random.default_rng(6).standard_normal((11, 256)).astype(np.float32)
    outs = [_same_bits_on_1_and_2_threads(weights, x)]
    np.testing.assert_array_equal(qtile.matmul_t_many(weights[1:2], x)[0], outs[0][1])
    np.testing.assert_array_equal(qtile.matmul_t_many(weights[:1], x[1:])[0], outs[0][0][1:])
    np.testing.assert_array_equal(qtile.matmul_t_many(weights[2:], x[6:7])[0], outs[0][2][6:7])


def _same_bits_on_1_and_2_threads(weights, x):
    """matmul_t_many's outputs, checked bitwise equal on 1 and 2 threads."""
    outs = []
    for n in (1, 2):
        with numba_threads(n):
            outs.append(qtile.matmul_t_many(weights, x))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    return outs[0]


def test_bits_do_not_depend_on_threads_cut_or_grouping():
    """More tiles than one piece, two weights in one dispatch, 1 vs 2 threads; a row's bits are the same
    whichever group it falls in (shifted by one row, or alone)."""
    raw_a, raw_b = random_blocks(QT.Q4_K, 16 * qtile.PIECE_TILES + 20, 256, seed=5), random_blocks(QT.Q6_K, 24, 256)
    weights = [(int(QT.Q4_K), raw_a, qtile.pack(int(QT.Q4_K), raw_a)),
               (int(QT.Q6_K), raw_b, qtile.pack(int(QT.Q6_K), raw_b))]
    x = np.random.default_rng(6).standard_normal((11, 256)).astype(np.float32)
    outs = [_same_bits_on_1_and_2_threads(weights, x)]
    np.testing.assert_array_equal(qtile.matmul_t_many(weights[:1], x[1:])[0], outs[0][0][1:])
    np.testing.assert_array_equal(qtile.matmul_t_many(weights[1:], x[6:7])[0], outs[0][1][6:7])


def test_bad_input_is_refused():
    q4 = int(QT.Q4_K)
    raw = random_blocks(QT.Q4_K, 4, 256)
    x = np.zeros((8, 256), np.float32)
    with pytest.raises(ValueError, match="do not belong"):
        qtile.matmul_t_many([(q4, raw, qtile.pack(q4, random_blocks(QT.Q4_K, 40, 256)))], x)
    with pytest.raises(ValueError, match="do not belong"):  # another format's tiles
        qtile.matmul_t_many([(q4, raw, qtile.pack(int(QT.Q6_K), random_blocks(QT.Q6_K, 4, 256)))], x)
    with pytest.raises(ValueError, match="row of 256 elements"):
        qtile.matmul_t_many([(q4, random_blocks(QT.Q4_K, 4, 512), qtile.pack(q4, raw))], x)
    with pytest.raises(ValueError, match="no tiled kernel"):
        qtile.matmul_t_many([(int(QT.IQ4_NL), random_blocks(QT.IQ4_NL, 4, 256), qtile.pack(q4, raw))], x)
    raw8 = random_blocks(QT.Q8_0, 4, 256)
    with pytest.raises(ValueError, match="no tiled kernel"):  # llama.cpp's tiled arithmetic: the K-quants only
        qtile.matmul_t_many([(int(QT.Q8_0), raw8, qtile.pack(int(QT.Q8_0), raw8))], x, True)
    with pytest.raises(ValueError, match="do not belong"):  # a K-quant's tiles for a Q8_0 weight
        qtile.matmul_t_many([(int(QT.Q8_0), random_blocks(QT.Q8_0, 4, 256), qtile.pack(q4, raw))], x)
    with pytest.raises(ValueError, match="must be"):
        qtile.matmul_t_many([(q4, raw, qtile.pack(q4, raw))], np.zeros(256, np.float32))


def test_frozen_weight_takes_the_tiles_from_a_prompt_on_and_keeps_vec_dot_below():
    """FrozenWeight: TILE_MIN_ROWS rows and more through the tiles (made once, kept), fewer rows with
    llama.cpp's vec_dot bits; a weight's bits do not depend on the weights it is called with (here a Q8_0 one
    on the row kernels)."""
    from pipeline.autograd import no_grad
    from pipeline.llm.quants import FORMATS, FrozenWeight, matmul_t_many
    raw = random_blocks(QT.Q4_K, 40, 512, seed=9)
    w = FrozenWeight(FORMATS[QT.Q4_K], raw, (40, 512))
    w8 = FrozenWeight(FORMATS[QT.Q8_0], random_blocks(QT.Q8_0, 24, 512, seed=10), (24, 512))
    x = np.random.default_rng(11).standard_normal((FrozenWeight.TILE_MIN_ROWS, 512)).astype(np.float32)
    with no_grad():
        np.testing.assert_array_equal(w.matmul_t(x), tiled(QT.Q4_K, raw, x))
        assert w.tiles() is w.tiles()
        few = x[:FrozenWeight.TILE_MIN_ROWS - 1]
        np.testing.assert_array_equal(w.matmul_t(few), qint_gemm.matmul_t_many([(int(QT.Q4_K), raw)], few)[0])
        w8.llama_numerics = True  # Q8_0 on the integer row kernels at any row count, beside the tiled Q4_K
        both = matmul_t_many([w8, w], x)
        np.testing.assert_array_equal(both[1], w.matmul_t(x))
        np.testing.assert_array_equal(both[0], w8.matmul_t(x))
        w.tiled = False  # the switch: vec_dot's bits at any row count
        np.testing.assert_array_equal(w.matmul_t(x), qint_gemm.matmul_t_many([(int(QT.Q4_K), raw)], x)[0])


def test_32_element_tiles_serve_inference_prompts_only():
    """Q8_0 / Q5_0 (formats.py: f32_prompt and prompt_tiles): a weight opened for inference takes the tiles
    from TILE_MIN_ROWS rows, the f32 GEMM below and the row kernels for a decode; any other no-grad forward keeps
    f32 prompts (the training forward's arithmetic); llama numerics keep vec_dot's bits at any row count."""
    from pipeline.autograd import no_grad
    from pipeline.kernels import qgemm
    from pipeline.llm.quants import FORMATS, FrozenWeight
    x = np.random.default_rng(12).standard_normal((FrozenWeight.TILE_MIN_ROWS, 256)).astype(np.float32)
    for qt in (QT.Q8_0, QT.Q5_0):
        raw = random_blocks(qt, 40, 256, seed=13)
        w = FrozenWeight(FORMATS[qt], raw, (40, 256))
        f32 = qgemm.matmul_t(int(qt), raw, x, (40, 256))
        with no_grad():
            np.testing.assert_array_equal(w.matmul_t(x), f32)  # not marked: the f32 tiles
            assert w.tile_bytes == 0
            w.inference = True
            np.testing.assert_array_equal(w.matmul_t(x), tiled(qt, raw, x))
            assert w.tile_bytes > 0
            few = x[:FrozenWeight.TILE_MIN_ROWS - 1]
            np.testing.assert_array_equal(w.matmul_t(few), qgemm.matmul_t(int(qt), raw, few, (40, 256)))
            np.testing.assert_array_equal(w.matmul_t(x[:1]), qint.matmul_t_many([(int(qt), raw)], x[:1])[0])
            w.tiled = False
            np.testing.assert_array_equal(w.matmul_t(x), f32)
            w.tiled, w.llama_numerics = True, True
            np.testing.assert_array_equal(w.matmul_t(x), qint_gemm.matmul_t_many([(int(qt), raw)], x)[0])
        w.llama_numerics = False
        np.testing.assert_array_equal(w.matmul_t(x), f32)  # gradients on: f32 whatever the flags


def test_for_inference_marks_the_block_projections_only():
    from pathlib import Path as P
    from pipeline.llm.quants import FrozenWeight, for_inference
    from pipeline.models.registry import load_model
    model = load_model(P(__file__).resolve().parents[1] / "fixtures" / "qwen3-mini-q8_0.gguf")
    weights = {n: w for n, w in model.named_weights().items() if isinstance(w, FrozenWeight)}
    assert not any(w.inference for w in weights.values())
    for_inference(model)
    assert all(w.inference == n.startswith("blk.") for n, w in weights.items()) and weights["token_embd.weight"]


def test_fucina_tiles_0_turns_the_tiles_off(tmp_path):
    """FUCINA_TILES=0 in the environment: FrozenWeight.tiled starts False (a fresh process)."""
    import os
    import subprocess
    probe = "from pipeline.llm.quants import FrozenWeight; print(FrozenWeight.tiled)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = dict(os.environ, FUCINA_TILES=value, NUMBA_CACHE_DIR=str(tmp_path))
        seen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert seen.stdout.strip() == expected
