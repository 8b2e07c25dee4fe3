"""Bounding the converter's memory: per-piece working-memory estimates, a budget pieces reserve from,
and handing freed heap back to the OS."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .hub import HubSource
    from .source import LocalSource

    Source = LocalSource | HubSource


# Working memory of pieces running at once (estimated): what bounds peak memory, whatever the model size and
# the number of workers.
MEMORY_BUDGET = 640 * 2**20
# Peak working bytes per source byte of one item, by source format and, where it decides the path, the
# block-scale dtype (measured: FP8 requantization by the float recipe ~19, by the lookup tables that E8M0
# scales allow ~3 plus the tables; FP4 recasts ~6).
WORK_FACTOR = {"fp8": 20, "fp8/F8_E8M0": 5, "mxfp4": 6, "nvfp4": 8}
# The lookup tables' own memory, whatever the matrix size (MAX_COMBOS * PAIRS bytes of pair table; measured: a
# 2 MB FP8 matrix peaked at 27 MB).
TABLES_BYTES = 32 * 2**20
# A piece of a copied tensor: its bytes, and the value check's masks and magnitudes (measured: 5.5x for BF16).
COPY_FACTOR = 6


def piece_bytes(unit, src: Source) -> int:
    """Estimated peak working memory of one of a unit's pieces: an item (expert or matrix), or a stretch of a
    copied tensor."""
    fmt = getattr(unit, "fmt", None)
    members = getattr(unit, "members", None)
    if fmt is None or not members:
        return COPY_FACTOR * max(n for _, _, n in unit.filled(0))
    item = sum(src.tensors[n].info.nbytes for part in members[0] for n in part.values())
    scale = members[0][0].get("scale")
    kind = f"{fmt}/{src.tensors[scale].info.dtype}" if scale in src.tensors else fmt
    return WORK_FACTOR.get(kind, WORK_FACTOR.get(fmt, 20)) * item + (TABLES_BYTES if kind == "fp8/F8_E8M0" else 0)


def _malloc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``: hand freed heap memory back to the OS. After a large unit, the freed
    temporaries would otherwise stay in the worker thread's malloc arena and count as resident."""
    try:
        import ctypes

        trim = ctypes.CDLL("libc.so.6").malloc_trim
        return lambda: trim(0)
    except (OSError, AttributeError):
        return lambda: None


release_memory = _malloc_trim()
# Freed heap is handed back after a piece that reserved this much, and after any piece once the process holds
# more than TRIM_ABOVE: each worker thread's malloc arena keeps what its largest piece freed, which would
# otherwise grow with the number of workers (measured: 968 MiB peak with 16 workers, 1095 MiB with 32).
TRIM_AFTER = 64 * 2**20
TRIM_ABOVE = 768 * 2**20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def anon_resident() -> int:
    """Resident memory of this process that no file backs (``/proc/self/statm``: resident - shared); 0 where
    that is not known."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class MemoryBudget:
    """Units reserve their working memory before they run; one larger than the budget runs alone."""

    def __init__(self, total: int):
        self.total = self.free = total
        self.cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.total)
        with self.cond:
            while self.free < n:
                self.cond.wait()
            self.free -= n
        return n

    def release(self, n: int) -> None:
        with self.cond:
            self.free += n
            self.cond.notify_all()
