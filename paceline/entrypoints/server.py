"""OpenAI-compatible HTTP API over an AsyncEngine: chat and text completions (streaming or not), models, health,
version, tokenize/detokenize and Prometheus metrics. Run: `paceline serve` or `python -m paceline.entrypoints.server`."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from paceline import __version__
from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.admission import QueueDelayError
from paceline.engine.async_engine import AsyncEngine, EngineStoppedError, QueueFullError, RequestStream
from paceline.engine.faults import maybe_install
from paceline.engine import gc_pacing
from paceline.engine.metrics import EngineMetrics
from paceline.entrypoints import tools
from paceline.entrypoints.dashboard import add_dashboard_routes
from paceline.entrypoints.protocol import (ERROR_RESPONSES, APIError, ChatCompletionRequest, ChatCompletionResponse,
                                           CompletionRequest, CompletionResponse, DetokenizeRequest,
                                           DetokenizeResponse, Limits, TokenizeRequest, TokenizeResponse, bad_request,
                                           validation_message)
from paceline.sampling import SamplingParams

log = logging.getLogger("paceline.server")

MAX_BODY_BYTES = 4 * 2**20
GRACEFUL_SHUTDOWN_S = 5.0  # Ctrl-C: in-flight requests get this long to finish, then they are aborted
# An idle keep-alive connection is closed after this long. It must outlast the clients' own pool expiry (httpx
# and the openai client: 5 s, aiohttp: 15 s): with uvicorn's 5 s the server could close a connection just as a
# client sent its next request on it, and that request died with a reset (httpx.ReadError, no status; one lost
# stream in the 30-minute soak of 2026-11-23). vLLM made the same timeout configurable for the same race.
KEEP_ALIVE_S = 65.0


@dataclass
class ServerSettings:
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    served_model_names: tuple[str, ...] = ()  # names /v1 accepts besides the engine's own
    retry_after_s: int = 1
    dashboard: bool = True  # GET /dashboard, the live page (--no-dashboard)
    limits: Limits = dataclasses.field(default_factory=Limits)


# ---- middleware: plain ASGI, so they also cover bodies FastAPI never parses ----------------------------------------

def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class BodyLimit:
    """413 for bodies over the limit; reads the body once (at most limit + 1 bytes) and replays it to the app.
    Bodies of the JSON endpoints are checked here too (check_json_body), before FastAPI parses them."""

    def __init__(self, app: Any, max_bytes: int, max_depth: int = Limits.max_json_depth) -> None:
        self.app, self.max_bytes, self.max_depth = app, max_bytes, max_depth

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body exceeds the limit of {self.max_bytes} bytes",
                             code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _error_response(too_large)(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _error_response(too_large)(scope, receive, send)
            if not message.get("more_body", False):
                break
        if scope["path"] in JSON_PATHS:
            err = check_json_body(b"".join(chunks), dict(scope["headers"]).get(b"content-type"), self.max_depth)
            if err is not None:
                return await _error_response(err)(scope, receive, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later reads wait for the client to disconnect

        await self.app(scope, replay, send)


JSON_PATHS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")


def check_json_body(raw: bytes, content_type: bytes | None, max_depth: int) -> APIError | None:
    """What FastAPI would otherwise answer with a 500 or a confusing 422: a body that is not a JSON object, too
    deeply nested (json.loads raises RecursionError), or holding strings no tokenizer can take (lone surrogates
    such as "\\ud800", legal JSON escapes that are not Unicode text)."""
    if content_type is not None:
        media = content_type.split(b";", 1)[0].strip().lower()
        if media != b"application/json" and not media.endswith(b"+json"):
            return APIError(400, f"Content-Type must be application/json, got {content_type.decode('latin-1')!r}",
                            code="invalid_content_type")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return bad_request(f"the request body is not valid JSON: {e}", code="invalid_json")
    except RecursionError:
        return bad_request(f"the request body nests deeper than {max_depth} levels", code="invalid_json")
    if not isinstance(data, dict):
        return bad_request("the request body must be a JSON object", code="invalid_json")
    # one iterative walk: nesting depth and every string (keys too) encodable as UTF-8
    stack: list[tuple[Any, int, str | None]] = [(data, 1, None)]
    while stack:
        value, depth, top = stack.pop()
        if depth > max_depth:
            return bad_request(f"the request body nests deeper than {max_depth} levels", param=top,
                               code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for k, v in items:
            field = top if top is not None else str(k)
            for s in (k, v):
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        return bad_request("a string in the request is not valid Unicode (a lone surrogate such as "
                                           "\\ud800)", param=field, code="invalid_unicode")
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, field))
    return None


class BearerAuth:
    """Every /v1 call needs `Authorization: Bearer <api key>` when the server has one."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "invalid or missing API key; send `Authorization: Bearer <key>`",
                               code="invalid_api_key")
                return await _error_response(err)(scope, receive, send)
        await self.app(scope, receive, send)


# ---- the app ----------------------------------------------------------------------------------------------------

