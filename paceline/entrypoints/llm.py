"""LLM(...).generate(...): offline batch generation over the same engine and scheduler the server uses."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from paceline.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, CacheConfig, EngineConfig, SchedulerConfig
from paceline.core.outputs import TokenLogprobs
from paceline.engine.pipelined import engine_for
from paceline.sampling import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprobs] | None


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then each one's TokenLogprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def _split_kwargs(kwargs: dict) -> EngineConfig:
    """Route flat keyword arguments (as vLLM's LLM takes them) to the config dataclass that owns each."""
    groups = {"cache": {}, "scheduler": {}, "engine": {}}
    owners = {f.name: "cache" for f in dataclasses.fields(CacheConfig)}
    owners |= {f.name: "scheduler" for f in dataclasses.fields(SchedulerConfig)}
    owners |= {f.name: "engine" for f in dataclasses.fields(EngineConfig) if f.name not in ("cache", "scheduler")}
    for key, value in kwargs.items():
        if key not in owners:
            raise ValueError(f"unknown LLM argument {key!r}")
        groups[owners[key]][key] = value
    return EngineConfig(cache=CacheConfig(**groups["cache"]), scheduler=SchedulerConfig(**groups["scheduler"]),
                        **groups["engine"])


Prompt = str | list[int] | dict


def prompt_from_dict(prompt: dict) -> str | list[int]:
    """vLLM's prompt dicts: {"prompt": "text"} (TextPrompt) or {"prompt_token_ids": [...]} (TokensPrompt)."""
    keys = set(prompt)
    if keys == {"prompt"}:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise ValueError(f'"prompt" must be a string, got {type(text).__name__}')
        return text
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f'"prompt_token_ids" must be a list of token ids, got {type(ids).__name__}')
        return list(ids)  # the engine checks each id against the vocabulary
    if not keys:
        raise ValueError('a prompt dict needs "prompt" (text) or "prompt_token_ids" (a list of ids)')
    if {"prompt", "prompt_token_ids"} <= keys:
        raise ValueError('a prompt dict takes "prompt" or "prompt_token_ids", not both')
    extra = sorted(keys - {"prompt", "prompt_token_ids"})
    raise ValueError(f"unsupported prompt dict key(s) {', '.join(map(repr, extra))}; "
                     'a prompt dict takes "prompt" (text) or "prompt_token_ids" (a list of ids)')


def offline_defaults(kwargs: dict) -> dict:
    """An LLM's keywords with the offline defaults filled in: nobody reads tokens as they come, so no TBT goal (and
    no start-up profile) unless asked for, and then a step budget for throughput, not for token gaps
    (config.OFFLINE_MAX_NUM_BATCHED_TOKENS); with a TBT goal, the server's budget."""
    out = {"tbt_goal_ms": 0.0, **kwargs}
    if not out["tbt_goal_ms"]:
        out.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
    return out


class LLM:
    """`LLM(model=None, dtype="auto", max_num_batched_tokens=..., scheduler=..., ...)`; keywords as in config.py."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        if "scheduler" in kwargs:  # the CLI's name for SchedulerConfig.policy
            kwargs["policy"] = kwargs.pop("scheduler")
        self.engine = engine_for(_split_kwargs({"model": model, **offline_defaults(kwargs)}))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             priority: int | list[int] = 0) -> list[GenerationOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate([self.tokenizer.encode(p, add_special_tokens=False) for p in prompts],
                             sampling_params, priority)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: int | list[int] = 0) -> list[GenerationOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts. A prompt is text, a list
        of token ids, or one of vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": [ids]}."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts must not be empty")
        prompts = [prompt_from_dict(p) if isinstance(p, dict) else p for p in prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        priorities = priority if isinstance(priority, list) else [priority] * len(prompts)
        if len(params) != len(prompts) or len(priorities) != len(prompts):
            raise ValueError("sampling_params and priority lists must be as long as prompts")

        results: list[GenerationOutput] = []
        pending: dict[str, tuple[GenerationOutput, int]] = {}
        try:
            for prompt, sp, prio in zip(prompts, params, priorities):
                sp = sp or SamplingParams()
                rid = str(next(self._ids))
                gen = GenerationOutput(rid, prompt if isinstance(prompt, str) else None, [], [], 0)
                results.append(gen)
                for i in range(sp.n):
                    # each of n samples is its own request; seeds differ so samples differ, reproducibly
                    sub = dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i,
                                          structured=sp.structured.copy() if sp.structured is not None else None)
                    request = self.engine.add_request(f"{rid}-{i}", prompt, sub, priority=prio)
                    gen.prompt_token_ids = request.prompt_token_ids
                    gen.outputs.append(CompletionOutput(i, "", [], None, None, [] if sub.logprobs is not None else None))
                    pending[request.request_id] = (gen, i)
            while pending:
                for out in self.engine.step():
                    gen, i = pending[out.request_id]
                    completion = gen.outputs[i]
                    completion.text = out.text
                    completion.token_ids.extend(out.new_token_ids)
                    if completion.logprobs is not None:
                        completion.logprobs.extend(out.new_logprobs)
                    if out.finished:
                        completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
                        if out.request.sampling_params.prompt_logprobs is not None and i == 0:
                            gen.prompt_logprobs = [None, *out.request.prompt_logprobs]
                        gen.num_cached_tokens = max(gen.num_cached_tokens, out.num_cached_tokens)
                        del pending[out.request_id]
        finally:
            for rid in list(pending):
                self.engine.abort(rid)
            if pending:
                self.engine.step()
        return results
