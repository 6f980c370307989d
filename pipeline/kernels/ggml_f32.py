"""llama.cpp's float32 operations as its CPU backend computes them on this x86 host's build (llama-numerics).

Why: `llama_numerics=True` rounds the activations of every matrix product as ggml-cpu does, and the integer dot
products then give llama.cpp's bits exactly. That is not enough on trained weights: each Q8 rounding absorbs a
float32 difference only until one value sits on the other side of a rounding midpoint, and on a 30-layer model
(~1e5 rounded activations per position) ulp-level differences in the f32 parts between the products (the RMSNorm
sum, RoPE's angles, the attention scores, softmax's exp, the order of the weighted sum of values, SiLU's exp)
flip a few roundings at nearly every position, each moving the logits by percents. So this module reproduces
those f32 parts operation for operation (ggml-cpu/ops.cpp, vec.cpp/vec.h, llamafile/sgemm.cpp of llama.cpp as
vendored by llama-cpp-python 0.3.36). llama.cpp compiles for the host (GGML_NATIVE), so its f32 paths differ by
ISA: `AVX512` (the host has AVX-512 F + DQ, as a native build of llama.cpp then does) picks the AVX-512 paths
(16-lane vectors, _mm512_reduce_add_ps, v_expf by scalef), else the AVX2 + FMA ones. The AVX2 forms:

- `rms_rows`: ggml_compute_forward_rms_norm_f32: the squares (f32 products) summed in float64 in order, the
  mean rounded to f32, scale = 1/sqrtf(mean + eps), y = x * scale * w.
- `rope_tables`: ggml_rope_cache_init: theta_scale = powf(base, -2/n_dims), the angle of pair i at position p
  built by i f32 multiplications of (float)p by theta_scale, then (/ freq_factor) * freq_scale, cosf and sinf
  (glibc's; numba's float32 math.cos/sin call them).
- `expf8`: ggml_v_expf (vec.h, AVX2), one lane of it (`expf16`: the AVX-512 one; `expf`: the host's).
- `swiglu_rows`: ggml_vec_swiglu_f32: x / (1 + v_expf(-x)) * g in groups of 8 (16), the tail with libm's expf.
- `attend`: the non-flash-attention graph with an F32 KV cache (llama-graph.cpp build_attn_mha): scores by
  ggml_vec_dot_f32 (four 8 (16)-lane FMA accumulators, its reduction order) times the softmax scale, the softmax
  of ggml_compute_forward_soft_max_f32 (v_expf over aligned groups of 8 (16) cells, each group's f32 sum added in
  float64, one f32 reciprocal), and the weighted sum of the values as mul_mat(v_trans, kq) computes it: llamafile's
  tinyBLAS for a batch of >= 2 tokens (one 8 (16)-lane FMA accumulator over the cells, `hsum`), ggml_vec_dot_f32
  for a single token (llamafile_sgemm refuses n < 2).

The KV cells are the positions (a fresh llama.cpp cache fills cell p with position p, and its padded n_kv is a
multiple of 256, so no scalar tails). Everything here is serial and scalar in numba with explicit lanes (no
fastmath: the bits are fixed); it is the parity mode's path, not the fast one.
"""
import math

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from pipeline.kernels.optim import fma


@intrinsic
def _as_f32(typingctx, bits):
    """Reinterpret int32 bits as float32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _as_i32(typingctx, x):
    """Reinterpret float32 bits as int32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@intrinsic
