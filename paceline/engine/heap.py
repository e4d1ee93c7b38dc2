"""Keep the memory a step frees in the process heap instead of handing it back to the kernel after every step.

Why: glibc gives freed memory at the top of a heap back to the kernel (trim; for a thread's arena it also unmaps
whole 64 MiB heaps) and serves large blocks from fresh mappings, so memory that a step frees is mapped and zeroed
again, page by page, when the next step allocates it. A served 1,500-token prompt (its activations, ~250 MB, are
allocated and freed on the engine thread) took ~45,000 minor page faults and 362.7 ms to its first token against
76 faults and 311.0 ms with the settings below (`benchmarks/lone_prompt.py --variant PACELINE_KEEP_HEAP=1 --variant
PACELINE_KEEP_HEAP=0 --rounds 2`, int4, AMX Xeon, 2026-11-25 16:26 UTC; docs/performance.md). An offline step on
the main thread, whose heap happened to keep the memory, never showed it. vLLM's CPU backend
asks for tcmalloc preloaded for the same reason; glibc's own knobs do it without another dependency.

Cost: the process keeps its largest step's activations resident between steps instead of returning them. A
default server after six lone 1,500-token prompts: 2,885 MB resident against 2,862 MB without (the 2 GiB KV pool
included; `benchmarks/lone_prompt.py`, one round, 17:10 UTC).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit (half a thread heap); bigger blocks still get own mappings
TRIM_THRESHOLD = 1 << 30  # free memory at a heap's top stays up to this much
TOP_PAD = 64 * 2**20  # and one thread heap is never unmapped while its arena's previous heap is full


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once for this process; True if they were set. A no-op (False) outside glibc or with
    PACELINE_KEEP_HEAP=0 (A/B runs). Cached: every ModelRunner asks, and find_library runs ldconfig in a subprocess
    (2-8 ms of a model load on demand, 2026-11-29)."""
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
