"""Vectorizable row primitives: float32 exp, sum of exp, max; a float64 exp (exp64).

numba's np.exp is a scalar libm call per element; these loops are pure
arithmetic, so LLVM turns them into SIMD. exp is Cephes-style: n = round(t
log2 e), r = t - n ln2 (two-constant Cody-Waite split), a degree-6 polynomial
for e^r, and 2^n built from exponent bits through a bitcast intrinsic.
Accuracy: within 5 ulp of the exact result on [-87, 88] (mean ~1.5 ulp);
inputs below -87 (including -inf) give exactly 0.
Sums of exp are float32 within tiles of TILE elements, and the tile sums are
added in float64 in order: SIMD speed, float64-grade error over long rows.
exp64 is Cephes' double exp (a Pade form of e^r, 2^n from exponent bits), within ~1 ulp on [-708, 0],
exactly 0 below: the float64 maps that round to float32 (the tanh GELU) vectorize with it, where libm's
exp and tanh are scalar calls (~10 ns each per element).
Trade-off: a few ulp of exp accuracy for numpy-class throughput in fused loops.
In-place forms take one array: with two arguments that alias, LLVM's overlap
check sends the loop to its scalar fallback (measured 5-10x slower).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# The exp maps and reductions below carry NO fastmath flags: with "reassoc" or
# "contract" LLVM chose a different association/FMA fusion in a fresh compile
# than in the cached code (measured: gradients 1 ulp apart between a cold and a
# warm numba cache), which broke bit-identity across processes. The reductions
# instead accumulate in LANES explicit float32 lanes (independent accumulators
# vectorize without reassociation) and fold the lanes in a fixed serial order.
LANES = 16
TILE = 64
LOG2E = np.float32(1.44269504088896341)
C1 = np.float32(0.693359375)
C2 = np.float32(-2.12194440e-4)
LOW = np.float32(-87.0)
HIGH = np.float32(88.0)
HALF = np.float32(0.5)
ONE = np.float32(1.0)
ZERO = np.float32(0.0)
P0 = np.float32(1.9875691500e-4)
P1 = np.float32(1.3981999507e-3)
P2 = np.float32(8.3334519073e-3)
P3 = np.float32(4.1665795894e-2)
P4 = np.float32(1.6666665459e-1)
P5 = np.float32(5.0000001201e-1)


@intrinsic
def _bits_as_f32(typingctx, x):
    """Reinterpret int32 bits as float32 (no conversion)."""
    if x != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _f32_as_bits(typingctx, x):
    """Reinterpret float32 bits as int32 (no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _bits_as_f64(typingctx, x):
    """Reinterpret int64 bits as float64 (no conversion)."""
    if x != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


D_LOG2E = 1.4426950408889634
D_C1 = 6.93145751953125e-1
D_C2 = 1.42860682030941723212e-6
D_P0, D_P1, D_P2 = 1.26177193074810590878e-4, 3.02994407707441961300e-2, 9.99999999999999999910e-1
D_Q0, D_Q1, D_Q2, D_Q3 = 3.00198505138664455042e-6, 2.52448340349684104192e-3, 2.27265548208155028766e-1, 2.0


@njit(cache=True, inline="always")
def exp64(t):
    """float64 exp(t) for t <= 0 (Cephes' exp: 0 below -708, where 2^n would leave the normal range)."""
    tc = max(t, -708.0)
    n = np.floor(tc * D_LOG2E + 0.5)
    r = tc - n * D_C1
    r = r - n * D_C2
    rr = r * r
    px = r * ((D_P0 * rr + D_P1) * rr + D_P2)
    e = px / (((D_Q0 * rr + D_Q1) * rr + D_Q2) * rr + D_Q3 - px)
    e = (1.0 + 2.0 * e) * _bits_as_f64((np.int64(n) + np.int64(1023)) << np.int64(52))
    return e if t >= -708.0 else 0.0


@njit(cache=True, inline="always")
def _order_key(i):
    """Map float32 bits to an int32 with the same order as the floats (sign-magnitude
    to two's complement); the map is its own inverse."""
    return np.int32(i ^ ((i >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@njit(cache=True, inline="always")
def expf(t):
    """float32 exp(t) for a float32 scalar t (0 below -87)."""
    tc = min(max(t, LOW), HIGH)
    n = np.floor(tc * LOG2E + HALF)
    r = tc - n * C1
    r = r - n * C2
    p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5
    p = p * r * r + r + ONE
    e = p * _bits_as_f32(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))
    return e if t >= LOW else ZERO


@njit(cache=True)
def row_max(src):
    """max of a float32 row. A float compare-and-select reduction does not
    vectorize without assuming no NaNs, so compare order-preserving integer
    keys instead (exact; a NaN row yields a NaN-pattern max and a NaN loss)."""
    m = np.int32(-2147483648)
    for j in range(src.shape[0]):
        m = max(m, _order_key(_f32_as_bits(src[j])))
    return _bits_as_f32(_order_key(m))


@njit(cache=True)
def sum_exp_shifted(src, shift):
    """sum_j exp(src[j] - shift) as float64: float32 lanes within fixed
    64-element tiles, each tile's lanes folded in order into a float64 total."""
    n = src.shape[0]
    full = n // TILE
    lanes = np.empty(LANES, np.float32)
    total = 0.0
    for t in range(full):
        base = t * TILE
        for k in range(LANES):
            lanes[k] = expf(src[base + k] - shift)
        for q in range(1, TILE // LANES):
            for k in range(LANES):
                lanes[k] += expf(src[base + q * LANES + k] - shift)
        part = lanes[0]
        for k in range(1, LANES):
            part += lanes[k]
        total += np.float64(part)
    part = ZERO
    for j in range(full * TILE, n):
        part += expf(src[j] - shift)
    return total + np.float64(part)


@njit(cache=True)
def exp_shifted_into(src, shift, dst, scale, offset):
    """dst[j] = exp(src[j] - shift) * scale - offset over float32 rows.
    dst must not overlap src (LLVM's overlap check would fall back to scalar
    code); use exp_shifted_inplace for the in-place form."""
    for j in range(src.shape[0]):
        dst[j] = expf(src[j] - shift) * scale - offset


@njit(cache=True)
def exp_shifted_inplace(row, shift, scale, offset):
    """row[j] = exp(row[j] - shift) * scale - offset (one pointer: vectorizes)."""
    for j in range(row.shape[0]):
        row[j] = expf(row[j] - shift) * scale - offset


@njit(cache=True)
def exp_shifted_sum_inplace(row, shift):
    """row[j] = exp(row[j] - shift); returns their sum in float64 (lanes within
    fixed tiles, like sum_exp_shifted)."""
    n = row.shape[0]
    full = n // TILE
    lanes = np.empty(LANES, np.float32)
    total = 0.0
    for t in range(full):
        base = t * TILE
        for k in range(LANES):
            e = expf(row[base + k] - shift)
            row[base + k] = e
            lanes[k] = e
        for q in range(1, TILE // LANES):
            for k in range(LANES):
                e = expf(row[base + q * LANES + k] - shift)
                row[base + q * LANES + k] = e
                lanes[k] += e
        part = lanes[0]
        for k in range(1, LANES):
            part += lanes[k]
        total += np.float64(part)
    part = ZERO
    for j in range(full * TILE, n):
        e = expf(row[j] - shift)
        row[j] = e
        part += e
    return total + np.float64(part)


def exp(x):
    """Vectorized float32 exp of an array (for tests and references)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x).reshape(-1)
    exp_shifted_into(x.reshape(-1), np.float32(0.0), out, np.float32(1.0), np.float32(0.0))
    return out.reshape(x.shape)
