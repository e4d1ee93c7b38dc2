"""Which models are in memory: load on demand off the step loop, evict the least recently used idle model, keep-alive.

Lives on the server's event loop; the engine thread only ever sees a finished Engine added to, or an idle one taken
out of, its MultiEngine (both between two steps, through AsyncEngine.call).

A load runs on one loader thread with torch limited to one thread there: torch's OpenMP keeps a team of workers
per thread that ever ran a parallel op, and a second team would make libgomp count more workers than cores and
stop spin-waiting on the engine thread for good (see AsyncEngine). The loader skips the start-up step-time
profile (it would time one thread); the engine thread installs the cached profile of that exact setup if there
is one, else the model serves without a step-time target until a start-up load (which profiles) has cached it.

A GGUF model loads from its runtime snapshot (loader.build_model: the model as built, mapped from one file), so
the load is mostly the kernel's work with the interpreter free, and it runs at the loaded models' priority. The
loader then maps the pages in, so that the first step on the engine thread takes no page faults. Both pieces run
as turns of the step loop (multi.LoadTurns): the engine thread waits between two steps while each runs, instead
of its steps running beside them, short of the interpreter and a core. Float32 and int4
models join the loop on plain linears. What the first token does not need waits until the model has produced it
(or FIRST_TOKEN_WAIT_S): a packer thread at nice 19 then packs the linears for oneDNN one at a time while the
model serves, and the new KV pool's prefault starts (nice 19 too). Each load keeps its LoadTimeline (multi.py):
request, estimate, room, build, mapping, joining, first step, first token; /v1/models shows it as `last_load`.

Memory is counted as each model's weights plus its KV pool (and host swap pool): measured once loaded, estimated
from the file's header before its first load.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import json
import logging
import threading
import math
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from paceline.config import EngineConfig
from paceline.engine.engine import Engine
from paceline.engine.model_specs import FOREVER, ModelSpec, estimate_bytes
from paceline.engine.multi import SWITCH_STEPS_BEFORE_S, LoadTimeline, LoadTurns, MultiEngine
from paceline.engine.prefault import held_until, madvise_function, set_nice
from paceline.model.llama import Linear, deferred_packing
from paceline.model.loader import piece_break, piece_breaks, piece_tick
from paceline.model.loader import unpacked_linears as model_unpacked_linears

log = logging.getLogger("paceline.residency")

REAP_INTERVAL_S = 0.5
DEFER_PACKING = os.environ.get("PACELINE_DEFER_PACKING", "1") != "0"  # 0: pack before serving (the A/B's before)
# The background packing of a freshly loaded model (_pack_slowly): its CPU priority and its pause between two Linears.
# Why nice 0 and long pauses, not nice 19 and short ones: at nice 19 beside two busy lanes it held the interpreter
# lock while preempted (Python's lock knows nothing of priorities), so the others' steps stalled for it; after a
# float32 debut 6-11 of 57-65 steps of the other streams took over 1.5x their CPU time in wall time (one int4 decode
# 64.6 ms for 13.0 ms of CPU), against 1 of 67 with nothing packing in the background (switch runs QQQ and RRR,
# 2026-11-29). At nice 0 it is scheduled as soon as it asks, and the pause bounds its share of a core (a float32
# Linear packs in ~1-3 ms). PACELINE_PACK_NICE=19 PACELINE_PACK_PAUSE_MS=2: as before (the A/B)
PACK_NICE = int(os.environ.get("PACELINE_PACK_NICE", "0"))
PACK_PAUSE_S = float(os.environ.get("PACELINE_PACK_PAUSE_MS", "20")) / 1000.0
LOAD_TURNS = os.environ.get("PACELINE_LOAD_TURNS", "1") != "0"  # 0: the load runs beside the steps (the A/B's before)
# A load's larger pieces each a turn of their own (_build_engine); PACELINE_PIECE_TURNS=0: the Engine and the mapping
# one turn each, as before 2026-11-29 (the A/B)
PIECE_TURNS = os.environ.get("PACELINE_PIECE_TURNS", "1") != "0"
MAP_IN_PIECE_BYTES = 128 << 20  # the mapping's turns: ~128 MB of pages each
MAP_IN_CALL_BYTES = 8 << 20  # one madvise call's part: a point between two of them may break the turn (piece_tick)
LOADER_NICE = int(os.environ.get("PACELINE_LOADER_NICE", "0"))  # the load's CPU priority (19: the A/B's before)
# Two warm-up forwards on the loader thread before the model joins (1: the A/B's before, 2026-11-23)
LOAD_WARM_UP = os.environ.get("PACELINE_LOAD_WARM_UP", "0") != "0"
# log every step around each switch as one JSON line (benchmarks/multi_model.py reads it)
LOG_SWITCH_STEPS = os.environ.get("PACELINE_LOG_SWITCH_STEPS", "0") != "0"
SWITCH_STEPS_AFTER_S = 0.3  # the log holds the steps this long after the first token too (the streams' gaps there)
FIRST_TOKEN_WAIT_S = 5.0  # packing and the KV prefault wait this long at most for a loaded model's first token


class UnknownModelError(KeyError):
    """No model of that name is configured (the server answers 404)."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.message = f"The model `{name}` does not exist. Served: {', '.join(known)}"

    def __str__(self) -> str:
        return self.message


