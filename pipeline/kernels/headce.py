"""Output-head cross-entropy in ONE pass over the weight: loss and input gradient together.

For a frozen head W [C, H] and inputs X [N, H], the loss needs the softmax of
X @ W.T and the input gradient needs softmax @ W - W[y]. Both are computed per
chunk of vocabulary rows while the chunk is still in cache: the chunk's logits,
an online softmax (running max m, running sum s, rescaled when the max grows)
and acc = acc * rescale + P_chunk @ W_chunk. Nothing of size [N, C] ever exists
and W streams from memory once instead of twice.

Trade-off: the input gradient is computed in the forward (the backward only
scales it per row), so it costs the second GEMM even if no backward follows,
and there is no weight gradient (callers use this only for a frozen W).
The vocabulary is cut into segments of SEGMENT_ROWS on a grid fixed by C alone;
each segment is one task run by ONE thread with the same serial code, and the
segments are merged serially in segment order, so the bits never depend on the
thread count.

The weight is a dense f32 array, or a row source (RowSource: a frozen head kept in its file format): each
chunk of rows is then dequantized into a per-segment buffer just before its two GEMMs, so no f32 copy of the
whole head ever exists (Gemma 3's 262144 x 640 head: 671 MB) and the GEMMs see the values, so the bits, that
the dense copy held.

Orientation: logits are computed transposed, W_c @ X.T -> [R, N], because
single-threaded OpenBLAS ran that ~10% faster than X @ W_c.T for N ~ 100 rows
(2026-11-29); the softmax kernel then works down columns, vectorized across
the N rows of X. Measured (docs/BENCHMARKS.md): x1.09 / x1.16 on the head
alone at 1 / 2 threads; both GEMMs were already near OpenBLAS's peak, so the gain
is the removed [N, C] buffer and CE passes more than the halved W traffic.
"""
import numpy as np
from numba import njit

from pipeline.kernels.fastexp import TILE, expf
from pipeline.kernels.blas import gemm
from pipeline.kernels.workpool import run_tiles

SEGMENT_ROWS = 8192  # vocabulary rows per task (one thread); 151936 -> 19 tasks balance 2 threads
CHUNK_ROWS = 1024    # vocabulary rows per GEMM pair: 4 MB of W at H = 1024, in cache for the second GEMM


@njit(cache=True)
def _chunk_softmax(lt, c0, labels, m, s, label_logit, rescale, col_max, tile_sum):
    """One chunk's online-softmax step, in place, on transposed logits.

    lt [R, N] float32 = W[c0:c0+R] @ X.T, overwritten with P = exp(lt - m_new);
    m [N] float32 running max (-inf before the first chunk); s [N] float64 running
    sum of exp(logit - m), rescaled here to the new max; label_logit [N] float32 set
    where labels[i] falls in the chunk; rescale [N] float32 out = exp(m_old - m_new),
    the factor for the accumulator. col_max, tile_sum [N] float32 are scratch.
    Loops run across the N columns (contiguous), so each is an elementwise SIMD
    loop with no reassociation: sums are float32 over TILE rows, then float64."""
    r, n = lt.shape
    for i in range(n):
        y = labels[i] - c0
        if 0 <= y < r:
            label_logit[i] = lt[y, i]
        col_max[i] = m[i]
    for j in range(r):
        row = lt[j]
        for i in range(n):
            v = row[i]
            # a NaN sticks (v != v), so NaN logits give a NaN loss as in pipeline/kernels/losses.py
            # (fastexp's exp maps NaN to 0, which would hide it)
            col_max[i] = v if (v > col_max[i] or v != v) else col_max[i]
    for i in range(n):
        f = 1.0
        if not col_max[i] <= m[i]:  # the max grew (or is NaN: then f, s, acc all turn NaN)
            f = np.exp(np.float64(m[i]) - np.float64(col_max[i]))  # 0 on the first chunk (m = -inf)
            m[i] = col_max[i]
        s[i] *= f
        rescale[i] = np.float32(f)
    for t0 in range(0, r, TILE):
        for i in range(n):
            tile_sum[i] = np.float32(0.0)
        for j in range(t0, min(r, t0 + TILE)):
            row = lt[j]
            for i in range(n):
                e = expf(row[i] - m[i])
                row[i] = e
                tile_sum[i] += e
        for i in range(n):
            s[i] += np.float64(tile_sum[i])


@njit(cache=True)
def _rescale_add(acc, part, rescale):
    """acc [N, H] = acc * rescale[:, None] + part (float32; rows with rescale 1 only add)."""
    n, h = acc.shape
    for i in range(n):
        f = rescale[i]
        a = acc[i]
        p = part[i]
        if f == np.float32(1.0):
            for j in range(h):
                a[j] += p[j]
        else:
            for j in range(h):
                a[j] = a[j] * f + p[j]


@njit(cache=True)
def _add_rows(w, total):
    """total [H] float64 += sum of the rows of w [R, H], in row order."""
    for j in range(w.shape[0]):
        row = w[j]
        for k in range(row.shape[0]):
            total[k] += np.float64(row[k])


class RowSource:
    """What head_ce reads a head from instead of a dense W: `shape` (C, H), `dtype` float32,
    `rows_into(a, b, out)` writing W[a:b] as f32 into out [b - a, H] on the calling thread (head_ce calls it
    from its tasks, so it must not dispatch to the workers itself), and `rows(ids)` -> W[ids] f32."""
    shape: tuple
    dtype = np.dtype(np.float32)

    def rows_into(self, a, b, out):
        raise NotImplementedError

    def rows(self, ids):
        raise NotImplementedError


