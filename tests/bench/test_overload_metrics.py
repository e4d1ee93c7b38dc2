"""benchmarks/overload.py reads the server's own /metrics (as rendered by EngineMetrics) for the queue-time
histogram past the limit and the peaks of the running / waiting gauges."""
import asyncio

import pytest

from paceline.engine.metrics import EngineMetrics


@pytest.fixture(scope="module")
def overload(load_benchmark):
    return load_benchmark("overload")


class _Response:
    def __init__(self, text: str):
        self.text = text


def test_queued_past_counts_the_finished_requests_that_waited_longer_than_the_limit(overload, monkeypatch):
    metrics = EngineMetrics("m")
    for wait in (0.05, 1.2, 4.9, 5.0, 5.1, 30.0):  # 5.0 is within a 5 s limit (buckets are <=)
        metrics.queue_time.observe(wait)
    monkeypatch.setattr(overload.httpx, "get", lambda url, timeout: _Response(metrics.render().decode()))
    assert overload.queued_past("http://x", 5.0) == {"finished": 6, "waited_past_limit": 2}
    assert overload.queued_past("http://x", 5) == {"finished": 6, "waited_past_limit": 2}  # an int limit too
    assert overload.queued_past("http://x", None) is None  # no limit: nothing to count
    assert overload.queued_past("http://x", 4.0) is None  # not a bucket edge: not exact, so not reported


def test_gauges_keep_the_peaks_until_stopped(overload):
    metrics = EngineMetrics("m")
    levels = [(3, 10), (7, 4), (5, 12)]
    stop = asyncio.Event()

    class Client:
        async def get(self, url, timeout):
            running, waiting = levels.pop(0)
            metrics.running.set(running)
            metrics.waiting.set(waiting)
            if not levels:
                stop.set()  # this sample is the last: the loop reads it, then ends
            return _Response(metrics.render().decode())

    peaks: dict[str, float] = {}
    asyncio.run(overload.gauges(Client(), "http://x", peaks, stop))
    assert peaks == {"running": 7.0, "waiting": 12.0}
