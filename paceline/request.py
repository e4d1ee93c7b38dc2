"""Request: one generation's tokens, state and timeline, shared by scheduler, executor and engine."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from paceline.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never run, or preempted by recompute (then num_computed_tokens == 0)
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its KV lives in host blocks
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower runs first (vLLM's convention)
    eos_token_id: int | None = None
    cache_salt: str | None = None
    client_id: str = ""  # whose request (the OpenAI `user` field or X-Client-Id): the fair policy's unit of share

    status: RequestStatus = RequestStatus.WAITING
    # prompt followed by every output token; kept as one list so slicing a chunk needs no concat
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # with prompt_logprobs: entry i is prompt token i + 1's (token 0 has none), filled as prompt chunks run
    prompt_logprobs: list = field(default_factory=list)

    # timeline (seconds, in the scheduler's clock)
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemption_times: list[float] = field(default_factory=list)
    num_swaps: int = 0
    finish_time: float | None = None
    # time slices (scheduler.time_slice_*): the MLFQ level (raised each time a slice preempts it), and where its
    # current residency began (output tokens, time) when it was last admitted or swapped in
    slice_level: int = 0
    slice_mark: int = 0
    slice_since: float = 0.0
    dropped_kv_tokens: int = 0  # KV tokens a recompute preemption dropped and readmission has not yet counted

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_preemptions(self) -> int:
        return len(self.preemption_times)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """True when exactly one known token (the last sampled one) lacks KV: the next step is a decode."""
        return self.num_output_tokens > 0 and self.num_tokens - self.num_computed_tokens == 1

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        self.token_times.append(now)

    def check_stop(self) -> str | None:
        """Stop conditions that need no text: stop token ids, EOS, max_tokens. Stop strings are the engine's."""
        sp = self.sampling_params
        n = self.num_output_tokens
        if n == 0:
            return None
        last = self.token_ids[-1]
        if n >= sp.min_tokens:
            if last in sp.stop_token_ids:
                self.stop_reason = last
                return "stop"
            if not sp.ignore_eos and last == self.eos_token_id:
                # a structured output the sampler closed because max_tokens was near: cut short, not finished
                return "length" if sp.structured is not None and sp.structured.cut_by_budget else "stop"
        if sp.max_tokens is not None and n >= sp.max_tokens:
            return "length"
        return None
