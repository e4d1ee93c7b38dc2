"""Time-slice preemption on the bundled model (float32): requests cut by their slices and resumed, by swap or by
recompute, under the fair policy too (each request its own client there: under fair only another client's
request cuts a slice), give exactly the greedy output they give uninterrupted."""
from __future__ import annotations

import pytest

from paceline import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at",
           "The quick brown fox", "List three primary colors:"]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(kv_cache_memory_gb=0.25, dtype="float32")
    return [llm.generate(p, greedy())[0].outputs[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("mode, policy", [("swap", "fcfs"), ("recompute", "fair")])
def test_sliced_requests_resume_unchanged(reference: list[list[int]], mode: str, policy: str) -> None:
    # two seats for six requests: a decoding request yields its seat after 3 tokens (fcfs: 6, 12 at lower levels;
    # fair: to a less-served client, after its first 3)
    llm = LLM(kv_cache_memory_gb=0.25, dtype="float32", max_num_seqs=2, time_slice_tokens=3,
              preemption_mode=mode, scheduling_policy=policy, swap_space_gb=0.05)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(), client_id=f"client-{i}" if policy == "fair" else "")
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    stats = llm.engine.stats()
    assert stats.num_slice_preemptions >= 4 and stats.num_preemptions == stats.num_slice_preemptions
    if mode == "recompute":
        assert stats.num_recomputed_tokens > 0
    else:
        assert stats.num_swaps == stats.num_preemptions
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == reference
    assert stats.num_used_blocks == 0
