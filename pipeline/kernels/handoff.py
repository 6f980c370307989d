"""The kernel pool's hand-off without locks or the GIL: atomics on int64 cells, a bounded spin, native jobs.

Trade-off: a worker blocked on a lock is woken by the kernel scheduler (tens of microseconds on a VM), and a
worker that runs a Python job must also win the GIL from the thread that dispatched it. Decode makes ~113
dispatches per token, so both costs are paid ~113 times. Here a waiting thread first spins on an int64 cell
inside a numba nogil function (so it never holds the GIL while it spins) for at most `ticks` of the CPU's
cycle counter (x86; elsewhere it does not spin), then sleeps: on Linux in the futex syscall from inside the
same nogil function (so waking needs no GIL either), elsewhere on a Python lock; the poster wakes a sleeper
only when the cell says one sleeps. A "native" job is a C function pointer (a numba cfunc) called with one
int64 argument from inside the spin loop, so a worker runs it with no Python at all: the decode products are
native jobs (pipeline/kernels/qint.py).

A signal cell is an int64 array of 8 (one cache line): cell[SEQ] counts posts, cell[SLEEPING] is 1 while
its waiter sleeps (set by the waiter before it sleeps; the poster swaps it to 0 and wakes the waiter when it
was 1: with sequentially consistent atomics either the waiter sees the post or the poster sees the flag).
Without a futex the waiter turns it back with a compare-and-swap when a post came first, and whoever of the two
turns it decides who releases the lock. A worker's go cell also holds the job: cell[KIND], cell[FN], cell[ARG].
cell[BUDGET] is the waiter's current spin in cycles: doubled (up to the configured spin) after a wait
shorter than the configured spin, halved after a longer one. So a decode, whose dispatches come tens of microseconds
apart, keeps spinning, while a waiter on a machine with more runnable threads than cores, where the thread
it waits for may be off its core for milliseconds, soon sleeps at once and leaves the core to it.
A `hold` cell (hold[SEQ] > 0) keeps every waiter spinning past its budget: a model forward holds it, so the
Python between two of its products (attention, norms: hundreds of microseconds at decode) never puts a worker
to sleep, whose futex wake-up on a VM costs more than the product it was woken for.
"""
from __future__ import annotations

import platform
import threading

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SEQ, SLEEPING, KIND, FN, ARG, BUDGET = 0, 1, 2, 3, 4, 5
CELL = 8  # int64 slots per cell: a 64-byte line, so two threads' cells never share one
PYTHON, NATIVE = 0, 1  # cell[KIND]
TIMEOUT, PYTHON_JOB, WAKE_CALLER = 0, 1, 2  # what serve() returns for
_I64 = ir.IntType(64)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_SYSCALLS = {"x86_64": (202, 24), "amd64": (202, 24), "aarch64": (98, 124), "arm64": (98, 124)}  # futex, yield
_SYS_FUTEX, _SYS_YIELD = _SYSCALLS.get(platform.machine().lower(), (None, None))
FUTEX = platform.system() == "Linux" and _SYS_FUTEX is not None  # else waiters sleep on Python locks
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE


def new_cell() -> np.ndarray:
    return np.zeros(CELL, np.int64)


def _slot(context, builder, sig, args):
    return builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])


@intrinsic
def atomic_load(typingctx, cell, i):
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot(context, builder, sig, args), "seq_cst", 8)
    return types.int64(cell, i), codegen


@intrinsic
def atomic_store(typingctx, cell, i, value):
    def codegen(context, builder, sig, args):
        builder.store_atomic(args[2], _slot(context, builder, sig, args), "seq_cst", 8)
        return context.get_dummy_value()
    return types.void(cell, i, value), codegen