def build_app(async_engine: AsyncEngine, metrics: EngineMetrics | None = None,
              settings: ServerSettings | None = None, router: Any = None) -> FastAPI:
    """router: several models (entrypoints/multi_serving.py's ModelRouter), routed by each request's `model`."""
    settings = settings or ServerSettings()
    engine = async_engine.engine
    if router is not None:
        router.bind(OpenAIServing, settings)  # each model gets the one-model serving, with these settings
    api = router if router is not None else OpenAIServing(async_engine, settings)
    if metrics is not None and hasattr(metrics, "observe_rejection"):
        async_engine.on_reject = metrics.observe_rejection  # 503s for overload, by reason

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if router is not None:
            router.start()
        yield
        await async_engine.shutdown()
        if router is not None:
            await router.close()

    app = FastAPI(title="paceline", version=__version__, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return _error_response(bad_request(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), code=None,
                       type="invalid_request_error" if exc.status_code < 500 else "server_error")
        return _error_response(err)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {exc}", type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_engine.is_running else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        if router is not None:
            return router.models_list()
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": api.created, "owned_by": "paceline", "root": engine.model_name,
             "parent": None, "max_model_len": engine.max_model_len} for name in api.model_names]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render() if metrics else b"", media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", responses=ERROR_RESPONSES, response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> Any:
        serving = await api.resolve(body.model)
        engine = serving.engine
        if (body.messages is None) == (body.prompt is None):
            raise bad_request("give either prompt or messages", param="prompt")
        if body.messages is not None:
            text = serving.chat_prompt(body.messages, body.add_generation_prompt)
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids),
                             "token_strs": None})

    @app.post("/detokenize", responses=ERROR_RESPONSES, response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> Any:
        engine = (await api.resolve(body.model)).engine
        vocab = _vocab_size(engine)
        bad = next((t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})

    # 200: a JSON body, or with stream=true an SSE stream of chunks (text/event-stream)
    @app.post("/v1/chat/completions", responses={**ERROR_RESPONSES, 200: {
        "model": ChatCompletionResponse, "content": {"text/event-stream": {}}}})
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await api.chat(request, body)

    @app.post("/v1/completions", responses={**ERROR_RESPONSES, 200: {
        "model": CompletionResponse, "content": {"text/event-stream": {}}}})
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await api.completions(request, body)

    if settings.dashboard and metrics is not None and metrics.step_log is not None:  # drain() ends its feeds
        add_dashboard_routes(app, getattr(metrics, "step_logs", None) or [metrics.step_log], settings.api_key, is_open=lambda: async_engine._accepting)

    inner: Any = app
    if settings.api_key:
        inner = BearerAuth(inner, settings.api_key)
    return BodyLimit(inner, settings.max_body_bytes, settings.limits.max_json_depth)  # type: ignore[return-value]


def _structured_param(body: Any) -> str:
    return "structured_outputs" if body.structured_outputs is not None else "response_format"


def _vocab_size(engine: Any) -> int | None:
    arch = getattr(engine, "arch", None)
    return getattr(arch, "vocab_size", None)


# ---- the OpenAI endpoints ----------------------------------------------------------------------------------------

@dataclass
class Choice:
    """Accumulated output of one engine request (one choice of the response)."""
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    request: Any = None  # the engine's Request (its prompt ids and prompt logprobs)

    def update(self, out: Any) -> None:
        self.request = out.request
        self.text = out.text
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.num_prompt_tokens, self.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason or "abort", out.stop_reason


def usage(choices: list[Choice]) -> dict:
    """A prompt counts once however many choices it has; its cached tokens are the fewest any choice reused."""
    prompts: dict[int, list[Choice]] = {}
    for c in choices:
        prompts.setdefault(c.prompt_index, []).append(c)
    prompt_tokens = sum(cs[0].num_prompt_tokens for cs in prompts.values())
    cached = sum(min(c.num_cached_tokens for c in cs) for cs in prompts.values())
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# line breaks to str.splitlines (which httpx, and so the official openai client, splits SSE lines with) that
# json.dumps(ensure_ascii=False) leaves raw: a model printing one would cut an event in two
_SPLITLINES_ONLY = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':')).translate(_SPLITLINES_ONLY)}\n\n"


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, settings: ServerSettings) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.settings = settings
        names = [*settings.served_model_names, self.engine.model_name]
        self.model_names = list(dict.fromkeys(names))
        self.created = int(time.time())
        self._grammars: Any = None  # GrammarCompiler, built on the first structured request

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(self.model_names)}",
                           param="model", code="model_not_found")

    async def resolve(self, model: str | None) -> OpenAIServing:
        """The serving for `model` (a ModelRouter picks among several; here there is one)."""
        self.check_model(model)
        return self

    def chat_prompt(self, messages: list, add_generation_prompt: bool = True, **template_vars: Any) -> str:
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        plain = [m if isinstance(m, dict) else {"role": m.role, "content": m.text()} for m in messages]
        bad = [k for k in template_vars if not k.isidentifier()]
        if bad:  # they become the template's variables; a key like "" is no name (schemathesis sent one)
            raise bad_request(f"chat_template_kwargs keys must be names, got {bad[0]!r}", param="chat_template_kwargs")
        try:
            return self.engine.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                                             **template_vars)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None
        except TypeError as e:  # a kwarg the tokenizer's template call does not take (or takes twice)
            raise bad_request(f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None

    async def prepare(self, params: SamplingParams, param: str) -> SamplingParams:
        """Server-side parts of a request's parameters: its output grammar, compiled (and cached by constraint)."""
        if params.structured is None:
            return params
        try:
            if self._grammars is None:
                from paceline.model.structured import GrammarCompiler
                self._grammars = await asyncio.to_thread(GrammarCompiler, self.engine.tokenizer,
                                                         _vocab_size(self.engine))
            params.structured.compiled = await asyncio.to_thread(self._grammars.compile, params.structured)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None
        return params

    # -- submitting --------------------------------------------------------------------------------------------

    async def submit(self, base_id: str, prompts: list[str | list[int]], params: SamplingParams, priority: int,
                     prompt_param: str, client_id: str = "") -> list[RequestStream]:
        """One engine request per (prompt, choice), all added or none (a failure aborts those already added)."""
        subs = []
        for p, prompt in enumerate(prompts):
            for i in range(params.n):
                seed = params.seed + i if params.seed is not None else None
                # each choice its own StructuredOutputs: the sampler keys grammar state by that object
                structured = params.structured.copy() if params.structured is not None else None
                subs.append((f"{base_id}-{p}-{i}", prompt,
                             dataclasses.replace(params, n=1, seed=seed, structured=structured)))
        results = await asyncio.gather(
            *(self.async_engine.add_request(rid, prompt, sp, priority, client_id=client_id) for rid, prompt, sp in subs),
            return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return streams
        for s in streams:
            s.abort()
        raise self._map_error(errors[0], prompt_param)

    def _map_error(self, e: BaseException, prompt_param: str) -> BaseException:
        if isinstance(e, (QueueFullError, QueueDelayError)):
            return APIError(503, str(e), type="server_error", code="server_overloaded",
                            headers={"Retry-After": str(max(e.retry_after_s, self.settings.retry_after_s))})
        if isinstance(e, EngineStoppedError):
            return APIError(503, str(e), type="server_error", code="server_shutting_down",
                            headers={"Retry-After": str(self.settings.retry_after_s)})
        if not isinstance(e, (ValueError, APIError)):  # failed inside the engine: this request only
            return APIError(500, str(e), type="server_error")
        if isinstance(e, ValueError):
            message = str(e)
            code = "context_length_exceeded" if "context length" in message else None
            return bad_request(message, param=prompt_param if ("prompt" in message or code) else None, code=code)
        return e

    # -- endpoints ---------------------------------------------------------------------------------------------

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        self.check_model(body.model)
        body.check_limits(self.settings.limits, 1, body.resolved_max_tokens(), self.engine.max_model_len)
        template = getattr(self.engine.tokenizer, "chat_template", None)
        tools.check(body, template, self.model_name)
        forced = tools.forced_structure(body)
        params = await self.prepare(body.sampling_params(_vocab_size(self.engine), forced),
                                    "tool_choice" if forced else _structured_param(body))
        messages, template_vars = tools.messages_for_template(body, tools.template_kind(template))
        extra = body.chat_template_kwargs or {}
        clash = sorted(set(extra) & ({"messages", "add_generation_prompt"} | set(template_vars)))
        if clash:  # the request's own fields set these; twice would be a TypeError, i.e. a 500
            raise bad_request(f"chat_template_kwargs may not set {clash[0]!r}; use the request field",
                              param="chat_template_kwargs")
        text = self.chat_prompt(messages, body.add_generation_prompt, **template_vars, **extra)
        prompt_ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.submit(base_id, [prompt_ids], params, body.priority, "messages", client_of(request, body))
        meta = {"id": base_id, "created": int(time.time()), "model": body.model or self.model_name}
        top = body.top_logprobs or 0
        if body.stream:
            await self.started(streams)
            return StreamingResponse(self._chat_stream(streams, meta, body.include_usage, top, body),
                                     media_type="text/event-stream")
        choices = await self._collect(request, streams, [0] * len(streams))
        if choices is None:
            return Response(status_code=499)  # the client left; nobody reads this
        out = []
        for c in choices:
            content, calls = tools.parse(body, c.text)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            out.append({"index": c.index, "message": message,
                        "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, top) if body.logprobs else None,
                        "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason})
        extra = {"prompt_logprobs": self._vllm_prompt_logprobs(choices[0].request)} if params.prompt_logprobs is not None else {}
        return JSONResponse({**meta, "object": "chat.completion", "choices": out, "usage": usage(choices), **extra})

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        self.check_model(body.model)
        prompts = body.prompts()
        body.check_limits(self.settings.limits, len(prompts), body.max_tokens, self.engine.max_model_len)
        params = await self.prepare(body.sampling_params(_vocab_size(self.engine)), _structured_param(body))
        vocab = _vocab_size(self.engine)
        for p in prompts:
            if (isinstance(p, str) and not p.strip()) or (isinstance(p, list) and not p):
                raise bad_request("prompt must not be empty", param="prompt")
            # echo and prompt_logprobs decode the prompt, which the engine's own id check does not cover for a fake
            decodes = body.echo or params.prompt_logprobs is not None
            bad = next((t for t in p if not 0 <= t < vocab), None) if decodes and isinstance(p, list) and vocab else None
            if bad is not None:
                raise bad_request(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        base_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(base_id, prompts, params, body.priority, "prompt", client_of(request, body))
        meta = {"id": base_id, "created": int(time.time()), "model": body.model or self.model_name}
        prompt_of = [p for p in range(len(prompts)) for _ in range(params.n)]
        # echo: the prompt's text leads each choice (token prompts are decoded as the model would print them)
        echo = [(p if isinstance(p, str) else self.engine.tokenizer.decode(p)) if body.echo else "" for p in prompts]
        if body.stream:
            await self.started(streams)
            return StreamingResponse(self._completion_stream(streams, prompt_of, meta, body.include_usage,
                                                             body.logprobs, echo), media_type="text/event-stream")
        choices = await self._collect(request, streams, prompt_of)
        if choices is None:
            return Response(status_code=499)
        out = []
        for c in choices:
            lp = None
            if body.logprobs is not None:
                lp = self._completion_logprobs(c.token_ids, c.logprobs, len(echo[c.prompt_index]))
                if body.echo:
                    lp = _join_logprobs(self._echo_logprobs(c.request), lp)
            choice = {"index": c.index, "text": echo[c.prompt_index] + c.text, "logprobs": lp,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(c.request)
            out.append(choice)
        return JSONResponse({**meta, "object": "text_completion", "choices": out, "usage": usage(choices)})

    # -- collecting and streaming ------------------------------------------------------------------------------

    async def _collect(self, request: Request, streams: list[RequestStream],
                       prompt_of: list[int]) -> list[Choice] | None:
        """Run every stream to its end; None (and everything aborted) if the client disconnects first."""
        choices = [Choice(i, prompt_of[i]) for i in range(len(streams))]

        async def drain() -> None:
            async for i, out in merge(streams):
                choices[i].update(out)

        work = asyncio.ensure_future(drain())
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                for s in streams:
                    s.abort()
        if not work.done() or work.cancelled():
            return None
        exc = work.exception()
        if exc is not None:
            raise self._map_error(exc, "prompt")
        return choices

    async def started(self, streams: list[RequestStream]) -> None:
        """Under --max-queue-delay-s a stream's headers wait for its first token, so a request that expires in the
        queue (or fails before any token) is a plain 503 / 500 rather than a 200 stream that breaks."""
        if self.async_engine.admission is None:
            return
        waits = [asyncio.ensure_future(s.started()) for s in streams]
        try:
            await asyncio.gather(*waits)
        except BaseException as e:  # an error, or cancelled (the client left): nothing of it streams
            for w in waits:
                w.cancel()
            for s in streams:
                s.abort()
            if isinstance(e, Exception):
                raise self._map_error(e, "prompt") from None
            raise

    async def _chat_stream(self, streams: list[RequestStream], meta: dict, include_usage: bool,
                           top: int, body: ChatCompletionRequest) -> AsyncIterator[str]:
        chunk = {**meta, "object": "chat.completion.chunk"}
        extra = {"usage": None} if include_usage else {}
        choices = [Choice(i, 0) for i in range(len(streams))]
        calling = tools.uses_tools(body)
        forced = calling and body.tool_choice not in (None, "auto")  # the whole output is the calls' JSON
        splitters = [tools.StreamSplitter() for _ in streams]
        try:
            for c in choices:
                yield sse({**chunk, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}], **extra})
            async for i, out in merge(streams):
                choices[i].update(out)
                text = out.new_text
                if calling:
                    text = "" if forced else splitters[i].feed(text)
                if not (text or out.finished or out.new_logprobs):
                    continue  # text held back (a possible stop string or tool call) and nothing else to say
                delta: dict[str, Any] = {"content": text} if text else {}
                finish = choices[i].finish_reason if out.finished else None
                if calling and out.finished:
                    content, calls = tools.parse(body, choices[i].text)
                    if calls:  # OpenAI's shape: each call a delta with its index; arguments whole, in one piece
                        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                        finish = "tool_calls"
                    else:  # no call after all: what was held back is content
                        rest = choices[i].text[splitters[i].emitted:] if not forced else choices[i].text
                        if rest:
                            delta["content"] = delta.get("content", "") + rest
                logprobs = self._chat_logprobs(out.new_token_ids, out.new_logprobs, top) if out.new_logprobs else None
                if "tool_calls" in delta:
                    # the calls, then finish_reason in a chunk of its own, as OpenAI sends them: the openai
                    # client's stream helper closes a call (its arguments.done event) only on a later chunk
                    yield sse({**chunk, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                                     "finish_reason": None}], **extra})
                    delta, logprobs = {}, None
                yield sse({**chunk, "choices": [{
                    "index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                    **({"stop_reason": out.stop_reason} if out.finished else {})}], **extra})
            if include_usage:
                yield sse({**chunk, "choices": [], "usage": usage(choices)})
        except Exception as e:  # an engine failure: tell this client, keep the server up
            yield sse(APIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"

    async def _completion_stream(self, streams: list[RequestStream], prompt_of: list[int], meta: dict,
                                 include_usage: bool, logprobs: int | None,
                                 echo: list[str]) -> AsyncIterator[str]:
        chunk = {**meta, "object": "text_completion"}
        extra = {"usage": None} if include_usage else {}
        choices = [Choice(i, prompt_of[i]) for i in range(len(streams))]
        offsets = [len(echo[c.prompt_index]) for c in choices]
        try:
            for c in choices:
                if echo[c.prompt_index] and logprobs is None:
                    yield sse({**chunk, "choices": [{"index": c.index, "text": echo[c.prompt_index], "logprobs": None,
                                                     "finish_reason": None}], **extra})
            async for i, out in merge(streams):
                first = choices[i].request is None
                choices[i].update(out)
                if first and echo[prompt_of[i]] and logprobs is not None:  # the prompt's logprobs exist from now
                    yield sse({**chunk, "choices": [{"index": i, "text": echo[prompt_of[i]],
                                                     "logprobs": self._echo_logprobs(out.request),
                                                     "finish_reason": None}], **extra})
                # a token whose text is held back (an incomplete UTF-8 sequence, a possible stop string) still gets
                # its chunk, with empty text, as vLLM sends it: a client that counts tokens by chunk (the benchmark's)
                # otherwise sees that stream's gap span two steps (issue 13's stall probe, 2026-11-24)
                if not (out.new_text or out.new_token_ids or out.finished or (logprobs is not None and out.new_logprobs)):
                    continue
                lp = None
                if logprobs is not None and out.new_logprobs:
                    lp = self._completion_logprobs(out.new_token_ids, out.new_logprobs, offsets[i])
                offsets[i] += len(out.new_text)
                yield sse({**chunk, "choices": [{
                    "index": i, "text": out.new_text, "logprobs": lp,
                    "finish_reason": choices[i].finish_reason if out.finished else None,
                    **({"stop_reason": out.stop_reason} if out.finished else {})}], **extra})
            if include_usage:
                yield sse({**chunk, "choices": [], "usage": usage(choices)})
        except Exception as e:
            yield sse(APIError(500, str(e), type="server_error").body())
        yield "data: [DONE]\n\n"

    # -- logprobs ----------------------------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[Any], top: int) -> dict:
        content = []
        for tid, lp in zip(token_ids, logprobs):
            tok = self._token_text(tid)
            content.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()), "top_logprobs": [
                {"token": (t := self._token_text(i)), "logprob": v, "bytes": list(t.encode())}
                for i, v in lp.top[:top]]})
        return {"content": content}

    def _echo_logprobs(self, request: Any) -> dict:
        """The prompt part of echo's logprobs: the first token has none (null), as in OpenAI's and vLLM's."""
        ids = request.prompt_token_ids
        lps = [None, *request.prompt_logprobs]
        tokens, token_logprobs, tops, offsets, offset = [], [], [], [], 0
        for tid, lp in zip(ids, lps):
            tok = self._token_text(tid)
            tokens.append(tok)
            offsets.append(offset)
            offset += len(tok)
            token_logprobs.append(lp.logprob if lp is not None else None)
            tops.append(None if lp is None else {tok: lp.logprob, **{self._token_text(i): v for i, v in lp.top}})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _vllm_prompt_logprobs(self, request: Any) -> list[dict | None]:
        """vLLM's prompt_logprobs: null for the first token, then {token id: {logprob, rank, decoded_token}} with
        the prompt token and the top k at each position."""
        out: list[dict | None] = [None]
        for tid, lp in zip(request.prompt_token_ids[1:], request.prompt_logprobs):
            entry = {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._token_text(tid)}}
            for rank, (i, v) in enumerate(lp.top, 1):
                entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": self._token_text(i)})
            out.append(entry)
        return out

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[Any], offset: int) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, lp in zip(token_ids, logprobs):
            tok = self._token_text(tid)
            tokens.append(tok)
            token_logprobs.append(lp.logprob)
            tops.append({self._token_text(i): v for i, v in lp.top})
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _join_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, delta) from all streams as they come; leaving early aborts the unfinished ones."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.abort()


MAX_CLIENT_ID_CHARS = 256


def client_of(request: Request, body: Any) -> str:
    """Whose request, for --scheduling-policy fair: the X-Client-Id header (a gateway's), else the body's `user`."""
    client = request.headers.get("x-client-id") or body.user or ""
    if len(client) > MAX_CLIENT_ID_CHARS:
        raise bad_request(f"the client id (X-Client-Id or user) is {len(client)} characters long; at most "
                          f"{MAX_CLIENT_ID_CHARS} are allowed", param="user")
    return client


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- command line ---------------------------------------------------------------------------------------------

def _default(section: type, name: str) -> Any:
    return section.__dataclass_fields__[name].default


# flag -> (config section, field); defaults stay in paceline/config.py, flags left out keep them
_FLAGS: dict[str, tuple[type, str]] = {
    "model": (EngineConfig, "model"),
    "dtype": (EngineConfig, "dtype"),
    "quantization": (EngineConfig, "quantization"),
    "wide_linears": (EngineConfig, "wide_linears"),
    "seed": (EngineConfig, "seed"),
    "block_size": (CacheConfig, "block_size"),
    "kv_cache_memory_gb": (CacheConfig, "kv_cache_memory_gb"),
    "num_kv_blocks": (CacheConfig, "num_blocks"),
    "swap_space_gb": (CacheConfig, "swap_space_gb"),
    "enable_prefix_caching": (CacheConfig, "enable_prefix_caching"),
    "max_num_batched_tokens": (SchedulerConfig, "max_num_batched_tokens"),
    "max_num_seqs": (SchedulerConfig, "max_num_seqs"),
    "max_model_len": (SchedulerConfig, "max_model_len"),
    "scheduler": (SchedulerConfig, "policy"),
    "scheduling_policy": (SchedulerConfig, "scheduling_policy"),
    "preemption_mode": (SchedulerConfig, "preemption_mode"),
    "long_prefill_token_threshold": (SchedulerConfig, "long_prefill_token_threshold"),
    "lone_prefill_tokens": (SchedulerConfig, "lone_prefill_tokens"),
    "max_num_partial_prefills": (SchedulerConfig, "max_num_partial_prefills"),
    "priority_aging_s": (SchedulerConfig, "priority_aging_s"),
    "max_batch_wait_ms": (SchedulerConfig, "max_batch_wait_ms"),
    "max_waiting_requests": (SchedulerConfig, "max_waiting_requests"),
    "max_queue_delay_s": (SchedulerConfig, "max_queue_delay_s"),
    "max_step_ms": (SchedulerConfig, "max_step_ms"),
    "short_step_ms": (SchedulerConfig, "short_step_ms"),
    "calm_step_ms": (SchedulerConfig, "calm_step_ms"),
    "time_slice_tokens": (SchedulerConfig, "time_slice_tokens"),
    "time_slice_ms": (SchedulerConfig, "time_slice_ms"),
    "level_aging_s": (SchedulerConfig, "level_aging_s"),
    "step_profile": (EngineConfig, "step_profile"),
    "tbt_goal_ms": (EngineConfig, "tbt_goal_ms"),
    "speculative_config": (EngineConfig, "speculative_config"),
    "tensor_parallel_size": (EngineConfig, "tensor_parallel_size"),
    "pipeline_parallel_size": (EngineConfig, "pipeline_parallel_size"),
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from paceline.config import (CALM_STEP_FRACTION, PREEMPTION_MODES, SCHEDULERS, SCHEDULING_POLICIES,
                                 STEP_TARGET_FRACTION, int_or_auto, scheduler_name)

    def flag(name: str, help: str, old: str | None = None, **kw: Any) -> None:
        """--name; `old`: the flag's former spelling, still accepted but not shown."""
        section, field = _FLAGS[name]
        default = _default(section, field)
        parser.add_argument("--" + name.replace("_", "-"), default=None,
                            help=help if default is None else f"{help} (default: {default})", **kw)
        if old:
            parser.add_argument(old, dest=name, default=None, help=argparse.SUPPRESS, **kw)

    flag("model", "GGUF file or Hugging Face folder (default: the bundled SmolLM2-135M-Instruct); repeat as "
         "NAME=PATH to serve several models", action="append")
    from paceline.entrypoints.multi_serving import add_multi_model_args
    add_multi_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="names clients may use in `model` (default: the model's own name)")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>` on /v1 calls")
    parser.add_argument("--no-dashboard", action="store_true", help="do not serve the live page GET /dashboard")
    parser.add_argument("--graceful-shutdown-s", type=float, default=GRACEFUL_SHUTDOWN_S,
                        help=f"on Ctrl-C / SIGTERM, how long in-flight requests may run before they are aborted "
                             f"(default: {GRACEFUL_SHUTDOWN_S})")
    parser.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                        help="seconds an idle keep-alive connection stays open; keep it above the clients' pool "
                             f"expiry (default: {KEEP_ALIVE_S})")
    parser.add_argument("--max-request-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help=f"larger request bodies get 413 (default: {MAX_BODY_BYTES})")
    flag("dtype", "activations (and unquantized weights) dtype; auto = float32, or bfloat16 under int4",
         choices=["auto", "float32", "bfloat16", "float16"])
    flag("quantization", "int4: hold the layers' weights as 4-bit codes (CPU; a Q4_0/Q4_1 GGUF as stored)",
         choices=["none", "int4"])
    flag("wide_linears", "what steps of more than 8 tokens run on a CPU without native bf16: fp32 weight copies, or "
         "int8 (faster prefill, lower quality: docs/performance.md)", choices=["auto", "fp32", "int8"])
    flag("seed", "seed for requests that give none", type=int)
    flag("max_num_batched_tokens", "token budget of one step; auto: what fits the step-time target each step",
         type=int_or_auto)
    flag("max_num_seqs", "most requests in one step; auto: as many as the step-time target allows each step",
         type=int_or_auto)
    flag("lone_prefill_tokens", "token budget of a step no stream waits on (no decode; step-time target on); "
         "0: the step budget", type=int)
    flag("max_model_len", "context length (capped by the model's)", type=int)
    flag("block_size", "tokens per KV-cache block", type=int)
    flag("kv_cache_memory_gb", "memory for the KV cache, GiB", type=float)
    flag("num_kv_blocks", "KV-cache blocks, overriding --kv-cache-memory-gb", type=int)
    flag("swap_space_gb", "host memory for swapped-out KV blocks, GiB", old="--swap-space", type=float)
    flag("enable_prefix_caching", "reuse the KV of shared prompt prefixes", action=argparse.BooleanOptionalAction)
    flag("scheduler", "batch-building policy", choices=SCHEDULERS, type=scheduler_name)
    flag("scheduling_policy", "order of the waiting queue; fair: fair share between clients (the `user` field or "
         "X-Client-Id header) within a priority level", choices=SCHEDULING_POLICIES)
    flag("preemption_mode", "how running requests give up their KV", choices=PREEMPTION_MODES)
    flag("long_prefill_token_threshold", "most tokens one prompt may take per step (0: off)", type=int)
    flag("max_num_partial_prefills", "prompts mid-prefill at once (0: unlimited)", type=int)
    flag("priority_aging_s", "a waiting request gains one priority level per this many seconds (0: off)", type=float)
    flag("max_batch_wait_ms", "static scheduler: how long to wait for a batch to fill", type=float)
    flag("max_waiting_requests", "waiting requests beyond which the server answers 503 (0: unlimited)", type=int)
    flag("max_queue_delay_s", "a request whose wait in the queue, predicted at arrival, exceeds this many seconds "
         "gets 503 with Retry-After at once; an admitted request is served (0: off)", type=float)
    flag("max_step_ms", "stall-free: cut prompt chunks so each step's predicted time stays under this; set it "
         "below your TBT SLO (0: off)", type=float)
    flag("short_step_ms", "stall-free: the step target for a chunk whose prompt costs more per token it can bring "
         "than a decode costs now (0: off; default 0.35 x the target derived from --tbt-goal-ms)", type=float)
    flag("calm_step_ms", "stall-free: the step target for a chunk no other prompt is queued behind (0: off; default "
         f"{CALM_STEP_FRACTION:g} x the target derived from --tbt-goal-ms)", type=float)
    flag("time_slice_tokens", "preempt a decoding request after this many output tokens (doubling per demotion) "
         "when queued work waits for its seat (0: off)", type=int)
    flag("time_slice_ms", "the same in ms of residency (0: off)", type=float)
    flag("level_aging_s", "time slices: a request demoted to level L queues as if it arrived L x this many seconds "
         "after its demotion (0: strict levels)", type=float)
    flag("step_profile", "profile (paceline profile) that --max-step-ms predicts with; default: a quick "
         "profile at start-up")
    flag("tbt_goal_ms", "the gap between two tokens a stream should not exceed; stall-free without --max-step-ms "
         f"takes its step-time target from it (x{STEP_TARGET_FRACTION:g}; 0: no target)", type=float)
    flag("speculative_config", 'speculative decoding, JSON as vLLM: {"method": "ngram", "num_speculative_tokens": K, '
         '"prompt_lookup_max": N, "prompt_lookup_min": M}')
    flag("tensor_parallel_size", "worker processes that split every layer (heads and MLP) of the model", type=int)
    flag("pipeline_parallel_size", "worker processes that each run a range of the model's layers", type=int)
    add_limit_args(parser)


_LIMIT_FLAGS = {  # flag -> (Limits field, help)
    "max_n": ("max_n", "most choices (n) per request"),
    "max_prompts_per_request": ("max_prompts", "most prompts in one /v1/completions request"),
    "max_tokens_per_request": ("max_total_tokens", "most tokens one request may ask for: prompts x n x max_tokens "
                                                   "(the context length when max_tokens is unset)"),
    "max_stop_strings": ("max_stop", "most stop strings (and stop_token_ids) per request"),
    "max_json_depth": ("max_json_depth", "deepest nesting of a request's JSON body"),
}


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """Per-request caps (paceline.entrypoints.protocol.Limits); their defaults suit a public server."""
    for flag, (field, help) in _LIMIT_FLAGS.items():
        default = Limits.__dataclass_fields__[field].default
        parser.add_argument("--" + flag.replace("_", "-"), type=int, default=default,
                            help=f"{help} (default: {default})")


def limits_from_args(args: argparse.Namespace) -> Limits:
    given = {field: getattr(args, flag) for flag, (field, _) in _LIMIT_FLAGS.items() if hasattr(args, flag)}
    bad = [f"--{flag.replace('_', '-')}" for flag, (field, _) in _LIMIT_FLAGS.items() if given.get(field, 1) < 1]
    if bad:
        raise SystemExit(f"error: {', '.join(bad)} must be >= 1")
    return Limits(**given)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    given: dict[type, dict[str, Any]] = {EngineConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
    for name, (section, field) in _FLAGS.items():
        value = getattr(args, name, None)
        if value is not None:
            given[section][field] = value
    names = getattr(args, "served_model_name", None)
    if isinstance(given[EngineConfig].get("model"), list):  # --model is repeatable: one model here is the last
        from paceline.engine.model_specs import parse_model_flag
        spec = parse_model_flag(given[EngineConfig]["model"][-1])
        given[EngineConfig]["model"] = spec.path
        if "=" in args.model[-1] and spec.path != args.model[-1]:
            given[EngineConfig]["served_model_name"] = spec.name
    if names:
        given[EngineConfig]["served_model_name"] = names[0]
    return EngineConfig(**given[EngineConfig], cache=CacheConfig(**given[CacheConfig]),
                        scheduler=SchedulerConfig(**given[SchedulerConfig]))


def run_server(args: argparse.Namespace) -> None:
    from paceline.engine.pipelined import engine_for

    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    from paceline.entrypoints.multi_serving import build_multi, model_specs_from_args
    specs, router = model_specs_from_args(args), None
    if specs is not None:  # several models, one step loop (entrypoints/multi_serving.py)
        async_engine, router, metrics = build_multi(config, specs, args)
    else:
        # built on the engine thread: torch must run its parallel ops from one thread only (see AsyncEngine)
        async_engine = AsyncEngine(lambda: maybe_install(engine_for(config)))  # faults: only with PACELINE_FAULT_INJECTION=1
        metrics = EngineMetrics(async_engine.engine.model_name, step_log=not getattr(args, "no_dashboard", False))
        async_engine.on_step = metrics.on_step  # read per call; an idle call before this only skips zero gauges
    engine = async_engine.engine
    if gc_pacing.PACING:  # full collections while the loop idles (engine/gc_pacing.py)
        async_engine.collector = gc_pacing.FullCollections()
    settings = ServerSettings(api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                              served_model_names=tuple(args.served_model_name or ()), limits=limits_from_args(args),
                              dashboard=not getattr(args, "no_dashboard", False))
    app = build_app(async_engine, metrics, settings, router)
    sched = config.scheduler
    if router is None:
        freeze_startup_heap()
        log.info("serving %s on http://%s:%d  KV cache %d tokens (%d blocks x %d); token budget %d per step, "
                 "at most %d requests per step; scheduler %s, %s order, preemption %s; max model len %d",
                 engine.model_name, args.host, args.port, engine.num_blocks * engine.block_size, engine.num_blocks,
                 engine.block_size, sched.max_num_batched_tokens, sched.max_num_seqs, sched.policy,
                 sched.scheduling_policy, sched.preemption_mode, engine.max_model_len)
    _GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False,
                                   timeout_graceful_shutdown=args.graceful_shutdown_s + 5, lifespan="on",
                                   timeout_keep_alive=getattr(args, "timeout_keep_alive", KEEP_ALIVE_S)),
                    async_engine, args.graceful_shutdown_s).run()


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (the model, torch, the tokenizer, the app: ~200,000 tracked
    objects) out of the cyclic collector's reach. Why: a full (generation 2) collection walks all of them while
    holding the GIL, so both the engine thread and the HTTP loop stop; on the 2-core VM one took 285-314 ms in an
    engine process (2026-11-24), a step or a token delivery that long, every time enough new objects have survived
    to trigger one. Frozen, a full collection walks only what was made since. Objects frozen here are never
    collected if they later become cyclic garbage, so only a single-model server does this: its start-up objects
    live as long as the process (a multi-model server evicts engines and relies on the collector to free them)."""
    gc.collect()  # what start-up already dropped is freed now, not kept forever
    gc.freeze()


class _GracefulServer(uvicorn.Server):
    """On Ctrl-C / SIGTERM, drain the engine first: in-flight requests get grace_s to finish, then
    are aborted so their streams end properly ([DONE], finish_reason "abort"); lifespan then stops the engine
    thread. uvicorn's own graceful timeout is only the backstop."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.async_engine, self.grace_s = async_engine, grace_s

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a handled Ctrl-C / SIGTERM ends with status 0, not a re-raised signal

    async def shutdown(self, sockets: list | None = None) -> None:
        drain = asyncio.ensure_future(self.async_engine.drain(self.grace_s))
        await super().shutdown(sockets)
        drain.cancel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m paceline.entrypoints.server", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_server(args)


if __name__ == "__main__":
    main()
