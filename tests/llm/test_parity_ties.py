"""Quantized llama.cpp parity, explained to float rounding: every logit difference is a rounding tie.

llama.cpp's CPU matmuls round the activations to 8 bits (Q8_K for K-quant
weights, Q8_0 for Q8_0) before its integer dot products; llama-numerics mode
(`Qwen3.from_gguf(..., llama_numerics=True)`) rounds ours the same way. When an
activation lands within a few ulps of a rounding midpoint, our float operations
(ordered differently from ggml's SIMD code) can round it to the neighbouring
integer: one such flip in a K/V row or the head's input moves the logits of these
small random models by ~1% (measured up to 2.2%), which is why
test_parity_llama.py can only bound the raw difference loosely.

This test removes that slack. It replays our forward with the rounding of the
nearest tie at the first mismatching position turned the other way, and repeats
(MAX_FLIPS at most). Passing means: after flipping at most MAX_FLIPS
roundings that each sat within TIE (relative) of a midpoint — an activation
element, or a Q8_0 block scale's f16 rounding — our logits equal llama.cpp's to
REL relative at every position: the two implementations agree to float
rounding, and the raw gap is rounding-tie chaos, not an error in our kernels.

Measured 2026-11-29 on all 14 quantized fixtures (3 shapes x Q8_0/Q4_K_S/
Q5_K_M/Q6_K + 2 committed files): raw max per-position gap up to 2.2e-2; after
1-6 flips, at most 7.6e-7 at every position.
"""
import numpy as np
import pytest

import pipeline.llm.quants as quants
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer
from pipeline.models.qwen3 import Qwen3

from test_parity_llama import FIXTURES, TEXT, files, llama  # noqa: F401  (files is a fixture)

pytestmark = [pytest.mark.parity, pytest.mark.needs("llama_cpp")]

MAX_FLIPS = 8
TIE = 1e-5   # a flipped rounding must be this close to its midpoint, relative to the value rounded
REL = 1e-5   # per-position relative error left after the flips (float rounding is ~3e-7)
CANDIDATES = 40  # nearest ties tried per mismatching position
QT = quants.QT


