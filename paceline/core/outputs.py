"""What one step runs (SchedulerOutput) and what the executor hands back (StepResult)."""
from __future__ import annotations

from dataclasses import dataclass, field

from paceline.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # index into request.token_ids of the first token computed now (== num_computed_tokens)
    num_tokens: int  # tokens computed now: request.token_ids[start:start + num_tokens]
    block_table: list[int]  # device blocks covering at least start + num_tokens tokens
    # proposed tokens verified in this step (speculative decoding): they follow the request's known tokens, so
    # the step computes token_ids[start:] + spec_token_ids, and num_tokens counts them
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_known_tokens(self) -> int:
        """Tokens computed now that the request already holds (num_tokens less the proposals)."""
        return self.num_tokens - len(self.spec_token_ids)

    @property
    def needs_sample(self) -> bool:
        """The chunk reaches the end of what the request knows, so its last position yields the next token."""
        return self.start + self.num_tokens - len(self.spec_token_ids) == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        """One known token (the last sampled one), with or without proposals after it."""
        return self.num_tokens - len(self.spec_token_ids) == 1 and self.request.num_output_tokens > 0 and self.needs_sample


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # copies the executor performs before the forward pass, in this order: out, then in
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    preempted_ids: list[str] = field(default_factory=list)  # recomputed later
    swapped_out_ids: list[str] = field(default_factory=list)
    swapped_in_ids: list[str] = field(default_factory=list)
    now: float = 0.0
    predicted_step_s: float = 0.0  # the step-time model's raw prediction, under max_step_ms (else 0)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_decode)  # proposals verified count as decode

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


@dataclass
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: list[tuple[int, float]]  # (token id, logprob), best first, as many as asked
    rank: int | None = None  # of the token among the vocabulary, 1 = the most likely (prompt logprobs only)


@dataclass
class StepResult:
    token_ids: dict[str, int] = field(default_factory=dict)  # request id -> sampled token, for needs_sample only
    # request id -> the accepted proposals plus one sampled token, for requests scheduled with spec_token_ids
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # only for requests that asked
    # request id -> (position p, logprobs of prompt tokens p+1, p+2, ...) for requests that asked for prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    duration: float = 0.0  # seconds the step took (measured, or simulated)
