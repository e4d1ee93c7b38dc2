"""The scheduler's shared mechanics: queues, admission, preemption, swap, update. Which tokens run is the
policy's call (policies.py); everything here is bookkeeping every policy needs.

The time is always an argument: the simulator drives this class in virtual time.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Callable

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.auto_batch import StepRatio, apply_auto_limits
from paceline.core.batch_shape import BatchShape, batch_shape, is_decode_slice
from paceline.core.fair import FairQueue, FairShare
from paceline.core.kv_cache import KVCacheManager, cdiv
from paceline.core.outputs import ScheduledRequest, SchedulerOutput, StepResult
from paceline.core.policies import POLICIES
from paceline.core.queues import RequestQueue, effective_priority, rank_function
from paceline.core.spec_adaptive import Candidate, Speculator, decode_to_verify
from paceline.core.time_slice import preempt_used_slices
from paceline.request import Request, RequestStatus
from paceline.spec_config import SpeculativeConfig

RUNNING, WAITING, SWAPPED, FINISHED = (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED,
                                       RequestStatus.FINISHED)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    kv_usage: float  # used / total device blocks, 0..1
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # of those, tokens served from the cache
    num_preemptions: int  # total, swap-outs included
    num_swaps: int  # total swap-outs
    num_slice_preemptions: int = 0  # of num_preemptions, those a used time slice caused
    num_recomputed_tokens: int = 0  # tokens run again because a recompute preemption dropped their KV
    num_host_blocks: int = 0
    num_used_host_blocks: int = 0
    num_cached_blocks: int = 0  # blocks findable by hash (free or in use)
    num_evictions: int = 0  # cached blocks handed out for fresh use
    num_steps: int = 0
    # speculative decoding, vLLM's names: steps a request verified proposals in, proposals, proposals accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # the last step scheduled, for the step log (engine/step_log.py), which records stats() after each step: the
    # KV rows its prompt chunks read (one chunk: the depth it ends at), the context its decodes read, the smallest
    # step-time target a chunk of it was held to (ms; 0: none was sized), and the measured / predicted scale the
    # target was divided by. Under max_step_ms only (0 otherwise): they explain a long step (the stall probe's gap)
    last_step_context: int = 0
    last_step_decode_context: int = 0
    last_step_target_ms: float = 0.0
    last_step_scale: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class Step:
    """One step under construction."""
    now: float
    max_tokens: int  # the token budget
    out: SchedulerOutput
    used: int = 0  # tokens scheduled so far (may pass max_tokens by one whole prompt under non-chunking policies)
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    resumed: set[str] = field(default_factory=set)  # admitted or swapped in now: not preempted again this step
    preempted: set[str] = field(default_factory=set)  # preempted now: not admitted or swapped in again this step
    shape: BatchShape | None = None  # what the step-time model sees of the step so far (max_step_ms only)
    target_ms: float = 0.0  # the smallest step-time target a chunk of this step was sized to (0: none was)
    # whether more than one prompt wanted compute when the step began (waiting, swapped, mid-prefill): whether the
    # calm and short targets may apply (Scheduler.others_queued), answered on the step's first chunk only
    others_queued: bool | None = None

    @property
    def budget(self) -> int:
        """Tokens left this step; never negative."""
        return max(0, self.max_tokens - self.used)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 num_host_blocks: int = 0, step_time: Callable[[BatchShape], float] | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        if config.max_step_ms > 0 and step_time is None:
            raise ValueError("max_step_ms needs a step-time model: pass step_time (seconds for a BatchShape)")
        self.auto_batch = config.auto_max_num_seqs or config.auto_max_num_batched_tokens
        if self.auto_batch:  # the limits change every step: on a copy, so the caller's config keeps its meaning
            if config.max_step_ms <= 0:
                raise ValueError("auto batch settings need a step-time target (max_step_ms > 0, or a TBT goal)")
            config = copy.copy(config)
        # what the seats of `auto` follow: the measured / predicted ratio of recent steps (core/auto_batch.py)
        self.auto_ratio = StepRatio() if self.auto_batch else None
        self.config = config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, num_host_blocks,
                                 cache_config.enable_prefix_caching, cache_config.watermark)
        self.slicing = config.time_slice_tokens > 0 or config.time_slice_ms > 0
        self.rank = rank_function(config.scheduling_policy, config.priority_aging_s, levels=self.slicing,
                                  level_aging_s=config.level_aging_s)
        # who keeps its KV under memory pressure (anchor()): the rank without fair's counters, which move every step
        self.progress_rank = self.rank
        self.by_priority = config.scheduling_policy in ("priority", "fair")
        self.fair = FairShare() if config.scheduling_policy == "fair" else None
        if self.fair is not None:  # counters change as steps run: one queue per client, the least served first
            self.waiting, self.swapped = FairQueue(self.fair, self.rank), FairQueue(self.fair, self.rank)
            self.rank = self.waiting.rank
        else:
            self.waiting = RequestQueue(self.rank)
            self.swapped = RequestQueue(self.rank)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.policy = POLICIES[config.policy]()  # SchedulerConfig has checked the name
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_steps = 0
        self.num_slice_preemptions = 0
        self.num_recomputed_tokens = 0
        # max_step_ms: the model predicts, and step_time_scale corrects it; the caller that times the steps keeps
        # it (the engine: a high quantile of measured / predicted; a profile taken on an idle machine reads low)
        self.step_time = step_time
        self.step_time_scale = 1.0
        self.queued_step_time_scale = 1.0  # a lower quantile, for steps with prompts queued (engine.py)
        self.last_shape: BatchShape | None = None  # the last scheduled step's, under max_step_ms (see stats())
        self.last_target_ms = 0.0
        self.last_scale = 0.0  # the scale that step was sized by (the engine moves it after the step ran)
        self.spec = speculative
        self.speculator = Speculator(speculative, step_time) if speculative else None
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted = 0
        self.spec_accepted_per_pos = [0] * (speculative.num_speculative_tokens if speculative else 0)

    # ---- requests in and out ----
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.status is not WAITING:
            raise ValueError(f"request {rid!r} must be waiting to be added, it is {request.status.value}")
        capacity = self.kv.pool.num_blocks * self.block_size
        need = request.num_tokens + (request.sampling_params.max_tokens or 0) - request.num_output_tokens
        if need > capacity:
            raise ValueError(f"request {rid!r} needs {need} tokens of KV cache but the whole cache holds {capacity}")
        self.requests[rid] = request
        if self.fair is not None:
            self.fair.arrive(request.client_id, len(request.prompt_token_ids))
        self.waiting.push(request)

    @property
    def wake_time(self) -> float | None:
        """When an idle step would schedule something with no new arrival (the policy says; None: only an arrival)."""
        return self.policy.wake_time

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def abort_request(self, request_id: str, now: float | None = None) -> Request | None:
        """End a request wherever it is, freeing everything it holds now."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, "abort", now)
        return request

    def finish_request(self, request_id: str, reason: str, now: float) -> None:
        """The engine ends a request early (a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason, now)

    def _finish(self, request: Request, reason: str, now: float | None) -> None:
        rid = request.request_id
        status = request.status
        if status is RUNNING:
            self._remove_running(request)
        elif status is WAITING:
            self.waiting.remove(rid)
        elif status is SWAPPED:
            self.swapped.remove(rid)
        self.kv.free(request)
        self.kv.forget(rid)
        del self.requests[rid]
        if self.fair is not None:
            self.fair.leave(request.client_id)
        request.status = FINISHED
        request.finish_reason = reason
        if now is not None:
            request.finish_time = now

    def _remove_running(self, request: Request) -> None:
        running = self.running
        for i in range(len(running) - 1, -1, -1):
            if running[i] is request:
                del running[i]
                return

    # ---- sizes ----
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def stats(self) -> SchedulerStats:
        kv, pool = self.kv, self.kv.pool
        used_host = kv.host.num_blocks - kv.host.num_free
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            num_blocks=pool.num_blocks, num_used_blocks=pool.num_used, num_free_blocks=pool.num_free,
            kv_usage=pool.num_used / pool.num_blocks, prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits, num_preemptions=self.num_preemptions, num_swaps=self.num_swaps,
            num_slice_preemptions=self.num_slice_preemptions, num_recomputed_tokens=self.num_recomputed_tokens,
            num_host_blocks=kv.host.num_blocks, num_used_host_blocks=used_host,
            num_cached_blocks=len(pool.cached), num_evictions=pool.num_evictions, num_steps=self.num_steps,
            spec_decode_num_drafts=self.spec_num_drafts, spec_decode_num_draft_tokens=self.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_num_accepted,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_accepted_per_pos),
            last_step_context=shape.prefill_kv_tokens if (shape := self.last_shape) is not None else 0,
            last_step_decode_context=shape.decode_context if shape is not None else 0,
            last_step_target_ms=self.last_target_ms,
            last_step_scale=self.last_scale)

    # ---- one step ----
    def schedule(self, now: float) -> SchedulerOutput:
        self.kv.end_step()
        self.policy.wake_time = None
        if self.auto_batch:
            apply_auto_limits(self)
        step = Step(now, self.config.max_num_batched_tokens, SchedulerOutput(now=now))
        if self.config.max_step_ms > 0:
            step.shape = BatchShape()
        if self.slicing:
            preempt_used_slices(self, step)
        self.policy(self, step)
        if self.spec is not None:
            self.add_speculation(step)
        out = step.out
        if out.scheduled:
            self.num_steps += 1
            if step.shape is not None:
                step.shape.num_swapped_blocks = len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out)
                out.predicted_step_s = self.step_time(step.shape)
                self.last_shape, self.last_target_ms = step.shape, step.target_ms
                self.last_scale = self.sizing_scale(step)
        return out

    def update(self, output: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        """Advance what each scheduled request computed, append sampled tokens, apply stop checks, free the
        finished. Returns the requests that got a token or finished, in schedule order."""
        if self.fair is not None:
            self.fair.charge(output)
        if self.auto_ratio is not None:
            self.auto_ratio.observe(output, result.duration)
        changed = []
        sampled = result.token_ids
        kv = self.kv
        caching, registered, bs = kv.enable_prefix_caching, kv.num_registered, self.block_size
        for s in output.scheduled:
            request = s.request
            if request.status is not RUNNING:  # aborted or finished by the engine after schedule()
                continue
            if s.spec_token_ids:
                self._update_verified(s, result, now)
                changed.append(request)
                continue
            end = s.start + s.num_tokens
            request.num_computed_tokens = end
            if caching and end // bs > registered.get(request.request_id, 0):
                kv.register_computed(request)
            if end == len(request.token_ids):
                token = sampled.get(request.request_id)
                if token is None:
                    raise ValueError(f"the step result has no token for request {request.request_id!r}, "
                                     "whose chunk reached the end of its known tokens")
                request.append_token(token, now)
                reason = request.check_stop()
                if reason is not None:
                    self._finish(request, reason, now)
                changed.append(request)
        if self.speculator is not None:
            self.speculator.observe(output.scheduled, self.requests)
        return changed

    # ---- speculative decoding ----
    def add_speculation(self, step: Step) -> None:
        """Extend this step's decodes with proposed tokens, with what the policy left: the token budget after every
        prompt chunk has taken its share (so speculation never starves a prefill), the predicted step time under
        max_step_ms, and free blocks beyond the watermark (never by preempting). How many per request is
        core/spec_adaptive.py's call."""
        spec, kv, speculator = self.spec, self.kv, self.speculator
        max_len = self.config.max_model_len
        candidates = []
        for i, s in enumerate(step.out.scheduled):
            request = s.request
            if not s.is_decode or s.spec_token_ids or request.sampling_params.logprobs is not None:
                continue  # logprobs: one entry per step is what the engine streams, so no proposals for them
            sp = request.sampling_params
            left = (sp.max_tokens - request.num_output_tokens) if sp.max_tokens is not None else spec.num_speculative_tokens + 1
            # the last verified token is a sample, so k proposals can add k + 1 tokens; none past max_tokens or the context
            k = min(spec.num_speculative_tokens, step.budget, left - 1, max_len - request.num_tokens)
            if k >= 1:
                drafts = speculator.propose(request.token_ids, k)
                candidates.append(Candidate(i, s, drafts, speculator.rate(request.request_id)))
        if not candidates:
            return
        shape = step.shape if step.shape is not None else batch_shape(step.out)
        limit = self.config.max_step_ms / 1000.0 / self.step_time_scale if step.shape is not None else None
        shape = replace(shape, num_swapped_blocks=len(step.out.blocks_to_swap_in) + len(step.out.blocks_to_swap_out))
        speculator.plan(candidates, shape, len(step.out.scheduled), step.budget, limit)
        for c in candidates:
            s, request = c.scheduled, c.scheduled.request
            drafts = c.drafts[:c.taken]
            if not drafts or not kv.allocate(request, s.num_tokens + len(drafts), reserve=kv.watermark_blocks):
                speculator.remember_shadow(request.request_id, request.num_tokens, c.drafts)
                continue
            if step.shape is not None:
                decode_to_verify(step.shape, s.start, len(drafts))
            s.spec_token_ids = drafts
            s.num_tokens += len(drafts)
            s.block_table = list(kv.tables[request.request_id])
            step.used += len(drafts)

    def _update_verified(self, s: ScheduledRequest, result: StepResult, now: float) -> None:
        """A decode that verified proposals: append the accepted ones and the token sampled after them (stopping
        where a stop condition hits), move num_computed_tokens back past the rejected ones, free their blocks."""
        request, rid = s.request, s.request.request_id
        verified = result.verified_token_ids.get(rid)
        drafts = s.spec_token_ids
        if not verified or len(verified) > len(drafts) + 1 or verified[:-1] != drafts[:len(verified) - 1]:
            raise ValueError(f"the step result's verified tokens {verified!r} for request {rid!r} are not an "
                             f"accepted prefix of its proposals {drafts!r} plus one token")
        num_accepted = len(verified) - 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(drafts)
        self.spec_num_accepted += num_accepted
        for i in range(num_accepted):
            self.spec_accepted_per_pos[i] += 1
        reason = None
        appended = 0
        for token in verified:
            request.append_token(token, now)
            appended += 1
            reason = request.check_stop()
            if reason is not None:
                break
        # KV is valid for the known token and each accepted proposal that was kept; the last token appended has none
        request.num_computed_tokens = s.start + s.num_known_tokens + appended - 1
        kv = self.kv
        if kv.enable_prefix_caching and request.num_computed_tokens // self.block_size > kv.num_registered.get(rid, 0):
            kv.register_computed(request)
        if reason is not None:
            self._finish(request, reason, now)
        else:
            kv.trim(request, request.num_tokens)

    # ---- mechanics the policies use ----
    def add_scheduled(self, step: Step, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        s = ScheduledRequest(request, request.num_computed_tokens, num_tokens, list(self.kv.tables[rid]))
        step.out.scheduled.append(s)
        step.scheduled[rid] = s
        step.used += num_tokens
        if step.shape is not None:
            step.shape.add_slice(request, s.start, num_tokens)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = step.now
            request.num_cached_tokens = request.num_computed_tokens

    def chunk_within_step_time(self, step: Step, request: Request, start: int, n: int) -> int:
        """The most of an n-token chunk of `request` starting at `start` that keeps the step's predicted time
        under max_step_ms (all n when no limit is set, or when no decode runs in the step). The first chunk of a step gets at least one block's worth, so
        prompts progress even when the decodes alone fill the time; not a prompt younger than defer_prompt_s (0
        unless several models' loop sets it), which then waits for a step with room for at least a block, and none
        beside decodes under hold_prompts (several models' loop, while another model loads or debuts)."""
        shape = step.shape
        if (self.config.hold_prompts and n > 0 and not is_decode_slice(request, start, n)
                and any(s.is_decode for s in step.out.scheduled)):
            return 0
        # no decode in the step: no stream waits on it, so only the token budget bounds it. A lone prompt then runs in
        # big chunks, several times faster per token on a CPU than step-target-sized ones (a prompt finishing in this
        # step decodes in the next, which the limit bounds again). Not when this slice is itself a decode: a request
        # swapped back in (or readmitted with all but its last token cached) one token from its end counts as one,
        # and joining chunks sized without a decode it made its stream wait for all of them (long state-machine runs)
        if shape is None or n <= 0:
            return n
        if shape.num_decodes == 0 and not is_decode_slice(request, start, n):
            return n
        if step.others_queued is None:
            step.others_queued = self.others_queued()
        target_ms = self.step_target_ms(shape, request, start, others_queued=step.others_queued)
        step.target_ms = min(step.target_ms or target_ms, target_ms)
        limit = target_ms / 1000.0 / self.sizing_scale(step)

        out = step.out
        # the block copies planned so far, and this request's own if it is coming back from host memory
        swapped = (len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out)
                   + len(self.kv.host_tables.get(request.request_id, ())))

        def fits(k: int) -> bool:
            trial = replace(shape, num_swapped_blocks=swapped)
            trial.add_slice(request, start, k)
            return self.step_time(trial) <= limit

        if fits(n):
            return n
        lo, hi = 0, n  # fits(lo) or lo == 0; not fits(hi). Step time grows with k, so bisect
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        if shape.num_prefill_tokens == 0:
            if step.now - request.arrival_time >= self.config.defer_prompt_s:
                lo = max(lo, min(n, self.block_size))
            elif lo < min(n, self.block_size):
                # deferred: a few tokens beside decodes that nearly fill the target lengthen the step by more than
                # their share (a float32 model's two decodes run its few-row product, 21 ms; with 5 prompt tokens
                # beside them oneDNN's, 45 ms: run EE of benchmarks/summaries/multi_model.md) and barely move the prompt
                lo = 0
        return lo

    def sizing_scale(self, step: Step) -> float:
        """The measured / predicted scale a step's chunks are sized by: with prompts queued the lower quantile, so
        that 1 in 10 such steps (not 1 in 50) may run over the target and the TBT goal's headroom goes to the queue's
        throughput (engine.QUEUED_STEP_TIME_QUANTILE)."""
        return self.queued_step_time_scale if step.others_queued else self.step_time_scale

    def others_queued(self) -> bool:
        """Whether more than one prompt wants compute now: waiting, swapped out, or running but not yet decoding."""
        queued = len(self.waiting) + len(self.swapped)
        for r in self.running:
            if queued > 1:
                break
            queued += not r.is_decoding
        return queued > 1

    def step_target_ms(self, shape: BatchShape, request: Request, start: int, others_queued: bool = True) -> float:
        """The step-time target a chunk of `request` from `start` may fill, beside the decodes already in `shape`:
        max_step_ms when other prompts are queued behind it; alone, calm_step_ms when the rest of its prompt is worth
        that long a step, else short_step_ms.

        Why short: a step's length is every running stream's token gap, while its prompt chunk only moves one prompt
        on. Throughput decides which matters more: the running decodes cost D / N a token now (D the predicted time
        of their N decodes alone), and the rest of this prompt costs P (its predicted prefill time) for at most O
        tokens to come (what max_tokens leaves). A step spent on a prompt that costs more per token it can bring
        than a decode costs now (P / O > D / N) buys less output than the same time spent on decodes, so such a
        step is held short: a lone long prompt beside a few streams (issue 13's stall probe: 1,500 tokens, one
        token out, beside 6 streams) no longer makes every stream wait for a full-target step.

        Why not when others are queued: that weighs the head of the queue alone, but a short step holds back every
        prompt behind it too, each a stream not yet decoding. Chat at 4 req/s (160 requests, 2026-11-25, AMX Xeon)
        ran most steps under the 42 ms short target with 16 prompt tokens while 8-24 requests waited behind heads
        with few tokens to come, and its queue grew for the whole run (docs/scheduling.md); vLLM kept up.

        The calm target: a full step moves the queue behind the prompt on (their TTFT, and the batch fills sooner),
        but a prompt alone in the queue gains only its own few tens of ms of TTFT from it, which every running
        stream pays in its token gap; an unsaturated server (chat at 0.5 req/s) is in that case almost always."""
        cfg = self.config
        full = cfg.max_step_ms
        if others_queued:
            return full
        if 0 < cfg.calm_step_ms < full:
            full = cfg.calm_step_ms
        short = cfg.short_step_ms
        if short <= 0 or short >= full:
            return full
        decodes = BatchShape(num_decodes=shape.num_decodes, num_requests=shape.num_decodes,
                             num_sampled=shape.num_decodes, decode_context=shape.decode_context)
        rest = replace(shape)
        rest.add_slice(request, start, request.num_tokens - start)
        prefill_s = self.step_time(rest) - self.step_time(shape)
        max_tokens = request.sampling_params.max_tokens
        to_come = (max_tokens - request.num_output_tokens if max_tokens is not None
                   else cfg.max_model_len - request.num_tokens)
        return full if prefill_s * shape.num_decodes <= self.step_time(decodes) * max(1, to_come) else short

    def _unschedule(self, step: Step, request: Request) -> None:
        s = step.scheduled.pop(request.request_id, None)
        if s is not None:
            scheduled = step.out.scheduled
            for i in range(len(scheduled) - 1, -1, -1):
                if scheduled[i] is s:
                    del scheduled[i]
                    break
            step.used -= s.num_tokens
            if step.shape is not None:  # rare (a preemption within the step): rebuild rather than subtract
                step.shape = BatchShape()
                for t in step.out.scheduled:
                    step.shape.add_slice(t.request, t.start, t.num_tokens)

    def reserve(self) -> int:
        """Blocks an admission must leave free: the watermark, unless nothing runs that could need them."""
        return self.kv.watermark_blocks if self.running else 0

    def run_running(self, step: Step, request: Request, num_tokens: int) -> bool:
        """Schedule num_tokens of a running request, preempting others if its blocks do not fit.
        False when the request itself was preempted or could not be placed."""
        table = self.kv.tables.get(request.request_id)
        if table is not None and request.num_computed_tokens + num_tokens <= len(table) * self.block_size:
            self.add_scheduled(step, request, num_tokens)  # fast path: most decodes fit their last block
            return True
        allocate = self.kv.allocate
        if allocate(request, num_tokens):
            self.add_scheduled(step, request, num_tokens)
            return True
        anchor = self.anchor()  # only once memory runs short: a scan of the running requests
        while True:
            victim = self.pick_victim(step, protect=anchor)
            if victim is None:
                # nobody but requests resumed in this step could give blocks (an asker other than the anchor is its
                # own last candidate): the anchor sits this step out and keeps its KV; next step they are candidates
                return False
            self.preempt(step, victim)
            if victim is request:
                return False
            if allocate(request, num_tokens):
                break
        self.add_scheduled(step, request, num_tokens)
        return True

    def anchor(self) -> Request | None:
        """The running request that memory pressure never takes KV from (run_running): the first by progress_rank
        (the earliest admitted among equals) once it has been preempted before; None while that request has not.

        Why: under recompute a victim loses its whole context. When the victim follows an order that moves with
        the work itself (fair's counters grow with the tokens a client ran, recomputed ones included), the request
        that got furthest is the one evicted next, and with a KV cache that holds one or two requests nothing ever
        finished (a recorded state-machine example under fair: 796 preemptions in a 1,596-step drain). And a
        request that ranks first may find no victim but itself: requests admitted before its chunk in the same step
        are not preempted in it (under time slices, equal-ranked waiting prompts go before running ones).

        The anchor's key does not move while it runs: (aged) priority and arrival, under time slices the MLFQ level
        too, which changes only when a cut takes the request out of running. So it keeps its blocks until it
        finishes, a slice cuts it after it made a token, a higher priority preempts it, or a better-keyed request
        is admitted (which is the anchor once it has been preempted once); alone it always fits, since add_request
        refuses a request the whole cache could not hold. The first of all running requests, so a lower priority
        is never held against a higher one. Only once preempted before: its first preemption still follows the order
        (under fair, the most-served client's request goes), and only a request going round again is held."""
        best = min(self.running, key=self.progress_rank, default=None)  # min: the first among equals
        return best if best is not None and best.preemption_times else None

    def pick_victim(self, step: Step, candidates: list[Request] | None = None,
                    protect: Request | None = None) -> Request | None:
        """The lowest-ranked running request (largest priority value, then latest arrival; under fcfs the
        latest arrival) that was not resumed in this step, other than `protect`."""
        resumed = step.resumed
        pool = candidates if candidates is not None else self.running
        best, best_key = None, None
        for r in pool:
            if r.request_id in resumed or r is protect:
                continue
            key = self.rank(r)
            if best is None or key >= best_key:
                best, best_key = r, key
        return best

    def use_swap(self, request: Request) -> bool:
        """Swap or recompute. auto: swap when the KV is larger than one step's token budget. Recomputing it
        would then take several steps of everyone's budget, while a swap costs two copies and no budget."""
        mode = self.config.preemption_mode
        if mode == "recompute" or request.num_computed_tokens == 0 or not self.kv.can_swap_out(request):
            return False
        return mode == "swap" or request.num_computed_tokens > self.config.max_num_batched_tokens

    def preempt(self, step: Step, victim: Request) -> None:
        self._unschedule(step, victim)
        self._remove_running(victim)
        out = step.out
        if self.use_swap(victim):
            out.blocks_to_swap_out.extend(self.kv.swap_out(victim))
            out.swapped_out_ids.append(victim.request_id)
            victim.status = SWAPPED
            victim.num_swaps += 1
            self.num_swaps += 1
            self.swapped.push(victim)
        else:
            # recompute: the KV goes, the tokens stay; full computed blocks remain findable in the cache
            self.kv.free(victim)
            victim.dropped_kv_tokens = victim.num_computed_tokens
            victim.num_computed_tokens = 0
            victim.status = WAITING
            out.preempted_ids.append(victim.request_id)
            self.waiting.push(victim)
        victim.preemption_times.append(step.now)
        step.preempted.add(victim.request_id)
        self.num_preemptions += 1

    def resume_swapped(self, step: Step, chunk: Callable[[Request], int]) -> None:
        """Swap requests back in, best-ranked first, while seats, budget and blocks allow."""
        max_seqs = self.config.max_num_seqs
        while self.swapped and len(self.running) < max_seqs:
            request = self.swapped.peek()
            if request.request_id in step.preempted:
                return
            # queued work that ranks first takes the seat; not under static, which admits only its batch's members
            if self.waiting and self.config.policy != "static" and self.queued_before(self.waiting.peek(), request,
                                                                                       step.now):
                return
            n = chunk(request)
            if n <= 0 or not self.kv.can_swap_in(request, n, self.reserve()):
                return
            self.swapped.pop()
            step.out.blocks_to_swap_in.extend(self.kv.swap_in(request, n))
            step.out.swapped_in_ids.append(request.request_id)
            request.status = RUNNING
            self.running.append(request)
            self._resumed(step, request)
            self.add_scheduled(step, request, n)

    def _resumed(self, step: Step, request: Request) -> None:
        step.resumed.add(request.request_id)
        request.slice_mark, request.slice_since = request.num_output_tokens, step.now  # a new residency

    def queued_before(self, a: Request, b: Request, now: float) -> bool:
        """Whether queued request a runs before queued request b (waiting vs swapped). Swapped requests come back
        first unless outranked; with time slices or fair share the whole rank decides (level, counter)."""
        if self.slicing or self.fair is not None:
            return self.rank(a) < self.rank(b)
        return self.by_priority and self.outranks(a, b, now)

    def outranks(self, a: Request, b: Request, now: float) -> bool:
        aging = self.config.priority_aging_s
        return effective_priority(a, now, aging) < effective_priority(b, now, aging)

    def admit_waiting(self, step: Step, chunk: Callable[[Request, int], int]) -> int:
        """Admit waiting requests best-ranked first while admit() succeeds; returns how many."""
        admitted = 0
        while self.waiting:
            request = self.waiting.peek()
            if self.swapped and not self.queued_before(request, self.swapped.peek(), step.now):
                break  # swapped requests resume before new admissions, unless outranked
            if not self.admit(step, request, chunk):
                break
            admitted += 1
        return admitted

    def admit(self, step: Step, request: Request, chunk: Callable[[Request, int], int]) -> bool:
        """Admit one waiting request: prefix lookup, chunk(request, tokens left to compute) tokens now
        (0: not now), blocks for them. Under the priority policy a request that cannot get memory or a seat
        preempts running requests it outranks."""
        kv, cfg = self.kv, self.config
        if request.request_id in step.preempted:
            return False
        seat_free = len(self.running) < cfg.max_num_seqs
        if not seat_free and not self.by_priority:
            return False
        cached = kv.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
        num_computed = len(cached) * self.block_size if cached else request.num_computed_tokens
        n = chunk(request, request.num_tokens - num_computed)
        if n <= 0:
            return False
        if not (seat_free and kv.can_allocate(request, n, cached, self.reserve())):
            if not (self.by_priority and self._preempt_for_admission(step, request, n, cached)):
                return False
        self.waiting.remove(request.request_id)
        kv.allocate(request, n, cached, self.reserve())
        kv.record_prefix_query(request.num_tokens, len(cached) * self.block_size)
        if request.dropped_kv_tokens:  # readmitted after a recompute preemption: what the cache does not give back
            self.num_recomputed_tokens += max(0, request.dropped_kv_tokens - num_computed)
            request.dropped_kv_tokens = 0
        request.status = RUNNING
        self.running.append(request)
        self._resumed(step, request)
        self.add_scheduled(step, request, n)
        return True

    def _preempt_for_admission(self, step: Step, request: Request, n: int, cached: list[int]) -> bool:
        """Preempt running requests the waiting `request` outranks, worst first, until it has a seat and its
        blocks. Does nothing unless preempting every outranked request would be enough."""
        kv = self.kv
        victims = [r for r in self.running
                   if r.request_id not in step.resumed and self.outranks(request, r, step.now)]
        if not victims:
            return False
        seats_short = len(self.running) - self.config.max_num_seqs + 1
        refs = kv.pool.ref_counts
        need = (cdiv(len(cached) * self.block_size + n, self.block_size) - len(cached)
                + sum(1 for b in cached if refs[b] == 0) + self.reserve() - kv.num_free_blocks)
        freeable = sum(1 for r in victims for b in kv.tables.get(r.request_id, ()) if refs[b] == 1)
        if seats_short > len(victims) or need > freeable:
            return False
        while victims:
            victim = self.pick_victim(step, victims)
            victims = [r for r in victims if r is not victim]
            self.preempt(step, victim)
            if len(self.running) < self.config.max_num_seqs and kv.can_allocate(request, n, cached, self.reserve()):
                return True
        return False

