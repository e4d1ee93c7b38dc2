"""Helpers shared by the scheduler tests: requests, a fake executor step, and the invariant checks."""
from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.outputs import SchedulerOutput, StepResult
from paceline.core.scheduler import Scheduler
from paceline.request import Request, RequestStatus
from paceline.sampling import SamplingParams


def make_request(rid: str | int, prompt: int | list[int], max_tokens: int = 8, arrival: float = 0.0,
                 priority: int = 0, salt: str | None = None, base: int | None = None) -> Request:
    """A request whose prompt is distinct per id unless given as a list."""
    if isinstance(prompt, int):
        start = (zlib.crc32(str(rid).encode()) % 100_000) * 1000 if base is None else base
        prompt = list(range(start, start + prompt))
    return Request(str(rid), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, priority=priority, cache_salt=salt)


def make_scheduler(policy: str = "stall-free", budget: int = 64, max_seqs: int = 128, num_blocks: int = 1000,
                   block_size: int = 16, host_blocks: int = 0, watermark: float = 0.0, caching: bool = True,
                   step_time=None, speculative=None, **kw) -> Scheduler:
    cfg = SchedulerConfig(policy=policy, max_num_batched_tokens=budget, max_num_seqs=max_seqs, **kw)
    cache = CacheConfig(block_size=block_size, watermark=watermark, enable_prefix_caching=caching)
    return Scheduler(cfg, cache, num_blocks, host_blocks, step_time=step_time, speculative=speculative)


def fake_result(out: SchedulerOutput, token: int = 7) -> StepResult:
    return StepResult({s.request.request_id: token for s in out.scheduled if s.needs_sample})


@dataclass
class StepView:
    """A step as it was scheduled (the output's properties change once update() appends tokens)."""
    out: SchedulerOutput
    changed: list[Request]
    batch: list[tuple[str, int]]  # (request id, tokens), in schedule order
    decodes: list[bool]
    shape: tuple[int, int]  # (decode tokens, prefill tokens)

    @property
    def ids(self) -> list[str]:
        return [rid for rid, _ in self.batch]


def step(sched: Scheduler, now: float, token: int = 7, result: StepResult | None = None) -> StepView:
    out = sched.schedule(now)
    check_output(sched, out)
    view = StepView(out, [], [(s.request.request_id, s.num_tokens) for s in out.scheduled],
                    [s.is_decode for s in out.scheduled], (out.num_decode_tokens, out.num_prefill_tokens))
    view.changed = sched.update(out, result or fake_result(out, token), now)
    check_state(sched)
    return view


def stall_free_budget(cfg, out: SchedulerOutput) -> int:
    """The most tokens a stall-free step may hold: the step budget, or the lone-prefill budget for a step no stream
    waits on (no decode, a step-time target)."""
    if cfg.max_step_ms > 0 and not any(s.is_decode for s in out.scheduled):
        return max(cfg.max_num_batched_tokens, cfg.lone_prefill_tokens)
    return cfg.max_num_batched_tokens


