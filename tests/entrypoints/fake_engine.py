"""A tiny stand-in for paceline.engine.engine.Engine: same surface, characters as tokens, no model.
Each step gives every running request one token; the token is a letter chosen by the request's seed and position."""
from __future__ import annotations

import time
from types import SimpleNamespace

from paceline.config import EngineConfig, SchedulerConfig
from paceline.core.outputs import TokenLogprobs
from paceline.engine.engine import RequestOutput as FakeOutput, StepStats  # the real contract, so the fake cannot drift
from paceline.request import Request, RequestStatus
from paceline.sampling import SamplingParams


class FakeTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i or not skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    def __init__(self, max_num_seqs: int = 8, max_waiting_requests: int = 0, step_s: float = 0.002,
                 max_model_len: int = 256) -> None:
        self.config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                                             max_waiting_requests=max_waiting_requests))
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.block_size, self.num_blocks = 4, 1024
        self.arch = SimpleNamespace(vocab_size=256)
        self.step_s = step_s
        self.fail_next_step = False
        self.extra_waiting = 0  # pretend this many more requests wait (to fill the queue without timing games)
        self.last_step: StepStats | None = None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.aborted: list[Request] = []
        self.texts: dict[str, str] = {}
        # tokens whose text comes only with the next token (as an incomplete UTF-8 sequence's does)
        self.hold_back: set[int] = set()
        self._held: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, client_id: str = "") -> Request:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if any(r.request_id == request_id for r in self.waiting + self.running):
            raise ValueError(f"request id {request_id!r} is already in use")
        room = self.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                             f"{self.max_model_len}")
        params.max_tokens = max_tokens
        req = Request(request_id, ids, params, arrival_time or time.monotonic(), priority=priority, eos_token_id=0,
                      client_id=client_id)
        self.waiting.append(req)
        self.texts[request_id] = ""
        return req

    def abort(self, request_id: str) -> None:
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.request_id == request_id:
                    queue.remove(r)
                    r.status, r.finish_reason, r.finish_time = RequestStatus.FINISHED, "abort", time.monotonic()
                    self.aborted.append(r)
                    return

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.aborted)

    def stats(self) -> SimpleNamespace:
        used = sum(-(-r.num_tokens // self.block_size) for r in self.running)
        return SimpleNamespace(num_running=len(self.running), num_waiting=len(self.waiting) + self.extra_waiting, num_swapped=0,
                               num_blocks=self.num_blocks, num_used_blocks=used, kv_usage=used / self.num_blocks,
                               prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)

    def _output(self, r: Request, new: list[int], new_text: str, logprobs: list) -> FakeOutput:
        self.texts[r.request_id] += new_text
        text = self.texts[r.request_id]
        if r.is_finished:
            del self.texts[r.request_id]
        return FakeOutput(r.request_id, new, new_text, text, r.is_finished, r.finish_reason, r.stop_reason, logprobs,
                          r.num_prompt_tokens, r.num_output_tokens, 0, r)

    def step(self) -> list[FakeOutput]:
        outputs = [self._output(r, [], "", []) for r in self.aborted]
        self.aborted.clear()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("simulated device failure")
        while self.waiting and len(self.running) < self.config.scheduler.max_num_seqs:
            r = self.waiting.pop(0)
            r.status, r.first_scheduled_time = RequestStatus.RUNNING, time.monotonic()
            self.running.append(r)
        if not self.running:
            self.last_step = None
            return outputs
        time.sleep(self.step_s)
        now = time.monotonic()
        num_prefill = sum(r.num_prompt_tokens for r in self.running if r.num_output_tokens == 0)
        self.last_step = StepStats(len(self.running) - sum(1 for r in self.running if r.num_output_tokens == 0),
                                   num_prefill, len(self.running), self.step_s)
        for r in list(self.running):
            sp = r.sampling_params
            if sp.prompt_logprobs is not None and r.num_output_tokens == 0:  # the prompt "ran": -1 each, rank 1
                r.prompt_logprobs = [TokenLogprobs(-1.0, [(t, -1.0)][:sp.prompt_logprobs], rank=1)
                                     for t in r.prompt_token_ids[1:]]
            tok = ord("a") + ((sp.seed or 0) + r.num_output_tokens) % 26
            r.append_token(tok, now)
            new_text = self._held.pop(r.request_id, "") + chr(tok)
            reason = r.check_stop()
            if tok in self.hold_back and not reason:
                self._held[r.request_id], new_text = new_text, ""
            text = self.texts[r.request_id] + new_text
            stop = next((s for s in sp.stop if s in text), None)
            if stop is not None:
                new_text = new_text if sp.include_stop_str_in_output else ""  # single-character stops only
                reason, r.stop_reason = "stop", stop
            if reason:
                r.status, r.finish_reason, r.finish_time = RequestStatus.FINISHED, reason, now
                self.running.remove(r)
            lp = [TokenLogprobs(-0.5, [(tok, -0.5), (tok + 1, -1.5)][:sp.logprobs + 1])] if sp.logprobs is not None else []
            outputs.append(self._output(r, [tok], new_text, lp))
        return outputs
