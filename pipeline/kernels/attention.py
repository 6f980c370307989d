"""Softmax row kernels for attention: in place over the [rows, keys] scores.

Trade-off: the score matrix is still materialized (BLAS does the two GEMMs on
each side, which beats hand-written loops at these sizes), but the softmax and
its backward are one fused pass per row instead of four numpy passes, using
the SIMD exp of pipeline/kernels/fastexp.py. Rows are independent; the parallel loop
runs over a fixed grid of row chunks, so the bits do not depend on threads.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from pipeline.kernels.fastexp import exp_shifted_sum_inplace, row_max
from pipeline.kernels.nn import threads_for

ROW_CHUNK = 64
_I64, _V8F = ir.IntType(64), ir.VectorType(ir.FloatType(), 8)


@njit(cache=True, nogil=True)
def _softmax_rows(s, i0, i1):
    for i in range(i0, i1):
        row = s[i]
        m = row_max(row)
        inv = np.float32(1.0 / exp_shifted_sum_inplace(row, m))
        for j in range(row.shape[0]):
            row[j] *= inv


@njit(cache=True, parallel=True)
def _softmax_inplace(s):
    """s [R, K] float32, each row replaced by its softmax (-inf entries give 0)."""
    n = s.shape[0]
    for c in prange((n + ROW_CHUNK - 1) // ROW_CHUNK):
        _softmax_rows(s, c * ROW_CHUNK, min(n, (c + 1) * ROW_CHUNK))


@njit(cache=True, nogil=True)
def _softmax_bwd_rows(p, dp, scale, i0, i1):
    for i in range(i0, i1):
        pr = p[i]
        dr = dp[i]
        dot = np.float32(0.0)
        for j in range(pr.shape[0]):
            dot += pr[j] * dr[j]
        for j in range(pr.shape[0]):
            dr[j] = pr[j] * (dr[j] - dot) * scale


@njit(cache=True, parallel=True)
def _softmax_bwd_inplace(p, dp, scale):
    """p, dp [R, K] float32: dp <- p * (dp - rowsum(p * dp)) * scale."""
    n = p.shape[0]
    for c in prange((n + ROW_CHUNK - 1) // ROW_CHUNK):
        _softmax_bwd_rows(p, dp, scale, c * ROW_CHUNK, min(n, (c + 1) * ROW_CHUNK))


def softmax_inplace(s):
    """Row softmax over the last axis of a C-contiguous array, in place (float32
    via the kernel, other dtypes via numpy). Returns s."""
    if s.dtype == np.float32 and s.flags.c_contiguous:
        with threads_for(s.size):
            _softmax_inplace(s.reshape(-1, s.shape[-1]))
        return s
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def softmax_backward_inplace(p, dp, scale=1.0):
    """dp <- p * (dp - sum(p * dp, last axis)) * scale, in place. Returns dp."""
    if p.dtype == np.float32 and dp.dtype == np.float32 and p.flags.c_contiguous and dp.flags.c_contiguous:
        with threads_for(p.size):
            _softmax_bwd_inplace(p.reshape(-1, p.shape[-1]), dp.reshape(-1, dp.shape[-1]), np.float32(scale))
        return dp
    dp -= (dp * p).sum(axis=-1, keepdims=True)
    dp *= p
    dp *= scale
    return dp


def softmax_rows_serial(s):
    """softmax_inplace on the calling thread only, GIL released (for callers that
    already run on several threads: a numba parallel launch is not re-entrant)."""
    if s.dtype == np.float32 and s.flags.c_contiguous:
        s2 = s.reshape(-1, s.shape[-1])
        _softmax_rows(s2, 0, s2.shape[0])
        return s
    return softmax_inplace(s)


def softmax_backward_rows_serial(p, dp, scale=1.0):
    """softmax_backward_inplace on the calling thread only, GIL released."""
    if p.dtype == np.float32 and dp.dtype == np.float32 and p.flags.c_contiguous and dp.flags.c_contiguous:
        p2, dp2 = p.reshape(-1, p.shape[-1]), dp.reshape(-1, dp.shape[-1])
        _softmax_bwd_rows(p2, dp2, np.float32(scale), 0, p2.shape[0])
        return dp
    return softmax_backward_inplace(p, dp, scale)


# --- decode-sized attention against a KV cache ----------------------------------------------------------------
@intrinsic
def _dot8(typingctx, a, b, n):
    """sum(a[:n] * b[:n]) over the first n - n % 8 elements of two f32 arrays whose last axis is contiguous, in 8
    lanes (lane l takes the elements i = l mod 8, one fmul and fadd each, never fused) added as
    ((0+4) + (2+6)) + ((1+5) + (3+7)). numba's loops leave such a float reduction scalar without fastmath, which
    this project does not allow (cold and cached code differed)."""
    def codegen(context, builder, sig, args):
        pa, pb = (context.make_array(t)(context, builder, v).data for t, v in zip(sig.args[:2], args[:2]))
        count = builder.and_(args[2], ir.Constant(_I64, -8))
        zero = ir.Constant(_V8F, [0.0] * 8)
        entry = builder.block
        loop, done = builder.append_basic_block("dot8.loop"), builder.append_basic_block("dot8.done")
        builder.cbranch(builder.icmp_signed(">", count, ir.Constant(_I64, 0)), loop, done)
        builder.position_at_end(loop)
        i, acc = builder.phi(_I64), builder.phi(_V8F)
        load = lambda p: builder.load(builder.bitcast(builder.gep(p, [i]), _V8F.as_pointer()), align=4)
        nxt, i_next = builder.fadd(acc, builder.fmul(load(pa), load(pb))), builder.add(i, ir.Constant(_I64, 8))
        i.add_incoming(ir.Constant(_I64, 0), entry)
        i.add_incoming(i_next, loop)
        acc.add_incoming(zero, entry)
        acc.add_incoming(nxt, loop)
        builder.cbranch(builder.icmp_signed("<", i_next, count), loop, done)
        builder.position_at_end(done)
        lanes = builder.phi(_V8F)
        lanes.add_incoming(zero, entry)
        lanes.add_incoming(nxt, loop)
        lane = lambda k: builder.extract_element(lanes, ir.Constant(ir.IntType(32), k))
        pair = lambda x, y: builder.fadd(lane(x), lane(y))
        return builder.fadd(builder.fadd(pair(0, 4), pair(2, 6)), builder.fadd(pair(1, 5), pair(3, 7)))
    return types.float32(a, b, n), codegen


@njit(cache=True, inline="always")
def _dot(a, b, n):
    """sum(a[:n] * b[:n]) in f32: _dot8's lanes, then the tail in order."""
    total = _dot8(a, b, n)
    for i in range(n - n % 8, n):
        total += a[i] * b[i]
    return total