def _element_steps(qtype, x):
    """(x in quantization steps before rounding, f32 block scale d) per element, as the roundtrip computes them."""
    if qtype in (QT.Q8_0, QT.Q4_0):
        blocks = x.reshape(-1, 32)
        d = (np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        return (blocks * inv).reshape(x.shape), d.reshape(x.shape[0], -1)
    blocks = x.reshape(-1, 256)
    mx = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx == 0, np.float32(0), np.float32(-127.0) / mx).astype(np.float32)
        d = np.where(iscale == 0, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    return (iscale[:, None] * blocks).reshape(x.shape), d.reshape(x.shape[0], -1)


def _half_brackets(d):
    """The two f16 values around f32 d, and d's position between them (0..1)."""
    h = d.astype(np.float16)
    below = h.astype(np.float32) <= d
    lo = np.where(below, h, np.nextafter(h, np.float16(-np.inf)))
    hi = np.where(below, np.nextafter(h, np.float16(np.inf)), h)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = (d.astype(np.float64) - lo) / (hi.astype(np.float64) - lo)
    return lo.astype(np.float32), hi.astype(np.float32), np.nan_to_num(frac, nan=0.0)


class TieReplay:
    """Wraps quants.llama_activation_roundtrip: records how close each rounding came to a midpoint
    and applies the chosen flips on replay. Two roundings can tie: an element to its integer
    step, and (Q8_0/Q4_0) a block's scale to f16, which rescales its 32 elements. A flip is
    (input, kind, row, index) where input is the index of the first call that read those bytes:
    q/k/v (and gate/up) quantize the same input, in llama.cpp as here, so one flip applies to
    every matmul reading it, and call order is the same on every replay."""

    def __init__(self, monkeypatch):
        self.original = quants.llama_activation_roundtrip
        self.flips, self.ties, self.seen, self.n_calls = set(), {}, {}, 0
        monkeypatch.setattr(quants, "llama_activation_roundtrip", self)
        # the replay needs the rounded activations in f32: the integer path (kernels/qint.py) is off here
        monkeypatch.setattr(quants.FrozenWeight, "uses_integer_dot", lambda w, rows: False)

    def __call__(self, qtype, x):
        y = self.original(qtype, x)
        if qtype not in (QT.Q8_0, QT.Q4_0, QT.Q4_K, QT.Q5_K, QT.Q6_K):
            return y
        x = np.asarray(x, dtype=np.float32)
        v, d = _element_steps(qtype, x)
        key = self.seen.setdefault(hash(x.tobytes()), self.n_calls)  # first call that read this input
        self.n_calls += 1
        block = x.shape[1] // d.shape[1]
        # distance to the midpoint as a relative change of the value being rounded: float noise
        # between two implementations is ~1e-7 relative, whatever is rounded (element or scale)
        ties = {"element": np.abs(np.abs(v - np.floor(v)) - 0.5) / np.maximum(np.abs(v), 0.5)}
        if qtype in (QT.Q8_0, QT.Q4_0):  # the scale is stored as f16
            lo, hi, frac = _half_brackets(d)
            with np.errstate(invalid="ignore", divide="ignore"):
                ties["scale"] = np.nan_to_num(np.abs(frac - 0.5) * (hi - lo) / d, nan=np.inf)
            scale = np.where(d.astype(np.float16).astype(np.float32) == lo, lo, hi)
        else:
            scale = d
        self.ties.setdefault(key, ties)
        mine = [f for f in self.flips if f[0] == key]
        if mine:
            y = y.copy()
            for _, kind, r, j in mine:
                if kind == "element":
                    q = np.rint(v[r, j])
                    y[r, j] = np.float32(np.clip(q + (1 if v[r, j] > q else -1), -127, 127)) * scale[r, j // block]
                else:
                    s = lo[r, j] if scale[r, j] == hi[r, j] else hi[r, j]
                    y[r, j * block:(j + 1) * block] = np.rint(v[r, j * block:(j + 1) * block]) * s
        return y

    def run(self, model, ids):
        self.ties, self.seen, self.n_calls = {}, {}, 0
        return model.infer(ids, all_logits=True)

    def nearest_ties(self, position, n):
        """The n roundings at positions <= `position` closest to a midpoint: (distance, (input, kind, row, index))."""
        found = []
        for key, ties in self.ties.items():
            for kind, dist in ties.items():
                head = dist[: position + 1].reshape(-1)
                for flat in np.argpartition(head, min(n, head.size - 1))[:n]:
                    flip = (key, kind) + divmod(int(flat), dist.shape[1])
                    if flip not in self.flips:
                        found.append((float(head[flat]), flip))
        return sorted(found)[:n]


def _rows(ref, ours):
    return np.linalg.norm(ref - ours, axis=1) / np.linalg.norm(ref, axis=1)


def explain(path, monkeypatch):
    """(raw per-position error, error after the flips, flips). The first mismatching position p
    takes the nearest tie (among its CANDIDATES nearest at or before it, those at p first) whose flip leaves every
    earlier position within REL and at least halves p's error; two ties can coincide at one
    position, so p may take more than one flip before it agrees to REL."""
    ids = np.array(Tokenizer.from_gguf(GGUFFile(path)).encode(TEXT))
    oracle = llama(path, quantized=True)
    oracle.eval(list(ids))
    ref = np.array(oracle.scores[: len(ids)], dtype=np.float32)
    model = Qwen3.from_gguf(path, llama_numerics=True)
    replay = TieReplay(monkeypatch)
    raw = rows = _rows(ref, replay.run(model, ids))
    while (rows > REL).any():
        p = int(np.flatnonzero(rows > REL)[0])
        assert len(replay.flips) < MAX_FLIPS, f"more than {MAX_FLIPS} rounding flips needed (position {p} still off)"
        accepted = False
        # a tie at p itself first: one at an earlier row would usually have shown there already
        for dist, flip in sorted(replay.nearest_ties(p, CANDIDATES), key=lambda c: (c[1][2] != p, c[0])):
            if dist > TIE:
                continue
            replay.flips.add(flip)
            trial = _rows(ref, replay.run(model, ids))
            if (p == 0 or trial[:p].max() <= REL) and trial[p] <= rows[p] / 2:
                rows, accepted = trial, True
                break
            replay.flips.discard(flip)
        assert accepted, (f"position {p} differs by {rows[p]:.2e} and no rounding within {TIE} (relative) "
                          f"of its midpoint explains it: not rounding")
        replay.run(model, ids)  # refresh the tie distances under the accepted flips
    return raw, rows, replay.flips


FAST = {("untied", "Q4_K_S"), ("untied", "Q6_K")}  # the two largest raw gaps; the full matrix runs with -m slow
UNEXPLAINED = set()


def _marks(s, k):
    marks = [] if (s, k) in FAST else [pytest.mark.slow]
    if (s, k) in UNEXPLAINED:
        marks.append(pytest.mark.xfail(strict=True,
                                       reason="a later mismatch is not a single rounding tie (see UNEXPLAINED)"))
    return marks


CASES = [pytest.param(s, k, id=f"{s}-{k}", marks=_marks(s, k))
         for s in ("tied", "untied", "wide") for k in ("Q8_0", "Q4_K_S", "Q5_K_M", "Q6_K")]


@pytest.mark.parametrize("shape,kind", CASES)
def test_quantized_logit_gaps_are_rounding_ties(files, shape, kind, monkeypatch, request):  # noqa: F811 (the fixture)
    from pipeline.kernels import blas
    if (shape, kind) == ("wide", "Q4_K_S") and blas.backend() == "mkl":
        # measured 2026-12-01 on AMD EPYC: with MKL under the tiles a 2.4e-2 gap at one position is not
        # explained within 8 flips (with OpenBLAS it is); an open question, run and reported, not hidden
        request.node.add_marker(pytest.mark.xfail(reason="MKL on AMD EPYC: a gap the tie explainer misses",
                                                  strict=False))
    raw, rows, flips = explain(files(shape, kind), monkeypatch)
    assert rows.max() <= REL, (f"{len(flips)} tie flips left a per-position relative error of {rows.max():.2e} "
                               f"(raw {raw.max():.2e}): the remaining gap is not rounding")


@pytest.mark.parametrize("name", ["qwen3-mini-q8_0.gguf", "qwen3-tied-q4_k_s.gguf"])
def test_committed_quantized_fixtures_agree_to_rounding(name, monkeypatch):
    raw, rows, flips = explain(FIXTURES / name, monkeypatch)
    assert rows.max() <= REL
