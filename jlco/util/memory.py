"""Returning freed heap memory to the OS.

glibc's malloc keeps memory freed by XLA (compiler scratch, a finished prefill's
buffers) in its arenas: the process's RSS, which is what an OOM killer and `VmHWM`
see, then grows ~200 MB per compiled program and never shrinks. `malloc_trim(0)` hands
the free pages back. Measured on configs/128k.py's warm-up (47 programs): peak RSS
7.3 GB without, see docs/journal/2026-12-02.md "Session 6" for with.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=None)
def _trim():
    """glibc's malloc_trim, or None (musl, macOS, no libc found)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Give the heap's free pages back to the OS → whether anything could be done."""
    fn = _trim()
    return bool(fn is not None and fn(0))
