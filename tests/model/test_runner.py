"""ModelRunner: chunked prefill, mixed batches, SchedulerOutput execution, swap."""
from __future__ import annotations

import pytest
import torch

from paceline.core.outputs import ScheduledRequest, SchedulerOutput
from paceline.engine.runner import ModelRunner
from paceline.model.attention import SeqSlice
from paceline.request import Request
from paceline.sampling import SamplingParams

BS = 4


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _table(first: int, tokens: int) -> list[int]:
    return list(range(first, first + (tokens + BS - 1) // BS))


def _step(runner: ModelRunner, parts: list[tuple[list[int], int, int, list[int]]]) -> list[torch.Tensor]:
    """One forward over (tokens, start, n, table) parts; returns the last-row logits of each, in the given order."""
    order = sorted(range(len(parts)), key=lambda i: parts[i][2] == 1)
    ids, pos, seqs, rows = [], [], [], {}
    for i in order:
        toks, start, n, table = parts[i]
        ids += toks[start:start + n]
        pos += range(start, start + n)
        seqs.append(SeqSlice(start, n, table))
        rows[i] = len(ids) - 1
    logits = runner.forward_tokens(ids, pos, seqs, [rows[i] for i in order])
    return [logits[order.index(i)] for i in range(len(parts))]


@pytest.fixture(scope="module")
def hf(tiny):
    return tiny.make_hf_model("llama", seed=11, max_position_embeddings=512)


def test_prefill_whole_equals_chunks(hf, tiny):
    prompt = _prompt(150, 0)
    whole = tiny.make_runner(hf).prefill_logits(prompt)
    for chunk in (1, 7, 64):
        chunked = tiny.make_runner(hf).prefill_logits(prompt, chunk=chunk)
        torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)


def test_prefill_interleaved_with_other_decodes(hf, tiny):
    runner = tiny.make_runner(hf, num_blocks=128)
    prompt = _prompt(60, 1)
    alone = tiny.make_runner(hf).prefill_logits(prompt)[-1]
    others = [_prompt(20 + 5 * i, 2 + i) for i in range(3)]
    tables = [_table(40 + 10 * i, 60) for i in range(3)]
    for toks, table in zip(others, tables):  # their prompts are in the cache; they now decode
        _step(runner, [(toks, 0, len(toks), table)])
    mine = _table(0, 60)
    start = 0
    for chunk in (7, 16, 1, 30, 6):  # the prompt advances in uneven chunks while the others decode
        parts = [(prompt, start, chunk, mine)]
        for j, toks in enumerate(others):
            toks.append((start + j) % 96)
            parts.append((toks, len(toks) - 1, 1, tables[j]))
        last = _step(runner, parts)[0]
        start += chunk
    assert start == 60
    torch.testing.assert_close(last, alone, atol=1e-4, rtol=0)


def test_mixed_batch_equals_each_alone(hf, tiny):
    # 3 prompt chunks (one fresh, two continuing) and 5 decodes in one pass
    prompts = [_prompt(n, 20 + n) for n in (25, 40, 33, 9, 17, 30, 12, 50)]
    spans = [(0, 25), (16, 24), (8, 25), (8, 1), (16, 1), (29, 1), (11, 1), (49, 1)]
    runner = tiny.make_runner(hf, num_blocks=128)
    tables = [_table(16 * i, 64) for i in range(8)]
    for toks, (start, _), table in zip(prompts, spans, tables):  # earlier context, computed separately
        if start:
            _step(runner, [(toks, 0, start, table)])
    mixed = _step(runner, [(toks, start, n, table) for toks, (start, n), table in zip(prompts, spans, tables)])
    for toks, (start, n), got in zip(prompts, spans, mixed):
        alone = tiny.make_runner(hf).prefill_logits(toks[:start + n])[-1]
        torch.testing.assert_close(got, alone, atol=1e-4, rtol=0)


def _request(rid: str, prompt: list[int], **sp) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=50, **sp), arrival_time=0.0)


def _run_steps(runner: ModelRunner, requests: dict[str, Request], tables: dict[str, list[int]], steps: int,
               chunk: int = 1000) -> None:
    """A minimal scheduler: every request runs min(chunk, remaining) tokens each step."""
    for _ in range(steps):
        sched = []
        for rid, r in requests.items():
            n = min(chunk, r.num_tokens - r.num_computed_tokens)
            sched.append(ScheduledRequest(r, r.num_computed_tokens, n, tables[rid]))
        result = runner.execute(SchedulerOutput(scheduled=sched))
        assert result.duration > 0
        for s in sched:
            s.request.num_computed_tokens += s.num_tokens
            if s.needs_sample:
                s.request.append_token(result.token_ids[s.request.request_id], 0.0)
            else:
                assert s.request.request_id not in result.token_ids


def test_execute_greedy_matches_alone_and_returns_logprobs(hf, tiny):
    runner = tiny.make_runner(hf, num_blocks=128)
    prompts = {"a": _prompt(30, 40), "b": _prompt(11, 41), "c": _prompt(19, 42)}
    reqs = {rid: _request(rid, p, logprobs=3 if rid == "b" else None) for rid, p in prompts.items()}
    tables = {rid: _table(30 * i, 60) for i, rid in enumerate(prompts)}
    _run_steps(runner, reqs, tables, steps=12, chunk=8)
    for rid, p in prompts.items():
        produced = reqs[rid].output_token_ids
        expected, _ = tiny.make_runner(hf).generate_greedy(p, len(produced))
        assert produced == expected
    result = runner.execute(SchedulerOutput(scheduled=[
        ScheduledRequest(r, r.num_computed_tokens, 1, tables[rid]) for rid, r in reqs.items()]))
    assert set(result.logprobs) == {"b"}
    lp = result.logprobs["b"]
    assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert lp.top[0][0] == result.token_ids["b"] and lp.logprob == pytest.approx(lp.top[0][1])


def test_swap_out_and_in_preserves_kv(hf, tiny):
    prompt = _prompt(21, 50)
    expected, _ = tiny.make_runner(hf).generate_greedy(prompt, 6)
    runner = tiny.make_runner(hf, num_blocks=32, num_host_blocks=16)
    req = _request("a", prompt)
    tables = {"a": [3, 7, 1, 9, 12, 0, 5, 2]}
    _run_steps(runner, {"a": req}, tables, steps=3)
    used = tables["a"][:(req.num_computed_tokens + BS - 1) // BS]
    host = [10 + i for i in range(len(used))]
    runner.execute(SchedulerOutput(blocks_to_swap_out=list(zip(used, host))))
    runner.kv_cache.normal_()  # the device blocks get reused by someone else meanwhile
    new = [20 + i for i in range(len(used))]
    runner.execute(SchedulerOutput(blocks_to_swap_in=list(zip(host, new))))
    tables["a"] = new + [30, 31]
    _run_steps(runner, {"a": req}, tables, steps=3)
    assert req.output_token_ids == expected


def test_swap_without_host_blocks_is_a_value_error(hf, tiny):
    with pytest.raises(ValueError, match="host"):
        tiny.make_runner(hf).execute(SchedulerOutput(blocks_to_swap_out=[(0, 0)]))


def test_bytes_per_block(hf, tiny):
    arch = tiny.arch_of(hf)
    assert ModelRunner.bytes_per_block(arch, 16, torch.bfloat16) == arch.num_layers * 2 * 16 * 2 * 16 * 2