def _f32_mul(typingctx, x, y):
    """x * y in f32 without a chance of contraction into a neighbouring add (a plain fmul)."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return types.float32(types.float32, types.float32), codegen


_HEX = lambda h: np.float32(float.fromhex(h))  # ggml's constants, written as in vec.h
_R, _LOG2E, _LN2_HI, _LN2_LO = _HEX("0x1.8p23"), _HEX("0x1.715476p+0"), _HEX("0x1.62e4p-1"), _HEX("0x1.7f7d1cp-20")
_C5, _C4, _C3, _C2, _C1 = (_HEX("0x1.0e4020p-7"), _HEX("0x1.573e2ep-5"), _HEX("0x1.555e66p-3"),
                           _HEX("0x1.fffdb6p-2"), _HEX("0x1.ffffecp-1"))
_ONE_BITS = np.int32(0x3F800000)
ONE = np.float32(1.0)
ZERO = np.float32(0.0)
_HOST = llvm.get_host_cpu_features()
AVX512 = bool(_HOST.get("avx512f") and _HOST.get("avx512dq"))  # what a native llama.cpp build on this host runs
LANES = 16 if AVX512 else 8  # ggml's f32 vector: softmax's and swiglu's groups, tinyBLAS's accumulator
STEP = 4 * LANES  # ggml_vec_dot_f32's four accumulators
TAIL_RUN = 8 if AVX512 else 4  # GCC's vectorized leftovers of vec_dot_f32 (products rounded, added in order)


@njit(cache=True, inline="always")
def expf8(x):
    """One lane of ggml_v_expf (vec.h, AVX2): 2^n e^b with n = round(x log2 e) taken from the bits of
    x log2 e + 1.5 2^23, a degree-5 polynomial for e^b - 1, and the scaled paths for |n| > 126 (0 below, inf
    above; -inf gives 0)."""
    z = fma(x, _LOG2E, _R)
    n = z - _R
    b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, x))
    e = np.int32(_as_i32(z) << np.int32(23))
    k = _as_f32(np.int32(e + _ONE_BITS))
    u = _f32_mul(b, b)
    j = fma(fma(fma(_C5, b, _C4), u, fma(_C3, b, _C2)), u, _f32_mul(_C1, b))
    if not abs(n) > np.float32(126.0):
        return fma(j, k, k)
    g = np.int32(-2113929216) if n <= ZERO else np.int32(0)  # 0x82000000 where n <= 0
    s1 = _as_f32(np.int32(g + np.int32(0x7F000000)))
    if abs(n) > np.float32(192.0):
        return _f32_mul(s1, s1)
    s2 = _as_f32(np.int32(e - g))
    return _f32_mul(fma(s2, j, s2), s1)


@njit(cache=True, inline="always")
def expf16(x):
    """One lane of ggml_v_expf (vec.h, AVX-512 F + DQ): the same reduction, the polynomial ending in
    fma(c1, b, 1), then scalef (j 2^n, one rounding, subnormals included); |n| > 192 gives 0 (n <= 0) or inf."""
    z = fma(x, _LOG2E, _R)
    n = z - _R
    if abs(n) > np.float32(192.0):  # -inf: n = -inf, 0
        return ZERO if n <= ZERO else np.float32(np.inf)
    b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, x))
    u = _f32_mul(b, b)
    j = fma(fma(fma(_C5, b, _C4), u, fma(_C3, b, _C2)), u, fma(_C1, b, ONE))
    return np.float32(np.float64(j) * 2.0 ** np.float64(n))  # exact in f64, rounded once to f32


@njit(cache=True, inline="always")
def expf(x):
    """One lane of the ggml_v_expf this host's llama.cpp build runs."""
    return expf16(x) if AVX512 else expf8(x)


@njit(cache=True, inline="always")
def _hsum16(v, c0):
    """_mm512_reduce_add_ps (GCC) of v[c0:c0+16]: high + low halves, then again to 4 lanes, (l0+l2) + (l1+l3)."""
    t0 = (v[c0 + 8] + v[c0]) + (v[c0 + 12] + v[c0 + 4])
    t1 = (v[c0 + 9] + v[c0 + 1]) + (v[c0 + 13] + v[c0 + 5])
    t2 = (v[c0 + 10] + v[c0 + 2]) + (v[c0 + 14] + v[c0 + 6])
    t3 = (v[c0 + 11] + v[c0 + 3]) + (v[c0 + 15] + v[c0 + 7])
    return (t0 + t2) + (t1 + t3)


