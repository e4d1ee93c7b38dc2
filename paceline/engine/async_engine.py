"""AsyncEngine: Engine.step() in a background thread, one asyncio stream of RequestOutput deltas per request.

The Engine is not thread-safe, so every call into it (add, abort, step, stats) happens on the engine thread:
other threads append commands to a deque and set an Event; the thread applies them before each step.
Torch releases the GIL inside its kernels, so the HTTP event loop keeps running while a step computes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from paceline.engine.admission import AdmissionControl, QueueDelayError
from paceline.sampling import SamplingParams

log = logging.getLogger("paceline.async_engine")


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting_requests already; the server answers 503 with Retry-After."""

    def __init__(self, num_waiting: int, retry_after_s: int = 1) -> None:
        super().__init__(f"the server is overloaded: {num_waiting} requests are already waiting; retry later")
        self.retry_after_s = retry_after_s


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineStepError(RuntimeError):
    """A step raised; every request in flight at that moment ends with this error."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its sampler row, detokenizer, stop strings); the others went on."""


MAX_FAILED_STEPS = 3  # steps in a row that fail for every request: the engine is broken, not a request


class RequestStream:
    """The deltas of one request, in order. Iterate it; leaving `async with` before the end aborts it."""

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.request_id, self.loop = engine, request_id, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._first: Any = None  # the first item, when started() looked at it

    async def started(self) -> None:
        """Wait for the first delta (the request ran) or raise its error, consuming nothing: a server can then
        answer a request that never ran (expired in the queue, failed on its first token) with a plain HTTP error
        instead of a stream that starts and breaks."""
        if self._first is None and not self.finished:
            self._first = await self.queue.get()
        if isinstance(self._first, BaseException):
            self.finished = True
            raise self._first

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Any:
        if self.finished:
            raise StopAsyncIteration
        if self._first is not None:
            item, self._first = self._first, None
        else:
            item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine thread already dropped it
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._drop(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


class AsyncEngine:
    def __init__(self, engine: Any, on_step: Callable[[Any, list, bool], None] | None = None) -> None:
        """engine: a paceline Engine (or anything with add_request/abort/step/has_unfinished/stats), or a
        function that builds one; a function runs on the engine thread and its error is raised here.
        on_step(engine, outputs, stepped) runs on the engine thread after every step (stepped=True) and when
        it goes idle (stepped=False, so gauges show aborts applied while idle); the server feeds metrics from it.

        Build the engine with a function when you can: torch's OpenMP keeps one team of worker threads per
        thread that ever ran a parallel op. A second team (the loading thread's plus the engine thread's) makes
        libgomp count more workers than cores and stop spin-waiting between ops, and every op then pays a futex
        wake-up: measured here, a batch-1 decode step took 28 ms on the engine thread after loading on the main
        thread, against 19.7 ms when the same thread loaded and stepped."""
        self.engine = None if callable(engine) and not hasattr(engine, "step") else engine
        self.on_step = on_step
        self._commands: deque[Callable[[], None]] = deque()  # deque append/popleft are atomic
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams
        self._wake = threading.Event()
        self._accepting = True
        self._stop = False
        self._idle = threading.Event()
        self.admission: AdmissionControl | None = None  # --max-queue-delay-s, set once the engine is built
        self.on_reject: Callable[[str], None] | None = None  # on_reject(reason) for every 503 of overload
        # full cyclic-garbage collections run while the loop is idle (gc_pacing.FullCollections; the server sets it)
        self.collector: Any = None
        # The arrival check's count of requests ahead: waiting in the engine (recounted after every step, +1 for
        # each add the engine thread applied since) plus adds submitted and not yet applied. Both move under _lock,
        # so an add is never counted twice or missed, even while a long step runs.
        self._num_waiting = 0
        self._pending_adds = 0
        self._dead: BaseException | None = None  # what killed the engine thread
        built: concurrent.futures.Future = concurrent.futures.Future()
        if self.engine is not None:
            built.set_result(self.engine)
        self._thread = threading.Thread(target=self._run, args=(None if self.engine else engine, built),
                                        name="paceline-engine", daemon=True)
        self._thread.start()
        self.engine = built.result()  # re-raises the builder's error
        self.max_waiting = getattr(self.engine.config.scheduler, "max_waiting_requests", 0) or 0
        delay = getattr(self.engine.config.scheduler, "max_queue_delay_s", 0.0) or 0.0
        self.admission = AdmissionControl(delay) if delay > 0 else None

    # ---- called from the event loop -------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, client_id: str = "",
                          model: str | None = None) -> RequestStream:
        """Add a request; returns once the engine has taken it. Raises ValueError (bad request: the engine's
        plain message), QueueFullError or EngineStoppedError, and then nothing was added. `model`: which model of
        a MultiEngine runs it (an Engine serves one and takes none)."""
        if self._dead is not None:
            raise EngineStoppedError(f"the engine stopped after an internal error ({self._dead!r}); the server "
                                     "must be restarted")
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down")
        arrival = time.monotonic()
        # Every overload decision is made here, from the engine thread's last count and snapshot, never on the
        # engine thread: a 503 must not wait for the step in flight (up to a second with a long prompt chunk).
        with self._lock:
            ahead = self._num_waiting + self._pending_adds
        if self.max_waiting and ahead >= self.max_waiting:
            self._rejected("queue_full")
            raise QueueFullError(ahead)
        if self.admission is not None:
            try:
                self.admission.check(ahead, arrival, request_id)
            except QueueDelayError as e:
                self._rejected(e.reason)
                raise
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        added: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # under the lock with the death check: no add is queued after the dead thread's last look
            if self._dead is not None:
                raise EngineStoppedError("the engine stopped after an internal error; the server must be restarted")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._pending_adds += 1  # a burst sees itself, until the engine thread has taken the add
            self._submit(lambda: self._add(request_id, prompt, params, priority, arrival, added, client_id, model))
        try:
            await asyncio.wrap_future(added)
        except BaseException:
            with self._lock:
                self._streams.pop(request_id, None)
            if not _was_rejected(added):  # cancelled while the add may still land: abort (commands run in order)
                self.abort(request_id)
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[Any]:
        """add_request, then the request's RequestOutput deltas up to the finished one; closing early aborts."""
        stream = await self.add_request(request_id, prompt, params, priority)
        async with stream:
            async for out in stream:
                yield out

    async def call(self, fn: Callable[[], Any]) -> Any:
        """fn() on the engine thread between two steps, where the engine may be changed; its result or error."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as e:
                    done.set_exception(e)
        self._submit(command)
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Free the request now: the engine thread applies it before its next step."""
        self._submit(lambda: self._abort(request_id))

    def _drop(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self.abort(request_id)

    async def drain(self, grace_s: float = 0.0) -> None:
        """Take no new requests; let in-flight ones run up to grace_s, then abort the rest (their streams end
        with finish_reason "abort")."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self.abort(rid)

    async def shutdown(self) -> None:
        """drain(0), then stop the engine thread."""
        await self.drain(0.0)
        self._submit(self._request_stop)
        await asyncio.to_thread(self._thread.join, 10.0)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def _rejected(self, reason: str) -> None:
        if self.on_reject is not None:
            try:
                self.on_reject(reason)
            except Exception:
                log.exception("metrics update failed")

    # ---- the engine thread ----------------------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wake.set()

    def _request_stop(self) -> None:
        self._stop = True

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int,
             arrival: float, added: concurrent.futures.Future, client_id: str = "", model: str | None = None) -> None:
        with self._lock:
            self._pending_adds -= 1
        if not added.set_running_or_notify_cancel():  # the caller went away before we got here
            with self._lock:
                self._streams.pop(request_id, None)
            return
        try:
            if self._dead is not None:
                raise EngineStoppedError("the engine stopped after an internal error; the server must be restarted")
            if self.max_waiting:  # a backstop: the arrival check decided from a count that may be a step old
                num_waiting = self.engine.stats().num_waiting
                if num_waiting >= self.max_waiting:
                    self._rejected("queue_full")
                    raise QueueFullError(num_waiting)
            routed = {"model": model} if model is not None else {}
            self.engine.add_request(request_id, prompt, params, priority=priority, arrival_time=arrival,
                                    client_id=client_id, **routed)
            with self._lock:
                self._num_waiting += 1
        except Exception as e:  # ValueError for bad input, QueueFullError; either way nothing was added
            with self._lock:
                self._streams.pop(request_id, None)
            added.set_exception(e)
            return
        added.set_result(None)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # an unknown or already finished id: nothing to free
            log.debug("abort of %s ignored", request_id, exc_info=True)

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            try:
                command()
            except Exception:
                log.exception("engine command failed")

    def _run(self, build: Callable[[], Any] | None, built: concurrent.futures.Future) -> None:
        if build is not None:
            try:
                self.engine = build()  # before the loop below reads it; __init__ waits on `built`
                built.set_result(self.engine)
            except BaseException as e:
                built.set_exception(e)
                return
        try:
            self._loop()
        except BaseException as e:  # a bug in the loop itself: never leave a client hanging on a dead thread
            log.critical("the engine thread died: %r; /health now answers 503 and every request ends with an "
                         "error", e, exc_info=True)
            with self._lock:
                self._dead = e
            self._accepting = False
            self._apply_commands()  # adds queued before the death fail (_add checks _dead), aborts are harmless
            self._fail_all(EngineStoppedError(f"the engine stopped after an internal error: {e!r}"))
        finally:
            self._idle.set()

    def _loop(self) -> None:
        failed_steps = 0
        while True:
            self._wake.clear()
            self._apply_commands()
            if self._stop:
                break
            if self.admission is not None:
                self._expire_waiting()
            if not self.engine.has_unfinished():
                self._recount()
                self._observe([], False)  # gauges reflect aborts applied while idle
                self._idle.set()
                if self.collector is not None:
                    self.collector.idle()
                # with a queue-delay limit the thread also wakes to expire requests (none wait while idle)
                self._wake.wait()
                continue
            self._idle.clear()
            try:
                outputs = self.engine.step()
            except Exception as e:
                failed_steps += 1
                log.exception("engine step failed (%d in a row); failing every request in flight", failed_steps)
                if failed_steps >= MAX_FAILED_STEPS:
                    # dead (_run) before the requests in flight hear of it: a client told of this failure then finds
                    # /health at 503 (failing them first let a /health right after the error still answer 200)
                    raise RuntimeError(f"{failed_steps} engine steps in a row failed; last: {e!r}") from e
                self._fail_all(EngineStepError(f"the engine failed while running this request: {e}"))
                time.sleep(0.01)  # a failure that repeats must not spin a core
                continue
            failed_steps = 0
            self._recount()
            if self.admission is not None:
                self.admission.observe(outputs, time.monotonic())
            self._observe(outputs, True)
            self._dispatch(outputs)
            if self.collector is not None:
                self.collector.stepped()
        self._fail_all(EngineStoppedError("the server shut down"))

    def _recount(self) -> None:
        """The waiting count the arrival check reads. On this thread no add lands between the count and the
        assignment, so it is exact; adds still pending are in _pending_adds."""
        count = _num_waiting(self.engine)
        with self._lock:
            self._num_waiting = count

    def _expire_waiting(self) -> None:
        """--max-queue-delay-s: the load snapshot before the step; only an engine with no load to read takes
        requests that waited too long out (with a 503), an admitted request is otherwise served (admission.py)."""
        expired = self.admission.sweep(self.engine, time.monotonic())
        if not expired:
            return
        error = self.admission.expired_error()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for rid in expired:
            self._abort(rid)
            self._rejected(error.reason)
            with self._lock:
                stream = self._streams.pop(rid, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, error))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _observe(self, outputs: list, stepped: bool) -> None:
        if self.on_step is None:
            return
        try:
            self.on_step(self.engine, outputs, stepped)
        except Exception:
            log.exception("metrics update failed")

    def _dispatch(self, outputs: list) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:  # its client left; the abort is queued or done
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                error = getattr(out, "error", None)
                item = RequestFailedError(f"the request failed inside the engine: {error}") if error else out
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            # one wake-up of the event loop per step, however many requests it served
            _call_soon(loop, _put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for rid in streams:
            self._abort(rid)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for stream in streams.values():
            by_loop.setdefault(stream.loop, []).append((stream.queue, error))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)


def _num_waiting(engine: Any) -> int:
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is not None and hasattr(scheduler, "num_waiting"):
        return scheduler.num_waiting
    return engine.stats().num_waiting


def _was_rejected(added: concurrent.futures.Future) -> bool:
    return added.done() and not added.cancelled() and added.exception() is not None


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass
