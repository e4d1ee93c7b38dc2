"""The serving engine at PP=2 keeps two steps in flight (engine/pipelined.py): greedy output token for token equal
to one process, with chunked prefill, preemption (recompute and swap), an abort mid-stream and a served request."""
from __future__ import annotations

from pathlib import Path

import pytest

from paceline import LLM, SamplingParams
from paceline.model.loader import load_checkpoint
from paceline.engine.pipelined import PipelinedEngine

BLOCK_SIZE = 4
PROMPTS = [[(11 * i + 3 * j) % 250 + 3 for j in range(6 + 7 * i)] for i in range(6)]
# 6 requests of 6..41 prompt + 16 output tokens in blocks of 4; 32 blocks = 16 per slot, 3 requests per slot need
# up to 28 of them: preemption. 8-token steps chunk every prompt
ARGS = {"dtype": "float32", "block_size": BLOCK_SIZE, "num_blocks": 32, "max_num_batched_tokens": 8,
        "pipeline_parallel_size": 2}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_folder: str) -> list[list[int]]:
    llm = LLM(tiny_folder, dtype="float32", block_size=BLOCK_SIZE, num_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(16))]


def count_in_flight(engine: PipelinedEngine) -> list[int]:
    """Wrap the runner's submit/collect: the number of steps in flight at each submit."""
    runner, seen, live = engine.runner, [], [0]
    submit, collect = runner.submit, runner.collect

    def counted_submit(*a, **k):
        live[0] += 1
        seen.append(live[0])
        return submit(*a, **k)

    def counted_collect(*a, **k):
        live[0] -= 1
        return collect(*a, **k)
    runner.submit, runner.collect = counted_submit, counted_collect
    return seen


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_two_steps_in_flight_equal_one_process(tiny_folder, reference, mode) -> None:
    llm = LLM(tiny_folder, preemption_mode=mode, swap_space_gb=0.001 if mode == "swap" else 0, **ARGS)
    engine = llm.engine
    try:
        assert isinstance(engine, PipelinedEngine) and len(engine.slots) == 2
        seen = count_in_flight(engine)
        outputs = llm.generate(PROMPTS, greedy(16))
        assert [o.outputs[0].token_ids for o in outputs] == reference
        assert max(seen) == 2  # stage 0 started a step while the other was still in the pipeline
        stats = engine.stats()
        assert stats.num_preemptions > 0 and (mode == "recompute") == (stats.num_swaps == 0)
        assert stats.num_blocks == 32 and stats.num_running == stats.num_waiting == 0
        assert all(s.core.scheduler.num_steps > 0 for s in engine.slots)  # both slots served requests
        assert not engine._owner and not engine._in_flight
    finally:
        engine.runner.close()


def test_abort_mid_stream_leaves_the_others_exact(tiny_folder, reference) -> None:
    engine = LLM(tiny_folder, **ARGS).engine
    try:
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, greedy(16))
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("r0", PROMPTS[0], greedy(4))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        finished: dict[str, str] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    finished[out.request_id] = out.finish_reason
            if len(tokens["r3"]) >= 2 and "r3" not in finished:
                engine.abort("r3")  # mid-stream; its slot's next step may already be in flight
        assert finished.pop("r3") == "abort" and tokens["r3"] == reference[3][:len(tokens["r3"])]
        assert 2 <= len(tokens["r3"]) < 16
        assert all(reason == "length" for reason in finished.values())
        others = [i for i in range(len(PROMPTS)) if i != 3]
        assert [tokens[f"r{i}"] for i in others] == [reference[i] for i in others]
        assert engine.stats().num_used_blocks == 0  # the aborted request's blocks came back
    finally:
        engine.runner.close()


def test_what_several_slots_cannot_do_is_refused(tiny_folder) -> None:
    # before any worker starts: speculative decoding would verify against tokens a step in flight computes
    with pytest.raises(ValueError, match="speculative decoding is not supported with pipeline"):
        LLM(tiny_folder, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **ARGS)


def test_served_at_pp2_through_the_openai_api(tiny_folder, reference) -> None:
    """`paceline serve --pipeline-parallel-size 2` on 127.0.0.1, concurrent completions by the official client."""
    import asyncio
    import sys

    import openai

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "entrypoints"))
    from test_server_real import KEY, Server

    server = Server("--model", tiny_folder, "--pipeline-parallel-size", "2", "--dtype", "float32", "--block-size",
                    str(BLOCK_SIZE), "--num-kv-blocks", "64", "--max-num-batched-tokens", "8", "--max-step-ms", "0",
                    "--api-key", KEY)
    try:
        server.wait_ready()

        async def main() -> list:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(*[client.completions.create(
                model=model, prompt=p, max_tokens=16, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True}) for p in PROMPTS[:4]])
        answers = asyncio.run(main())
        tiny = load_checkpoint(tiny_folder).tokenizer
        for answer, ids in zip(answers, reference):
            assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 16
            assert answer.choices[0].text == tiny.decode(ids, skip_special_tokens=True)
        idle = server.wait_idle()
        assert idle["paceline:num_requests_running"] == 0 and idle["paceline:kv_cache_used_blocks"] == 0
    finally:
        assert server.stop() == 0, server.output()
