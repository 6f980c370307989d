"""Reading untrusted files: JSON with bounded nesting (never RecursionError), short reprs for messages.

Python's json parser recurses once per nesting level, so a 100,000-deep header
raises RecursionError from deep inside the decoder. Before json.loads we
measure the nesting: string literals are cut out with one regex (JSON's own
string grammar, so the cut falls where the decoder's would), the brackets left
over become +1/-1 steps, and their running sum's maximum is the depth. That is
a few C-speed passes over the text, and anything deeper than `max_depth` is
refused without being parsed.

Trade-off: a pre-scan plus the standard decoder instead of an iterative parser
of our own: one more pass over the text, but the decoder stays the standard
library's. Duplicate object keys are refused too (json keeps the last one
silently, which would hide a tensor or a field).
"""
from __future__ import annotations

import json
import re

import numpy as np

# A complete JSON string literal: quote, then runs of plain characters or backslash escapes, quote.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_OPENERS = np.frombuffer(b"[{", np.uint8)
_CHUNK = 1 << 20


def nesting_depth(text: str) -> int:
    """The deepest [ / { nesting of JSON `text`, not counting brackets inside string literals.

    From an unterminated string on, everything is string to the decoder (it
    stops there with an error), so the scan stops there too.
    """
    outside = _STRING.sub("", text)
    unterminated = outside.find('"')
    if unterminated >= 0:
        outside = outside[:unterminated]
    brackets = np.frombuffer(outside.encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKET), np.uint8)
    depth = deepest = 0
    for start in range(0, len(brackets), _CHUNK):  # chunks: a 100 MB header must not need 800 MB of sums
        running = depth + np.cumsum(np.where(np.isin(brackets[start:start + _CHUNK], _OPENERS), 1, -1))
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest


def _no_duplicate_keys(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def parse_json(text: str, source: str, error: type[Exception], max_depth: int = 64):
    """json.loads(text) with nesting at most max_depth and unique keys; any defect -> error(f"{source}: ...")."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise error(f"{source}: JSON nested {depth} levels deep, the limit is {max_depth}")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except ValueError as e:  # JSONDecodeError, a duplicate key, an integer past Python's digit limit
        raise error(f"{source}: not valid JSON ({e})") from None


def brief(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: a hostile value must not flood the error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