@njit(cache=True, nogil=True)
def _attend_cached(q, k, v, pos0, scale, window, out, h0, h1):
    """out[p, h*D:(h+1)*D] = softmax(q[p, h] . k[visible, h // g] * scale) @ v[visible, h // g] for each query
    p (at position pos0 + p) and head h in h0..h1, the keys visible to it being positions
    max(0, pos0+p-window+1) (window > 0) .. pos0 + p; g = H // KV query heads share a kv head. Keys and values
    are read in memory order (position by position, every head of it), each once per query: strided per head,
    the cache came from DRAM at a third of its bandwidth."""
    t, n_h, d = q.shape
    g = n_h // k.shape[1]
    scores = np.empty((h1 - h0, pos0 + t), np.float32)
    weights = np.empty(h1 - h0, np.float32)
    for p in range(t):
        last = pos0 + p
        first = max(0, last - window + 1) if window > 0 else 0
        n = last + 1 - first
        for j in range(n):
            for h in range(h0, h1):
                scores[h - h0, j] = _dot(q[p, h], k[first + j, h // g], d) * scale
        for h in range(h0, h1):
            row = scores[h - h0, :n]
            weights[h - h0] = np.float32(1.0 / exp_shifted_sum_inplace(row, row_max(row)))
        out[p, h0 * d:h1 * d] = 0.0
        j = 0
        while j + 4 <= n:  # four keys a pass over each head's output: a quarter of its loads and stores
            for h in range(h0, h1):
                row, inv, kv, o = scores[h - h0], weights[h - h0], h // g, out[p, h * d:(h + 1) * d]
                w0, w1, w2, w3 = row[j] * inv, row[j + 1] * inv, row[j + 2] * inv, row[j + 3] * inv
                v0, v1, v2, v3 = v[first + j, kv], v[first + j + 1, kv], v[first + j + 2, kv], v[first + j + 3, kv]
                for i in range(d):
                    o[i] += (w0 * v0[i] + w1 * v1[i]) + (w2 * v2[i] + w3 * v3[i])
            j += 4
        for j in range(j, n):
            for h in range(h0, h1):
                w, vj, o = scores[h - h0, j] * weights[h - h0], v[first + j, h // g], out[p, h * d:(h + 1) * d]
                for i in range(d):
                    o[i] += w * vj[i]


def attend_cached(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: float, window: int = 0):
    """Causal grouped-query attention of a few new queries against a KV cache, in one serial numba call (no
    score matrix, no BLAS: at decode sizes numpy's per-call overhead was most of the time). q f32 [t, H, D] at
    positions pos0.., k/v f32 [s, KV, D] with s >= pos0 + t (H a multiple of KV) -> f32 [t, H*D]. The bits
    depend on the inputs only (not on threads or the BLAS). Serial on purpose: the cache streams from DRAM in
    memory order near its bandwidth (4096 keys x 8 x 128: 3.3 ms), and two threads sharing the kv heads, each
    reading its heads' strided slices, measured slower at every length tried (256-4096 keys)."""
    t, n_h, d = q.shape
    if k.ndim != 3 or k.shape != v.shape or k.shape[2] != d or n_h % k.shape[1] or k.shape[0] < pos0 + t:
        raise ValueError(f"attend_cached: q {q.shape} needs k, v [>= {pos0 + t}, KV, {d}] with H % KV == 0, "
                         f"got k {k.shape}, v {v.shape}")
    q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))
    out = np.empty((t, n_h * d), np.float32)
    _attend_cached(q, k, v, int(pos0), np.float32(scale), int(window), out, 0, n_h)
    return out
