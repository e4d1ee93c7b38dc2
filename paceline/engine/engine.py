"""Engine: one schedule → execute → update round per step, and the text each request streams."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generator
from pathlib import Path

import torch

from paceline.config import EngineConfig
from paceline.core.batch_shape import batch_shape
from paceline.core.outputs import SchedulerOutput, StepResult, TokenLogprobs
from paceline.core.scheduler import Scheduler
from paceline.engine.faults import run_isolated
from paceline.engine.prefault import paced_by
from paceline.engine.runner import ModelRunner
from paceline.model import (amx_attention_kernel, attention_kernel, f32_rows_kernel, int4_amx_kernel, layer_loop, llama,
                            q8_kernel, w4a8_kernel)
from paceline.model.llama import drain
from paceline.model.loader import DTYPES, build_model, cache_root, default_model_path, load_checkpoint, piece_break
from paceline.model.tokenizer import IncrementalDetokenizer, StopStringMatcher
from paceline.parallel.executor import build_runner, parallel_bytes_per_block
from paceline.request import Request
from paceline.sampling import SamplingParams
from paceline.spec_config import SpeculativeConfig

log = logging.getLogger("paceline")


@dataclass
class RequestOutput:
    """One request's delta after a step."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    new_logprobs: list[TokenLogprobs]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    request: Request
    error: str | None = None  # the request failed inside the engine (finish_reason "error"); the others went on


# under max_step_ms the engine tracks this quantile of measured / predicted step time, not its mean: on a shared
# machine one batch shape's p99 step time is 18-47 % above its median, and the TBT SLO is judged on the tail
STEP_TIME_QUANTILE = 0.98
# the quantile that sizes a step with prompts queued behind its chunk (Scheduler.queued_step_time_scale): an
# overloaded server spends the TBT goal's headroom on throughput, a step over the target still well inside the goal
QUEUED_STEP_TIME_QUANTILE = 0.9
QUEUED_SCALE_ON = os.environ.get("PACELINE_QUEUED_SCALE", "1") != "0"  # 0: every step by STEP_TIME_QUANTILE (A/B)
STEP_TIME_RATE = 0.05  # log-step of the quantile tracker: a step over the scale raises it 5 %, one under lowers it 0.1 %


def track_quantile(estimate: float, sample: float, quantile: float = STEP_TIME_QUANTILE,
                   rate: float = STEP_TIME_RATE) -> float:
    """One step of stochastic quantile tracking in log space: settles where `quantile` of the samples lie below.
    A sample's size does not matter, only its side, so one wild step moves the estimate no more than any other."""
    above = 1.0 if sample > estimate else 0.0
    return min(4.0, max(0.25, estimate * math.exp(rate * (above - (1.0 - quantile)))))


@dataclass
class StepStats:
    num_decode_tokens: int
    num_prefill_tokens: int
    num_requests: int
    duration: float
    num_preempted: int = 0
    num_swapped_out: int = 0
    predicted_s: float = 0.0  # the step-time model's prediction as max_step_ms judged it (scaled); 0 without a limit


@dataclass
class _TextState:
    """Detokenizer and stop-string matcher of one request; what has been handed out so far."""
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    num_emitted_tokens: int = 0
    text: str = ""
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def is_4bit_gguf(model: str | None) -> bool:
    """A GGUF whose layers are stored as Q4_0/Q4_1 codes (the header says so): int4 holds them exactly as stored."""
    from paceline.model.loader import read_gguf

    path = model if model is not None else default_model_path()
    if not str(path).endswith(".gguf"):
        return False
    try:
        metadata, _ = read_gguf(path)
    except Exception:  # not readable as GGUF: the loader will say why
        return False
    return metadata.get("general.file_type") in (2, 3)  # LLAMA_FTYPE_MOSTLY_Q4_0, _Q4_1


