"""The offline API on the bundled model, through the real scheduler: batching, preemption and prefix caching
never change greedy output. In float32 by name: the exactness contract is fp32's, whatever the default mode."""
from __future__ import annotations

import pytest

from paceline import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "The quick brown fox",
    "Water boils at",
    "In 1969, astronauts",
    "import numpy as np\n",
]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_gb=0.25, dtype="float32")


@pytest.fixture(scope="module")
def reference(llm: LLM) -> dict[str, list[int]]:
    """Each prompt generated alone: the output every other arrangement must reproduce."""
    return {p: llm.generate(p, greedy(24))[0].outputs[0].token_ids for p in PROMPTS}


def test_batch_of_64_equals_one_by_one(llm: LLM, reference: dict[str, list[int]]) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    outputs = llm.generate(prompts, greedy(24))
    assert [o.outputs[0].token_ids for o in outputs] == [reference[p] for p in prompts]
    assert llm.engine.stats().num_used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_resume_unchanged(reference: dict[str, list[int]], mode: str) -> None:
    # 8 requests of ~10 prompt + 24 output tokens need ~3 blocks each; 10 blocks force preemption mid-decode
    small = LLM(num_blocks=10, block_size=16, preemption_mode=mode, swap_space_gb=0.05, dtype="float32")
    outputs = small.generate(PROMPTS, greedy(24))
    stats = small.engine.stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [reference[p] for p in PROMPTS]
    assert stats.num_used_blocks == 0


def test_prefix_cache_hit_gives_same_output(llm: LLM) -> None:
    long_prompt = "Here is a story about a lighthouse keeper who counts ships. " * 8
    first = llm.generate(long_prompt, greedy(16))[0]
    second = llm.generate(long_prompt, greedy(16))[0]
    assert second.num_cached_tokens >= 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids
    crowd = llm.generate(PROMPTS, [seeded] + [SamplingParams(temperature=1.0, max_tokens=16)] * 7)
    assert crowd[0].outputs[0].token_ids == alone


def test_stop_string_cuts_text(llm: LLM) -> None:
    full = llm.generate("Count: 1, 2, 3, 4,", greedy(16))[0].outputs[0].text
    assert "," in full
    cut = llm.generate("Count: 1, 2, 3, 4,", greedy(16, stop=[","]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == ","
    assert cut.text == full[: full.index(",")]


def test_chat_and_n(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Say hello."}],
                   SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8))[0]
    assert len(out.outputs) == 2 and all(o.token_ids for o in out.outputs)


def test_bad_input_is_a_value_error(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy(4))
    with pytest.raises(ValueError, match="context length"):
        llm.generate("hi", greedy(10**6))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[10**9]], greedy(4))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_step_stats_count_decodes_and_prompt_chunks(llm: LLM) -> None:
    engine = llm.engine
    request = engine.add_request("stats-a", "The capital of France is", greedy(3))
    first = engine.step()  # the whole prompt, and its first token
    assert engine.last_step.num_prefill_tokens == request.num_prompt_tokens
    assert engine.last_step.num_decode_tokens == 0
    assert first[0].num_output_tokens == 1
    engine.step()
    assert engine.last_step.num_decode_tokens == 1 and engine.last_step.num_prefill_tokens == 0
    while engine.has_unfinished():
        engine.step()


def test_offline_budget_prefills_a_long_prompt_in_one_step(llm: LLM) -> None:
    """Offline (no TBT goal) the step budget is OFFLINE_MAX_NUM_BATCHED_TOKENS, not the server's 512: a 1,200-token
    prompt is one step. Given a budget or a TBT goal, the LLM keeps the server's defaults."""
    from paceline.config import OFFLINE_MAX_NUM_BATCHED_TOKENS
    from paceline.entrypoints.llm import offline_defaults
    assert llm.engine.scheduler.config.max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS
    engine = llm.engine
    ids = [(17 * i) % 4000 + 100 for i in range(1200)]
    engine.add_request("offline-long", ids, greedy(1))
    engine.step()
    assert engine.last_step.num_prefill_tokens == 1200
    while engine.has_unfinished():
        engine.step()
    assert offline_defaults({"max_num_batched_tokens": 256})["max_num_batched_tokens"] == 256
    assert "max_num_batched_tokens" not in offline_defaults({"tbt_goal_ms": 160.0})


