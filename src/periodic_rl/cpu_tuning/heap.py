"""Keeping freed memory in the process, so that CPU training does not page-fault every step.

glibc's malloc serves each allocation above its mmap threshold (at most 32 MiB) with a fresh
``mmap`` and unmaps it again on ``free``. A CPU training step allocates such buffers over and
over: the ``[vocab, hidden]`` gradient of a tied embedding (113 MiB for SmolLM2-135M), the
logits of a micro-batch, the weight gradients. Each time, the kernel maps and zeroes the pages
one 4 KiB fault at a time, which costs more than the arithmetic on them, and more still inside a
virtual machine. :func:`keep_freed_memory` turns that off for the calling process: big
allocations come from the heap too, and the heap keeps what is freed for the next step's
allocations (docs/benchmarks.md).

The cost: the process's resident memory stays near its peak instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["keep_freed_memory"]

#: ``mallopt`` parameters (glibc's ``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: The largest trim threshold ``mallopt`` takes (an ``int``): the heap's free top is returned to
#: the kernel only beyond 2 GiB.
MAX_TRIM_THRESHOLD = 2**31 - 1
#: What a user may already have chosen for the allocator; then it is left alone.
ALLOCATOR_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def allocator_chosen() -> bool:
    """Whether the environment already tunes or replaces malloc (glibc variables, tunables, or
    a preloaded jemalloc / tcmalloc / mimalloc)."""
    if any(name in os.environ for name in ALLOCATOR_ENV):
        return True
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return True
    preload = os.environ.get("LD_PRELOAD", "")
    return any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc"))


def uses_glibc() -> bool:
    """Whether this process runs on glibc (whose ``mallopt`` takes the settings below)."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):  # no confstr, or a libc that lacks the name
        return False
    return bool(version) and version.startswith("glibc")


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and keep freed memory for reuse (glibc).

    Returns whether the setting was applied: False off glibc, when the environment already
    chose the allocator's behaviour (:func:`allocator_chosen`), or when ``mallopt`` refuses.
    Applies to allocations made after the call; calling it again is harmless.
    """
    if not uses_glibc() or allocator_chosen():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own libc
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, MAX_TRIM_THRESHOLD))