@njit(cache=True, inline="always")
def group_sum(v, c0):
    """The f32 sum of one vector of v from c0 as this host's ggml reduces it (LANES values)."""
    if AVX512:
        return _hsum16(v, c0)
    return _hsum8(v[c0], v[c0 + 1], v[c0 + 2], v[c0 + 3], v[c0 + 4], v[c0 + 5], v[c0 + 6], v[c0 + 7])


@njit(cache=True, nogil=True)
def swiglu_rows(g, u, out):
    """out = silu(g) * u over flat f32 arrays as ggml_vec_swiglu_f32: v_silu (x / (1 + v_expf(0 - x))) for
    the groups of LANES from the start, ggml_silu_f32 (libm expf) for the tail."""
    n = g.shape[0]
    body = n - n % LANES
    for i in range(body):
        x = g[i]
        out[i] = _f32_mul(x / (ONE + expf(ZERO - x)), u[i])
    for i in range(body, n):
        x = g[i]
        out[i] = _f32_mul(x / (ONE + math.exp(-x)), u[i])


@njit(cache=True, nogil=True)
def rms_rows(x, w, eps, out):
    """out[r] = x[r] * scale * w, scale = 1/sqrtf(f32(sum_f64(x^2) / d) + eps): ggml's rms_norm then mul."""
    n, d = x.shape
    for r in range(n):
        total = 0.0
        for i in range(d):
            total += np.float64(_f32_mul(x[r, i], x[r, i]))
        mean = np.float32(total / d)
        scale = ONE / np.sqrt(mean + eps)
        for i in range(d):
            out[r, i] = _f32_mul(_f32_mul(x[r, i], scale), w[i])


@njit(cache=True, nogil=True)
def _rope_tables(positions, half, theta_scale, freq_scale, factors, cos, sin):
    for p in range(positions.shape[0]):
        theta = np.float32(positions[p])
        for i in range(half):
            angle = _f32_mul(freq_scale, theta / factors[i])
            cos[p, i] = math.cos(angle)
            sin[p, i] = math.sin(angle)
            theta = _f32_mul(theta, theta_scale)


def rope_tables(positions, head_dim: int, base: float, freq_scale: float = 1.0, factors=None):
    """(cos, sin) f32 [len(positions), head_dim/2] as ggml_rope_cache_init builds them (no YaRN ramp:
    ext_factor 0, attn_factor 1, which is what llama.cpp uses without YaRN scaling)."""
    pos = np.ascontiguousarray(positions, np.int64)
    half = head_dim // 2
    theta_scale = np.float32(_powf(np.float32(base), np.float32(-2.0) / np.float32(head_dim)))
    ff = np.ones(half, np.float32) if factors is None else np.ascontiguousarray(factors, np.float32)
    cos, sin = np.empty((len(pos), half), np.float32), np.empty((len(pos), half), np.float32)
    _rope_tables(pos, half, theta_scale, np.float32(freq_scale), ff, cos, sin)
    return cos, sin


@njit(cache=True)
def _powf(a, b):
    return a ** b  # float32 ** float32: libm's powf (as ggml calls it)


