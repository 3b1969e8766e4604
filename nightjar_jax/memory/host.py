"""The process's own memory as the system sees it: its resident bytes, and giving freed heap back.

Freeing device arrays or compiled executables on the CPU backend returns their bytes to the C allocator, not to
the system: glibc keeps the freed chunks of its heaps and arenas, so the process's resident memory stays where it
was. Sleep mode on a CPU host, which exists to hand memory back, then handed back little the system could see: the
default pair at level 2 held 2,412 MiB resident asleep, and 624 MiB once glibc's ``malloc_trim`` ran (2026-12-06;
docs/benchmarks.md, "Sleep mode on a CPU host"). :func:`trim` runs it where the engine frees much at once: a sleep,
a weight update, a drop of compiled variants (on every backend; on an accelerator it gives back host-side scraps
only). It is a no-op where the C library is not glibc, and with ``NIGHTJAR_MALLOC_TRIM=0`` in the environment (only
"0" turns it off, as the project's other switches; read at each call; ``scripts/bench_sleep.py --no-trim``).
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

_malloc_trim = None  # glibc's malloc_trim, once looked up (False: none here)


def proc_bytes(path: str, field: str) -> int | None:
    """A ``<field>: <n> kB`` line of a ``/proc`` file (``/proc/meminfo``, ``/proc/self/status``) in bytes; None
    where the file or the line is missing (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> int | None:
    """The process's resident memory (``VmRSS``) in bytes; None where ``/proc`` does not say (not Linux)."""
    return proc_bytes("/proc/self/status", "VmRSS")


def trim() -> bool:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim(0)``); returns whether it ran (False
    where the C library has no such call, or ``NIGHTJAR_MALLOC_TRIM=0``). Safe beside other threads: glibc locks each
    arena as it trims it."""
    global _malloc_trim
    if os.environ.get("NIGHTJAR_MALLOC_TRIM", "1").strip() == "0":
        return False
    if _malloc_trim is None:
        _malloc_trim = False
        try:
            fn = ctypes.CDLL(None).malloc_trim  # (the process's own symbols: no ldconfig run from a server)
        except (OSError, AttributeError, TypeError):
            logger.debug("no malloc_trim in this C library: freed memory stays with the allocator")
        else:
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _malloc_trim = fn
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True
