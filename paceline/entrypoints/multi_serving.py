"""Several models behind one OpenAI-compatible server: a request goes to its `model`'s OpenAIServing.

Each loaded model gets the same OpenAIServing a one-model server has (its tokenizer, chat template, context
length), bound to that model inside the shared AsyncEngine; an unknown name is a 404, a model that cannot be
loaded for lack of memory a 503 with Retry-After. A request holds its model (it cannot be evicted) from
routing until its response has been sent, streaming ones included.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import Metric

from paceline.engine.metrics import P, EngineMetrics
from paceline.engine.model_specs import parse_keep_alive
from paceline.engine.residency import ModelLoadError, NoRoomError, Residency, UnknownModelError
from paceline.entrypoints.protocol import APIError, bad_request

log = logging.getLogger("paceline.server")


class _BoundEngine:
    """The AsyncEngine as one model's OpenAIServing sees it: its requests go to that model."""

    def __init__(self, async_engine: Any, name: str, engine: Any) -> None:
        self._async_engine, self.name, self.engine = async_engine, name, engine

    async def add_request(self, request_id: str, prompt: Any, params: Any, priority: int = 0, **kw: Any) -> Any:
        return await self._async_engine.add_request(request_id, prompt, params, priority, model=self.name, **kw)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._async_engine, attr)


class ModelRouter:
    """What build_app calls in place of one OpenAIServing: resolve, chat, completions, the model list."""

    def __init__(self, async_engine: Any, residency: Residency) -> None:
        self.async_engine, self.residency = async_engine, residency
        self._serving_cls: Any = None
        self.settings: Any = None
        self.model_names = residency.names
        self.default_model = self.model_names[0]
        self.created = int(time.time())
        self._servings: dict[str, Any] = {}
        residency.on_unload.append(lambda name: self._servings.pop(name, None))

    def bind(self, serving_cls: type, settings: Any) -> None:
        """build_app's OpenAIServing class and ServerSettings, which every model's serving is built with (passed in,
        not imported: the server module imports this one)."""
        self._serving_cls, self.settings = serving_cls, settings

    # -- routing -----------------------------------------------------------------------------------------------

    async def _acquire(self, model: str | None, keep_alive: Any = None) -> tuple[str, Any]:
        name = model if model is not None else self.default_model
        seconds = None
        if keep_alive is not None:
            try:
                seconds = parse_keep_alive(keep_alive)
            except ValueError as e:
                raise bad_request(str(e), param="keep_alive") from None
        try:
            engine = await self.residency.acquire(name, seconds)
        except UnknownModelError as e:
            raise APIError(404, e.message, param="model", code="model_not_found") from None
        except NoRoomError as e:
            raise APIError(503, str(e), type="server_error", code="model_not_loaded",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        except ModelLoadError as e:
            raise APIError(500, str(e), type="server_error", code="model_load_failed") from None
        serving = self._servings.get(name)
        if serving is None or serving.engine is not engine:
            settings = dataclasses.replace(self.settings, served_model_names=(name,))
            serving = self._servings[name] = self._serving_cls(_BoundEngine(self.async_engine, name, engine), settings)
        return name, serving

    async def resolve(self, model: str | None) -> Any:
        """The model's OpenAIServing for a call that needs only its tokenizer (tokenize, detokenize)."""
        name, serving = await self._acquire(model)
        self.residency.release(name)
        return serving

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(self.model_names)}",
                           param="model", code="model_not_found")

    async def chat(self, request: Request, body: Any) -> Response:
        name, serving = await self._acquire(body.model, body.keep_alive)
        return await self._held(name, serving.chat(request, body))

    async def completions(self, request: Request, body: Any) -> Response:
        name, serving = await self._acquire(body.model, body.keep_alive)
        return await self._held(name, serving.completions(request, body))

    async def _held(self, name: str, call: Any) -> Response:
        """Run the endpoint; the model is released once the response is done (a stream: once it has ended)."""
        try:
            response = await call
        except BaseException:
            self.residency.release(name)
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._release_after(name, response.body_iterator)
        else:
            self.residency.release(name)
        return response

    async def _release_after(self, name: str, body: AsyncIterator) -> AsyncIterator:
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.residency.release(name)

    # -- /v1/models --------------------------------------------------------------------------------------------

    def models_list(self) -> dict:
        return {"object": "list", "data": [
            {"object": "model", "created": self.created, "owned_by": "paceline", "root": card["id"], "parent": None,
             **card} for card in self.residency.cards()]}

    def start(self) -> None:
        self.residency.start()

    async def close(self) -> None:
        await self.residency.close()


