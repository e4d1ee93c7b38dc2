"""Full cyclic-garbage collections paced by the engine loop: run while it is idle, not in the middle of streams.

Why: a generation-2 collection walks every object the collector tracks while holding the GIL, so the engine thread
(between two torch ops) and the HTTP loop (delivering tokens) both stop for as long as it takes. A single-model
server freezes its start-up heap so that such a walk stays short (entrypoints/server.freeze_startup_heap); a server
of several models cannot (a model it evicts must be collectable), and there one took 104-143 ms with both models
streaming (2026-11-29, `/tmp` gc.callbacks probe in benchmarks/multi_model.py's one-loop arm: the stalls sat on the
run's largest int4 gaps). Paced, CPython's own trigger (more than threshold2 generation-1 collections since the last
full one) only marks a full collection due; it runs once the loop has no request in flight, or, under load that
never pauses, once MAX_BUSY_S has passed since the last one, so memory held by cycles stays bounded either way.
Generations 0 and 1 stay automatic (1-4 ms each in the same probe).
"""
from __future__ import annotations

import gc
import os
import time

PACING = os.environ.get("PACELINE_GC_PACING", "1") != "0"  # 0: CPython's own full collections, as before (the A/B)
MAX_BUSY_S = 60.0  # under continuous load a due full collection waits at most this long
NEVER = 1 << 30  # generation 2's threshold while paced: CPython never starts a full collection by itself


class FullCollections:
    """Call idle() when the engine loop has nothing in flight and stepped() after each step (engine thread)."""

    def __init__(self, max_busy_s: float = MAX_BUSY_S) -> None:
        self.max_busy_s = max_busy_s
        t0, t1, t2 = gc.get_threshold()
        self.due_after = t2 if t2 < NEVER else 10  # generation-1 collections between two full ones (default 10)
        gc.set_threshold(t0, t1, NEVER)
        self.last = time.monotonic()
        self.collections = 0

    def due(self) -> bool:
        return gc.isenabled() and gc.get_count()[2] > self.due_after

    def idle(self) -> None:
        if self.due():
            self._collect()

    def stepped(self) -> None:
        if time.monotonic() - self.last >= self.max_busy_s and self.due():
            self._collect()

    def _collect(self) -> None:
        gc.collect()
        self.last = time.monotonic()
        self.collections += 1