@njit(cache=True, nogil=True)
def norm_rope_heads(x, w, eps, cos, sin, out, normed, interleaved):
    """x, out f32 [t, heads, d]; cos, sin f32 [t, d/2]: ggml's per-head rms_norm (then mul by w) when normed,
    then rope_f32's rotation of pairs (x0, x1) = (x[i], x[i + d/2]) (NeoX) or (x[2i], x[2i+1]): x0 cos - x1 sin
    and x0 sin + x1 cos as GCC contracted them (-O3 -march=native; vfmsub231ss / vfmadd132ss, and
    vfmaddsub231ps in the vectorized loop): the x0 product fused, the x1 product rounded first."""
    t, n_heads, d = x.shape
    half = d // 2
    row = np.empty((1, d), np.float32)
    normed_row = np.empty((1, d), np.float32)
    for p in range(t):
        for h in range(n_heads):
            if normed:
                row[0] = x[p, h]
                rms_rows(row, w, eps, normed_row)
                src = normed_row[0]
            else:
                src = x[p, h]
            for i in range(half):
                i1, i2 = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                a, b = src[i1], src[i2]
                c, s = cos[p, i], sin[p, i]
                out[p, h, i1] = fma(a, c, -_f32_mul(b, s))
                out[p, h, i2] = fma(a, s, _f32_mul(b, c))


@njit(cache=True, inline="always")
def _vec_dot(x, y, n, acc):
    """ggml_vec_dot_f32: four LANES-wide FMA accumulators over STEP-element steps (acc: STEP lanes), reduced
    as this host's GGML_F32_VEC_REDUCE does, then the leftovers added in order."""
    acc[:STEP] = ZERO
    body = n & ~(STEP - 1)
    for i in range(0, body, STEP):
        for j in range(STEP):
            acc[j] = fma(x[i + j], y[i + j], acc[j])
    return _tail(x, y, body, n, _reduce(acc))


@njit(cache=True, inline="always")
def _tail(x, y, i0, n, total):
    """vec_dot_f32's leftovers `sumf += x[i]*y[i]` as GCC compiled them (-O3 -march=native, contraction on):
    vectorized products (rounded) added in order up to the last multiple of TAIL_RUN (4 on AVX2, 8 on
    AVX-512), the rest fused."""
    fused = i0 + (n - i0) // TAIL_RUN * TAIL_RUN
    for j in range(i0, fused):
        total += _f32_mul(x[j], y[j])
    for j in range(fused, n):
        total = fma(x[j], y[j], total)
    return total


@njit(cache=True, inline="always")
def _reduce(acc):
    """GGML_F32_VEC_REDUCE of sum[0..3] (acc[LANES j + lane]): x0+x2, x1+x3, x0+x1, then the host's
    horizontal sum (AVX2: low + high half, two hadds; AVX-512: _mm512_reduce_add_ps)."""
    if AVX512:
        t0 = (_lane(acc, 8) + _lane(acc, 0)) + (_lane(acc, 12) + _lane(acc, 4))
        t1 = (_lane(acc, 9) + _lane(acc, 1)) + (_lane(acc, 13) + _lane(acc, 5))
        t2 = (_lane(acc, 10) + _lane(acc, 2)) + (_lane(acc, 14) + _lane(acc, 6))
        t3 = (_lane(acc, 11) + _lane(acc, 3)) + (_lane(acc, 15) + _lane(acc, 7))
        return (t0 + t2) + (t1 + t3)  # _hsum16's order
    return _reduce32(acc)


@njit(cache=True, inline="always")
def _lane(acc, i):
    """Lane i of the AVX-512 GGML_F32_VEC_REDUCE's x0 = (x0 + x2) + (x1 + x3) (acc[16j + lane])."""
    return (acc[i] + acc[32 + i]) + (acc[16 + i] + acc[48 + i])


@njit(cache=True, inline="always")
def _reduce32(acc):
    """GGML_F32x8_REDUCE of sum[0..3] (acc[8j + lane]): x0+x2, x1+x3, then x0+x1, low + high half,
    hadd, hadd."""
    t0 = (acc[0] + acc[16]) + (acc[8] + acc[24])
    t1 = (acc[1] + acc[17]) + (acc[9] + acc[25])
    t2 = (acc[2] + acc[18]) + (acc[10] + acc[26])
    t3 = (acc[3] + acc[19]) + (acc[11] + acc[27])
    t4 = (acc[4] + acc[20]) + (acc[12] + acc[28])
    t5 = (acc[5] + acc[21]) + (acc[13] + acc[29])
    t6 = (acc[6] + acc[22]) + (acc[14] + acc[30])
    t7 = (acc[7] + acc[23]) + (acc[15] + acc[31])
    return ((t0 + t4) + (t1 + t5)) + ((t2 + t6) + (t3 + t7))


