"""The handful of sums that decide what one step costs: what a step-time model sees of a batch.

It lives in core because two users need it: the scheduler, which sizes prompt chunks to a step-time limit as it
builds a step, and the simulator's cost models, which time whole steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from paceline.core.outputs import SchedulerOutput


@dataclass
class BatchShape:
    num_prefill_tokens: int = 0  # tokens of prompt chunks (and of recomputed outputs after a preemption)
    num_decodes: int = 0
    num_requests: int = 0
    num_sampled: int = 0  # rows that reach the LM head
    prefill_attn_pairs: float = 0.0  # sum over chunks of c*start + c*(c+1)/2: causal query-key pairs
    prefill_kv_tokens: int = 0  # sum over chunks of start + c: KV rows a chunk reads
    decode_context: int = 0  # sum over decodes of the context each attends to
    num_swapped_blocks: int = 0
    num_masked: int = 0  # sampled rows under a grammar (structured outputs): each costs a mask fill

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes

    @classmethod
    def build(cls, chunks: Iterable[tuple[int, int]] = (), decode_contexts: Iterable[int] = (), num_swapped_blocks: int = 0) -> "BatchShape":
        """chunks: (start, num_tokens) of each prompt chunk, all assumed to end their prompt only if sampled later."""
        s = cls(num_swapped_blocks=num_swapped_blocks)
        for start, c in chunks:
            s.add_chunk(start, c, sampled=False)
        for ctx in decode_contexts:
            s.add_decode(ctx)
        return s

    def add_chunk(self, start: int, c: int, sampled: bool) -> None:
        self.num_prefill_tokens += c
        self.num_requests += 1
        self.num_sampled += sampled
        self.prefill_attn_pairs += c * start + c * (c + 1) / 2
        self.prefill_kv_tokens += start + c

    def add_decode(self, context: int) -> None:
        self.num_decodes += 1
        self.num_requests += 1
        self.num_sampled += 1
        self.decode_context += context

    def add_slice(self, request, start: int, num_tokens: int) -> None:
        """num_tokens of `request` from `start`, counted as batch_shape() counts them (is_decode_slice)."""
        end = start + num_tokens
        if is_decode_slice(request, start, num_tokens):
            self.add_decode(end)
        else:
            self.add_chunk(start, num_tokens, sampled=end == len(request.token_ids))
        if end == len(request.token_ids) and request.sampling_params.structured is not None:
            self.num_masked += 1


def is_decode_slice(request, start: int, num_tokens: int) -> bool:
    """Whether num_tokens of `request` from `start` are a decode: one token that ends a request already past its
    prompt (a resumed output too); anything else is a chunk."""
    return num_tokens == 1 and start + 1 == len(request.token_ids) > len(request.prompt_token_ids)


def batch_shape(output: SchedulerOutput) -> BatchShape:
    s = BatchShape(num_swapped_blocks=len(output.blocks_to_swap_in) + len(output.blocks_to_swap_out))
    # BatchShape.add_slice per item, inlined: this runs once per simulated step
    decodes = decode_ctx = chunks = prefill = sampled = kv = masked = 0
    pairs = 0.0
    for item in output.scheduled:
        req, start, c = item.request, item.start, item.num_tokens
        n = len(req.token_ids)
        k = len(item.spec_token_ids)  # a verification: k + 1 query tokens, each reaching the LM head
        if start + c - k == n:
            sampled += 1 + k
            masked += req.sampling_params.structured is not None
            if c == 1 and n > len(req.prompt_token_ids):
                decodes += 1
                decode_ctx += n
                continue
        chunks += 1
        prefill += c
        pairs += c * start + c * (c + 1) / 2
        kv += start + c
    s.num_decodes, s.decode_context, s.num_prefill_tokens = decodes, decode_ctx, prefill
    s.num_requests, s.num_sampled, s.prefill_attn_pairs, s.prefill_kv_tokens = decodes + chunks, sampled, pairs, kv
    s.num_masked = masked
    return s