def check_output(sched: Scheduler, out: SchedulerOutput, running_before: set[str] | None = None) -> None:
    """A step's output, checked before update(): limits, block coverage, starts. `running_before`: the ids
    running when the step began, if known; requests admitted in the step come after the chunks in flight."""
    cfg = sched.config
    assert len(out.scheduled) <= cfg.max_num_seqs
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    total = out.num_batched_tokens
    prompts = [s.num_tokens for s in out.scheduled if not s.is_decode]
    if cfg.policy == "stall-free":
        assert total <= stall_free_budget(cfg, out)
    elif cfg.policy == "prefill-first":
        assert total <= cfg.max_num_batched_tokens or len(out.scheduled) == 1
    else:  # one whole prompt may overflow the budget
        assert total - max(prompts, default=0) <= cfg.max_num_batched_tokens
    # a step without decodes is bounded by the token budget only: no stream waits on it
    if cfg.policy == "stall-free" and cfg.max_step_ms and any(s.is_decode for s in out.scheduled):
        # a step with prompts queued is sized by the lower of the engine's two scales (Scheduler.chunk_within_step_time)
        limit = cfg.max_step_ms / 1000 / min(sched.step_time_scale, sched.queued_step_time_scale)
        # a swap-out planned after a chunk was sized (a preemption for a later request) adds copies it could not see
        if out.predicted_step_s > limit * (1 + 1e-9) and not out.swapped_out_ids:
            # over the limit only by the decodes, or by the one-block floor of the step's first prompt chunk
            chunks = [s for s in out.scheduled if not s.is_decode]
            assert len(chunks) <= 1 and all(s.num_tokens <= sched.block_size for s in chunks), \
                f"predicted {out.predicted_step_s:.4f} s over the {limit:.4f} s limit with chunks {chunks}"
    bs = sched.block_size
    for s in out.scheduled:
        r = s.request
        assert r.status is RequestStatus.RUNNING
        assert s.num_tokens >= 1
        assert s.start == r.num_computed_tokens
        assert s.start + s.num_known_tokens <= r.num_tokens
        if s.spec_token_ids:  # proposals only follow the last known token of a decode
            assert s.is_decode and s.needs_sample and r.sampling_params.logprobs is None
            assert len(s.spec_token_ids) <= sched.spec.num_speculative_tokens
            sp = r.sampling_params
            assert sp.max_tokens is None or r.num_output_tokens + len(s.spec_token_ids) < sp.max_tokens
        assert len(s.block_table) * bs >= s.start + s.num_tokens
        assert s.block_table == sched.kv.tables[r.request_id]
    if cfg.policy == "stall-free" and out.num_prefill_tokens:
        # decodes first: when any prompt chunk runs, every running decode runs too
        scheduled = set(ids)
        for r in sched.running:
            if r.is_decoding and r.request_id not in out.swapped_in_ids:
                assert r.request_id in scheduled, f"decode {r.request_id} skipped while a prompt chunk ran"
        # a request admitted in this step, recomputed after a preemption with all but its last token in the prefix
        # cache, looks like a decode but is a new prompt: it rightly queues behind the chunks already in flight
        kinds = [s.is_decode for s in out.scheduled if s.request.request_id not in out.swapped_in_ids
                 and (running_before is None or s.request.request_id in running_before)]
        assert kinds == sorted(kinds, reverse=True), "a decode scheduled after a prompt chunk"


def check_state(sched: Scheduler) -> None:
    """Block accounting and queue membership."""
    kv, pool = sched.kv, sched.kv.pool
    held = Counter(b for t in kv.tables.values() for b in t)
    for rid, t in kv.tables.items():
        assert len(t) == len(set(t)), "a block twice in one table"
        # between steps no request holds a block past its known tokens: rejected proposals' slots were given back
        assert len(t) <= kv.blocks_for(sched.requests[rid].num_tokens), f"{rid} holds blocks past its tokens"
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == held.get(b, 0), f"block {b}: ref {pool.ref_counts[b]} != {held.get(b, 0)} tables"
    free = {b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0}
    assert set(pool.free_queue) == free and len(pool.free_queue) == len(free)
    for h, b in pool.cached.items():
        assert pool.block_hashes[b] == h
    host = Counter(b for t in kv.host_tables.values() for b in t)
    host.update(kv.host.free_list)
    host.update(kv._host_to_release)
    assert sorted(host) == list(range(kv.host.num_blocks)) and all(c == 1 for c in host.values())

    running = {r.request_id for r in sched.running}
    assert len(running) == len(sched.running) <= sched.config.max_num_seqs
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)
    assert set(kv.tables) <= running
    assert set(kv.host_tables) == {r.request_id for r in sched.swapped}
    assert all(r.status is RequestStatus.WAITING for r in sched.waiting)
    assert all(r.status is RequestStatus.SWAPPED for r in sched.swapped)
    assert len(running) + len(sched.waiting) + len(sched.swapped) == len(sched.requests)
    for r in sched.waiting:
        assert r.num_computed_tokens == 0 and r.request_id not in kv.tables