@intrinsic
def atomic_add(typingctx, cell, i, value):
    """cell[i] += value atomically; returns the old value."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _slot(context, builder, sig, args), args[2], "seq_cst")
    return types.int64(cell, i, value), codegen


@intrinsic
def atomic_cas(typingctx, cell, i, old, new):
    """cell[i] = new if cell[i] == old, atomically; True when it did."""
    def codegen(context, builder, sig, args):
        pair = builder.cmpxchg(_slot(context, builder, sig, args), args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)
    return types.boolean(cell, i, old, new), codegen


@intrinsic
def _cycles(typingctx):
    """The CPU's cycle counter on x86 (rdtsc); 0 elsewhere, which turns spinning off (on AArch64 LLVM reads
    PMCCNTR_EL0, which user code may not)."""
    def codegen(context, builder, sig, args):
        if not _X86:
            return ir.Constant(_I64, 0)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, []), "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen


@intrinsic
def _pause(typingctx):
    """x86 `pause` in a spin loop (yields the core's pipeline to its sibling, saves power); nothing elsewhere."""
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def atomic_swap(typingctx, cell, i, value):
    """cell[i] = value atomically; returns the old value."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("xchg", _slot(context, builder, sig, args), args[2], "seq_cst")
    return types.int64(cell, i, value), codegen


@intrinsic
def _futex(typingctx, cell, i, op, value):
    """futex(&low 32 bits of cell[i], op, value) through libc's syscall() (Linux; x86-64/aarch64 numbers):
    FUTEX_WAIT sleeps while that word equals value (returns at once when it does not), FUTEX_WAKE wakes
    `value` sleepers."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_I64, [_I64], var_arg=True)
        fn = cgutils.get_or_insert_function(builder.module, fnty, "syscall")
        word = builder.ptrtoint(_slot(context, builder, sig, args), _I64)  # little-endian: the low half
        zero = ir.Constant(_I64, 0)
        builder.call(fn, [ir.Constant(_I64, _SYS_FUTEX or 0), word, args[2], args[3], zero, zero, zero])
        return context.get_dummy_value()
    return types.void(cell, i, op, value), codegen


@intrinsic
def _sched_yield(typingctx):
    """sched_yield() through libc's syscall() (Linux): another runnable thread gets this core, if any."""
    def codegen(context, builder, sig, args):
        if FUTEX:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, [_I64], var_arg=True),
                                                "syscall")
            builder.call(fn, [ir.Constant(_I64, _SYS_YIELD)])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _call(typingctx, fn, arg):
    """Call the C function void(int64) at address fn with arg."""
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [_I64])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [args[1]])
        return context.get_dummy_value()
    return types.void(fn, arg), codegen


def _pointer_to(dtype):
    @intrinsic
    def pointer(typingctx, address):
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
        return types.CPointer(dtype)(address), codegen
    return pointer


# int64 address -> typed pointer, for numba.carray views of arrays a native job was handed by address
i64_pointer, u8_pointer, i8_pointer = _pointer_to(types.int64), _pointer_to(types.uint8), _pointer_to(types.int8)
i32_pointer, f32_pointer = _pointer_to(types.int32), _pointer_to(types.float32)


@njit(cache=True, nogil=True)
def cycles() -> int:
    return _cycles()


@njit(cache=True, nogil=True)
def add(cell, i, value) -> int:
    """cell[i] += value atomically from Python (a hold count); returns the old value."""
    return atomic_add(cell, i, value)


@njit(cache=True, nogil=True)
def spin_until(cell, target, ticks, hold) -> bool:
    """Spin until cell[SEQ] >= target (True) or `ticks` cycles have passed (False), without the GIL; while
    hold[SEQ] > 0 (a forward that dispatches every few tens of microseconds is running) the spin goes on."""
    start = _cycles()
    polls = 0
    while atomic_load(cell, SEQ) < target:
        if _cycles() - start >= ticks and atomic_load(hold, SEQ) <= 0:  # >=: a counter that reads 0 with
            return False                                                 # ticks 0 must not spin forever
        polls += 1
        if polls % 64 == 0:
            _sched_yield()
        else:
            _pause()
    return True


