"""Keep freed memory in the process heap instead of handing it back to the OS.

Why: glibc serves every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB)
with a fresh ``mmap`` and returns it with ``munmap`` when freed. A training step allocates and frees
activation-sized blocks (tens of MB) again and again, so their pages are faulted in and zeroed by
the kernel on every use (28 K minor faults per tiny-64x8-L16 step, 100-300 K per small-model step
at length 128). Raising the mmap threshold to 1 GiB and never trimming the heap lets freed blocks
be reused: the faults drop to almost none and the kernel time of a run halves. Measured as whole
processes on our 2-core VM (docs/performance.md): small-4x8-L128 4.4 % faster, tiny-64x8-L16 within
noise; peak RSS 2 % higher (the heap keeps some fragments).

The cost: the process keeps its peak heap resident after a step instead of returning it, which a
long training run does anyway. Only glibc (Linux) has these knobs; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 1 << 30  # blocks below 1 GiB come from the heap and return to it
_NEVER_TRIM = -1  # glibc reads the int as size_t: the largest value, so the top of the heap is never trimmed
_applied = False


def keep_freed_memory() -> bool:
    """Tell glibc's allocator to reuse freed blocks; True if it took effect (idempotent), False where
    the C library is not glibc."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
    return _applied