def _segment(XT, W, labels, c0, c1, chunk_rows, want_row_sum):
    """Online softmax over vocabulary rows c0..c1 of W (an array or a RowSource), one thread, chunk by chunk.
    -> (m [N] f32, s [N] f64, label_logit [N] f32, acc [N, H] f32 = sum_c exp(logit - m) W[c],
    row_sum [H] f64 = sum_c W[c] or None)."""
    h, n = XT.shape
    chunk_rows = min(chunk_rows, c1 - c0)
    m = np.full(n, -np.inf, np.float32)
    s = np.zeros(n, np.float64)
    label_logit = np.zeros(n, np.float32)
    rescale = np.empty(n, np.float32)
    col_max = np.empty(n, np.float32)
    tile_sum = np.empty(n, np.float32)
    acc = np.empty((n, h), np.float32)
    part = np.empty((n, h), np.float32)
    logits = np.empty((chunk_rows, n), np.float32)
    row_sum = np.zeros(h, np.float64) if want_row_sum else None
    dense = isinstance(W, np.ndarray)
    buf = None if dense else np.empty((chunk_rows, h), np.float32)
    for a in range(c0, c1, chunk_rows):
        b = min(c1, a + chunk_rows)
        lt = logits[:b - a]
        if dense:
            w_chunk = W[a:b]
        else:
            w_chunk = buf[:b - a]
            W.rows_into(a, b, w_chunk)
        gemm(w_chunk, XT, lt)
        _chunk_softmax(lt, a, labels, m, s, label_logit, rescale, col_max, tile_sum)
        if a == c0:
            gemm(lt.T, w_chunk, acc)
        else:
            gemm(lt.T, w_chunk, part)
            _rescale_add(acc, part, rescale)
        if want_row_sum:
            _add_rows(w_chunk, row_sum)
    return m, s, label_logit, acc, row_sum


def head_ce(X, W, labels, smoothing=0.0, segment_rows=None, chunk_rows=None):
    """Per-row cross-entropy of X @ W.T and its gradient w.r.t. X, one pass over W.

    X [N, H] float32, W [C, H] float32 (or a RowSource of that shape), labels [N] all in [0, C) (callers drop
    ignored rows first); smoothing eps uses the target (1 - eps) onehot + eps / C.
    Returns (loss [N] float64, gx_unit [N, H] float32 = the gradient of each row's
    own loss w.r.t. its row of X: softmax @ W - (1 - eps) W[y] - eps/C sum_c W[c]).
    segment_rows / chunk_rows default to SEGMENT_ROWS / CHUNK_ROWS (read at call time)."""
    source = isinstance(W, RowSource)
    if not (isinstance(X, np.ndarray) and (source or isinstance(W, np.ndarray) and W.ndim == 2) and X.ndim == 2
            and X.dtype == W.dtype == np.float32 and X.shape[1] == W.shape[1]):
        raise ValueError(f"head_ce: expected float32 X [N, H] and W [C, H], got {getattr(X, 'dtype', None)}"
                         f"{getattr(X, 'shape', None)} and {getattr(W, 'dtype', None)}{getattr(W, 'shape', None)}")
    n, c = X.shape[0], W.shape[0]
    segment_rows = SEGMENT_ROWS if segment_rows is None else int(segment_rows)
    chunk_rows = CHUNK_ROWS if chunk_rows is None else int(chunk_rows)
    labels = np.ascontiguousarray(labels, dtype=np.int64)
    if labels.shape != (n,) or (n and (labels.min() < 0 or labels.max() >= c)):
        raise ValueError(f"head_ce: labels must be {n} integers in [0, {c}), got shape {labels.shape}")
    if segment_rows < 1 or chunk_rows < 1:
        raise ValueError(f"head_ce: segment_rows {segment_rows} and chunk_rows {chunk_rows} must be positive")
    if n == 0:
        return np.zeros(0, np.float64), np.zeros_like(X)
    if not source:
        W = np.ascontiguousarray(W)
    XT = np.ascontiguousarray(X.T)
    bounds = [(a, min(c, a + segment_rows)) for a in range(0, c, segment_rows)]
    parts = [None] * len(bounds)

    def task(k):
        parts[k] = _segment(XT, W, labels, *bounds[k], chunk_rows, smoothing != 0.0)

    run_tiles(len(bounds), task)

    # Merge in segment order: M = max m_k, S = sum s_k e^(m_k - M), A = sum acc_k e^(m_k - M).
    big_m = parts[0][0].astype(np.float64)
    for p in parts[1:]:
        np.maximum(big_m, p[0], out=big_m)
    big_s = np.zeros(n, np.float64)
    gx = np.zeros_like(X)
    label_logit = np.zeros(n, np.float32)
    row_sum = np.zeros(X.shape[1], np.float64)
    for (c0, c1), (m, s, ll, acc, rs) in zip(bounds, parts):
        f = np.exp(m - big_m)
        big_s += s * f
        gx += acc * f.astype(np.float32)[:, None]
        inside = (labels >= c0) & (labels < c1)
        label_logit[inside] = ll[inside]
        if rs is not None:
            row_sum += rs
    loss = big_m + np.log(big_s) - (1.0 - smoothing) * label_logit
    gx *= (1.0 / big_s).astype(np.float32)[:, None]
    w_labels = W.rows(labels) if source else W[labels]
    if smoothing == 0.0:
        gx -= w_labels
    else:
        loss -= smoothing / c * (X.astype(np.float64) * row_sum).sum(axis=1)  # numpy, not threaded BLAS: fixed order
        gx -= np.float32(1.0 - smoothing) * w_labels
        gx -= (smoothing / c * row_sum).astype(np.float32)
    return loss, gx
