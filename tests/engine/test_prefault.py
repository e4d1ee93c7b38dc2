"""The KV pool is resident from the start (engine/prefault.py): a lazily allocated CPU pool is faulted in on a
background thread, without a write, so RSS is what was configured rather than a growth over hours of traffic."""
from __future__ import annotations

import ctypes
import mmap

import torch

from paceline.engine.prefault import populate, populate_in_background
from paceline.engine.runner import ModelRunner
from paceline.model.arch import ModelArch


def resident_share(t: torch.Tensor) -> float:
    """The share of the tensor's whole pages that are in memory, by mincore(2) (smaps would show the mapping, which
    the kernel may have merged with its neighbours)."""
    page = mmap.PAGESIZE
    start = (t.data_ptr() + page - 1) // page * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    pages = (end - start) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


def fresh_pages(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A float tensor on a new anonymous mapping: untouched pages, not resident, reading as zeros. (torch.empty in a
    long test process may get memory the allocator already holds, resident and dirty.)"""
    buf = mmap.mmap(-1, nbytes)
    return buf, torch.frombuffer(buf, dtype=torch.float32)


def test_populate_makes_a_lazy_tensor_resident_without_changing_it() -> None:
    buf, t = fresh_pages(96 * 2**20)
    assert resident_share(t) < 0.01  # lazily committed: nothing written yet
    t[::1024 * 1024] = 7.0  # a few pages written before: populate must not touch what they hold
    assert populate(t)
    assert resident_share(t) == 1.0
    assert bool((t[::1024 * 1024] == 7.0).all()) and float(t[1:1024 * 1024].abs().sum()) == 0.0


def test_populate_in_background_returns_a_thread_to_join() -> None:
    buf, t = fresh_pages(80 * 2**20)
    populate_in_background(t).join(timeout=60)
    assert resident_share(t) == 1.0


def test_a_paced_population_waits_while_its_event_is_clear_and_goes_on_when_set() -> None:
    import threading

    from paceline.engine.prefault import CHUNK_BYTES, paced_by

    buf, t = fresh_pages(4 * CHUNK_BYTES)
    go = threading.Event()
    with paced_by(go):
        thread = populate_in_background(t)
    assert thread.paced_by is go
    thread.join(timeout=0.5)
    assert thread.is_alive() and resident_share(t) < 0.01  # held before its first chunk
    go.set()
    thread.join(timeout=60)
    assert not thread.is_alive() and resident_share(t) == 1.0
    assert populate_in_background(fresh_pages(CHUNK_BYTES)[1]).paced_by is None  # outside paced_by: unpaced


def test_populate_refuses_what_it_cannot_do() -> None:
    assert not populate(torch.empty(64, 64).t())  # not contiguous: the range would not be the tensor's


def test_the_runner_makes_a_large_cpu_pool_resident_and_leaves_a_small_one_alone() -> None:
    arch = ModelArch("llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=16)
    # 2 layers x K,V x 22,000 blocks x 16 slots x 16 floats x 4 bytes = 86 MiB: over the lazy threshold
    big = ModelRunner(None, arch, num_blocks=22_000, block_size=16)
    assert big.prefault is not None
    big.prefault.join(timeout=60)
    assert resident_share(big.kv_cache) == 1.0
    assert float(big.kv_cache.abs().sum()) == 0.0  # still zeros: attention multiplies masked slots by 0
    small = ModelRunner(None, arch, num_blocks=64, block_size=16)  # zeroed at allocation: nothing to do
    assert small.prefault is None


def test_the_background_population_runs_at_nice_19_and_leaves_the_caller_as_it_was(monkeypatch):
    import os
    import threading

    from paceline.engine import prefault

    seen = []
    monkeypatch.setattr(prefault, "populate", lambda t: seen.append(os.getpriority(os.PRIO_PROCESS,
                                                                                    threading.get_native_id())))
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    prefault.populate_in_background(torch.zeros(4)).join(timeout=10)
    assert seen == [max(before, 19)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
