"""Many-row products with a frozen weight kept in its file format: x @ W.T and g @ W.

Trade-off: the weight W [n_out, n_in] is never materialised in f32 as a whole.
It is cut into tiles on a grid fixed by W's shape alone; each tile is
dequantized into a small per-thread f32 buffer (~TILE_BYTES, stays in L2) and
multiplied by single-threaded BLAS straight into its own slice of the output.
Tiles run on our own threads (pipeline/kernels/workpool.py), so both cores do useful work
(dequantizing and multiplying) instead of OpenBLAS's workers spinning against
ours. No output element sums over more than one tile:
  * x @ W.T tiles W's rows, so a tile owns whole output columns (for few rows
    computed as W_tile @ x.T, a faster BLAS shape, and transposed into place);
  * g @ W tiles W's columns in whole blocks (256 weights for the K-quants),
    so a tile owns whole output columns there too.
Each tile is computed by the same code on the same shapes whatever thread
takes it, so results are bitwise independent of the thread count. Costs: one
f32 tile per thread (at least n_out x 256 x 4 bytes for g @ W on a K-quant),
and one BLAS call per tile (tiles are big enough that this is noise); matmul_t_groups (ES members, lock-step
rows) makes one call per tile for all groups where a probe shows BLAS gives each group its own call's bits.
"""
from __future__ import annotations

import threading

import numpy as np

from . import dequant
from .blas import gemm
from .workpool import run_tiles

F32 = dequant.F32
# f32 tile size: ~3/8 of L2, leaving room for x and BLAS packing; a LoRA step measured 1722 vs 1871 ms
# (MKL) and 2151 vs 2288 ms (OpenBLAS) median against 2 MB tiles: less CPU and shorter dispatch tails
TILE_BYTES = 768 << 10
TRANSPOSE_BELOW_ROWS = 256
_LOCAL = threading.local()


def _unit(qtype: int) -> int:
    """Columns per tile step: one block (F16/BF16: a 32-column group)."""
    if qtype not in dequant.TILE_KERNELS:
        raise ValueError(f"qgemm: no kernel for ggml type {qtype}")
    return dequant.TILE_KERNELS[qtype][1]


