"""One row per GGML tensor format: the facts every kernel and loader dispatches through, stated once.

Trade-off: the kernel modules keep their per-format compiled drivers as module-level functions (numba caches
a function by its module and name; closures made by a factory would share one cache index), but every table
that maps a format to its kernels, block geometry or partner is built from FORMATS by the kernel's name, so
adding a format is one row here plus its kernels (docs/models.md "Adding a format"). The block sizes equal
gguf-py's GGML_QUANT_SIZES (tests/kernels/test_formats.py checks them when gguf is installed); this module
needs no gguf, so the kernels import it freely. Kernel names are strings resolved by the module that owns
them (`kernel(module_globals)`), which keeps formats.py free of import cycles: every kernel module imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

# activation partners of the integer dots (llama.cpp's vec_dot_type)
Q8_0_PARTNER, Q8_1_PARTNER, Q8_K_PARTNER = "Q8_0", "Q8_1", "Q8_K"
PARTNER_BLOCK = {Q8_0_PARTNER: 32, Q8_1_PARTNER: 32, Q8_K_PARTNER: 256}  # elements per activation block


@dataclass(frozen=True)
class Format:
    """A GGUF tensor type: its block geometry, where its fp16 scales sit, and the names of its kernels
    ("" where there is none): `dequant` (pipeline/kernels/dequant.py tile kernel), `dot` (pipeline/kernels/qdot.py fused
    matvec), `idot` (pipeline/kernels/qint.py integer row kernel against `partner` activations), `gemm`
    (pipeline/kernels/qint_gemm.py blocked integer GEMM), `quantize` (kernels/quantize.py encoder key). `tile_kind` is
    pipeline/kernels/qtile.py's tile layout (-1: no tiles) and `tile_source` the block reader its packer uses.
    `f32_prompt`: the default mode keeps this format's prompts (more rows than a decode) on f32 activations
    (the tiled f32 GEMM, exact) although it has a `gemm`, which then serves --llama-numerics only.
    `prompt_tiles`: an inference prompt (weights opened for inference: generate, serve, bench llm; quants.
    for_inference) takes the qtile tiles all the same; the other no-grad forwards (fine-tune evaluation, ES
    members) keep f32_prompt's f32 arithmetic, the training forward's."""
    qtype: int          # gguf GGMLQuantizationType id
    name: str           # ggml's spelling, e.g. "Q4_K"
    block: int          # elements per block (1 for the plain floats)
    block_bytes: int    # bytes per block
    layout: str         # the block's fields, little-endian (fp16 = IEEE half)
    d_at: int = -1      # byte offset of the fp16 scale d in a block (-1: none)
    dmin_at: int = -1   # byte offset of the second fp16 (dmin, or Q4_1/Q5_1's m; -1: none)
    partner: str = ""   # activation blocks of the integer dot ("" : no integer kernel)
    bsums: bool = False  # the integer dot also reads Q8_K's 16-element sums (Q2_K's mins, Q6_K's offset)
    tile_kind: int = -1
    tile_source: int = -1
    dequant: str = ""
    dot: str = ""
    idot: str = ""
    gemm: str = ""
    quantize: str = ""
    f32_prompt: bool = False
    prompt_tiles: bool = False

    @property
    def quantized(self) -> bool:
        """True when the bytes are blocks, not plain floats."""
        return self.block > 1

    def row_bytes(self, n_cols: int) -> int:
        return n_cols // self.block * self.block_bytes

    @property
    def scales(self) -> tuple:
        """(block elements, block bytes, d offset, dmin offset): the constants a compiled driver folds in."""
        return self.block, self.block_bytes, self.d_at, self.dmin_at


def _row(qtype, name, block, block_bytes, layout, d_at=-1, dmin_at=-1, partner="", bsums=False, tile=(-1, -1),
         kernels=True, gemm=False, quantize=False, f32_prompt=False, prompt_tiles=False):
    key = name.lower()
    return Format(qtype, name, block, block_bytes, layout, d_at, dmin_at, partner, bsums, tile[0], tile[1],
                  f"_dq_{key}" if kernels else "", f"_mv_{key}" if kernels else "",
                  f"_mm_{key}" if partner else "", f"_gemm_{key}" if gemm else "", key if quantize else "",
                  f32_prompt, prompt_tiles)


# f32_prompt on the 32-element formats: their blocked GEMM serves --llama-numerics; the default mode's prompts stay
# on f32 activations. Measured 2026-12-07 (docs/BENCHMARKS.md): the real SmolLM2 Q4_1's prompt is exact there (KL 0
# to the dequantized model, 2.9e-3 on Q8_1 ones; llama.cpp 3.0e-3) for 2-11% more CPU; Gemma 3's Q5_0/Q8_0 prompt
# KL 3.5e-3 vs 4.6e-3 on Q8_0 ones (llama.cpp 5.4e-3) for a gain inside the noise (Qwen3-0.6B-shaped Q8_0: 17% at
# 64 rows). f32 prompts also keep a no-grad forward (fine-tune evaluation, ES's lock-step members) on the training
# forward's arithmetic, as tests/es and tests/llm expect on the Q8_0 fixture. prompt_tiles (2026-12-08,
# docs/BENCHMARKS.md): an inference prompt through Q8_0/Q4_0/Q5_0 takes qtile's 32-element tiles (Gemma 3 prompt
# KL 4.4e-3, llama.cpp 5.4e-3; its prompt CPU -47%, a Qwen3-0.6B-shaped Q8_0's -65%); Q4_1/Q5_1 have tiles too but
# keep their exact f32 prompts (SmolLM2 Q4_1's prompt already x1.9-2.1 of llama.cpp's CPU time at 1 thread; KL 0
# against llama.cpp's 3.0e-3).
FORMATS = (
    _row(0, "F32", 1, 4, "f32", kernels=False),
    _row(1, "F16", 1, 2, "f16 (its tile kernels take 32-column groups)"),
    _row(30, "BF16", 1, 2, "bf16: the high halves of f32s (32-column groups)"),
    _row(8, "Q8_0", 32, 34, "d fp16 | qs int8[32]; x = d * q", 0, partner=Q8_0_PARTNER, tile=(6, 6), gemm=True,
         quantize=True, f32_prompt=True, prompt_tiles=True),
    _row(2, "Q4_0", 32, 18, "d fp16 | qs u8[16] nibbles (values j, j + 16); x = d * (q - 8)", 0, partner=Q8_0_PARTNER,
         tile=(5, 7), gemm=True, quantize=True, f32_prompt=True, prompt_tiles=True),
    _row(3, "Q4_1", 32, 20, "d fp16 | m fp16 | qs u8[16]; x = d * q + m", 0, 2, partner=Q8_1_PARTNER, tile=(7, 9),
         gemm=True, quantize=True, f32_prompt=True),
    _row(6, "Q5_0", 32, 22, "d fp16 | qh u32 (bit 4 of q) | qs u8[16]; x = d * (q - 16)", 0,
         partner=Q8_0_PARTNER, tile=(5, 8), gemm=True, quantize=True, f32_prompt=True, prompt_tiles=True),
    _row(7, "Q5_1", 32, 24, "d fp16 | m fp16 | qh u32 | qs u8[16]; x = d * q + m", 0, 2, partner=Q8_1_PARTNER,
         tile=(7, 10), gemm=True, quantize=True, f32_prompt=True),
    _row(10, "Q2_K", 256, 84, "scales u8[16] (4-bit scale | 4-bit min) | qs u8[64] | d fp16 | dmin fp16", 80, 82,
         partner=Q8_K_PARTNER, bsums=True, tile=(4, 5)),
    _row(11, "Q3_K", 256, 110, "hmask u8[32] | qs u8[64] | scales u8[12] (6-bit, - 32) | d fp16", 108,
         partner=Q8_K_PARTNER, tile=(2, 3)),
    _row(12, "Q4_K", 256, 144, "d fp16 | dmin fp16 | scales u8[12] (6-bit scales and mins) | qs u8[128]", 0, 2,
         partner=Q8_K_PARTNER, tile=(0, 0), gemm=True, quantize=True),
    _row(13, "Q5_K", 256, 176, "d fp16 | dmin fp16 | scales u8[12] | qh u8[32] | qs u8[128]", 0, 2,
         partner=Q8_K_PARTNER, tile=(1, 1), gemm=True, quantize=True),
    _row(14, "Q6_K", 256, 210, "ql u8[128] | qh u8[64] | scales int8[16] | d fp16", 208, partner=Q8_K_PARTNER,
         bsums=True, tile=(2, 2), gemm=True, quantize=True),
    _row(20, "IQ4_NL", 32, 18, "d fp16 | qs u8[16] nibbles into IQ4_VALUES", 0, partner=Q8_0_PARTNER),
    _row(23, "IQ4_XS", 256, 136, "d fp16 | scales_h u16 | scales_l u8[4] (6-bit, - 32) | qs u8[128]", 0,
         partner=Q8_K_PARTNER, tile=(3, 4)),
)
BY_QTYPE = {f.qtype: f for f in FORMATS}
BY_NAME = {f.name: f for f in FORMATS}
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = (f.qtype for f in FORMATS)
BLOCK_FORMATS = tuple(f for f in FORMATS if f.quantized)
QK_K = BY_QTYPE[Q4_K].block  # the K-quants' super-block


def format_of(qtype) -> Format | None:
    """The row of a tensor type id, or None when Fucina has no kernels for it."""
    try:
        return BY_QTYPE.get(int(qtype))
    except (TypeError, ValueError):
        return None


def block_sizes(qtype) -> tuple[int, int]:
    """(elements, bytes) per block of a type this table holds (ValueError otherwise)."""
    fmt = format_of(qtype)
    if fmt is None:
        raise ValueError(f"formats: no row for ggml type {qtype}")
    return fmt.block, fmt.block_bytes


def kernels(field: str, module_globals: dict) -> dict:
    """{qtype: the function named by each row's `field`} for the rows that have one, looked up in the calling
    kernel module's globals (its own compiled drivers)."""
    return {f.qtype: module_globals[getattr(f, field)] for f in FORMATS if getattr(f, field)}
# (block, block bytes, d offset, dmin offset) by type id: a compiled driver indexes it with its format's constant
GEOMETRY = tuple(BY_QTYPE[q].scales if q in BY_QTYPE else (0, 0, -1, -1) for q in range(max(BY_QTYPE) + 1))
