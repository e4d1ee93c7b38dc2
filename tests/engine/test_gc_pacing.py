"""Full collections paced by the engine loop: due by CPython's own count, run while idle or after MAX_BUSY_S."""
import gc
import time
import weakref

import pytest

from paceline.engine.gc_pacing import NEVER, FullCollections


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)  # the rest of the session collects as before


def cyclic_garbage() -> weakref.ref:
    """A cycle that only a full collection frees once it has aged into generation 2."""
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    dead = weakref.ref(a)
    gc.collect(1)  # survives two young collections: now in generation 2
    gc.collect(1)
    del a, b
    return dead


def make_due(pacer: FullCollections) -> None:
    while not pacer.due():
        gc.collect(1)  # each one counts towards generation 2, as the allocations of a busy server would


def test_full_collections_wait_for_an_idle_loop(thresholds):
    pacer = FullCollections(max_busy_s=3600)
    assert gc.get_threshold()[2] == NEVER  # CPython no longer starts one by itself
    dead = cyclic_garbage()
    make_due(pacer)
    pacer.stepped()  # busy, and the last full collection is recent: it waits
    assert dead() is not None and pacer.collections == 0
    pacer.idle()
    assert dead() is None and pacer.collections == 1
    pacer.idle()  # nothing due any more: no second walk
    assert pacer.collections == 1


def test_under_load_that_never_pauses_a_due_collection_waits_at_most_max_busy_s(thresholds):
    pacer = FullCollections(max_busy_s=0.05)
    dead = cyclic_garbage()
    make_due(pacer)
    pacer.stepped()
    assert dead() is not None  # not yet: 50 ms have not passed
    time.sleep(0.06)
    pacer.stepped()
    assert dead() is None and pacer.collections == 1

