"""SamplingParams: what a request asks of the sampler and of the stop checks, validated once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20


@dataclass(eq=False)
class StructuredOutputs:
    """A constraint on the output text, enforced at sampling time by a token mask (exactly one kind is set).

    eq=False on purpose: the sampler keeps each request's grammar matcher keyed by this object's identity, so every
    request holds its own instance (dataclasses.replace(params, structured=so.copy()) for each choice). A shared
    one still gives correct output: the sampler checks the matcher has seen exactly the request's output tokens
    and rebuilds it by replaying them when not, only slower."""
    json: str | None = None  # a JSON schema, as canonical JSON text (the cache key of its compiled grammar)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's syntax; GBNF is converted)
    strict: bool = False  # json: no properties beyond the schema's, as OpenAI's strict mode
    compiled: Any = field(default=None, repr=False)  # the library's compiled grammar, set by whoever validates
    # set by the sampler when it forced the output to close before max_tokens: the request then ends "length"
    cut_by_budget: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        kinds = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if sum(kinds) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object, regex, choice, grammar")

    def copy(self) -> "StructuredOutputs":
        return StructuredOutputs(self.json, self.json_object, self.regex, self.choice, self.grammar, self.strict,
                                 self.compiled)

    @property
    def key(self) -> tuple:
        return (self.json, self.json_object, self.regex, self.choice, self.grammar, self.strict)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled (vLLM accepts both)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length (the engine resolves it)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's logprob plus top k
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob (and rank) plus the top k there
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's range [-100, 100])
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        need(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(0.0 < self.repetition_penalty <= 10.0, f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        need(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                               and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        need(self.logit_bias is None or all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0
                                            for t, b in self.logit_bias.items()),
             "logit_bias must map non-negative token ids to values in [-100, 100]")
        need(self.structured is None or isinstance(self.structured, StructuredOutputs),
             "structured must be a StructuredOutputs")
