"""Verifying proposed tokens (speculative decoding) against the target model.

A proposal of k tokens for a request is run as k + 1 query positions; position i yields the target's token after
the known tokens and proposals 0..i-1. Each position is sampled exactly as a plain decode at that output position
would be (same penalties over the tokens before it, same per-(seed, position) noise), and the proposals are kept
while they equal those samples; the first sample that differs (or the one after all k) is kept too.

For a deterministic proposer (n-gram lookup: the draft distribution is a point mass q = 1 at d) this is exactly
rejection sampling: proposal d is accepted with probability p(d) = min(1, p(d) / q(d)), and when it is not, the
token kept is distributed as p restricted to tokens other than d, which is the normalised residual max(0, p - q).
So the output distribution is the target's, and since the noise depends only on (seed, output position), a seeded
request produces the same tokens with and without speculation; a greedy one (argmax) too.

`rejection_sample` is the general form for a proposer with a distribution of its own (a draft model): accept d
with probability min(1, p(d) / q(d)), else sample max(0, p - q) normalised.
"""
from __future__ import annotations

import torch

from paceline.core.outputs import ScheduledRequest
from paceline.model.sampler import SampleRow


def verify_rows(s: ScheduledRequest) -> list[SampleRow]:
    """The sampler rows of one scheduled request: one, or k + 1 for k proposals, row i seeing proposals 0..i-1 as
    already generated (penalties, min_tokens and the seeded position all follow from that)."""
    r = s.request
    out = r.output_token_ids
    drafts = s.spec_token_ids
    return [SampleRow(r.sampling_params, r.prompt_token_ids, out + drafts[:i] if i else out, r.eos_token_id)
            for i in range(len(drafts) + 1)]


def accept_prefix(drafts: list[int], sampled: list[int]) -> list[int]:
    """The proposals that equal the target's samples at their positions, then the target's sample after them:
    between 1 and len(drafts) + 1 tokens. sampled[i] is the target's token at proposal i's position."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} sampled tokens for {len(drafts)} proposals, got {len(sampled)}")
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return drafts[:n] + [sampled[n]]


def rejection_sample(target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling for one request (Leviathan et al. 2023; Chen et al. 2023).

    target_probs [k + 1, vocab]: the target's distribution at each proposal's position and after the last;
    draft_probs [k, vocab] the proposer's, or None for a deterministic proposer (a point mass at each draft token).
    Returns the accepted proposals and one more token; its distribution is the target's whatever the proposals."""
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} proposals, got {target_probs.shape[0]}")
    out: list[int] = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        q_d = float(draft_probs[i, d]) if draft_probs is not None else 1.0
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_d > 0 and u * q_d < float(p[d]):  # u < p(d) / q(d), without dividing by a tiny q
            out.append(d)
            continue
        if draft_probs is not None:
            residual = (p - draft_probs[i]).clamp_min(0)
        else:
            residual = p.clone()
            residual[d] = 0
        total = residual.sum()
        # p == q (nothing left over) cannot reject; guard the rounding case by falling back to p
        residual = residual / total if total > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out
