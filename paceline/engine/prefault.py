"""Make a lazily allocated CPU tensor resident, page by page, without writing to it.

Why: the KV pool (2 GiB by default) is its own anonymous mapping (runner.py), which the kernel zeroes page by
page on first write. Start-up stays fast, but the process then grows for hours as blocks are first
written (the free queue hands out never-used blocks before cached ones), each first write of a block pays a few
hundred page faults inside a step, and a machine short of memory fails late, under load, instead of at start.
A 30-minute soak's RSS rose +17.8 % after its warm-up that way (benchmarks/summaries/soak.md). vLLM allocates its
KV cache up front for the same reasons.

How: madvise(MADV_POPULATE_WRITE) (Linux >= 5.14) faults every page in as if written, but writes nothing, so it
may run on a background thread while the engine already writes blocks: no race on the contents, and start-up
does not wait for the ~2 s it takes to populate 2 GiB on this 2-core machine. ctypes releases the GIL during the
call. Where the kernel lacks it, nothing happens (the pool stays lazy, as before). The thread runs at nice 19:
on 2 cores, faulting 2 GiB beside a server's first steps made them 3-10x slower (2026-11-23, the step-time
refit's log); pages it has not reached yet are faulted by the step that first writes them, as without it.
A model loaded on demand beside other models' streams holds its pool's prefault back (`held_until`) until its
first token: even at nice 19, zeroing 2 GiB takes memory bandwidth and a core whenever a step's threads sleep,
and the first prompt is what a switch waits for.
An engine paces its pool's prefault (`paced_by`): the thread populates only while the engine has nothing to run,
one CHUNK_BYTES piece at a time. Beside a busy engine's steps even nice 19 was not enough: in the 32-stream probe
right after a start, the prefault ran through the whole probe (~8 s), its mixed steps ran 0.83-1.40x their
prediction and the probe made 380.6 tok/s, against 449.2 with no prefault (the steps faulting their own pages;
`/tmp` A/B in one process, 2026-11-24 08:21-08:24 UTC, benchmarks/summaries/vs_vllm.md).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from typing import Callable

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only from 3.14 on
# one madvise call per chunk, so a process that exits meanwhile is not held for long, and a paced prefault's chunk
# in flight when a step starts overlaps it by ~10 ms at most (2 GiB took ~2 s here)
CHUNK_BYTES = 16 * 2**20
_held = threading.local()  # .gate: the Event that prefault threads started on this thread wait for; .go: their pacer


def madvise_function() -> Callable[..., int] | None:
    """libc's madvise through ctypes (which releases the GIL during the call); None where it cannot be found."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def populate(tensor: torch.Tensor, go: threading.Event | None = None) -> bool:
    """Fault in every whole page of the tensor's memory, writing nothing. False where the kernel (or the device)
    cannot; the tensor is then as it was. With `go`, each chunk waits until it is set (paced_by)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    madvise = madvise_function()
    if madvise is None:
        return False
    page = mmap.PAGESIZE
    begin = tensor.data_ptr()
    start = (begin + page - 1) // page * page  # madvise takes page-aligned ranges; a partial page at an end
    end = (begin + tensor.numel() * tensor.element_size()) // page * page  # is a few bytes of the pool's edges
    while start < end:
        if go is not None:
            go.wait()
        n = min(CHUNK_BYTES, end - start)
        if madvise(start, n, MADV_POPULATE_WRITE) != 0:
            log.debug("MADV_POPULATE_WRITE failed (errno %d): the KV pool stays lazily resident", ctypes.get_errno())
            return False
        start += n
    return True


def set_nice(value: int, thread_id: int | None = None) -> None:
    """This thread's (or another's) CPU priority; Linux keeps one per thread."""
    try:
        os.setpriority(os.PRIO_PROCESS, thread_id or threading.get_native_id(), value)
    except (AttributeError, OSError):  # not Linux, or lowering a nice value without the right: it stays
        pass


@contextlib.contextmanager
def _for_threads_started_here(name: str, value: threading.Event) -> Iterator[None]:
    """Inside the block, populate_in_background on this thread hands `value` to its thread as `name`."""
    before = getattr(_held, name, None)
    setattr(_held, name, value)
    try:
        yield
    finally:
        setattr(_held, name, before)


def held_until(gate: threading.Event) -> contextlib.AbstractContextManager[None]:
    """Prefault threads started by this thread inside the block wait for `gate` before they populate anything."""
    return _for_threads_started_here("gate", gate)


def paced_by(go: threading.Event) -> contextlib.AbstractContextManager[None]:
    """Prefault threads started by this thread inside the block populate only while `go` is set (checked before
    each chunk): the engine clears it while it has work, so its steps never share the cores with the prefault."""
    return _for_threads_started_here("go", go)


def _populate_niced(tensor: torch.Tensor, nice: int, gate: threading.Event | None,
                    go: threading.Event | None = None) -> bool:
    set_nice(nice)
    if gate is not None:
        gate.wait()
    return populate(tensor, go) if go is not None else populate(tensor)


def populate_in_background(tensor: torch.Tensor, name: str = "paceline-prefault", nice: int = 19) -> threading.Thread:
    """populate(tensor) on a daemon thread at the given nice value; the thread (started) is returned so a caller
    may join it. The thread holds a reference to the tensor until it is done. Inside held_until(gate) it waits
    for the gate first; inside paced_by(go) it populates only while go is set."""
    gate, go = getattr(_held, "gate", None), getattr(_held, "go", None)
    thread = threading.Thread(target=_populate_niced, args=(tensor, nice, gate, go), name=name, daemon=True)
    thread.paced_by = go  # what the engine asks to tell whether the prefault may overlap its steps
    thread.start()
    return thread