@njit(cache=True, inline="always")
def _hsum8(a0, a1, a2, a3, a4, a5, a6, a7):
    """llamafile's hsum(__m256) and softmax's group sum: ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))."""
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@njit(cache=True, nogil=True)
def _attend(q, k, v, pos0, scale, window, out, h0, h1):
    t, n_h, d = q.shape
    g = n_h // k.shape[1]
    n_cells = pos0 + t
    scores = np.empty(n_cells + 8, np.float32)
    acc = np.zeros(STEP, np.float32)
    lanes = np.zeros((STEP, d), np.float32)
    single = t == 1
    for p in range(t):
        last = pos0 + p
        first = max(0, last - window + 1) if window > 0 else 0
        for h in range(h0, h1):
            kv = h // g
            qh = q[p, h]
            big = -np.inf
            for c in range(first, last + 1):
                s = _f32_mul(_vec_dot(k[c, kv], qh, d, acc), scale)
                scores[c] = s
                big = max(big, s)
            total = 0.0
            g_first, g_last = first - first % LANES, last - last % LANES
            for c in range(g_first, g_last + LANES):  # masked cells (outside first..last) give v_expf(-inf) = 0
                scores[c] = expf(scores[c] - big) if first <= c <= last else ZERO
            for c0 in range(g_first, g_last + 1, LANES):
                total += np.float64(group_sum(scores, c0))
            inv = np.float32(1.0 / total)
            lanes[:] = ZERO
            if single:  # mul_mat(v_trans, kq) with one token: ggml_vec_dot_f32 over the cells
                for c in range(first, last + 1):
                    w = _f32_mul(scores[c], inv)
                    lane = lanes[c % STEP]
                    vc = v[c, kv]
                    for i in range(d):
                        lane[i] = fma(vc[i], w, lane[i])
                o = out[p, h * d:(h + 1) * d]
                for i in range(d):
                    for j in range(STEP):
                        acc[j] = lanes[j, i]
                    o[i] = _reduce(acc)
            else:  # llamafile tinyBLAS: one LANES-wide accumulator over the cells, then hsum
                for c in range(first, last + 1):
                    w = _f32_mul(scores[c], inv)
                    lane = lanes[c % LANES]
                    vc = v[c, kv]
                    for i in range(d):
                        lane[i] = fma(vc[i], w, lane[i])
                o = out[p, h * d:(h + 1) * d]
                for i in range(d):
                    for j in range(LANES):
                        acc[j] = lanes[j, i]
                    o[i] = group_sum(acc, 0)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: float, window: int = 0) -> np.ndarray:
    """Causal grouped-query attention of the t new queries q f32 [t, H, D] (positions pos0..) against the cache
    k, v f32 [>= pos0 + t, KV, D] -> f32 [t, H*D], with llama.cpp's arithmetic for one llama_decode call of
    these t tokens (F32 KV cache, no flash attention). scale multiplies the scores (the softmax's scale: 1 for
    families that scale q instead); window > 0 hides keys window or more positions behind the query."""
    t, n_h, d = q.shape
    if k.ndim != 3 or k.shape != v.shape or k.shape[2] != d or n_h % k.shape[1] or k.shape[0] < pos0 + t:
        raise ValueError(f"ggml_f32.attend: q {q.shape} needs k, v [>= {pos0 + t}, KV, {d}] with H % KV == 0, "
                         f"got k {k.shape}, v {v.shape}")
    q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))
    out = np.empty((t, n_h * d), np.float32)
    _attend(q, k, v, int(pos0), np.float32(scale), int(window), out, 0, n_h)
    return out
