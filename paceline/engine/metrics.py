"""Prometheus metrics of one server, named as vLLM names them under the prefix `paceline:`, plus paceline's own
(step composition, stalls, used KV blocks). Fed on the engine thread after every step from Engine.last_step,
Engine.stats() and the requests' timelines (time.monotonic() seconds). The same observations feed the
dashboard's StepLog (step_log.py)."""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from paceline.config import STALL_FACTOR
from paceline.engine.step_log import EngineInfo, StepLog

P = "paceline:"
MEDIAN_WINDOW = 256  # decode steps the running median looks back over

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 240.0,
                   480.0, 960.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")  # error: failed inside the engine, the others went on
REJECT_REASONS = ("queue_full", "queue_delay_predicted", "queue_delay_expired")


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 stall_factor: float = STALL_FACTOR, step_log: bool = True) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.stall_factor = stall_factor
        self.step_log = StepLog(model_name) if step_log else None
        m = {"labelnames": ["model_name"], "registry": r}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, **m).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(P + name, doc, **m).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(P + name, doc, buckets=buckets, **m).labels(model_name)

        # vLLM's names
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (new or preempted).")
        self.swapped = gauge("num_requests_swapped", "Requests whose KV cache is swapped out to host memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.gpu_usage = gauge("gpu_cache_usage_perc", "Alias of kv_cache_usage_perc (vLLM v0 name).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Preemptions (recompute or swap).")
        self.slice_preemptions = counter("num_time_slice_preemptions", "Of the preemptions, those a used time slice caused.")
        self.recomputed_tokens = counter("num_recomputed_tokens", "Tokens computed again after a recompute preemption.")
        # speculative decoding, as vLLM names it: acceptance rate = accepted / draft tokens
        self.spec_drafts = counter("spec_decode_num_drafts", "Decodes that carried proposed tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Proposed tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted.")
        self.spec_accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by position in the proposal.",
                                             labelnames=["model_name", "position"], registry=r)
        self._model_name = model_name
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        success = Counter(P + "request_success", "Finished requests by finish reason.",
                          labelnames=["model_name", "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        rejected = Counter(P + "request_rejected", "Requests answered 503 for overload, by reason: the waiting "
                           "queue was full, the predicted or the actual queueing delay passed --max-queue-delay-s.",
                           labelnames=["model_name", "reason"], registry=r)
        self.rejected = {reason: rejected.labels(model_name, reason) for reason in REJECT_REASONS}
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between two consecutive output tokens.", ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Same samples as inter_token_latency_seconds.",
                         ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.req_prompt = hist("request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.req_generation = hist("request_generation_tokens", "Output length of finished requests.",
                                   TOKEN_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens run per engine step.", TOKEN_BUCKETS)
        # paceline's own
        self.steps = counter("engine_steps", "Engine steps that ran a batch.")
        self.step_duration = hist("step_duration_seconds", "Duration of one engine step.", ITL_BUCKETS)
        self.step_decode = counter("step_decode_tokens", "Decode tokens run, summed over steps.")
        self.step_prefill = counter("step_prefill_tokens", "Prompt-chunk tokens run, summed over steps.")
        self.stalls = counter("stalls", f"TBT gaps longer than {stall_factor:g}x the running median decode step.")
        self.stall_seconds = counter("stall_seconds", "Summed length of the stalled TBT gaps.")
        self.used_blocks = gauge("kv_cache_used_blocks", "KV-cache blocks referenced by requests.")
        self.total_blocks = gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.")

        self._decode_steps: deque[float] = deque(maxlen=MEDIAN_WINDOW)
        self._stall_threshold: float | None = None
        self._seen_tokens: dict[str, int] = {}  # request id -> output tokens whose timing is already counted
        self._last_stats: dict[str, float] = {}
        self._num_stalls = 0
        self._step_gaps: list[float] = []  # this step's TBT gaps, handed to the step log in one call

    def observe_rejection(self, reason: str) -> None:
        """Any thread: prometheus_client counters are thread-safe."""
        if reason in self.rejected:
            self.rejected[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # called on the engine thread --------------------------------------------------------------------------------

    def on_step(self, engine: Any, outputs: list, stepped: bool = True) -> None:
        step = engine.last_step if stepped else None
        if step is not None:
            self.observe_step(step)
        stats = engine.stats()
        self.observe_stats(stats)
        stalls_before = self._num_stalls
        for out in outputs:
            self.observe_output(out)
        log = self.step_log
        if log is not None:
            if log.info is None:
                log.info = EngineInfo.of(engine, log.model)
            now = time.monotonic()
            if self._step_gaps:
                log.observe_tbt(self._step_gaps, now)
                self._step_gaps.clear()
            if step is not None:
                log.record(step, stats, self._num_stalls - stalls_before, now)
            log.maybe_snapshot(engine, now, force=not stepped)

    def observe_step(self, step: Any) -> None:
        tokens = step.num_decode_tokens + step.num_prefill_tokens
        if tokens == 0:
            return
        self.steps.inc()
        self.iteration_tokens.observe(tokens)
        self.step_duration.observe(step.duration)
        self.step_decode.inc(step.num_decode_tokens)
        self.step_prefill.inc(step.num_prefill_tokens)
        if step.num_decode_tokens:
            self._decode_steps.append(step.duration)
            self._stall_threshold = self.stall_factor * statistics.median(self._decode_steps)

    def observe_stats(self, stats: Any) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(getattr(stats, "num_swapped", 0))
        self.kv_usage.set(stats.kv_usage)
        self.gpu_usage.set(stats.kv_usage)
        self.used_blocks.set(stats.num_used_blocks)
        self.total_blocks.set(stats.num_blocks)
        # the scheduler keeps running totals; counters take the increase since the last look
        for name, counter in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                              ("num_preemptions", self.preemptions), ("spec_decode_num_drafts", self.spec_drafts),
                              ("num_slice_preemptions", self.slice_preemptions),
                              ("num_recomputed_tokens", self.recomputed_tokens),
                              ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
                              ("spec_decode_num_accepted_tokens", self.spec_accepted)):
            value = getattr(stats, name, 0)
            delta = value - self._last_stats.get(name, 0)
            if delta > 0:
                counter.inc(delta)
            self._last_stats[name] = value
        for pos, value in enumerate(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", ())):
            key = f"spec_pos_{pos}"
            delta = value - self._last_stats.get(key, 0)
            if delta > 0:
                self.spec_accepted_per_pos.labels(self._model_name, str(pos)).inc(delta)
            self._last_stats[key] = value

    def observe_output(self, out: Any) -> None:
        req = out.request
        rid = out.request_id
        seen = self._seen_tokens.get(rid, 0)
        times = req.token_times
        log = self.step_log
        gaps = self._step_gaps if log is not None else None
        if seen == 0 and times:
            ttft = max(0.0, times[0] - req.arrival_time)
            self.ttft.observe(ttft)
            self.prompt_tokens.inc(out.num_prompt_tokens)
            if log is not None:
                log.observe_ttft(ttft, times[0])
        for i in range(max(seen, 1), len(times)):
            gap = times[i] - times[i - 1]
            self.itl.observe(gap)
            self.tpot.observe(gap)
            if gaps is not None:
                gaps.append(gap)
            if self._stall_threshold is not None and gap > self._stall_threshold:
                self.stalls.inc()
                self.stall_seconds.inc(gap)
                self._num_stalls += 1
        self.generation_tokens.inc(len(out.new_token_ids))
        if not out.finished:
            self._seen_tokens[rid] = len(times)
            return
        self._seen_tokens.pop(rid, None)
        reason = out.finish_reason or "abort"
        if reason in self.success:
            self.success[reason].inc()
        end = req.finish_time if req.finish_time is not None else time.monotonic()
        self.e2e.observe(max(0.0, end - req.arrival_time))
        if req.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, req.first_scheduled_time - req.arrival_time))
        self.req_prompt.observe(out.num_prompt_tokens)
        self.req_generation.observe(out.num_output_tokens)