def numeric_mode(model: str | None, device: torch.device, dtype: str, quantization: str) -> tuple[str, str]:
    """Resolve "auto": the fastest mode that keeps the file's quality (benchmarks/summaries/quality.md). On CPU a
    4-bit GGUF runs int4 (its own codes, bfloat16 activations); anything else runs bfloat16. fp32 is only ever
    asked for by name: it is the reference the exactness tests hold to."""
    if quantization == "auto":
        quantization = "int4" if device.type == "cpu" and dtype in ("auto", "bfloat16") and is_4bit_gguf(model) else "none"
    if dtype == "auto":
        dtype = "bfloat16"
    return dtype, quantization


PROFILE_CACHE_MAX_ERROR = 0.3  # a quick profile fitting its own shapes worse than this is not kept on disk

class Engine:
    def __init__(self, config: EngineConfig | None = None, speculative_config: SpeculativeConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        # speculative decoding: the argument, else the config's field once EngineConfig has one (a JSON string or dict)
        spec = speculative_config or getattr(config, "speculative_config", None)
        self.speculative_config = spec if isinstance(spec, SpeculativeConfig) or spec is None else SpeculativeConfig.parse(spec)
        t0 = time.perf_counter()
        self.device = resolve_device(config.device)
        config.dtype, config.quantization = numeric_mode(config.model, self.device, config.dtype, config.quantization)
        dtype = DTYPES[config.dtype]
        quantized = config.quantization != "none"
        if quantized and self.device.type != "cpu":
            raise ValueError(f"{config.quantization} quantization runs on CPU only; this engine's device is {self.device}")
        # int4 quantizes from float32 weights, so a Q4_1 GGUF's own codes come back before any rounding
        ckpt = load_checkpoint(config.model, "float32" if quantized else config.dtype)
        piece_break()  # a load on demand lets the other models step here (engine/residency.py)
        self.arch = ckpt.arch
        self.tokenizer = ckpt.tokenizer
        self.model_name = config.served_model_name or ckpt.name
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size

        cache = config.cache
        self.block_size = cache.block_size
        # the KV memory is per process: with several ranks, each holds only its KV heads (TP) or layers (PP)
        block_bytes = (parallel_bytes_per_block(self.arch, cache.block_size, dtype, tp, pp) if tp * pp > 1
                       else ModelRunner.bytes_per_block(self.arch, cache.block_size, dtype))
        self.num_blocks = cache.num_blocks or max(1, int(cache.kv_cache_memory_gb * 2**30 // block_bytes))
        self.num_host_blocks = int(cache.swap_space_gb * 2**30 // block_bytes)
        self.max_model_len = min(config.scheduler.max_model_len, self.arch.max_position_embeddings)
        config.scheduler.max_model_len = self.max_model_len
        # set while this engine has nothing to run: only then does its KV pool's prefault populate (_pace_prefault)
        self.prefault_go = threading.Event()
        self.prefault_go.set()
        with paced_by(self.prefault_go):
            if tp * pp > 1:
                # the scheduler stays here; the workers load their own part of the checkpoint and only execute
                self.runner = build_runner(ckpt.arch, ckpt.weights, model=config.model, dtype=config.dtype,
                                           quantization=config.quantization, device=self.device,
                                           num_blocks=self.num_blocks, block_size=cache.block_size,
                                           num_host_blocks=self.num_host_blocks, seed=config.seed,
                                           tensor_parallel_size=tp, pipeline_parallel_size=pp)
            else:
                # from the GGUF's runtime snapshot when there is one: no conversion, the tensors mapped (loader.py)
                model = build_model(ckpt, config.model, config.dtype, config.quantization, config.wide_linears,
                                    self.device)
                piece_break()
                self.runner = ModelRunner(model, self.arch, self.num_blocks, cache.block_size,
                                          num_host_blocks=self.num_host_blocks, device=self.device, dtype=dtype,
                                          seed=config.seed)
        del ckpt
        piece_break()
        self.live_step_time = None  # the step-time model refitted to measured steps (core/step_time.LiveStepTime)
        self.scheduler = Scheduler(config.scheduler, cache, self.num_blocks, self.num_host_blocks,
                                   step_time=self._step_time_model(), speculative=self.speculative_config)
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            from paceline.engine.spec_draft import load_drafter
            load_drafter(self)
        self._text: dict[str, _TextState] = {}
        self._aborted: list[Request] = []
        self.last_step: StepStats | None = None
        # steps teach the live step-time refit and the scale; off while they run on fewer threads than the model
        # was profiled on (multi.py's lanes), whose times would teach it the wrong machine
        self.learn_steps = True
        log.info("model %s loaded in %.2f s on %s (%s, quantization %s); KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB); "
                 "token budget %d per step, at most %d requests; scheduler %s/%s",
                 self.model_name, time.perf_counter() - t0, self.device, config.dtype, config.quantization,
                 self.num_blocks,
                 self.block_size, self.num_blocks * self.block_size, self.num_blocks * block_bytes / 2**30,
                 config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                 config.scheduler.policy, config.scheduler.scheduling_policy)

    def _step_time_model(self):
        """What the scheduler predicts step times with under max_step_ms: the given profile, else a quick one
        of this engine's own runner (the same kernels, dtype and threads that will serve)."""
        spec = self.speculative_config
        if self.config.scheduler.max_step_ms <= 0 and not (spec is not None and spec.adaptive):
            return None  # adaptive speculation weighs a proposal's cost with the same model
        model = self._profiled_model()
        if model is None:
            return None
        from paceline.core.step_time import LiveStepTime
        self.live_step_time = LiveStepTime(model)
        return self.live_step_time.step_time

    def _profiled_model(self):
        """The profile file, the cached start-up profile of this setup, or a fresh quick one."""
        from paceline.core.step_time import ProfiledCostModel
        from paceline.engine.profile import quick_step_time_model

        if self.config.step_profile:
            return ProfiledCostModel.load(self.config.step_profile)
        t0 = time.perf_counter()
        cached = self._profile_cache_path()
        if cached.exists():
            try:
                model = ProfiledCostModel.load(cached)
                log.info("step-time profile for max_step_ms=%g read from %s", self.config.scheduler.max_step_ms, cached)
                return model
            except (OSError, ValueError, KeyError) as e:  # a torn or old file: profile again
                log.warning("ignoring the cached step-time profile %s: %s", cached, e)
        self.prefault_go.clear()  # the profile's timings must not share the cores with the prefault either
        try:
            model = quick_step_time_model(self.runner, self.arch.vocab_size, self.block_size, self.num_blocks,
                                          self.max_model_len, self.tokenizer)
        except ValueError as e:
            if self.config.scheduler.max_step_ms_given and self.config.scheduler.max_step_ms > 0:
                raise
            # the default target (from tbt_goal_ms) must not stop a small engine from starting: it serves without
            log.warning("no step-time target (the default from tbt_goal_ms=%g): %s", self.config.tbt_goal_ms, e)
            self.config.scheduler.max_step_ms = 0.0
            return None
        finally:
            self.prefault_go.set()
        error = model.meta["median_rel_error"]
        log.info("step-time profile for max_step_ms=%g taken in %.1f s (median error %.0f %%)",
                 self.config.scheduler.max_step_ms, time.perf_counter() - t0, 100 * error)
        if error > PROFILE_CACHE_MAX_ERROR:
            # a profile taken while other work shared the cores (seen 2026-11-23: a constant 117 ms, 70 % median
            # error) would price every later server's steps from the cache; this one serves, refitted live
            log.warning("the step-time profile's median error is %.0f %% (a busy machine?): not cached", 100 * error)
            return model
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            model.save(tmp)
            os.replace(tmp, cached)  # atomic: a server starting beside this one reads all of it or nothing
        except OSError as e:
            log.warning("could not cache the step-time profile at %s: %s", cached, e)
        return model

    def _profile_cache_path(self) -> Path:
        """Where the start-up profile of this exact setup is kept, so a warm start skips the ~10-30 s it takes: the
        model file, numeric mode, cache shape, threads, torch and the kernels' source all go into the key. A machine
        that drifts after it was taken is what the engine's measured / predicted tracking corrects."""
        model = Path(self.config.model or default_model_path())
        stat = model.stat()
        sources = sorted((Path(__file__).resolve().parents[1]).glob("model/*.py")) + [
            Path(__file__).with_name("runner.py"), Path(__file__).resolve().parents[1] / "sim" / "profile.py"]
        h = hashlib.sha256()
        for part in (str(model.resolve()), stat.st_size, stat.st_mtime_ns, self.config.dtype, self.config.quantization,
                     self.config.wide_linears, self.device, self.block_size, self.num_blocks, self.max_model_len, torch.__version__,
                     torch.get_num_threads(), platform.processor(), os.cpu_count(),
                     # the kernels' switches read from the environment (what an int4 model's steps run, and which
                     # build of the w4a8 and attention ops: an AVX2 build's steps cost more than an AVX-512 one's)
                     ":".join(llama.w4a8_linears()), llama.int4_wide_choice(), w4a8_kernel.build_key(),
                     llama.int4_bf16_from_rows(),
                     attention_kernel.isa(), llama.w8a8_build(), q8_kernel.build_key(), layer_loop.enabled(),
                     int4_amx_kernel.supported(), amx_attention_kernel.supported(), f32_rows_kernel.build_key(),
                     llama.F32_CODES):
            h.update(f"{part}\0".encode())
        for src in sources:
            if src.exists():
                h.update(src.read_bytes())
        return cache_root() / "step-profiles" / f"{h.hexdigest()[:24]}.json"

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.arch.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, client_id: str = "") -> Request:
        if request_id in self._text:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenize_prompt(prompt)
        # a request must fit in the context and, whole, in the KV cache, or it could never finish
        context = min(self.max_model_len, self.num_blocks * self.block_size)
        room = context - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, which leaves no room for output in the "
                             f"context length {context}")
        if params.max_tokens is None:
            # a copy: the caller may share one SamplingParams across prompts of different lengths
            params = dataclasses.replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(prompt_ids) + params.max_tokens} exceeds the context length {context}")
        if params.prompt_logprobs is not None and self.config.pipeline_parallel_size > 1:
            raise ValueError("prompt_logprobs is not supported with pipeline parallelism (the last stage returns "
                             "the logits of sampled positions only)")
        if params.min_tokens > params.max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})")
        request = Request(request_id, prompt_ids, params, time.monotonic() if arrival_time is None else arrival_time,
                          priority=priority, eos_token_id=self.eos_token_id, client_id=client_id,
                          # prompt logprobs need every prompt position computed: no prefix-cache hits from others
                          cache_salt=f"prompt-logprobs:{request_id}" if params.prompt_logprobs is not None else None)
        self._text[request_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens),
            StopStringMatcher(params.stop, include_stop_str_in_output=params.include_stop_str_in_output))
        self.scheduler.add_request(request)
        self.prefault_go.clear()  # the next step runs this request: the prefault waits
        return request

    def abort(self, request_id: str) -> None:
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self._aborted.append(request)
        self._pace_prefault()

    def has_unfinished(self) -> bool:
        return bool(self._aborted) or self.scheduler.has_unfinished()

    def stats(self):
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        return drain(self.step_iter())

    def step_iter(self, sliced: bool = False,
                  execute: Callable[[SchedulerOutput], Generator[None, None, StepResult]] | None = None
                  ) -> Generator[None, None, list[RequestOutput]]:
        """step; with `sliced`, suspended between two layers of the model (a bare `yield`, from
        ModelRunner.execute_iter), so that the loop of several models (engine/multi.py) can run another model's
        step in between. Unsliced (step), the runner's plain execute runs: the single-model path, the
        tensor- and pipeline-parallel runners and the fault injector's hooks see exactly what they always saw.
        `execute`: the forward runs elsewhere (multi.py's lanes: on a worker thread while this one waits), a
        generator that yields until the result is in; scheduling and the update stay on the calling thread."""
        outputs = self._drain_aborted()
        sched_out = self.scheduler.schedule(time.monotonic())
        if sched_out.is_empty:
            self._pace_prefault()
            self.last_step = None
            return outputs
        # composition is read before update(): afterwards a decode's request already holds its new token
        num_decode = sched_out.num_decode_tokens
        num_prefill = sched_out.num_batched_tokens - num_decode
        predicted = sched_out.predicted_step_s * self.scheduler.last_scale  # the scale moves after this step
        # what the refit learns from; read before update(), which moves the requests on
        shape = batch_shape(sched_out) if self.live_step_time is not None else None
        try:
            if execute is not None:
                result = yield from execute(sched_out)
            else:
                result = (yield from self.runner.execute_iter(sched_out)) if sliced else self.runner.execute(sched_out)
            failed: dict[str, str] = {}
        except Exception as e:  # one request's row may have done it: find it, fail it alone (engine/faults.py)
            result, failed = run_isolated(self.runner, sched_out, e)
        for rid, message in failed.items():
            outputs.append(self._error_output(rid, message))
        if not failed and self.learn_steps and not self._warming_up():
            if shape is not None:
                self.live_step_time.observe(shape, result.duration)
            if sched_out.predicted_step_s > 0 and num_prefill > 0:
                # only steps with a prompt chunk count: the limit sized those, and decode-only steps, predicted
                # differently well, would pull the scale toward their own error
                sched = self.scheduler
                ratio = result.duration / sched_out.predicted_step_s
                sched.step_time_scale = track_quantile(sched.step_time_scale, ratio)
                sched.queued_step_time_scale = (track_quantile(sched.queued_step_time_scale, ratio,
                                                               QUEUED_STEP_TIME_QUANTILE)
                                                if QUEUED_SCALE_ON else sched.step_time_scale)
        updated = self.scheduler.update(sched_out, result, time.monotonic())
        self._pace_prefault()
        self.last_step = StepStats(num_decode, num_prefill, len(sched_out.scheduled), result.duration,
                                   len(sched_out.preempted_ids), len(sched_out.swapped_out_ids), predicted)
        if result.prompt_logprobs:
            for s in sched_out.scheduled:
                got = result.prompt_logprobs.get(s.request.request_id)
                if got is not None:  # a recomputed (preempted) prompt adds only what was not recorded yet
                    start, lps = got
                    have = len(s.request.prompt_logprobs)
                    if start <= have:
                        s.request.prompt_logprobs.extend(lps[have - start:])
        return outputs + self._text_outputs(updated, result)

    def _drain_aborted(self) -> list[RequestOutput]:
        outputs = [self._final_output(r) for r in self._aborted]
        self._aborted.clear()
        return outputs

    def _text_outputs(self, updated: list[Request], result: StepResult) -> list[RequestOutput]:
        """The text delta of every request a step moved on, its sampled logprobs queued with it."""
        outputs = []
        for request in updated:
            if request.request_id in result.logprobs:
                self._text[request.request_id].pending_logprobs.append(result.logprobs[request.request_id])
            try:
                outputs.append(self._delta(request))
            except Exception as e:  # its detokenizer or stop strings: this request's fault, not the step's
                log.exception("request %s failed while turning tokens into text", request.request_id)
                outputs.append(self._error_output(request.request_id, f"{type(e).__name__}: {e}", request))
        return outputs

    def _pace_prefault(self) -> None:
        """Let the KV pool's prefault (engine/prefault.py) run only while this engine has no step to run: beside
        the steps it took a core and memory bandwidth from them, even at nice 19 (the 32-stream probe right after a
        start: 380.6 tok/s with it in flight, 449.2 without; its mixed steps 0.83-1.40x their prediction). The
        steps then fault the pages they first write themselves, which cost nothing measurable there."""
        if not self.has_unfinished():
            self.prefault_go.set()
        else:
            self.prefault_go.clear()

    def _warming_up(self) -> bool:
        """Whether the KV pool is still being made resident (engine/prefault.py): on a 2-core machine that thread
        takes a core from the step's two OpenMP threads. The first steps after a start ran 3-10x their later time
        on 2026-11-23 (the stall probe's 64-token steps 0.5-0.93 s, later ~0.09 s; which share of that this thread
        caused was not measured apart), and the scale rises 5 % per slow step but falls 0.1 % per fast one, so
        such a burst held the step-time target down for hundreds of steps. Those steps are not learned from. A
        prefault this engine paces does not run beside its steps, so their steps are learned from from the start
        (before pacing, a busy server's prefault ran for its first ~8 s and nothing was learned meanwhile)."""
        prefault = getattr(self.runner, "prefault", None)
        # a paced prefault (_pace_prefault) waits while steps run: at most the chunk it was in overlaps a step
        paced = getattr(prefault, "paced_by", None) is self.prefault_go
        return prefault is not None and prefault.is_alive() and not paced

    def _delta(self, request: Request) -> RequestOutput:
        state = self._text[request.request_id]
        new_ids = request.token_ids[request.num_prompt_tokens + state.num_emitted_tokens:]
        state.num_emitted_tokens += len(new_ids)
        # a stop token or EOS ends the text without being shown, as OpenAI servers do
        shown = new_ids
        if request.finish_reason == "stop" and not request.sampling_params.include_stop_str_in_output:
            shown = new_ids[:-1]
        new_text = ""
        for tok in shown:
            piece, stopped, stop_str = state.matcher.feed(state.detok.add(tok))
            new_text += piece
            if stopped:
                self.scheduler.finish_request(request.request_id, "stop", time.monotonic())
                request.stop_reason = stop_str
                break
        else:
            if request.is_finished:  # release what was held back as a possible stop string
                new_text += state.matcher.feed(state.detok.flush())[0] + state.matcher.flush()
        state.text += new_text
        logprobs, state.pending_logprobs = state.pending_logprobs, []
        if request.is_finished:
            del self._text[request.request_id]
        return RequestOutput(request.request_id, new_ids, new_text, state.text, request.is_finished,
                             request.finish_reason, request.stop_reason, logprobs, request.num_prompt_tokens,
                             request.num_output_tokens, request.num_cached_tokens, request)

    def _error_output(self, request_id: str, message: str, request: Request | None = None) -> RequestOutput:
        """End a request that failed inside the engine: its blocks are freed now, its stream gets the error."""
        request = request or self.scheduler.get_request(request_id)
        if self.scheduler.get_request(request_id) is not None:
            self.scheduler.finish_request(request_id, "error", time.monotonic())
        state = self._text.pop(request_id, None)
        if request is None:  # unknown here: nothing to free, still an answer for its stream
            request = Request(request_id, [0], SamplingParams(), time.monotonic())
        request.finish_reason = "error"
        return RequestOutput(request_id, [], "", state.text if state else "", True, "error", None, [],
                             request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens, request,
                             error=message)

    def _final_output(self, request: Request) -> RequestOutput:
        state = self._text.pop(request.request_id, None)
        text = state.text if state else ""
        return RequestOutput(request.request_id, [], "", text, True, request.finish_reason or "abort",
                             request.stop_reason, [], request.num_prompt_tokens, request.num_output_tokens,
                             request.num_cached_tokens, request)
