"""The GGML weight formats Fucina reads: one table, no logic.

Trade-off: only the formats hub GGUFs of small dense models commonly ship in get
kernels (F32/F16/BF16; Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; the K-quants Q2_K..Q6_K;
IQ4_NL and IQ4_XS, which need no codebook tables); anything else (the IQ1-IQ3
codebook formats, TQ, MXFP4) is rejected at load time with the format's name
instead of being half-supported.
Block sizes come from pipeline.kernels/formats.py, the one table of every format's facts the kernels dispatch through
(tests/kernels/test_formats.py holds it to gguf-py's GGML_QUANT_SIZES).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from gguf import GGMLQuantizationType as QT

from pipeline.kernels import formats as _formats


@dataclass(frozen=True)
class Format:
    name: str          # ggml's spelling, e.g. "Q4_K"
    qtype: QT          # the GGUF tensor type id
    block_size: int    # elements per block
    type_size: int     # bytes per block
    quantized: bool    # True when the bytes are blocks, not plain floats

    def row_bytes(self, n_cols: int) -> int:
        return n_cols // self.block_size * self.type_size

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size


def _fmt(row: _formats.Format) -> Format:
    return Format(row.name, QT(row.qtype), row.block, row.block_bytes, row.quantized)


FORMATS: dict[QT, Format] = {QT(row.qtype): _fmt(row) for row in _formats.FORMATS}

SUPPORTED_NAMES = ", ".join(f.name for f in FORMATS.values())


def format_of(qtype) -> Format | None:
    """The Format for a tensor type id, or None when Fucina has no kernel for it."""
    try:
        return FORMATS.get(QT(int(qtype)))
    except ValueError:
        return None


_INTEGER = None  # (qint.supports, qint_gemm.supports, qtile.supports, grad_enabled), imported on first use


def _integer_kernels():
    """What uses_integer_dot asks, imported once: a decode asks ~300 times a token, and an import statement
    inside the method cost more than the rest of it."""
    global _INTEGER
    from pipeline.kernels import qint, qint_gemm, qtile
    from pipeline.autograd.tensor import grad_enabled
    _INTEGER = (qint.supports, qint_gemm.supports, qtile.supports, grad_enabled)
    return _INTEGER


class FrozenWeight:
    """A frozen [n_out, n_in] matrix kept in its file format (quantized stays quantized).

    `raw` is the GGUF data as read (memory-mapped): f32/f16 arrays, uint16 bits for
    BF16, or uint8 block bytes [n_out, row_bytes]. `matmul_t(x)` computes x @ W.T:
    a fused dequant-matvec for a few rows of x (decode), or a tiled dequant + BLAS
    for many rows (prefill, training; pipeline/kernels/qgemm.py). `matmul(g)` computes g @ W
    (the backward of a frozen linear) the same tiled way. It carries no gradient.

    `integer_dot` (default True: on AVX2 the integer kernels beat the f32 ones where they are used,
    docs/models.md): forwards that record no graph (under autograd's no_grad(): inference, ES member
    evaluation, evaluation passes) quantize their activations the way llama.cpp does and take integer
    block dot products: at most INTEGER_MAX_ROWS activation rows (decode) through every block format
    (pipeline/kernels/qint.py: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS: ggml's vec_dot bit for
    bit), and any number of rows (prefill) through Q4_K/Q5_K/Q6_K: from
    TILE_MIN_ROWS rows the tiled GEMM (pipeline/kernels/qtile.py, tiles packed at first use and kept; `tiled = False`
    turns it off; Q2_K, Q3_K and IQ4_XS too), fewer rows the register-blocked GEMM (pipeline/kernels/qint_gemm.py),
    both measured faster than the tiled f32 GEMM; the 32-element formats' prefill (f32_prompt in
    pipeline/kernels/formats.py) stays on the tiled f32 GEMM, except an inference prompt (`inference`, set by
    for_inference) of TILE_MIN_ROWS rows or more through Q8_0/Q4_0/Q5_0 (prompt_tiles): their qtile tiles.
    A forward with gradients on keeps f32 activations (the training contract). `llama_numerics` (parity runs) takes the
    integer path for every block format at any row count.
    """

    FUSED_MAX_ROWS = 4  # below this many activation rows the fused kernel wins (docs/models.md)
    integer_dot = True  # set False (on an instance or the class) to keep no-grad forwards on f32 activations
    INTEGER_MAX_ROWS = FUSED_MAX_ROWS  # beyond this, only formats with a blocked integer GEMM stay integer
    TILE_MIN_ROWS = 16  # from this many rows (a prompt, not a decode step) the K-quants take pipeline/kernels/qtile.py
    # set False (on an instance or the class; FUCINA_TILES=0 in the environment, e.g. for many worker processes
    # on one host: each holds its own tiles) to keep prompts on vec_dot's arithmetic and make no tiles
    tiled = os.environ.get("FUCINA_TILES", "1") != "0"
    # True on the projections of a model opened for inference (for_inference: generate, serve, bench llm): their
    # prompts take the tiles of the formats whose pipeline/kernels/formats.py row says prompt_tiles
    inference = False

    def __init__(self, fmt: Format, raw, shape: tuple[int, int], name: str = ""):
        self.format, self.raw, self.shape, self.name = fmt, raw, tuple(shape), name
        self.llama_numerics = False  # round activations like llama.cpp's CPU dot products (parity mode)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def tiles(self):
        """pipeline/kernels/qtile.pack of raw (Q4_K/Q5_K/Q6_K/Q3_K/IQ4_XS/Q2_K), made at first use and kept beside raw
        (1.1x, 1.6x, 1.3x, 2.5x, 2.1x, 1.4x its bytes); made again if raw is replaced."""
        hit = self.__dict__.get("_tiles")
        if hit is None or hit[0] is not self.raw:
            from pipeline.kernels import qtile
            hit = self.__dict__["_tiles"] = (self.raw, qtile.pack(int(self.format.qtype), self.raw))
        return hit[1]

    @property
    def tile_bytes(self) -> int:
        """Bytes of the tiles made so far (0 before the first prompt, or with `tiled` False)."""
        hit = self.__dict__.get("_tiles")
        return 0 if hit is None else int(hit[1].nbytes)

    def dequantize(self):
        """The f32 copy [n_out, n_in] (allocated per call)."""
        import numpy as np
        from pipeline.kernels import dequant
        if self.format.qtype == QT.F32:
            return np.asarray(self.raw, dtype=np.float32)
        if self.format.qtype == QT.F16:
            return np.asarray(self.raw).astype(np.float32)
        if self.format.qtype == QT.BF16:
            bits = np.asarray(self.raw).view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(self.shape)
        return dequant.dequantize_rows(int(self.format.qtype), self.raw, self.shape[1])

    def uses_integer_dot(self, rows: int) -> bool:
        """True when matmul_t of `rows` activation rows takes the integer path (pipeline/kernels/qint.py, or for many
        rows the tiled kernels/qtile.py or the blocked kernels/qint_gemm.py where they take the format;
        the class doc)."""
        supports, gemm_supports, tile_supports, grad_enabled = _INTEGER or _integer_kernels()
        if not supports(self.format.qtype):
            return False
        row = _formats.BY_QTYPE[self.format.qtype]
        fast = (rows <= self.INTEGER_MAX_ROWS or (not row.f32_prompt and gemm_supports(self.format.qtype))
                or self.takes_tiles(rows))
        return self.llama_numerics or (self.integer_dot and fast and not grad_enabled())

    def takes_tiles(self, rows: int) -> bool:
        """True when a default-mode (not llama_numerics) integer product of `rows` rows takes qtile's tiles:
        TILE_MIN_ROWS rows or more through a format with tiles, unless its formats.py row keeps prompts on f32
        (f32_prompt) and this is not an inference weight of a prompt_tiles format."""
        row = _formats.BY_QTYPE[self.format.qtype]
        _, _, tile_supports, _ = _INTEGER or _integer_kernels()
        return (self.tiled and rows >= self.TILE_MIN_ROWS and tile_supports(self.format.qtype)
                and (not row.f32_prompt or (self.inference and row.prompt_tiles)))

    def matmul_t(self, x):
        """x [..., n_in] f32 -> x @ W.T [..., n_out] f32."""
        import numpy as np
        from pipeline.kernels import dequant, qgemm
        x2 = np.asarray(x, dtype=np.float32).reshape(-1, self.shape[1])
        if self.uses_integer_dot(x2.shape[0]):
            y = integer_matmul_t_many([self], x2)[0]
            return y.reshape(*np.shape(x)[:-1], self.shape[0])
        if self.llama_numerics:  # F16/BF16 (every block format took the integer path above)
            x2 = llama_activation_roundtrip(self.format.qtype, x2)
        if self.format.quantized and x2.shape[0] <= self.FUSED_MAX_ROWS:
            y = dequant.matvec_rows(int(self.format.qtype), self.raw, x2)
        elif self.format.qtype in (QT.F16, QT.BF16) and x2.shape[0] <= self.FUSED_MAX_ROWS:
            y = dequant.matvec_half(self.raw, x2, bf16=self.format.qtype == QT.BF16)
        else:
            y = qgemm.matmul_t(int(self.format.qtype), self.raw, x2, self.shape)
        return y.reshape(*np.shape(x)[:-1], self.shape[0])

    def matmul(self, g):
        """g [..., n_out] f32 -> g @ W [..., n_in] f32: the input gradient of x @ W.T.

        Tiled (pipeline/kernels/qgemm.py): W is dequantized a few columns at a time into a
        per-thread buffer, never as a whole; bitwise independent of the thread count."""
        import numpy as np
        from pipeline.kernels import qgemm
        g2 = np.asarray(g, dtype=np.float32).reshape(-1, self.shape[0])
        y = qgemm.matmul(int(self.format.qtype), self.raw, g2, self.shape)
        return y.reshape(*np.shape(g)[:-1], self.shape[1])

    def __repr__(self):
        return f"FrozenWeight({self.name!r}, {self.format.name}, {self.shape})"


def matmul_t_many(weights: list, x) -> list:
    """[w.matmul_t(x) for w in weights], for weights that share their input (q/k/v, gate/up),
    in one dispatch to the threads: the integer block dots when every weight takes them
    (pipeline/kernels/qint.py, activations quantized once), the tiled GEMM for many rows of x (kernels/qgemm.py),
    the fused matvec for a few rows through block or 16-bit weights (dequant.matvec_many).
    The results equal the one-by-one calls bit for bit."""
    import numpy as np
    from pipeline.kernels import dequant, qgemm
    x2 = np.asarray(x, dtype=np.float32).reshape(-1, weights[0].shape[1])
    if all(w.shape[1] == x2.shape[1] and w.uses_integer_dot(x2.shape[0]) for w in weights):
        ys = integer_matmul_t_many(weights, x2)
        return [y.reshape(*np.shape(x)[:-1], w.shape[0]) for w, y in zip(weights, ys)]
    few = x2.shape[0] <= FrozenWeight.FUSED_MAX_ROWS
    if any(w.llama_numerics or w.shape[1] != x2.shape[1] or (few and w.format.qtype == QT.F32) for w in weights):
        return [w.matmul_t(x) for w in weights]
    if few:
        ys = dequant.matvec_many([(int(w.format.qtype), w.raw) for w in weights], x2)
    else:
        ys = qgemm.matmul_t_many([(int(w.format.qtype), w.raw, w.shape) for w in weights], x2)
    return [y.reshape(*np.shape(x)[:-1], w.shape[0]) for w, y in zip(weights, ys)]


# llama.cpp 0.3.36 takes its tiled K-quant GEMM (ggml-cpu/tiled: ggml_tiled_min_batch) from 8 activation rows
GGML_TILED_MIN_ROWS = 8


def integer_matmul_t_many(weights: list, x2, group_rows: int | None = None) -> list:
    """x2 [m, n_in] @ W.T for weights on the integer path. The arithmetic is chosen per weight by the rows of
    one independent group (group_rows, default m: a caller stacking ES members or lock-step rows passes one
    member's rows, so each row gets the bits it would get alone):
      * the K-quants and IQ4_XS (and an inference weight's Q8_0/Q4_0/Q5_0: FrozenWeight.takes_tiles) with at
        least FrozenWeight.TILE_MIN_ROWS rows (unless the weight's `tiled` is False):
        the tiled GEMM (pipeline/kernels/qtile.py, its own arithmetic: one fma per block and output); a weight with
        llama_numerics from GGML_TILED_MIN_ROWS rows, with llama.cpp's AVX2 tiled arithmetic (qtile's ggml_avx2);
      * otherwise llama.cpp's vec_dot arithmetic: the register-blocked GEMM (pipeline/kernels/qint_gemm.py) for at least
        qint_gemm.ROWS rows through Q4_K/Q5_K/Q6_K, else the row kernels (pipeline/kernels/qint.py), the same bits.
    Each weight's bits do not depend on the other weights of the call."""
    from pipeline.kernels import qint_gemm, qtile
    n = x2.shape[0] if group_rows is None else group_rows
    # llama numerics: llama.cpp's tiled AVX2 arithmetic from GGML_TILED_MIN_ROWS rows, decided per weight
    tiled = [qtile.supports(w.format.qtype, True) and n >= GGML_TILED_MIN_ROWS if w.llama_numerics else
             w.takes_tiles(n) for w in weights]
    rest = [w for w, t in zip(weights, tiled) if not t]
    ys = {}
    for ggml in (False, True):
        group = [w for w, t in zip(weights, tiled) if t and w.llama_numerics == ggml]
        if group:
            ys.update(zip(map(id, group), qtile.matmul_t_many([(int(w.format.qtype), w.raw, w.tiles())
                                                               for w in group], x2, ggml)))
    if not rest:
        ys_rest = iter([])
    elif x2.shape[0] >= qint_gemm.ROWS and all(qint_gemm.supports(w.format.qtype) for w in rest):
        ys_rest = iter(qint_gemm.matmul_t_many([(int(w.format.qtype), w.raw) for w in rest], x2))
    else:
        ys_rest = iter(integer_product(rest)(x2))
    return [ys[id(w)] if t else next(ys_rest) for w, t in zip(weights, tiled)]


def for_inference(model) -> None:
    """Mark the block projections of a model opened for inference (generate, serve, bench llm) so that their
    prompts take the tiles of the prompt_tiles formats (pipeline/kernels/formats.py). Models built for training,
    fine-tune evaluation or ES members are not marked: their no-grad forwards keep the training forward's f32
    arithmetic where f32_prompt says so. The head and embedding are left alone (a prompt's head is one row; an
    all-logits head would pack tiles of the whole vocabulary)."""
    for name, w in model.named_weights().items():
        if isinstance(w, FrozenWeight) and name.startswith("blk."):
            w.inference = True


def integer_product(weights: list):
    """The pipeline/kernels/qint.Product of this group of weights, kept on the first one: a decode makes the same ~113
    products every token, and laying a product's job out once saves most of its per-call Python. The group is
    found again only while its weights hold the same raw arrays (a replaced raw gets a new product); the key
    holds the weights themselves, so no other object can take their ids."""
    from pipeline.kernels import qint
    cache = weights[0].__dict__.setdefault("_integer_products", {})
    key = tuple(weights)
    hit = cache.get(key)
    if hit is not None and all(w.raw is raw for w, raw in zip(weights, hit[0])):
        return hit[1]
    product = qint.Product([(int(w.format.qtype), w.raw) for w in weights], weights[0].shape[1])
    cache[key] = (tuple(w.raw for w in weights), product)
    return product


def matmul_t_groups(weights: list, x3) -> list:
    """[matmul_t_many(weights, x3[j]) for every group j, stacked to [groups, N, n_out]] with the same bits,
    reading each weight once for all groups where a kernel allows it: the fused matvec computes every
    row alone (so its rows can be stacked), the tiled GEMM dequantizes each tile once for all groups
    (qgemm.matmul_t_groups), and the integer dots take all groups' rows in one call (each row is quantized
    and multiplied alone, so its bits do not depend on the rows beside it: tests/kernels/test_qint_gemm.py).
    Groups are ES members, or rows decoding in lock-step, that share nothing but the weights. Paths whose
    per-row bits depend on the call (f32 BLAS for a few rows, llama numerics' f32 roundtrip) are called
    group by group."""
    import numpy as np
    from pipeline.kernels import dequant, qgemm
    x3 = np.ascontiguousarray(x3, dtype=np.float32)
    groups, n, n_in = x3.shape
    if groups > 1 and all(w.shape[1] == n_in and w.uses_integer_dot(n) for w in weights):
        ys = integer_matmul_t_many(weights, x3.reshape(groups * n, n_in), group_rows=n)
        return [y.reshape(groups, n, w.shape[0]) for w, y in zip(weights, ys)]
    few = n <= FrozenWeight.FUSED_MAX_ROWS
    if groups == 1 or any(w.llama_numerics or w.uses_integer_dot(n) or w.shape[1] != n_in
                          or (few and w.format.qtype == QT.F32) for w in weights):
        per_group = [matmul_t_many(weights, x3[j]) for j in range(groups)]
        return [np.stack([ys[i] for ys in per_group]) for i in range(len(weights))]
    if few:
        ys = dequant.matvec_many([(int(w.format.qtype), w.raw) for w in weights], x3.reshape(groups * n, n_in))
        return [y.reshape(groups, n, w.shape[0]) for w, y in zip(weights, ys)]
    return qgemm.matmul_t_groups([(int(w.format.qtype), w.raw, w.shape) for w in weights], x3)


def weight_rows(w: FrozenWeight, ids):
    """Dequantize only the rows `ids` of w (embedding lookup) -> f32 [len(ids), n_in]."""
    import numpy as np
    from pipeline.kernels import dequant
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    raw = np.asarray(w.raw)[ids]
    if w.format.qtype == QT.F32:
        return raw.astype(np.float32, copy=True)
    if w.format.qtype == QT.F16:
        return raw.astype(np.float32)
    if w.format.qtype == QT.BF16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return dequant.dequantize_rows(int(w.format.qtype), raw, w.shape[1])


def _q8_blocks(x):
    """x [N, n] f32 in ggml-cpu's Q8_0/Q8_1 activation blocks: (q [N, n/32, 32] integers as f32, d [N, n/32] f32)."""
    import numpy as np
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):  # quantize_row_q8_0's AVX2 path scales by 127/max (the generic one by 1/d)
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    return np.rint(blocks * inv[..., None]), d  # x86 SIMD rounds half to even


def llama_activation_roundtrip(qtype, x):
    """x as llama.cpp's CPU matmul sees it: activations are themselves quantized to the
    weight type's dot-product partner (Q8_0 for Q8_0/Q4_0/Q5_0/IQ4_NL, Q8_1 for Q4_1/Q5_1,
    Q8_K for the K-quants and IQ4_XS, BF16 for BF16, F16 for F16) and dequantized here. Q8_1
    rounds like Q8_0 (its fp16 block sums are the integer path's). The f32 path of parity runs
    through F16/BF16 weights reads it (block formats take pipeline/kernels/qint.py, llama.cpp's own
    arithmetic), and tests/llm/test_parity_ties.py's replay of rounding ties."""
    import numpy as np
    x = np.asarray(x, dtype=np.float32)
    row = _formats.format_of(qtype)
    partner = row.partner if row else ""  # pipeline/kernels/formats.py's activation partner of the integer dot
    if partner in (_formats.Q8_0_PARTNER, _formats.Q8_1_PARTNER):
        q, d = _q8_blocks(x.reshape(-1, x.shape[-1]))
        return (q * d.astype(np.float16).astype(np.float32)[..., None]).reshape(x.shape)
    if partner == _formats.Q8_K_PARTNER:
        blocks = x.reshape(-1, _formats.PARTNER_BLOCK[partner])
        mx = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
        with np.errstate(divide="ignore"):
            iscale = np.where(mx == 0, np.float32(0), np.float32(-127.0) / mx).astype(np.float32)
            d = np.where(iscale == 0, np.float32(0), np.float32(1) / iscale).astype(np.float32)
        q = np.minimum(np.rint(iscale[:, None] * blocks), 127)
        return (q * d[:, None]).astype(np.float32).reshape(x.shape)
    if qtype == QT.BF16:
        b = x.view(np.uint32)
        return ((b + np.uint32(0x7FFF) + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)
    if qtype == QT.F16:  # ggml's F16 vec_dot_type is F16: activations rounded to nearest half
        return x.astype(np.float16).astype(np.float32)
    return x