class MultiMetrics:
    """One EngineMetrics per model (every series labelled model_name) in its own registry, rendered as one
    exposition, plus each model's residency: state, loads, last load time, memory."""

    def __init__(self, step_log: bool = True) -> None:
        self.per_model: dict[str, EngineMetrics] = {}
        self.step_log_enabled = step_log
        self.registry = CollectorRegistry()
        self.registry.register(_Merged(self))
        self.residency: Residency | None = None
        r = self.registry
        self.loaded = Gauge(P + "model_loaded", "1 while the model is loaded, 0.5 while it loads, else 0.",
                            ["model_name"], registry=r)
        self.loads = Gauge(P + "model_loads", "Times the model was loaded.", ["model_name"], registry=r)
        self.load_seconds = Gauge(P + "model_load_seconds", "Duration of the model's last load.", ["model_name"],
                                  registry=r)
        self.memory = Gauge(P + "model_memory_bytes", "Weights and KV pools the model holds (or will hold).",
                            ["model_name"], registry=r)

    @property
    def step_logs(self) -> list:
        return [m.step_log for m in self.per_model.values() if m.step_log is not None]

    @property
    def step_log(self) -> Any:
        logs = self.step_logs
        return logs[0] if logs else None

    def of(self, name: str) -> EngineMetrics:
        m = self.per_model.get(name)
        if m is None:  # kept across unloads: counters continue where they were
            m = self.per_model[name] = EngineMetrics(name, step_log=self.step_log_enabled)
        return m

    def on_step(self, multi: Any, outputs: list, stepped: bool) -> None:
        """AsyncEngine's hook: the model that stepped gets its outputs; on idle calls every model refreshes."""
        if stepped and multi.last_model is not None:
            name = multi.last_model
            self.of(name).on_step(multi.engines[name], outputs, True)
            return
        for name, engine in list(multi.engines.items()):
            self.of(name).on_step(engine, [] if stepped else outputs, False)

    def render(self) -> bytes:
        if self.residency is not None:
            for name, slot in self.residency.slots.items():
                self.loaded.labels(name).set({"loaded": 1.0, "loading": 0.5}.get(slot.state, 0.0))
                self.loads.labels(name).set(slot.num_loads)
                self.load_seconds.labels(name).set(slot.load_s)
                self.memory.labels(name).set(slot.nbytes)
        return generate_latest(self.registry)


class _Merged:
    """A collector yielding each family once with the samples of every model's registry."""

    def __init__(self, metrics: MultiMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for m in list(self.metrics.per_model.values()):
            for family in m.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(family.samples)
        return list(families.values())


# ---- command line -------------------------------------------------------------------------------------------------

def add_multi_model_args(parser: Any) -> None:
    parser.add_argument("--models-config", default=None,
                        help="YAML list of models (name, path, dtype, quantization, kv_cache_memory_gb, keep_alive, "
                             "pinned, load); see docs/multi-model.md")
    parser.add_argument("--max-loaded-models", type=int, default=0,
                        help="most models in memory at once; a request for another evicts the least recently used "
                             "idle one (0: no limit)")
    parser.add_argument("--memory-budget-gb", type=float, default=0.0,
                        help="GiB that loaded models' weights and KV pools may take together (0: no limit)")


def model_specs_from_args(args: Any) -> list | None:
    """The models of a several-model server, or None for the one-model server (a bare --model PATH)."""
    from paceline.engine.model_specs import check_unique, load_models_config, parse_model_flag

    flags = getattr(args, "model", None) or []
    config = getattr(args, "models_config", None)
    if not config and len(flags) <= 1:
        return None
    try:
        specs = load_models_config(config) if config else []
        specs += [parse_model_flag(v) for v in flags]
        specs = check_unique(specs)
        if getattr(args, "max_loaded_models", 0) < 0 or getattr(args, "memory_budget_gb", 0.0) < 0:
            raise ValueError("--max-loaded-models and --memory-budget-gb must be >= 0")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return specs


def build_multi(base: Any, specs: list, args: Any) -> tuple[Any, ModelRouter, MultiMetrics]:
    """The AsyncEngine over a MultiEngine, the models marked eager loaded on the engine thread (profiled there as a
    one-model server would be) while they fit, the residency that loads the rest on demand, and the metrics."""
    from paceline.engine.async_engine import AsyncEngine
    from paceline.engine.engine import Engine
    from paceline.engine.model_specs import estimate_bytes
    from paceline.engine.multi import GIL_SWITCH_S, MultiEngine

    if GIL_SWITCH_S > 0:  # the process is the server's: its threads take turns in the GIL (multi.GIL_SWITCH_S)
        sys.setswitchinterval(GIL_SWITCH_S)
        log.info("interpreter switch interval %.2f ms", sys.getswitchinterval() * 1e3)
    max_loaded = args.max_loaded_models
    budget = int(args.memory_budget_gb * 2**30)

    def build() -> MultiEngine:
        multi = MultiEngine(base)
        used = 0
        for spec in specs:
            if spec.load != "eager" or (max_loaded and len(multi.engines) >= max_loaded):
                continue
            config = spec.engine_config(base)
            need = estimate_bytes(config) if budget else 0
            if budget and used + need > budget:
                log.info("model %s is not loaded at start-up: the memory budget is taken", spec.name)
                continue
            multi.add_model(spec.name, Engine(config))
            used += need
        return multi

    try:
        async_engine = AsyncEngine(build)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    metrics = MultiMetrics(step_log=not getattr(args, "no_dashboard", False))
    for name in async_engine.engine.engines:
        metrics.of(name)
    async_engine.on_step = metrics.on_step
    residency = Residency(async_engine, async_engine.engine, specs, base, max_loaded, budget)
    metrics.residency = residency
    for card in residency.cards():
        log.info("model %s: %s", card["id"], card["state"])
    return async_engine, ModelRouter(async_engine, residency), metrics
