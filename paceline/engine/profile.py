"""Timing the real executor over a grid of batch shapes, and fitting the step-time model (core/step_time.py) to it.

The batches are built by hand (requests with fake token ids, block tables of distinct blocks) and run
through the same ModelRunner.execute the engine calls, so the profile sees exactly the kernels a server
step runs. The KV contents are garbage, which costs the same as real keys and values. The engine takes a quick
profile at start-up when max_step_ms has no profile file; `paceline profile` (sim/profile.py) a full one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from paceline.config import CacheConfig
from paceline.core.batch_shape import BatchShape, batch_shape
from paceline.core.outputs import ScheduledRequest, SchedulerOutput
from paceline.core.step_time import ProfiledCostModel
from paceline.request import Request
from paceline.sampling import SamplingParams

BLOCK_SIZE = CacheConfig.block_size


@dataclass
class GridPoint:
    chunks: list[tuple[int, int, bool]]  # (start, tokens, samples) of each prompt chunk
    decode_contexts: list[int]

    @property
    def kv_tokens(self) -> int:
        return sum(s + c for s, c, _ in self.chunks) + sum(self.decode_contexts)


def grid(quick: bool = False, max_kv_tokens: int = 12288, max_len: int | None = None) -> list[GridPoint]:
    """Decode-only, prompt-only and mixed batches spanning what a CPU server runs; chunks that end their
    prompt (sampled) and chunks that do not, so the fit can tell the LM-head cost from the per-request one."""
    # batches of 1 and 2 rows and more: a float32 model's few-row product serves steps of up to 2 rows (the
    # step-time model's wide_rows feature), and the fit needs steps on both sides of it
    if quick:
        batches, contexts, chunk_sizes, starts = (1, 2, 4, 16, 32), (128, 1024), (32, 128, 512), (0, 1024)
        mixed = (4, 16, 32)
    else:
        batches, contexts, chunk_sizes, starts = (1, 2, 4, 8, 16, 32, 64), (64, 256, 1024, 2048), (16, 64, 128, 256, 512, 1024), (0, 512, 1536)
        mixed = (2, 4, 8)
    pts: list[GridPoint] = []
    for b in batches:
        for ctx in contexts:
            pts.append(GridPoint([], [ctx] * b))
    for i, c in enumerate(chunk_sizes):
        for j, s in enumerate(starts):
            pts.append(GridPoint([(s, c, (i + j) % 2 == 0)], []))
    for b in mixed:
        for c in chunk_sizes[-3:]:
            pts.append(GridPoint([(256, c, True)], [512] * b))
    pts.append(GridPoint([(0, 128, True), (512, 256, False), (0, 64, True)], [300] * 8))
    longest = max_len or 1 << 30  # no request may pass the model's context
    return [p for p in pts if p.kv_tokens <= max_kv_tokens
            and all(s + c <= longest for s, c, _ in p.chunks) and all(c <= longest for c in p.decode_contexts)]


def build_output(point: GridPoint, vocab_size: int, first_block: int = 0, block_size: int = BLOCK_SIZE) -> SchedulerOutput:
    sp = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    out = SchedulerOutput()
    block = first_block
    for i, (start, c, samples) in enumerate(point.chunks):
        n_prompt = start + c if samples else start + c + 1
        r = Request(f"p{i}", [(7 * k + i) % vocab_size for k in range(n_prompt)], sp, 0.0)
        r.num_computed_tokens = start
        nb = -(-(start + c) // block_size)
        out.scheduled.append(ScheduledRequest(r, start, c, list(range(block, block + nb))))
        block += nb
    for i, ctx in enumerate(point.decode_contexts):
        r = Request(f"d{i}", [(3 * k + i) % vocab_size for k in range(ctx - 1)], sp, 0.0)
        r.token_ids.append(1)
        r.num_computed_tokens = ctx - 1
        nb = -(-ctx // block_size)
        out.scheduled.append(ScheduledRequest(r, ctx - 1, 1, list(range(block, block + nb))))
        block += nb
    return out


def time_grid(runner, vocab_size: int, points: list[GridPoint], repeats: int = 3,
              block_size: int = BLOCK_SIZE) -> tuple[list[BatchShape], list[float]]:
    """Run each grid point through runner.execute; its shape and the best of `repeats` timings."""
    shapes: list[BatchShape] = []
    times: list[float] = []
    runner.execute(build_output(points[0], vocab_size, block_size=block_size))  # warm-up: first-call allocations
    for p in points:
        sched = build_output(p, vocab_size, block_size=block_size)
        samples = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            runner.execute(sched)
            samples.append(time.perf_counter() - t0)
        shapes.append(batch_shape(sched))
        # the minimum: on a shared machine every other reading is this cost plus someone else's work
        times.append(min(samples[1:]))  # the first run of a shape warms its buffers
    return shapes, times


def few_rows_of(runner) -> int:
    """Steps of up to this many rows run the runner's model's few-row product (LlamaModel.few_rows); 0: none."""
    few_rows = getattr(getattr(runner, "model", None), "few_rows", None)
    return int(few_rows()) if callable(few_rows) else 0


def quick_step_time_model(runner, vocab_size: int, block_size: int, num_blocks: int,
                          max_len: int | None = None, tokenizer=None) -> ProfiledCostModel:
    """A quick profile of a live runner (an engine's own, before it serves): what max_step_ms predicts with
    when no profile file is given. Uses the runner's KV cache as scratch, so call it before any request."""
    # a block per request of rounding slack: the grid's largest batch has 32 requests
    points = grid(quick=True, max_kv_tokens=min(12288, (num_blocks - 40) * block_size), max_len=max_len)
    if len(points) < 8:
        raise ValueError(f"a KV cache of {num_blocks} blocks (context {max_len}) is too small for the start-up profile; "
                         "give a profile file (paceline profile) instead")
    shapes, times = time_grid(runner, vocab_size, points, repeats=2, block_size=block_size)
    model = ProfiledCostModel.fit(shapes, times, {"quick": True, "source": "engine start-up"}, few_rows_of(runner))
    if tokenizer is not None:
        model.mask_s_per_row = mask_cost(tokenizer, vocab_size)
    return model


def mask_cost(tokenizer, vocab_size: int) -> float:
    """Per constrained row; 0 when this tokenizer cannot be constrained (structured outputs are refused then)."""
    from paceline.model.structured import mask_time_per_row

    try:
        return mask_time_per_row(tokenizer, vocab_size)
    except ValueError:
        return 0.0