def test_shared_params_without_max_tokens_fit_each_prompt(llm: LLM) -> None:
    shared = SamplingParams(temperature=0.0, max_tokens=None, stop_token_ids=[0])
    engine = llm.engine
    short = engine.add_request("shared-a", "Hi", shared)
    long = engine.add_request("shared-b", "Tell me a long story about the sea, the sky and the land.", shared)
    assert shared.max_tokens is None
    assert short.sampling_params.max_tokens - long.sampling_params.max_tokens == long.num_prompt_tokens - short.num_prompt_tokens
    engine.abort("shared-a")
    engine.abort("shared-b")
    engine.step()
    assert engine.stats().num_used_blocks == 0


def test_max_step_ms_cuts_chunks_by_predicted_time_and_output_is_unchanged(llm: LLM, reference, tmp_path) -> None:
    from paceline.sim.cost_model import FEATURES, ProfiledCostModel

    # a made-up profile, far from this machine's timings: the engine's measured / predicted scale must adapt
    coef = dict.fromkeys(FEATURES, 0.0) | {"constant": 0.004, "prefill_tokens": 2e-4, "prefill_attn_pairs": 2e-7,
                                           "decodes": 3e-4, "decode_context": 1e-7}
    ProfiledCostModel(coef).save(tmp_path / "profile.json")
    timed = LLM(kv_cache_memory_gb=0.25, dtype="float32", max_num_batched_tokens=512, max_step_ms=60,
                step_profile=str(tmp_path / "profile.json"))
    long_prompt = " ".join(PROMPTS) * 30
    alone = llm.generate(long_prompt, greedy(16))[0].outputs[0].token_ids

    sched = timed.engine.scheduler
    schedule, chunks = sched.schedule, []

    def recording(now):
        out = schedule(now)
        chunks.extend(s.num_tokens for s in out.scheduled if s.request.num_prompt_tokens > 100 and not s.is_decode)
        assert out.predicted_step_s > 0
        return out
    sched.schedule = recording
    # the short prompts first: from the second step on they decode beside the long prompt's chunks (a step without
    # decodes is bounded by the token budget only)
    outs = timed.generate([*PROMPTS, long_prompt], [greedy(24)] * len(PROMPTS) + [greedy(16)])
    assert outs[-1].outputs[0].token_ids == alone
    assert [o.outputs[0].token_ids for o in outs[:-1]] == [reference[p] for p in PROMPTS]
    assert sched.step_time_scale != 1.0
    assert len(chunks) > 2 and max(chunks) < 512 < sum(chunks)  # the time, not the token budget, cut them


def test_vllm_prompt_dicts_give_the_same_output(llm: LLM, reference: dict[str, list[int]]) -> None:
    text = PROMPTS[0]
    ids = llm.tokenizer.encode(text)
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, text], greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == [reference[text]] * 3
    assert outs[0].prompt == text and outs[1].prompt is None and outs[1].prompt_token_ids == ids
    single = llm.generate({"prompt_token_ids": ids}, greedy(24))  # one dict alone, as vLLM takes it
    assert len(single) == 1 and single[0].outputs[0].token_ids == reference[text]


@pytest.mark.parametrize("bad, message", [
    ({"prompt_token_ids": [10**9]}, "outside the vocabulary"),
    ({"prompt_token_ids": "hello"}, "must be a list of token ids"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt": 5}, "must be a string"),
    ({"prompt": ""}, "empty"),
    ({}, 'needs "prompt"'),
    ({"prompt": "a", "prompt_token_ids": [1]}, "not both"),
    ({"prompt": "a", "multi_modal_data": {}}, "unsupported prompt dict key.*'multi_modal_data'"),
])
def test_bad_prompt_dicts_are_value_errors_and_add_nothing(llm: LLM, bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt": "fine"}, bad], greedy(4))
    assert not llm.engine.has_unfinished() and llm.engine.stats().num_used_blocks == 0