def _check_raw(qtype: int, raw, shape):
    n_out, n_in = shape
    raw = np.ascontiguousarray(raw)
    if qtype in (dequant.F16, dequant.BF16):
        raw = raw.view(np.uint16)
        if raw.shape != (n_out, n_in):
            raise ValueError(f"qgemm: 16-bit weight must be [{n_out}, {n_in}], got {raw.shape}")
    elif qtype != F32:
        _, block, size = dequant.TILE_KERNELS.get(qtype, (None, 0, 0))
        if not block:
            raise ValueError(f"qgemm: no kernel for ggml type {qtype}")
        if raw.dtype != np.uint8 or raw.shape != (n_out, n_in // block * size) or n_in % block:
            raise ValueError(f"qgemm: weight [{n_out}, {n_in}] in blocks of {block} ({size} B) must be uint8 "
                             f"[{n_out}, {n_in // block * size}], got {raw.dtype} {raw.shape}")
    return raw


def _buffer(n: int, name: str = "buf") -> np.ndarray:
    """This thread's f32 scratch `name` of at least n elements (grown, never shrunk)."""
    buf = getattr(_LOCAL, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(n, np.float32)
        setattr(_LOCAL, name, buf)
    return buf[:n]


def row_tile(shape) -> int:
    """Rows of W per tile for x @ W.T: ~TILE_BYTES of f32, an even number of tiles (two
    threads finish together), a multiple of 16 rows; from the shape alone."""
    n_out, n_in = shape
    count = max(1, -(-n_out * n_in * 4 // TILE_BYTES))
    if count > 1:
        count += count % 2
    per_tile = -(-n_out // count)
    return max(16, -(-per_tile // 16) * 16)


def col_tile(qtype: int, n_out: int) -> int:
    """Columns of W per tile for g @ W: whole blocks, ~TILE_BYTES of f32 (from the shape alone)."""
    unit = _unit(qtype)
    return max(1, TILE_BYTES // (4 * n_out * unit)) * unit


def matmul_t(qtype: int, raw, x: np.ndarray, shape) -> np.ndarray:
    """x [N, n_in] f32 @ W.T -> [N, n_out] f32, W [n_out, n_in] = `shape` stored as `raw` in format qtype."""
    return matmul_t_many([(qtype, raw, shape)], x)[0]


def matmul_t_many(weights, x: np.ndarray) -> list:
    """[x @ W.T for (qtype, raw, shape) in weights] (weights sharing an input: q/k/v, gate/up),
    all tiles in one dispatch so the threads stay busy to the end. Each output is the same
    as matmul_t's for that weight alone."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    # For up to ~200 rows OpenBLAS runs W @ xT (both operands contiguous, no transpose flags)
    # faster than x @ W.T, even counting the copy of the [rows, N] result back into place
    # (single thread, 128 rows: 111-119 vs 99-103 GFLOP/s; 64 rows: 84 vs 61; equal at 256).
    transposed = x.shape[0] < TRANSPOSE_BELOW_ROWS
    xt = np.ascontiguousarray(x.T) if transposed else None
    tiles, outs = [], []
    for qtype, raw, shape in weights:
        n_out, n_in = shape
        if x.ndim != 2 or x.shape[1] != n_in:
            raise ValueError(f"qgemm.matmul_t: x must be [N, {n_in}] for W {tuple(shape)}, got {x.shape}")
        if qtype == F32:
            raw = np.ascontiguousarray(raw, dtype=np.float32)
        else:
            raw = _check_raw(qtype, raw, shape)
        out = np.empty((x.shape[0], n_out), np.float32)
        rows = row_tile(shape)
        tiles += [(qtype, raw, r0, min(n_out, r0 + rows), out) for r0 in range(0, n_out, rows)]
        outs.append(out)

    def tile(i):
        qtype, raw, r0, r1, out = tiles[i]
        w = _tile_rows(qtype, raw, r0, r1, x.shape[1])
        if transposed:  # the tile's [rows, N] product is copied into place by the same thread
            out[:, r0:r1] = gemm(w, xt, _buffer((r1 - r0) * x.shape[0], "product").reshape(r1 - r0, -1)).T
        else:
            gemm(x, w.T, out[:, r0:r1])

    run_tiles(len(tiles), tile)
    return outs


def _tile_rows(qtype, raw, r0, r1, n_in):
    """Rows r0:r1 of W as f32: a view for F32, else dequantized into this thread's tile buffer."""
    if qtype == F32:
        return raw[r0:r1]
    kernel, unit, _ = dequant.TILE_KERNELS[qtype]
    w = _buffer((r1 - r0) * n_in).reshape(r1 - r0, n_in)
    kernel(raw[r0:r1], w, dequant.HALF_TO_FLOAT, 0, -(-n_in // unit))
    return w


def matmul_t_groups(weights, x3: np.ndarray) -> list:
    """[matmul_t_many(weights, x3[j]) for every group j, stacked to [groups, N, n_out]], each tile of W
    dequantized ONCE for all groups, with every group's bits those of matmul_t_many's call for it alone.
    What the groups share is the dequantization and the streaming of W (ES members scoring the same rows,
    rows decoding in lock-step), and, where `shared_call` finds that BLAS gives each group's rows the same
    bits inside one call over all groups (its general GEMM path), the call itself, in the layout
    matmul_t_many picks for that many rows: one GEMM per tile at the plain forward's efficiency instead of one
    per group (~51-row calls ran at ~105 against ~128 GFLOP/s)."""
    groups, n, n_in = x3.shape
    transposed = n < TRANSPOSE_BELOW_ROWS
    every_transposed = groups * n < TRANSPOSE_BELOW_ROWS
    tiles, outs = [], []
    for qtype, raw, shape in weights:
        if shape[1] != n_in:
            raise ValueError(f"qgemm.matmul_t_groups: x must be [G, N, {shape[1]}] for W {tuple(shape)}, "
                             f"got {x3.shape}")
        raw = np.ascontiguousarray(raw, dtype=np.float32) if qtype == F32 else _check_raw(qtype, raw, shape)
        out = np.empty((groups, n, shape[0]), np.float32)
        rows = row_tile(shape)
        tiles += [(qtype, raw, r0, min(shape[0], r0 + rows), out) for r0 in range(0, shape[0], rows)]
        outs.append(out)
    shared = {r: shared_call(r, n_in, n, groups) for r in {r1 - r0 for _, _, r0, r1, _ in tiles}}
    flat = np.ascontiguousarray(x3, dtype=np.float32).reshape(groups * n, n_in)
    xt = np.ascontiguousarray(flat.T) if every_transposed and any(shared.values()) else None
    xs = [] if all(shared.values()) else [np.ascontiguousarray(x3[j].T if transposed else x3[j], dtype=np.float32)
                                          for j in range(groups)]

    def tile(i):
        qtype, raw, r0, r1, out = tiles[i]
        w = _tile_rows(qtype, raw, r0, r1, n_in)
        if shared[r1 - r0]:  # one call over every group's rows: each group's bits, as alone (probed)
            if every_transposed:
                prod = gemm(w, xt, _buffer((r1 - r0) * groups * n, "product").reshape(r1 - r0, -1))
                out[:, :, r0:r1] = prod.reshape(r1 - r0, groups, n).transpose(1, 2, 0)
            else:
                gemm(flat, w.T, out.reshape(groups * n, -1)[:, r0:r1])
            return
        for j in range(groups):  # matmul_t_many's call for group j alone, on the tile dequantized once
            if transposed:
                out[j, :, r0:r1] = gemm(w, xs[j], _buffer((r1 - r0) * n, "product").reshape(r1 - r0, -1)).T
            else:
                gemm(xs[j], w.T, out[j, :, r0:r1])

    run_tiles(len(tiles), tile)
    return outs


_SHARED = {}  # (tile rows, n_in, rows per group, groups, layout) -> shared_call's answer


def _product(w, x):
    """x @ w.T in matmul_t_many's layout for len(x) rows (W @ x.T below TRANSPOSE_BELOW_ROWS), one BLAS call."""
    if len(x) < TRANSPOSE_BELOW_ROWS:
        return gemm(w, np.ascontiguousarray(x.T), np.empty((len(w), len(x)), np.float32)).T
    return gemm(x, w.T, np.empty((len(x), len(w)), np.float32))


_LAYOUTS = {"matmul_t_many": _product,  # this module's tiles
            "x_wt": lambda w, x: gemm(x, w.T, np.empty((len(x), len(w)), np.float32))}  # kernels.nn.matmul_nt's


def shared_call(rows: int, n_in: int, n: int, groups: int, layout: str = "matmul_t_many") -> bool:
    """Whether ONE BLAS call over `groups` groups of n rows (in `layout`'s form for groups * n rows) gives every
    group's rows the bits of the group's own call (its form for n rows), for a W tile [rows, n_in]; probed
    once per shape on random operands. Layouts: matmul_t_many's (W @ x.T below TRANSPOSE_BELOW_ROWS rows,
    else x @ W.T) and x_wt (always x @ W.T, kernels.nn.matmul_nt's tiles).

    Why a probe and not a rule: OpenBLAS computes each output element the same way wherever its row sits, and
    in either operand order, on its general GEMM path, but small products (measured: M*N*K below ~0.6-1e6 on
    its SkylakeX kernels) and single rows take other kernels with other summation orders. Which path a call
    takes depends on the shapes (and the library), never on the values, so one comparison per shape decides
    it for every operand of that shape, on whatever BLAS is loaded; a mismatch keeps one call per group."""
    key = (rows, n_in, n, groups, layout)
    product = _LAYOUTS[layout]
    if groups < 2:
        return False
    if key not in _SHARED:
        from .workpool import single_thread_blas
        rng = np.random.default_rng(0)
        w = rng.standard_normal((rows, n_in), dtype=np.float32)
        x = rng.standard_normal((groups * n, n_in), dtype=np.float32)
        with single_thread_blas():
            every = product(w, x)
            _SHARED[key] = all(np.array_equal(every[j * n:(j + 1) * n], product(w, x[j * n:(j + 1) * n]))
                               for j in range(groups))
    return _SHARED[key]


def matmul(qtype: int, raw, g: np.ndarray, shape) -> np.ndarray:
    """g [N, n_out] f32 @ W -> [N, n_in] f32 (the input gradient of a frozen linear layer)."""
    n_out, n_in = shape
    g = np.ascontiguousarray(g, dtype=np.float32)
    if g.ndim != 2 or g.shape[1] != n_out:
        raise ValueError(f"qgemm.matmul: g must be [N, {n_out}] for W {tuple(shape)}, got {g.shape}")
    if qtype == F32:
        return g @ np.asarray(raw, np.float32)
    raw = _check_raw(qtype, raw, shape)
    kernel, unit, _ = dequant.TILE_KERNELS[qtype]
    cols = col_tile(qtype, n_out)
    out = np.empty((g.shape[0], n_in), np.float32)

    def tile(i):
        c0, c1 = i * cols, min(n_in, (i + 1) * cols)
        w = _buffer(n_out * (c1 - c0)).reshape(n_out, c1 - c0)
        kernel(raw, w, dequant.HALF_TO_FLOAT, c0 // unit, (c1 + unit - 1) // unit)
        gemm(g, w, out[:, c0:c1])

    run_tiles((n_in + cols - 1) // cols, tile)
    return out
