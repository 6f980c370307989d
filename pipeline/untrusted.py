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

Input paths: every file a flag names must be a regular file. A FIFO would block
the open (or feed bytes forever), /dev/zero never ends, a directory is not a
file: `not_a_regular_file` says which it is, and `open_regular` opens without
blocking and checks the opened descriptor (so a path swapped after the check is
caught too).
"""
from __future__ import annotations

import json
import os
import re
import stat

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


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _refusal(path, mode: int, what: str) -> str:
    if stat.S_ISDIR(mode):
        return f"{path} is a directory, not a {what}"
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    return f"{path} is {kind}, not a regular file (expected a {what})"


def not_a_regular_file(path, what: str = "file") -> str | None:
    """Why `path` cannot be read as a `what` (missing, a directory, a FIFO, a device, unreadable), or None.

    The message starts with the path: '{path}: no such file', '{path} is a directory, not a GGUF file',
    '{path} is a FIFO (named pipe), not a regular file (expected a GGUF file)'."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"{path}: no such file"
    except OSError as e:
        return f"{path}: cannot read ({e.strerror or e})"
    return None if stat.S_ISREG(mode) else _refusal(path, mode, what)


def open_regular(path, error: type[Exception], what: str = "file", flag: str = ""):
    """The regular file `path` opened for binary reading; anything else is error('[flag ]{path} ...').

    O_NONBLOCK keeps a FIFO from blocking the open; fstat of the opened descriptor is what is checked."""
    prefix = f"{flag} " if flag else ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        problem = not_a_regular_file(path, what)
        raise error(prefix + (problem or f"{path}: cannot read ({e.strerror or e})")) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(prefix + _refusal(path, mode, what))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
