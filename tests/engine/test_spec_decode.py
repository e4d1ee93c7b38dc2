"""Speculative decoding (n-gram) on the bundled model in float32: outputs equal those without it, token for token,
greedy and seeded, alone and batched; proposals are actually made and accepted."""
from __future__ import annotations

import pytest

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.engine import Engine
from paceline.sampling import SamplingParams
from paceline.spec_config import SpeculativeConfig

TEXT = ("The lighthouse keeper counted ships every night. He wrote their names in a blue book, "
        "and when the book was full he started another one.")
PROMPTS = [
    f"Repeat the following text exactly.\n\n{TEXT}\n\nRepeated text:\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "# the same function, copied:\ndef fibonacci(n):\n",
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]


def _engine(spec: SpeculativeConfig | None, **sched) -> Engine:
    config = EngineConfig(dtype="float32", device="cpu", cache=CacheConfig(kv_cache_memory_gb=0.1),
                          scheduler=SchedulerConfig(**sched))
    return Engine(config, speculative_config=spec)


def _run(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    requests = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_used_blocks == 0
    return [r.output_token_ids for r in requests]


@pytest.fixture(scope="module")
def plain() -> Engine:
    return _engine(None)


@pytest.fixture(scope="module")
def spec() -> Engine:
    return _engine(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1))


def _greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_greedy_equals_plain_alone_and_batched(plain: Engine, spec: Engine) -> None:
    want = _run(plain, PROMPTS, [_greedy()] * len(PROMPTS))
    before = spec.stats()
    for p, w in zip(PROMPTS, want):
        assert _run(spec, [p], [_greedy()]) == [w]
    assert _run(spec, PROMPTS, [_greedy()] * len(PROMPTS)) == want
    st = spec.stats()
    drafts = st.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = st.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafts > 0 and accepted > 0, "the repeating prompts should have had proposals accepted"
    assert accepted <= drafts
    # the repeated text is accepted mostly whole: far fewer verify steps than tokens
    assert accepted >= 0.3 * drafts


def test_seeded_sampling_with_penalties_equals_plain(plain: Engine, spec: Engine) -> None:
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=11 + i, max_tokens=24, ignore_eos=True,
                             repetition_penalty=1.0 if i % 2 else 1.1, min_tokens=4)
              for i in range(2)]
    assert _run(spec, PROMPTS[:2], params) == _run(plain, PROMPTS[:2], params)


def test_stops_where_plain_stops(plain: Engine, spec: Engine) -> None:
    # max_tokens cuts inside a run of accepted proposals; a stop string ends the text where plain ends it
    params = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, stop=["book"], ignore_eos=True)]
    prompts = PROMPTS[:2]
    a = [plain.add_request(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    b = [spec.add_request(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    texts = {id(plain): {}, id(spec): {}}
    for engine in (plain, spec):
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    texts[id(engine)][o.request_id] = (o.text, o.finish_reason)
    assert [r.num_output_tokens for r in b] == [r.num_output_tokens for r in a] == [7, len(a[1].output_token_ids)]
    assert texts[id(spec)] == texts[id(plain)]
