"""Request bodies of the OpenAI-compatible API, the error type they raise, and their mapping to SamplingParams."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from paceline.sampling import MAX_LOGPROBS, SamplingParams

# the one place the accepted priority range is defined; lower runs first, as in vLLM
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000


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


class Strict(BaseModel):
    # strict: "0.5" is not a number and true is not an integer; unknown fields are ignored as OpenAI does
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class SamplingFields(Strict):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's, then vLLM's extras)."""
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, seed=self.seed, max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens)
        except ValueError as e:
            # SamplingParams messages start with the field they are about ("top_p must be ...")
            field = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=field if field in type(self).model_fields else None) from None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                              param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        return self._params(self.max_tokens, self.logprobs)

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


def validation_message(err: ValidationError | list[dict[str, Any]]) -> tuple[str, str | None]:
    """First error of a pydantic validation as (plain message, dotted parameter path)."""
    errors = err.errors() if isinstance(err, ValidationError) else err
    if not errors:
        return "invalid request body", None
    first = errors[0]
    # drop FastAPI's "body" prefix and pydantic's union-branch names ("str", "list[int]")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    fields = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
    param = ".".join(fields) or None
    return (f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid value")), param
