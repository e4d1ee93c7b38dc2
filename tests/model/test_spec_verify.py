"""Verification of proposals: the accept rule, and rejection sampling keeps the target's distribution exactly."""
from __future__ import annotations

import pytest
import torch

from paceline.model.spec_verify import accept_prefix, rejection_sample


def test_accept_prefix_keeps_matching_proposals_then_the_targets_token() -> None:
    assert accept_prefix([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus the bonus token
    assert accept_prefix([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first mismatch is replaced by the target's token
    assert accept_prefix([5, 6, 7], [1, 6, 7, 8]) == [1]
    with pytest.raises(ValueError):
        accept_prefix([5], [5])


def _first_tokens(target: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(target.shape[1])
    seconds = torch.zeros(target.shape[1])
    for _ in range(n):
        if draft_probs is not None:  # the guarantee holds for proposals drawn from the proposer's distribution
            drafts = [int(torch.multinomial(q, 1, generator=g)) for q in draft_probs]
        out = rejection_sample(target, drafts, draft_probs, g)
        counts[out[0]] += 1
        if len(out) > 1:
            seconds[out[1]] += 1
    return counts / n, seconds


@pytest.mark.parametrize("draft_kind", ["point", "distribution"])
def test_rejection_sampling_matches_the_target_distribution(draft_kind: str) -> None:
    torch.manual_seed(0)
    vocab = 6
    target = torch.softmax(torch.randn(3, vocab) * 1.5, dim=-1)
    if draft_kind == "point":
        drafts, draft_probs = [int(target[0].argmin()), 2], None  # a poor proposal: rarely accepted
    else:
        drafts, draft_probs = [], torch.softmax(torch.randn(2, vocab), dim=-1)
    n = 20000
    freq, _ = _first_tokens(target, drafts, draft_probs, n)
    # the first token's distribution is the target's: 6 cells, 20000 draws, a chi-square far under its 0.001 tail
    chi2 = float(((freq - target[0]) ** 2 / target[0]).sum() * n)
    assert chi2 < 20.5, (freq, target[0], chi2)


def test_a_draft_equal_to_the_target_is_always_accepted() -> None:
    target = torch.softmax(torch.randn(3, 5), dim=-1)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        out = rejection_sample(target, [1, 2], target[:2], g)
        assert out[:2] == [1, 2] and len(out) == 3
