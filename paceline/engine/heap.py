"""Keep the memory a step frees in the process heap instead of handing it back to the kernel after every step.

Why: glibc gives freed memory at the top of a heap back to the kernel (trim; for a thread's arena it also unmaps
whole 64 MiB heaps) and serves large blocks from fresh mappings, so memory that a step frees is mapped and zeroed
again, page by page, when the next step allocates it. A served 1,500-token prompt (its activations, ~250 MB, are
allocated and freed on the engine thread) took 48-66 thousand minor page faults, and its step ran 340-440 ms
against ~275 ms for the same step in a process whose main-thread heap happened to keep that memory; with the
settings below, 2-117 faults after the first request and steps of 274-315 ms (a default server, 8 lone 1,500-token
prompts, int4, AMX CPU, 2026-11-25 16:05 UTC; the probe is described in docs/performance.md). vLLM's CPU backend
asks for tcmalloc preloaded for the same reason; glibc's own knobs do it without another dependency.

Cost: after the largest step the process keeps that step's activations resident (a few hundred MB for a
2,048-token step of the bundled model) instead of returning them between steps.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit (half a thread heap); bigger blocks still get own mappings
TRIM_THRESHOLD = 1 << 30  # free memory at a heap's top stays up to this much
TOP_PAD = 64 * 2**20  # and one thread heap is never unmapped while its arena's previous heap is full


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once for this process; True if they were set. A no-op (False) outside glibc or with
    PACELINE_KEEP_HEAP=0 (A/B runs)."""
    if os.environ.get("PACELINE_KEEP_HEAP", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators behave otherwise
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not done:
        log.warning("mallopt refused paceline's heap thresholds; steps may fault their activations in again")
    return done
