"""'compiling kernels for this CPU (first run only)': said when numba compiles, never when it loads from its cache.

A fresh clone's first `generate` of a quantized model spends most of its time in numba (measured on a 2-core
machine under load: 65-105 s cold before the cuts of docs/models.md "The first call", 26 s after, 3 s warm), which
otherwise looks like a hang. numba emits its "numba:compile" event only on a cache miss (a function loaded
from the cache compiles nothing), so a listener on it is an exact detector: the notice is printed at the first
miss, a progress line every PROGRESS_S seconds of compiling after it, and a closing line with the count and
the seconds when the command ends. On a warm cache nothing is printed. Only this process's compiles are seen
(the workers of a multiprocess run compile their own).
"""
from __future__ import annotations

import contextlib
import sys
import time

from numba.core import event

MESSAGE = "compiling kernels for this CPU (first run only; the next runs load them from the cache)"
PROGRESS_S = 10.0


def _stderr(msg):
    print(msg, file=sys.stderr, flush=True)


class CompileNotice(event.Listener):
    """Counts the outermost compiles (a kernel and everything it pulls in is one) and their seconds."""

    def __init__(self, log=_stderr, clock=time.perf_counter):
        self.log, self.clock = log, clock
        self.said, self.depth, self.count, self.seconds = False, 0, 0, 0.0
        self.t0 = self.last_progress = None

    def on_start(self, ev):
        if self.depth == 0:
            self.t0 = self.clock()
            if not self.said:
                self.said, self.last_progress = True, self.t0
                self.log(MESSAGE)
        self.depth += 1

    def on_end(self, ev):
        self.depth -= 1
        if self.depth:
            return
        now = self.clock()
        self.count += 1
        self.seconds += now - self.t0
        if now - self.last_progress >= PROGRESS_S:
            self.last_progress = now
            self.log(f"  ... {self.count} kernels compiled, {self.seconds:.0f} s")

    def summary(self) -> str:
        return f"compiled {self.count} kernel(s) in {self.seconds:.1f} s (cached: the next runs load them)"


@contextlib.contextmanager
def compile_notice(log=_stderr):
    """Listen for numba compiles while the block runs; -> the CompileNotice (said: whether anything compiled)."""
    notice = CompileNotice(log)
    event.register("numba:compile", notice)
    try:
        yield notice
    finally:
        event.unregister("numba:compile", notice)
        if notice.said:
            log(notice.summary())
