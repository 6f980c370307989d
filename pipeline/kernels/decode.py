"""One decode token's transformer layer in one numba call, its products dispatched to the kernel pool from native
code.

Trade-off: the general inference path (pipeline/models/decoder.py `_infer_rows`) runs a layer as ~60 Python
steps around seven products; on a 0.6B model each decode token spent ~13 ms there (beside ~24 ms in the
products) while the pool's other thread idled, where llama.cpp's whole graph runs in C. Here one call per
layer does the norms, RoPE, the KV-cache write, attention, SwiGLU, the residuals and the four products (each a
pipeline/kernels/qint.py job block posted to the workers with handoff.dispatch), through the very kernels the general
path calls (rms_rows, norm_rope_heads, qint's fill and pieces, attention._attend_cached, nn._swiglu_range), so
its bits equal the general path's for any thread count (tests/models/test_decode_fast.py). Cost: only the
common shape is covered (one row, one token, integer-dot frozen weights without biases, SwiGLU or the tanh
GELU outside llama.cpp's f16-table numerics, post-norms or none); anything else takes the general path.
"""
import numpy as np
from numba import njit

from . import handoff
from .attention import _attend_cached
from .nn import _swiglu_range, gelu_tanh_mul_range
from .qint import _fill, scratch


@njit(cache=True, nogil=True)
def rms_rows(x, w, eps, out):
    """out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w for x, out f32 [n, d], w f32 [d]."""
    n, d = x.shape
    for r in range(n):
        ss = np.float32(0.0)
        for i in range(d):
            ss += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
        for i in range(d):
            out[r, i] = x[r, i] * inv * w[i]


@njit(cache=True, nogil=True)
def norm_rope_heads(x, w, eps, cos, sin, out, normed, interleaved):
    """x, out f32 [t, heads, d]; w f32 [d]; cos, sin f32 [t, 1, d/2]."""
    t, n_heads, d = x.shape
    half = d // 2
    for p in range(t):
        for h in range(n_heads):
            inv = np.float32(1.0)
            if normed:
                ss = np.float32(0.0)
                for i in range(d):
                    ss += x[p, h, i] * x[p, h, i]
                inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
            for i in range(half):
                i1, i2 = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                a, b = x[p, h, i1], x[p, h, i2]
                if normed:
                    a, b = a * inv * w[i1], b * inv * w[i2]
                out[p, h, i1] = a * cos[p, 0, i] - b * sin[p, 0, i]
                out[p, h, i2] = b * cos[p, 0, i] + a * sin[p, 0, i]


@njit(cache=True, nogil=True)
def _product(template, needs, total_rows, x, lut, cells, n, runner, ticks, hold):
    """x @ W.T for the weights of a qint product template -> its flat output [m * total rows] (weight w's rows
    from its offset), run by this thread and n pool workers; needs: the product's qint USE_* bits."""
    arrays = scratch(x.shape[0], x.shape[1], needs)
    flat = np.empty(x.shape[0] * total_rows, np.float32)
    job, address = _fill(template, x, arrays, lut, flat, needs)
    handoff.dispatch(cells, n, runner, address, ticks, hold)
    if job[0] < 0:  # never: the scratch the job points into stays referenced until every thread is done
        flat[0] = arrays[0][0, 0] + arrays[1][0, 0] + arrays[2][0, 0] + arrays[3][0, 0] + arrays[4][0, 0] + \
            arrays[5][0, 0] + arrays[6][0, 0]
    return flat


@njit(cache=True, nogil=True)
def _residual(x, y, post_norm, post, eps):
    """x + y, or x + rms(y) * post_norm (families with post-norms)."""
    if post:
        normed = np.empty_like(y)
        rms_rows(y, post_norm, eps, normed)
        return x + normed
    return x + y


@njit(cache=True, nogil=True)
def layer(x, eps, attn_norm, ffn_norm, q_norm, k_norm, normed, post_attn_norm, post_ffn_norm, post, gelu, cos,
          sin, interleaved, heads, kv_heads, head_dim, kc, vc, pos, scale, window, templates, needs, rows, lut,
          cells, n, runners, ticks, hold):
    """x f32 [1, hidden] of the token at position pos -> the layer's output [1, hidden], keys and values written
    to kc[pos], vc[pos] (f32 [capacity, kv_heads, head_dim]). templates: the qkv, o, gate+up and down product
    job templates; needs[i] the product's qint USE_* bits, rows[i] its total output rows and runners[i] the
    address of its qint runner (`qint.runner_of` its formats). post: RMSNorm each
    branch's output before its residual (Gemma 3); gelu: the tanh GELU gate instead of SwiGLU."""
    h = np.empty_like(x)
    rms_rows(x, attn_norm, eps, h)
    qkv = _product(templates[0], needs[0], rows[0], h, lut, cells, n, runners[0], ticks, hold)
    nq, nkv = heads * head_dim, kv_heads * head_dim
    q = qkv[:nq].reshape(1, heads, head_dim)
    k = qkv[nq:nq + nkv].reshape(1, kv_heads, head_dim)
    qr, kr = np.empty_like(q), np.empty_like(k)
    norm_rope_heads(q, q_norm, eps, cos, sin, qr, normed, interleaved)
    norm_rope_heads(k, k_norm, eps, cos, sin, kr, normed, interleaved)
    for kh in range(kv_heads):  # element loops, not kc[pos] = kr[0]: an array assigned into a slice makes numba
        for ki in range(head_dim):  # compile its shape-mismatch message (str, join: seconds of a cold first call)
            kc[pos, kh, ki] = kr[0, kh, ki]
            vc[pos, kh, ki] = qkv[nq + nkv + kh * head_dim + ki]
    a = np.empty((1, nq), np.float32)
    _attend_cached(qr, kc[:pos + 1], vc[:pos + 1], pos, scale, window, a, 0, heads)
    o = _product(templates[1], needs[1], rows[1], a, lut, cells, n, runners[1], ticks, hold)
    x = _residual(x, o.reshape(1, -1), post_attn_norm, post, eps)
    rms_rows(x, ffn_norm, eps, h)
    gu = _product(templates[2], needs[2], rows[2], h, lut, cells, n, runners[2], ticks, hold)
    ffn = rows[2] // 2
    s = np.empty(ffn, np.float32)
    if gelu:
        gelu_tanh_mul_range(gu[:ffn], gu[ffn:], s)
    else:
        _swiglu_range(gu[:ffn], gu[ffn:], s)
    down = _product(templates[3], needs[3], rows[3], s.reshape(1, ffn), lut, cells, n, runners[3],
                    ticks, hold)
    return _residual(x, down.reshape(1, -1), post_ffn_norm, post, eps)
