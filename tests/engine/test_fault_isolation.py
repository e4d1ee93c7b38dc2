"""One request's fault is that request's only (engine/faults.py), on a tiny random model in float32: faults injected
into the sampler, the logits (a NaN row), the detokenizer and the stop-string matcher of some requests end those
with finish_reason "error" and a message, while every other request in the same batches produces exactly the
tokens it produces without them, and no KV block is left behind."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.engine import Engine
from paceline.engine.faults import MARKER, FaultInjector, run_isolated
from paceline.model.loader import write_hf_folder
from paceline.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from _tiny_checkpoints import tiny_checkpoint  # noqa: E402

GOOD = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
STAGES = ["sampler", "nan", "detokenize", "stop"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_hf_folder(tiny_checkpoint("llama", seed=3), path)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from a second thread
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_step_ms=0, max_num_batched_tokens=256, max_model_len=256))
    yield Engine(config)
    torch.set_num_threads(before)


def params(i: int) -> SamplingParams:
    # greedy, and seeded random: both must come out the same whatever failed beside them
    if i % 2:
        return SamplingParams(temperature=0.8, seed=100 + i, max_tokens=16, ignore_eos=True, stop=["zzz"])
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=["zzz"])


def run(engine: Engine, prompts: dict[str, str]) -> dict[str, tuple[list[int], str | None, str | None]]:
    for i, (rid, prompt) in enumerate(prompts.items()):
        engine.add_request(rid, prompt, params(i % len(GOOD)))
    results: dict[str, tuple[list[int], str | None, str | None]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.request.output_token_ids, out.finish_reason, out.error)
    assert engine.stats().num_used_blocks == 0
    return results


def test_faulty_requests_fail_alone_and_the_others_are_token_exact(engine):
    want = run(engine, {f"ref{i}": p for i, p in enumerate(GOOD)})
    FaultInjector(engine).install()
    prompts = {f"good{i}": p for i, p in enumerate(GOOD)}
    # the faulty ones arrive in the same batches (a long budget: all prompts prefill in the first steps)
    for stage in STAGES:
        prompts[f"bad-{stage}"] = f"Tell me a story. {MARKER}{stage}"
    got = run(engine, prompts)
    for i in range(len(GOOD)):
        tokens, reason, error = got[f"good{i}"]
        assert (reason, error) == ("length", None)
        assert tokens == want[f"ref{i}"][0], f"good{i} changed beside the faults"
    for stage in STAGES:
        tokens, reason, error = got[f"bad-{stage}"]
        assert reason == "error" and error, stage
        assert ("non-finite logits" in error) if stage == "nan" else (f"injected {stage} fault" in error), error
        # text faults fire on the 3rd token: the request ran and then failed mid-stream
        assert len(tokens) >= (2 if stage in ("detokenize", "stop") else 0)
    assert engine.stats().num_running == engine.stats().num_waiting == 0


def test_a_step_of_two_nan_rows_fails_those_two_and_nothing_else(engine, tmp_path):
    """Two faulty requests that make up a whole step (the CI flake of 2026-11-29): each names its own row in its
    error, so isolation fails the two and the engine goes on; before, both failed alone with the batch's very
    message, which reads as a broken engine, and every request in flight failed with them."""
    write_hf_folder(tiny_checkpoint("llama", seed=3), tmp_path)
    fresh = FaultInjector(Engine(dataclasses.replace(engine.config, model=str(tmp_path)))).install().engine
    got = run(fresh, {"nan-a": f"Hi {MARKER}nan", "nan-b": f"Yo {MARKER}nan"})
    for rid in ("nan-a", "nan-b"):
        tokens, reason, error = got[rid]
        assert reason == "error" and f"non-finite logits (NaN or inf) for request {rid}" in error, error
    tokens, reason, error = run(fresh, {"good0": GOOD[0]})["good0"]
    assert (reason, error, len(tokens)) == ("length", None, 16)


def test_isolation_gives_up_when_every_request_fails(engine):
    class Broken:
        def execute(self, out):
            raise RuntimeError("no device")

    engine.add_request("a", "Hello", SamplingParams(max_tokens=2))
    engine.add_request("b", "World", SamplingParams(max_tokens=2))
    out = engine.scheduler.schedule(0.0)
    # each request alone fails exactly as the batch did: the engine is broken, not a request
    with pytest.raises(RuntimeError, match="no device"):
        run_isolated(Broken(), out, RuntimeError("no device"))

    class EachItsOwn:
        def execute(self, out):
            raise ValueError(f"bad grammar in {out.scheduled[0].request.request_id}")

    # faulty requests that make up the whole step, each failing its own way: they fail, nothing else does
    result, failed = run_isolated(EachItsOwn(), out, ValueError("bad grammar in a, b"))
    assert sorted(failed) == ["a", "b"] and not result.token_ids
    # a step of one request that fails alone as it did in the step: that request's fault (a NaN row, say), not
    # the engine's, so it fails alone rather than every request in flight (the soak found this case)
    alone = dataclasses.replace(out, scheduled=out.scheduled[:1])
    result, failed = run_isolated(Broken(), alone, RuntimeError("no device"))
    assert list(failed) == ["a"] and not result.token_ids
    for rid in ("a", "b"):
        engine.abort(rid)
    engine.step()
    assert engine.stats().num_used_blocks == 0