@njit(cache=True, nogil=True)
def wait(cell, target, ticks, hold) -> bool:
    """Wait for cell[SEQ] >= target without the GIL: spin (cell[BUDGET] cycles, at most `ticks`, or as long
    as `hold` is held), then sleep in the futex. Without a futex: False when the caller must sleep on the
    cell's lock (its sleep is announced), True when done."""
    start = _cycles()
    budget = min(cell[BUDGET], ticks)
    done = spin_until(cell, target, budget, hold)
    while not done:
        atomic_store(cell, SLEEPING, 1)
        seq = atomic_load(cell, SEQ)
        if seq >= target:  # a post came first: take the announcement back (without a futex, a poster that
            done = atomic_cas(cell, SLEEPING, 1, 0) or FUTEX  # took it first releases the lock)
            break
        if not FUTEX:
            break
        _futex(cell, SEQ, _FUTEX_WAIT, seq & 0xFFFFFFFF)
    cell[BUDGET] = min(ticks, 2 * budget + 1024) if _cycles() - start <= ticks else budget // 2
    return done


@njit(cache=True, nogil=True)
def post(cell) -> bool:
    """cell[SEQ] += 1, waking its waiter if it sleeps; True when that waiter sleeps on its Python lock (no
    futex) and the poster must release the lock."""
    atomic_add(cell, SEQ, 1)
    if FUTEX:
        if atomic_swap(cell, SLEEPING, 0) == 1:
            _futex(cell, SEQ, _FUTEX_WAKE, 1)
        return False
    return atomic_cas(cell, SLEEPING, 1, 0)


@njit(cache=True, nogil=True)
def post_job(cell, kind, fn, arg) -> bool:
    """Set a worker's job (kind, and for a native one its function and argument), then `post` its go cell."""
    atomic_store(cell, KIND, kind)
    atomic_store(cell, FN, fn)
    atomic_store(cell, ARG, arg)
    return post(cell)


@njit(cache=True, nogil=True)
def run_native(fn, arg):
    """Call a native job on this thread, without the GIL."""
    _call(fn, arg)


@njit(cache=True, nogil=True)
def dispatch(cells, n, fn, arg, ticks, hold):
    """The native job fn(arg) on this thread and the first n pool workers at once, from native code (Linux: the
    futex path only, workpool.native_workers): worker w's go cell is cells[2w], its done cell cells[2w + 1]; each
    worker is waited for until its done count reaches its go count."""
    for w in range(n):
        post_job(cells[2 * w], NATIVE, fn, arg)
    _call(fn, arg)
    for w in range(n):
        wait(cells[2 * w + 1], atomic_load(cells[2 * w], SEQ), ticks, hold)


@njit(cache=True, nogil=True)
def serve(go, done, seen, ticks, hold):
    """A worker's wait: run each native job posted on `go` (seen = the posts handled so far), counting it on
    `done`, until a Python job is posted (PYTHON_JOB). Between posts it spins `ticks` cycles (on, while `hold`
    is held), then sleeps in the futex; without one it returns TIMEOUT to sleep on its lock, or WAKE_CALLER
    when the poster of a native job sleeps on its lock for `done`. Returns (what, seen)."""
    while True:
        if not wait(go, seen + 1, ticks, hold):
            return TIMEOUT, seen
        seen += 1
        if atomic_load(go, KIND) != NATIVE:
            return PYTHON_JOB, seen
        _call(atomic_load(go, FN), atomic_load(go, ARG))
        if post(done):
            return WAKE_CALLER, seen


class NativeJob:
    """A job runner `func(address)` (address: an int64 job block that the runner reads through carray views)
    compiled as a C callback on first use, or loaded from numba's cache, and kept for the life of the process:
    its address is handed to the pool's workers (workpool.run_native)."""

    def __init__(self, func):
        self._func, self._compiled, self._lock = func, None, threading.Lock()

    @property
    def address(self) -> int:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = cfunc(types.void(types.int64), cache=True)(self._func)
        return self._compiled.address
