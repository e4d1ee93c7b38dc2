"""Measurements a comparison takes once per server before its probes: the decode step that strict/relaxed SLOs
scale, and the prefill rate of one prompt alone that turns a TTFT into an estimated queueing delay."""
from __future__ import annotations

import numpy as np

from paceline.bench.client import Endpoint, run
from paceline.bench.metrics import all_decoding_gaps
from paceline.bench.prompts import PromptSource
from paceline.bench.workload import RequestSpec


def calibrate_decode_step(ep: Endpoint, source: PromptSource, *, batch: int = 16, prompt_tokens: int = 16,
                          output_tokens: int = 96, seed: int = 0, progress: bool = False) -> float:
    """Median gap while all `batch` requests are decoding: `batch` short prompts sent at once, long outputs."""
    requests = [RequestSpec(i, 0.0, prompt_tokens, output_tokens) for i in range(batch)]
    rng = np.random.default_rng([seed, 99])
    ids = [source.token_ids(prompt_tokens, rng) for _ in requests]
    prompts = [source.text(p) for p in ids] if ep.prompt_format == "text" else ids
    result = run(ep, requests, prompts, progress=progress, scrape_interval=None, label="calibrating")
    failed = [r.error for r in result.records if not r.ok]
    if failed:
        raise RuntimeError(f"calibration failed: {failed[0]}")
    gaps = all_decoding_gaps(result.records)
    gaps = [g for g in gaps if g > 0]  # tokens that shared a chunk are not steps
    if len(gaps) < 4:
        raise RuntimeError("calibration saw too few gaps with every request decoding; raise output_tokens")
    return float(np.median(gaps))


def measure_prefill_rate(ep: Endpoint, source: PromptSource, *, prompt_tokens: int = 1024, repeats: int = 2,
                         seed: int = 0) -> float:
    """Prompt tokens per second of one request alone (the best TTFT of `repeats` tries, max_tokens 1). It turns a
    TTFT into an estimated queueing delay for servers that do not expose theirs (see `ttft_excess`)."""
    best = None
    for i in range(repeats):
        ids = source.token_ids(prompt_tokens, np.random.default_rng([seed, 98, i]))  # fresh text: no prefix-cache hit
        prompt = source.text(ids) if ep.prompt_format == "text" else ids
        rec = run(ep, [RequestSpec(0, 0.0, prompt_tokens, 1)], [prompt], progress=False, scrape_interval=None).records[0]
        if not rec.ok:
            raise RuntimeError(f"prefill measurement failed: {rec.error}")
        best = rec.ttft if best is None else min(best, rec.ttft)
    return prompt_tokens / best