class NoRoomError(RuntimeError):
    """The model cannot be loaded now: every loaded model is busy or pinned (the server answers 503, Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(RuntimeError):
    """The model's files could not be loaded (the server answers 500 and tries again on the next request)."""


@dataclass
class ModelSlot:
    spec: ModelSpec
    state: str = "unloaded"  # unloaded | loading | loaded
    engine: Engine | None = None
    nbytes: int = 0  # measured once loaded; 0: not known yet
    in_flight: int = 0  # requests holding it (between acquire and release)
    last_used: float = 0.0
    keep_alive: float = FOREVER  # seconds idle before unloading; a request's keep_alive replaces it
    loading: asyncio.Future | None = None
    num_loads: int = 0
    load_s: float = 0.0  # duration of the last load
    timeline: LoadTimeline | None = None  # the last load on demand, request to first token


class Residency:
    def __init__(self, async_engine: Any, multi: MultiEngine, specs: list[ModelSpec], base: EngineConfig,
                 max_loaded: int = 0, memory_budget_bytes: int = 0) -> None:
        self.async_engine, self.multi, self.base = async_engine, multi, base
        self.max_loaded, self.budget = max_loaded, memory_budget_bytes
        self.slots: dict[str, ModelSlot] = {s.name: ModelSlot(s, keep_alive=s.keep_alive) for s in specs}
        for name, engine in multi.engines.items():  # loaded at start-up
            slot = self.slots[name]
            slot.state, slot.engine, slot.nbytes, slot.num_loads = "loaded", engine, engine_bytes(engine), 1
            slot.last_used = time.monotonic()
        self._lock = asyncio.Lock()  # one load or eviction decision at a time
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="paceline-loader")
        self._packer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="paceline-packer")  # PACK_NICE
        self._reaper: asyncio.Task | None = None
        self._packing: set[asyncio.Future] = set()  # background packing of freshly loaded models
        self.on_unload: list[Any] = []  # callbacks(name): the server drops what it built on that Engine

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def start(self) -> None:
        """Start unloading models whose keep-alive ran out (call on the running event loop)."""
        if self._reaper is None:
            self._reaper = asyncio.ensure_future(self._reap_forever())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._packing):
            task.cancel()
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._packer.shutdown(wait=False, cancel_futures=True)

    # ---- requests ------------------------------------------------------------------------------------------------

    async def acquire(self, name: str, keep_alive: float | None = None) -> Engine:
        """The model's Engine, loaded first if need be; the model stays loaded until release(name)."""
        requested = time.monotonic()
        slot = self.slots.get(name)
        if slot is None:
            raise UnknownModelError(name, self.names)
        slot.in_flight += 1
        try:
            if keep_alive is not None:
                slot.keep_alive = keep_alive
            if slot.state != "loaded":
                if slot.loading is None:
                    slot.loading = asyncio.ensure_future(self._load(slot, LoadTimeline(requested)))
                # shielded: a client that leaves must not cancel a load that others may be waiting for
                await asyncio.shield(slot.loading)
            slot.last_used = time.monotonic()
            assert slot.engine is not None
            return slot.engine
        except BaseException:
            self.release(name)
            raise

    def release(self, name: str) -> None:
        slot = self.slots[name]
        slot.in_flight -= 1
        slot.last_used = time.monotonic()

    # ---- loading and unloading -----------------------------------------------------------------------------------

    async def _load(self, slot: ModelSlot, timeline: LoadTimeline) -> None:
        name = slot.spec.name
        loop = asyncio.get_running_loop()
        first_token = asyncio.Event()
        held = threading.Event()  # the new KV pool's prefault waits for it

        def on_first_token() -> None:  # on the engine thread (or the event loop, after FIRST_TOKEN_WAIT_S)
            held.set()
            loop.call_soon_threadsafe(first_token.set)
            log.info("model %s: switch %s (seconds after the request)", name, timeline.split())
            if LOG_SWITCH_STEPS:  # the steps up to the first token, and those of the next SWITCH_STEPS_AFTER_S
                def log_steps() -> None:
                    after = self.multi.steps_since(timeline.start - SWITCH_STEPS_BEFORE_S, timeline.start)
                    log.info("model %s: switch steps %s", name, json.dumps({"split": timeline.split(),
                                                                              "steps": timeline.steps,
                                                                              "after": after[len(timeline.steps):]}))
                loop.call_soon_threadsafe(loop.call_later, SWITCH_STEPS_AFTER_S, log_steps)

        timeline.on_first_token = on_first_token
        try:
            async with self._lock:
                if slot.state == "loaded":
                    return
                timeline.mark("lock")
                config = slot.spec.engine_config(self.base)
                # the size estimate reads file headers (a thread, ~10 ms quiet; 0.95 s once beside busy steps,
                # 2026-11-23); only a memory budget needs it
                need = slot.nbytes or (await asyncio.to_thread(_estimate, config) if self.budget else 0)
                timeline.mark("estimated")
                await self._make_room(slot, need)
                timeline.mark("room")
                slot.state, slot.timeline = "loading", timeline
                t0 = time.perf_counter()
                turns = self.multi.turns if LOAD_TURNS else None
                if turns is not None:
                    turns.pending = True  # the other models' step targets make room for its turns

                def nudge() -> None:  # on the loader thread: have the engine thread serve the turn, idle or not
                    asyncio.run_coroutine_threadsafe(self.async_engine.call(self.multi.serve_load_turn), loop)

                try:
                    engine, step_ms = await loop.run_in_executor(self._loader, _build_engine, config, timeline,
                                                                 held, turns, nudge)
                except Exception as e:
                    held.set()
                    if turns is not None:
                        turns.pending = False
                    slot.state = "unloaded"
                    log.exception("loading model %s failed", name)
                    raise ModelLoadError(f"model {name} could not be loaded: {e}") from e
                timeline.mark("loaded")
                # The join is queued now and not awaited: the requests waiting for this load are released when
                # this task ends, after the join's command (asyncio runs callbacks in order), so each one's add
                # reaches the engine thread at the same step boundary as the join instead of one step later.
                joined = asyncio.ensure_future(self.async_engine.call(
                    lambda: _install(self.multi, name, engine, step_ms, timeline)))
                slot.engine, slot.state = engine, "loaded"
                slot.nbytes = slot.nbytes or need  # measured once it has joined (_after_join)
                slot.num_loads += 1
                slot.last_used = time.monotonic()
                self._packing.add(asyncio.ensure_future(self._after_join(slot, engine, timeline, joined, t0,
                                                                          first_token)))
        finally:
            slot.loading = None

    async def _after_join(self, slot: ModelSlot, engine: Engine, timeline: LoadTimeline, joined: asyncio.Future,
                          t0: float, first_token: asyncio.Event) -> None:
        """Once the fresh model is in the loop: its size; once it has produced its first token (or after
        FIRST_TOKEN_WAIT_S): the KV prefault goes on, and its linears are packed for oneDNN while it serves."""
        name = slot.spec.name
        try:
            try:
                await joined
            except Exception:  # cannot happen while this load holds the name; if it does, the model is not in
                log.exception("model %s could not join the loop", name)  # the loop: say so and leave it out
                self.multi.turns.pending = False
                timeline.finish()
                slot.engine, slot.state = None, "unloaded"
                return
            slot.load_s = time.perf_counter() - t0
            try:
                await asyncio.wait_for(first_token.wait(), FIRST_TOKEN_WAIT_S)
            except asyncio.TimeoutError:  # its request went away, or the loop is that slow: do not hold forever
                timeline.finish()
            # after the first token: walking every tensor holds the interpreter for a few ms on the event loop
            slot.nbytes = engine_bytes(engine)
            log.info("model %s loaded in %.2f s (%.0f MiB)", name, slot.load_s, slot.nbytes / 2**20)
            if self.slots[name].engine is not engine:  # unloaded before it served: nothing to pack
                return
            linears = unpacked_linears(engine)
            if linears:
                await self._pack(name, linears)
        finally:
            self._packing.discard(asyncio.current_task())

    async def _pack(self, name: str, linears: list[Linear]) -> None:
        """Pack a freshly loaded model's linears for oneDNN while it serves (see _build_engine)."""
        try:
            t0 = time.perf_counter()
            async with self._lock:  # a load that comes next waits for these ~0.4 s, not the other way round
                await asyncio.get_running_loop().run_in_executor(self._packer, _pack_slowly, linears,
                                                                 self._record_pack)
            await self.async_engine.call(lambda: drop_plain_weights(linears))
            log.info("model %s: %d linears packed in %.2f s while serving", name, len(linears),
                     time.perf_counter() - t0)
        except Exception:  # it serves on, unpacked
            log.exception("packing model %s failed", name)

    def _record_pack(self, start: float, end: float, cpu: float) -> None:
        """On the packer thread: one Linear's packing, among the loop's recent steps (a switch's step record shows
        it beside the steps it may have slowed)."""
        self.multi.recent_steps.append(("(pack)", start, end, cpu, 0, 0))

    def _fits(self, need: int, exclude: ModelSlot) -> tuple[bool, str]:
        loaded = [s for s in self.slots.values() if s.state != "unloaded" and s is not exclude]
        if self.max_loaded and len(loaded) >= self.max_loaded:
            return False, f"{len(loaded)} models are loaded (--max-loaded-models {self.max_loaded})"
        used = sum(s.nbytes for s in loaded)
        if self.budget and used + need > self.budget:
            return False, (f"it needs {need / 2**20:.0f} MiB and {used / 2**20:.0f} of the "
                           f"{self.budget / 2**20:.0f} MiB budget are in use")
        return True, ""

    async def _make_room(self, slot: ModelSlot, need: int) -> None:
        name = slot.spec.name
        if self.budget and need > self.budget:
            raise NoRoomError(f"model {name} needs {need / 2**20:.0f} MiB, more than the whole memory budget of "
                              f"{self.budget / 2**20:.0f} MiB", retry_after_s=60)
        while True:
            fits, why = self._fits(need, slot)
            if fits:
                return
            victims = sorted((s for s in self.slots.values() if s.state == "loaded" and s is not slot
                              and not s.spec.pinned and s.in_flight == 0), key=lambda s: s.last_used)
            if not victims:
                raise NoRoomError(f"model {name} cannot be loaded now: {why}, and none of them is idle and unpinned; "
                                  "retry later")
            if not await self._unload(victims[0]):
                raise NoRoomError(f"model {name} cannot be loaded now: {why}; retry later")

    async def _unload(self, slot: ModelSlot) -> bool:
        """Take an idle model out of the loop and free it; False if it turned out busy."""
        name = slot.spec.name
        try:
            await self.async_engine.call(lambda: self.multi.remove_model(name))
        except ValueError as e:
            log.info("not unloading %s: %s", name, e)
            return False
        slot.engine, slot.state = None, "unloaded"
        for callback in self.on_unload:
            callback(name)
        gc.collect()  # the KV pool and weights go now, not at some later collection
        log.info("model %s unloaded (%.0f MiB freed)", name, slot.nbytes / 2**20)
        return True

    async def unload(self, name: str) -> bool:
        """Unload a model now if it is idle (keep_alive 0, or an operator's call)."""
        async with self._lock:
            slot = self.slots[name]
            if slot.state != "loaded" or slot.in_flight:
                return False
            return await self._unload(slot)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for slot in list(self.slots.values()):
                if (slot.state == "loaded" and slot.in_flight == 0 and not slot.spec.pinned
                        and not math.isinf(slot.keep_alive) and now - slot.last_used >= slot.keep_alive):
                    try:
                        await self.unload(slot.spec.name)
                    except Exception:
                        log.exception("unloading %s failed", slot.spec.name)

    # ---- what /v1/models shows -----------------------------------------------------------------------------------

    def cards(self) -> list[dict]:
        out = []
        for name, slot in self.slots.items():
            engine = slot.engine
            out.append({"id": name, "state": slot.state, "pinned": slot.spec.pinned,
                        "max_model_len": engine.max_model_len if engine is not None else None,
                        "memory_bytes": slot.nbytes or None,
                        "keep_alive_s": None if math.isinf(slot.keep_alive) else slot.keep_alive,
                        "last_load": slot.timeline.split() if slot.timeline is not None else None})
        return out


