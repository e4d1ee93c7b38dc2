"""Request and response bodies of the OpenAI-compatible API, the error type the server answers with, and their
mapping to SamplingParams.

The pydantic models here are both what the handlers validate with and what FastAPI writes into /openapi.json,
so the document cannot drift from the code. One rule for fields (OpenAI's): a field the server does not know is a
400 naming it; a field of OpenAI's reference that the server does not implement is a 400 naming it and saying so
(UNSUPPORTED); nothing is silently dropped. docs/openai-api.md lists every field and a test walks that table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from paceline.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutputs

# the one place the accepted priority range is defined; lower runs first, as in vLLM
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class APIError(Exception):
    """An error the server answers with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class Limits:
    """Per-request caps that keep one request from taking the server (issue: n=10000 ran for 20 CPU-minutes).
    Defaults a public server can live with; `paceline serve --max-n ...` changes them."""
    max_n: int = 16  # choices per request
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_total_tokens: int = 65536  # sum over prompts and choices of max_tokens (the context length when unset)
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 512  # characters of one stop string
    max_json_depth: int = 64  # nesting of the JSON body (a response_format schema counts)
    max_logit_bias: int = 1024  # entries of logit_bias
    max_tools: int = 128


# ---- error bodies (declared in the OpenAPI document for every 4xx/5xx) ------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (the field is named in error.param)"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    503: {"model": ErrorResponse, "description": "Overloaded or shutting down (see Retry-After)"},
}


# ---- request bodies ----------------------------------------------------------------------------------------------

def whole_numbers(value: Any, depth: int = 2) -> Any:
    """1.0 as 1, in a field or in its lists (token ids, lists of them): JSON Schema's `integer` includes a number
    with no fractional part (schemathesis sends 2255.0 where the document says integer), and OpenAI's and vLLM's
    servers take it. Everything else goes to the strict check unchanged: "1", true and 1.5 are still refused, and
    1.0 for a float field is the same number."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list) and depth > 0:
        return [whole_numbers(v, depth - 1) for v in value]
    return value

class Strict(BaseModel):
    # strict: "0.5" is not a number and true is not an integer; unknown fields are rejected (OpenAI's rule)
    model_config = ConfigDict(strict=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers(cls, value: Any) -> Any:
        return whole_numbers(value)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM's per-chunk usage: not implemented, so only false


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(Strict):
    """vLLM's `structured_outputs` extra: exactly one of these."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


# OpenAI fields the server knows but does not implement: a 400 that names them and says why
UNSUPPORTED: dict[str, str] = {
    "audio": "audio output is not supported",
    "functions": "the deprecated `functions` is not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "this server runs no reasoning models",
    "verbosity": "`verbosity` is not supported",
    "metadata": "stored completions are not supported, so `metadata` has nothing to label",
    "moderation": "moderation is not supported",
    "prompt_cache_options": "cache breakpoints and lifetimes are not supported; prefix caching is automatic",
    "guided_json": "use `response_format` or `structured_outputs` (vLLM's current spelling)",
    "guided_regex": "use `structured_outputs` (vLLM's current spelling)",
    "guided_choice": "use `structured_outputs` (vLLM's current spelling)",
    "guided_grammar": "use `structured_outputs` (vLLM's current spelling)",
}


