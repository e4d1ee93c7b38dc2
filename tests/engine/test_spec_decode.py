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
    # no step-time limit: the start-up profile of a small cache on a busy machine can predict any step over it,
    # which would switch speculation off (correctly) and leave nothing to test
    return _engine(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1), max_step_ms=0)


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


@pytest.fixture(scope="module")
def fixed_k() -> Engine:
    return _engine(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, adaptive=False), max_step_ms=0)


def test_fixed_and_adaptive_k_both_equal_plain(plain: Engine, spec: Engine, fixed_k: Engine) -> None:
    want = _run(plain, PROMPTS, [_greedy(32)] * len(PROMPTS))
    assert _run(fixed_k, PROMPTS, [_greedy(32)] * len(PROMPTS)) == want
    assert _run(spec, PROMPTS, [_greedy(32)] * len(PROMPTS)) == want
    assert spec.scheduler.speculator.config.adaptive and not fixed_k.scheduler.speculator.config.adaptive


@pytest.fixture(scope="module")
def drafted() -> Engine:
    # the target in float32 drafted by its own weights in int4 (the same Q4_1 codes, bfloat16 activations), at a
    # fixed k: adaptive k would (rightly) not speculate when, on a busy 2-core machine, a draft step measures as
    # slow as a target step
    return _engine(SpeculativeConfig("draft_model", num_speculative_tokens=3, quantization="int4", adaptive=False),
                   max_step_ms=0)


def test_int4_draft_model_equals_plain_and_is_mostly_accepted(plain: Engine, drafted: Engine) -> None:
    want = _run(plain, PROMPTS, [_greedy()] * len(PROMPTS))
    before = drafted.stats()
    assert _run(drafted, PROMPTS, [_greedy()] * len(PROMPTS)) == want
    st = drafted.stats()
    drafts = st.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = st.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    # greedy: the int4 copy agrees with float32 on nearly every token (97 % measured)
    assert drafts > 0 and accepted >= 0.8 * drafts, (accepted, drafts)
    params = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=20, ignore_eos=True) for i in range(2)]
    assert _run(drafted, PROMPTS[2:], params) == _run(plain, PROMPTS[2:], params)
    assert drafted.scheduler.speculator.draft_cost > 0


def test_a_random_tiny_draft_model_keeps_outputs_exact(plain: Engine, drafted: Engine) -> None:
    import torch

    from paceline.engine.runner import ModelRunner
    from paceline.engine.spec_draft import attach_drafter
    from paceline.model.arch import ModelArch
    from paceline.model.llama import LlamaModel
    from paceline.model.loader import expected_weight_names

    arch = ModelArch(architecture="llama", vocab_size=drafted.arch.vocab_size, hidden_size=32, intermediate_size=48,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False)
    g = torch.Generator().manual_seed(3)
    shapes = {"embed_tokens": (arch.vocab_size, 32), "q_proj": (32, 32), "k_proj": (16, 32), "v_proj": (16, 32),
              "o_proj": (32, 32), "gate_proj": (48, 32), "up_proj": (48, 32), "down_proj": (32, 48), "norm": (32,)}
    weights = {n: torch.randn(next(s for k, s in shapes.items() if k in n), generator=g) * 0.3
               for n in expected_weight_names(arch)}
    model = LlamaModel.from_weights(arch, weights, max_positions=drafted.runner.model.max_positions)
    attach_drafter(drafted, ModelRunner(model, arch, drafted.num_blocks, drafted.block_size), cost_ratio=0.05)
    want = _run(plain, PROMPTS, [_greedy()] * len(PROMPTS))
    assert _run(drafted, PROMPTS, [_greedy()] * len(PROMPTS)) == want
    params = [SamplingParams(temperature=0.8, seed=5 + i, max_tokens=20, ignore_eos=True) for i in range(2)]
    assert _run(drafted, PROMPTS[:2], params) == _run(plain, PROMPTS[:2], params)
    assert drafted.stats().spec_decode_num_draft_tokens > 0