def _estimate(config: EngineConfig) -> int:
    try:
        return estimate_bytes(config)
    except Exception as e:  # the load itself will say what is wrong with the file
        log.debug("no size estimate for %s: %s", config.model, e)
        return 0


def _build_engine(config: EngineConfig, timeline: LoadTimeline | None = None,
                  held: threading.Event | None = None, turns: LoadTurns | None = None,
                  nudge: Callable[[], None] | None = None) -> tuple[Engine, float]:
    """On the loader thread, one torch thread: the Engine without its step-time model, and the max_step_ms that
    _install gives it once it has a profile. Its KV pool's prefault waits for `held` (set at the first token).
    With `turns`, building the Engine and mapping its pages in each run as a turn of the step loop (LoadTurns in
    multi.py: the engine thread waits between two steps while the piece runs)."""
    pieces = itertools.count(1)

    @contextlib.contextmanager
    def turn() -> Iterator[None]:
        # inside, each larger piece a turn of its own (loader.piece_break): the Engine in one turn took 25-53 ms,
        # once 198 ms, and the int4 streams beside a float32 load waited for all of it on top of their step (gaps
        # 55-61 ms against their p99 of 50-59, 2026-11-29 11:42 UTC switch run); in parts (the snapshot's
        # unpickling, ~26 ms, ~10.5 since SNAPSHOT_FORMAT 2, is the largest) and the mapping in ~MAP_IN_PIECE_BYTES
        # parts. Each piece's end is marked in the timeline (piece1, piece2, ...): the switch's record shows them
        with (turns.take(nudge) if turns is not None else contextlib.nullcontext()) as next_turn:
            def next_piece() -> None:
                timeline.mark(f"piece{next(pieces)}")
                next_turn()
            with piece_breaks(next_piece if PIECE_TURNS and next_turn is not None else None):
                yield

    timeline = timeline or LoadTimeline(time.monotonic())
    timeline.mark("build_start")
    step_ms, config.scheduler.max_step_ms = config.scheduler.max_step_ms, 0.0
    # From a runtime snapshot a load is mostly the kernel mapping pages and torch ops, with the interpreter free,
    # so it runs at the loaded models' own priority: at nice 19 it got a core only between their steps and a
    # switch took seconds (2026-11-23). What can wait runs at nice 19: the new KV pool's prefault, the packing.
    set_nice(LOADER_NICE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # float32 and int4 models start on plain linears and are packed for oneDNN once the model serves (~0.3-1.5 s
    # of one core for the bundled model, more than a switch's 0.5 s budget). An int4 model's layers run paceline's
    # own kernel on its 4-bit codes for steps of up to 96 rows, so only larger steps see the plain copies. Other
    # dtypes pack now: unpacked bfloat16 runs several times slower on CPUs without native bf16 math.
    defer = config.quantization == "int4" or (config.dtype == "float32" and config.quantization == "none")
    try:
        with contextlib.ExitStack() as stack:
            if defer and DEFER_PACKING:
                stack.enter_context(deferred_packing())
            if held is not None:
                stack.enter_context(held_until(held))
            with turn():
                engine = Engine(config)
                timeline.mark("engine_built")
        model = getattr(engine.runner, "model", None)
        if model is not None and hasattr(model, "layers"):
            with turn():
                map_in(model)
                timeline.mark("mapped")
            # Left out by default (2026-11-24): the first step on the engine's two threads does whatever first-call
            # set-up a kernel has, while these forwards ran on one thread beside the other models' steps, before
            # the request could start; see docs/multi-model.md for the A/B.
            if LOAD_WARM_UP:
                warm_up(model)
                timeline.mark("warmed")
        return engine, step_ms
    finally:
        torch.set_num_threads(threads)


MADV_POPULATE_READ = 22  # linux/mman.h (5.14+)


def map_in(model: torch.nn.Module) -> None:
    """Fault in the pages of every tensor a freshly loaded model holds, reading nothing: a model from a runtime
    snapshot is file pages mapped on demand, and the first step would otherwise take ~100k page faults on the
    engine thread. madvise through ctypes releases the interpreter while the kernel works."""
    madvise = madvise_function()
    if madvise is None:
        return
    page = mmap.PAGESIZE
    done = 0
    for storage in {id(t.untyped_storage()): t.untyped_storage() for t in model_tensors(model)}.values():
        if storage.device.type != "cpu" or storage.nbytes() < page:
            continue
        start, end = storage.data_ptr() // page * page, storage.data_ptr() + storage.nbytes()
        for part in range(start, end, MAP_IN_CALL_BYTES):  # the embedding alone is ~113 MB in float32
            length = min(MAP_IN_CALL_BYTES, end - part)
            if madvise(part, length, MADV_POPULATE_READ) != 0:
                return  # an older kernel: the pages come in on first use, as before
            done += length
            if done >= MAP_IN_PIECE_BYTES:
                done = 0
                piece_break()
            else:
                piece_tick()


def reachable_tensors(*roots: Any) -> list[torch.Tensor]:
    """Every tensor reachable from the roots through lists, tuples, dicts, modules and paceline's model objects
    (Linears, int4 codes, buffers, KV pools), each object once."""
    out, seen, stack = [], set(), list(roots)
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith("paceline.model"):
            stack.extend(vars(obj).values())
    return out


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every plain tensor of the model; packed oneDNN weights have no storage and are left out."""
    return [t for t in reachable_tensors(model) if t.layout == torch.strided and not t.is_mkldnn]


@torch.inference_mode()
def warm_up(model: torch.nn.Module) -> None:
    """Run a one-token and a 16-token forward on the loader thread, into a scratch KV cache (the pool's masked
    slots must stay zeros): whatever a kernel sets up on its first call of a shape happens here, not in the
    first step of the engine thread."""
    from paceline.model.attention import SeqSlice, build_metadata

    arch, bs = model.arch, 16
    for n in (1, bs):
        kv = torch.zeros(len(model.layers), 2, 1, bs, arch.num_kv_heads, arch.head_dim, dtype=model.dtype)
        meta = build_metadata([SeqSlice(0, n, [0])], bs, model.device)
        hidden = model(torch.ones(n, dtype=torch.long), torch.arange(n), meta, kv)
        model.compute_logits(hidden[-1:])


def unpacked_linears(engine: Engine) -> list[Linear]:
    """The model's Linears left on plain weights by deferred_packing that the normal build packs."""
    model = getattr(engine.runner, "model", None)
    if model is None or not hasattr(model, "lm_head"):  # a parallel runner: its workers built their own parts
        return []
    return model_unpacked_linears(model)


def _pack_slowly(linears: list[Linear], record: Callable[[float, float, float], None] | None = None) -> None:
    """On the packer thread (one torch thread, PACK_NICE), while the model already serves: pack one Linear at a
    time. The engine thread may be calling it meanwhile; Linear reads `packed` first, so a call uses either the
    plain weight or the packed copy, both whole. The sleep (PACK_PAUSE_S) hands the core back between two.
    Its own thread: once lowered, a thread's priority may not be raised again without privileges. `record`(start,
    end, CPU seconds) hears of each Linear."""
    set_nice(PACK_NICE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for lin in linears:
            start, cpu = time.monotonic(), time.thread_time()
            lin.packed = Linear._pack(lin.weight, lin.bias)
            if record is not None:
                record(start, time.monotonic(), time.thread_time() - cpu)
            time.sleep(PACK_PAUSE_S)
    finally:
        torch.set_num_threads(threads)


def drop_plain_weights(linears: list[Linear]) -> None:
    """On the engine thread, between two steps: free the plain copies of the weights that now have packed ones
    (except those that few-row steps read: Linear.keep_plain)."""
    for lin in linears:
        lin.drop_plain()


def _install(multi: MultiEngine, name: str, engine: Engine, step_ms: float,
             timeline: LoadTimeline | None = None) -> None:
    """On the engine thread: the cached step-time profile of this setup (never a new one: that would stall every
    other model's streams for seconds), then the model joins the loop. Here, not on the loader thread: the
    profile's key holds torch's thread count, which is 1 there (2026-11-24 the switch served without its
    profile that way)."""
    multi.turns.pending = False  # from here it counts as a busy model through its requests
    if step_ms > 0:
        from paceline.core.step_time import ProfiledCostModel

        path = engine.config.step_profile or engine._profile_cache_path()
        try:
            engine.scheduler.step_time = ProfiledCostModel.load(path).step_time
            engine.config.scheduler.max_step_ms = step_ms
        except (OSError, ValueError, KeyError):
            log.warning("model %s: no cached step-time profile at %s, so it serves without a step-time target; "
                        "load it once at start-up (load: eager) to profile it", name, path)
    multi.add_model(name, engine, timeline)


def engine_bytes(engine: Engine) -> int:
    """Bytes of every tensor the engine's model and runner hold (weights, KV pool, host swap pool), each storage
    once."""
    seen_ptrs: set[int] = set()
    total = 0
    for t in reachable_tensors(engine.runner.model, engine.runner.kv_cache, engine.runner.host_cache):
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # an opaque (e.g. oneDNN-packed) weight: its own memory
            total += t.numel() * t.element_size()
            continue
        if storage.data_ptr() not in seen_ptrs:
            seen_ptrs.add(storage.data_ptr())
            total += storage.nbytes()
    return total
