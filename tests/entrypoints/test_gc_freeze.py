"""The single-model server freezes its start-up heap: full collections stop walking the model, torch and the app."""
import gc
import time
import weakref

from paceline.entrypoints.server import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.peer: Node | None = None


def test_start_up_objects_leave_the_collector_and_start_up_garbage_is_freed_first() -> None:
    alive = [Node()]  # a tracked container that lives on, as the model does
    a, b = Node(), Node()
    a.peer, b.peer = b, a  # cyclic garbage left over from start-up
    dead = weakref.ref(a)
    del a, b
    try:
        freeze_startup_heap()
        assert dead() is None  # collected before the freeze, not kept forever in the permanent generation
        assert gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # a full collection no longer walks it
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
    assert any(o is alive for o in gc.get_objects())


def test_an_app_frozen_after_it_was_built_still_serves() -> None:
    """run_server freezes after build_app: the routes, the engine thread and the streams work on as before."""
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient

    from paceline.engine.async_engine import AsyncEngine
    from paceline.engine.metrics import EngineMetrics
    from paceline.entrypoints.server import ServerSettings, build_app

    engine = FakeEngine()
    metrics = EngineMetrics(engine.model_name)
    app = build_app(AsyncEngine(engine, on_step=metrics.on_step), metrics, ServerSettings())
    try:
        freeze_startup_heap()
        with TestClient(app) as client:
            for _ in range(3):
                r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "seed": 0})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == "abcde"
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    finally:
        gc.unfreeze()


def test_the_engine_loop_runs_due_full_collections_while_idle() -> None:
    """The server's engine loop calls its collector (engine/gc_pacing.py) after every step and when it goes idle."""
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient

    from paceline.engine.async_engine import AsyncEngine
    from paceline.engine.metrics import EngineMetrics
    from paceline.entrypoints.server import ServerSettings, build_app

    class Counting:
        def __init__(self) -> None:
            self.idle_calls = self.step_calls = 0

        def idle(self) -> None:
            self.idle_calls += 1

        def stepped(self) -> None:
            self.step_calls += 1

    engine = FakeEngine()
    metrics = EngineMetrics(engine.model_name)
    async_engine = AsyncEngine(engine, on_step=metrics.on_step)
    counting = async_engine.collector = Counting()
    with TestClient(build_app(async_engine, metrics, ServerSettings())) as client:
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "seed": 0})
        assert r.status_code == 200, r.text
        assert counting.step_calls >= 5  # one step a token
        deadline = time.monotonic() + 10
        while counting.idle_calls == 0 and time.monotonic() < deadline:  # the loop goes idle once the stream ends
            time.sleep(0.01)
    assert counting.idle_calls >= 1
