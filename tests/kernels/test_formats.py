"""pipeline/kernels/formats.py, the one table of format facts: its sizes against gguf-py's, and every kernel table built
from it against what the kernels do with a random block of each row."""
import numpy as np
import pytest

from pipeline.kernels import dequant, formats, qdot, qint, qint_gemm, qtile, quantize
from pipeline.kernels.formats import FORMATS, PARTNER_BLOCK

ROWS = 3


def _random_rows(fmt, n_blocks, seed):
    """ROWS rows of n_blocks random blocks whose fp16 scales are small finite halves (any other byte is a valid
    quant), or random f16/bf16 values for the 16-bit rows."""
    rng = np.random.default_rng(seed)
    if not fmt.quantized:
        values = rng.standard_normal((ROWS, n_blocks * dequant.HALF_GROUP)).astype(np.float32)
        return values.astype(np.float16).view(np.uint16) if fmt.name == "F16" else quantize.to_bf16_bits(values)
    raw = rng.integers(0, 256, (ROWS, n_blocks, fmt.block_bytes), dtype=np.uint8)
    for at, scale in ((fmt.d_at, 0.01), (fmt.dmin_at, 0.004)):
        if at >= 0:
            halves = (rng.uniform(0.5, 1.5, (ROWS, n_blocks)) * scale).astype(np.float16)
            raw[:, :, at:at + 2] = halves.view(np.uint8).reshape(ROWS, n_blocks, 2)
    return raw.reshape(ROWS, -1)


def test_sizes_are_gguf_pys():
    gguf = pytest.importorskip("gguf")
    for fmt in FORMATS:
        qt = gguf.GGMLQuantizationType(fmt.qtype)
        assert qt.name == fmt.name
        assert gguf.GGML_QUANT_SIZES[qt] == (fmt.block, fmt.block_bytes), fmt.name


def test_rows_are_consistent():
    assert len({f.qtype for f in FORMATS}) == len({f.name for f in FORMATS}) == len(FORMATS)
    for fmt in formats.BLOCK_FORMATS:
        assert 0 <= fmt.d_at <= fmt.block_bytes - 2, fmt.name
        assert fmt.dmin_at == -1 or 0 <= fmt.dmin_at <= fmt.block_bytes - 2, fmt.name
        if fmt.partner:
            assert fmt.block % PARTNER_BLOCK[fmt.partner] == 0, fmt.name
        assert formats.GEOMETRY[fmt.qtype] == fmt.scales
        assert formats.block_sizes(fmt.qtype) == (fmt.block, fmt.block_bytes)
    assert formats.format_of(999) is None
    with pytest.raises(ValueError, match="no row for ggml type 999"):
        formats.block_sizes(999)


def test_every_dispatch_table_is_the_tables():
    has = lambda field: {f.qtype for f in FORMATS if getattr(f, field)}
    assert set(dequant.TILE_KERNELS) == has("dequant")
    assert set(qdot.MATVEC) == has("dot")
    assert set(qint.KERNELS) == has("idot") == set(qint.PARTNER) == set(qint.NEEDS)
    assert set(qint_gemm.KERNELS) == has("gemm")
    assert all(formats.BY_QTYPE[q].partner for q in qint_gemm.KERNELS)  # a blocked GEMM has row kernels beside it
    assert all(f.gemm for f in FORMATS if f.f32_prompt)  # f32_prompt only says where the default mode skips one
    assert set(qtile.KINDS) == {f.qtype for f in FORMATS if f.tile_kind >= 0}
    assert set(quantize.BLOCK) == {f.quantize for f in FORMATS if f.quantize}
    assert all(qint.supports(f.qtype) == bool(f.partner) for f in FORMATS)
    from pipeline.llm.quants import FORMATS as LOADED
    assert {int(q): (f.block_size, f.type_size, f.quantized) for q, f in LOADED.items()} == {
        f.qtype: (f.block, f.block_bytes, f.quantized) for f in FORMATS}


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.dequant], ids=lambda f: f.name)
def test_each_rows_kernels_on_a_random_block(fmt):
    """Dequant of a random valid block gives the row's element count; the fused matvec against the identity
    gives the same values exactly (one nonzero product per output); the integer dot, where the row has one,
    is llama.cpp's 8-bit rounding of the same product; the tiles, where it has them, have their layout's size."""
    n_blocks = 2
    raw = _random_rows(fmt, n_blocks, seed=fmt.qtype)
    n = n_blocks * (fmt.block if fmt.quantized else dequant.HALF_GROUP)
    w = dequant.dequantize_rows(fmt.qtype, raw, n) if fmt.quantized else None
    if w is None:
        w = (raw.view(np.float16).astype(np.float32) if fmt.name == "F16"
             else (raw.astype(np.uint32) << 16).view(np.float32))
    else:
        assert w.shape == (ROWS, n) and np.isfinite(w).all()
        assert formats.BY_QTYPE[fmt.qtype].row_bytes(n) == raw.shape[1]
    eye = np.eye(n, dtype=np.float32)
    assert np.array_equal(dequant.matvec_many([(fmt.qtype, raw)], eye)[0], w.T)
    if fmt.partner:
        x = np.random.default_rng(1).standard_normal((2, n)).astype(np.float32)
        y = qint.matmul_t_many([(fmt.qtype, raw)], x)[0]
        exact = x.astype(np.float64) @ w.T.astype(np.float64)
        bound = 0.02 * np.abs(x).sum(axis=1, keepdims=True) * np.abs(w).max()
        assert np.all(np.abs(y - exact) <= bound), fmt.name
    if fmt.tile_kind >= 0:
        tiles = qtile.pack(fmt.qtype, raw)
        assert tiles.shape == (1, n_blocks, qtile.TILE_BLOCK[fmt.tile_kind])


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f.quantize], ids=lambda f: f.name)
def test_each_encoder_writes_the_rows_bytes(fmt):
    x = np.random.default_rng(fmt.qtype).standard_normal((ROWS, 2 * fmt.block)).astype(np.float32)
    raw = quantize.quantize(x, fmt.quantize)
    assert raw.shape == (ROWS, fmt.row_bytes(x.shape[1]))
    back = dequant.dequantize_rows(fmt.qtype, raw, x.shape[1])
    assert np.abs(back - x).max() <= 0.25 * np.abs(x).max()