class SamplingFields(Strict):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's, then vLLM's extras). Ranges here are
    the hard ones; the per-server caps (Limits) are checked after validation."""
    model: str | None = None
    n: int = Field(1, ge=1, description="choices per prompt; capped by the server's --max-n")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100], added to the logit before sampling")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; prefix caching is automatic here
    service_tier: Literal["auto", "default"] | None = None
    store: Literal[False] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsRequest | None = None
    # Ollama's: how long the model stays loaded after this request ("5m", seconds, 0, or negative for ever)
    keep_alive: str | int | float | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="each prompt token's logprob and rank, plus the top k there")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def structured(self) -> StructuredOutputs | None:
        """The output constraint asked for, by response_format or structured_outputs (not both)."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise bad_request("give either response_format or structured_outputs, not both", param="structured_outputs")
        if so is not None:
            given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                       ("grammar", so.grammar), ("json_object", so.json_object or None))
                     if v is not None}
            if len(given) != 1:
                raise bad_request("structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                                  param="structured_outputs")
            (kind, value), = given.items()
            if kind == "json":
                schema = value if isinstance(value, dict) else _schema_from_text(value, "structured_outputs.json")
                return StructuredOutputs(json=canonical_json(schema))
            if kind == "json_object":
                return StructuredOutputs(json_object=True)
            if kind == "choice":
                if any(not c for c in value):
                    raise bad_request("structured_outputs.choice entries must be non-empty strings",
                                      param="structured_outputs.choice")
                return StructuredOutputs(choice=tuple(value))
            return StructuredOutputs(**{kind: value})
        if rf is None or rf.type == "text":
            if rf is not None and rf.json_schema is not None:
                raise bad_request("json_schema is only for type json_schema", param="response_format.json_schema")
            return None
        if rf.type == "json_object":
            if rf.json_schema is not None:
                raise bad_request("json_schema is only for type json_schema", param="response_format.json_schema")
            return StructuredOutputs(json_object=True)
        if rf.json_schema is None:
            raise bad_request("response_format of type json_schema needs `json_schema`", param="response_format.json_schema")
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        # strict: the output must match the schema exactly, extra properties included (OpenAI's strict mode)
        return StructuredOutputs(json=canonical_json(schema), strict=bool(rf.json_schema.strict))

    def _prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they come whole, after the prompt ran
            raise bad_request("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
        return self.prompt_logprobs

    def _params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, seed=self.seed, max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=self._prompt_logprobs(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=parse_logit_bias(self.logit_bias, vocab_size), structured=self.structured())
        except ValueError as e:
            # SamplingParams messages start with the field they are about ("top_p must be ...")
            field = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=field if field in type(self).model_fields else None) from None

    def check_limits(self, limits: Limits, num_prompts: int, max_tokens: int | None, context: int) -> None:
        if self.n > limits.max_n:
            raise bad_request(f"n must be at most {limits.max_n} on this server, got {self.n}", param="n")
        if num_prompts > limits.max_prompts:
            raise bad_request(f"at most {limits.max_prompts} prompts per request, got {num_prompts}", param="prompt")
        total = num_prompts * self.n * (max_tokens if max_tokens is not None else context)
        if total > limits.max_total_tokens:
            raise bad_request(f"prompts x n x max_tokens = {total} exceeds this server's limit of "
                              f"{limits.max_total_tokens} tokens per request; lower n or max_tokens",
                              param="max_tokens" if max_tokens is not None else "n")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > limits.max_stop:
            raise bad_request(f"at most {limits.max_stop} stop strings, got {len(stops)}", param="stop")
        if any(len(s) > limits.max_stop_chars for s in stops):
            raise bad_request(f"a stop string may have at most {limits.max_stop_chars} characters", param="stop")
        if self.logit_bias is not None and len(self.logit_bias) > limits.max_logit_bias:
            raise bad_request(f"logit_bias may have at most {limits.max_logit_bias} entries", param="logit_bias")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > limits.max_stop:
            raise bad_request(f"at most {limits.max_stop} stop_token_ids", param="stop_token_ids")


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            raise bad_request(f"logit_bias token id {tid} is outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        out[tid] = float(value)
    return out


def canonical_json(schema: dict[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _schema_from_text(text: str, param: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"{param} is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object", param=param)
    return schema


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text"]] | None = None
    # prefix-cache blocks live in memory until evicted, never longer: "in_memory" is what happens anyway
    prompt_cache_retention: Literal["in_memory"] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, vocab_size: int | None = None,
                        structured: StructuredOutputs | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._params(self.resolved_max_tokens(), logprobs, vocab_size)
        if structured is not None:  # a tool call the grammar guarantees
            if params.structured is not None:
                raise bad_request("tool_choice required/named cannot be combined with response_format",
                                  param="tool_choice")
            params.structured = structured
        return params


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # the document states what the handler enforces (its 400 names the field and why): no fill-in-the-middle, and
    # best_of only as n. `maxLength` applies to the string branch only, so null stays valid
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0},
                               description="fill-in-the-middle is not supported: empty or null only")
    best_of: int | None = Field(None, ge=1, description="best-of sampling is not supported: equal to n, or absent")

    def sampling_params(self, vocab_size: int | None = None) -> SamplingParams:
        if self.suffix:
            raise bad_request("suffix (fill-in-the-middle) is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        params = self._params(self.max_tokens, self.logprobs, vocab_size)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs  # echo with logprobs shows the prompt's too (as vLLM)
        return params

    def prompts(self) -> list[str | list[int]]:
        """The batch: one string, one token list, a list of strings, or a list of token lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


# ---- response bodies (documentation: the handlers build plain dicts of this shape) ------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with prompt_logprobs (vLLM's shape)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with prompt_logprobs (vLLM's shape)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


def validation_message(err: ValidationError | list[dict[str, Any]]) -> tuple[str, str | None]:
    """First error of a pydantic validation as (plain message, dotted parameter path)."""
    errors = err.errors() if isinstance(err, ValidationError) else err
    if not errors:
        return "invalid request body", None
    # an unknown field anywhere is what a client most needs to hear about
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    # drop FastAPI's "body" prefix and pydantic's union-branch names ("str", "list[int]", "function-after[...]")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    fields = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool", "dict")]
    param = ".".join(fields) or None
    if first.get("type") == "extra_forbidden":
        name = fields[-1] if fields else "?"
        if len(fields) == 1 and name in UNSUPPORTED:
            return f"`{name}` is not supported: {UNSUPPORTED[name]}", param
        return f"Unrecognized request argument supplied: {param}", param
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return (f"{param}: {msg}" if param else msg), param
