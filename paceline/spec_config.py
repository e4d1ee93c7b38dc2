"""SpeculativeConfig: `--speculative-config` as vLLM spells it, validated once.

Methods: "ngram" (prompt lookup over the request's own tokens) and "draft_model" (a smaller or cheaper checkpoint
that shares the tokenizer proposes greedily; `model` defaults to the target's own checkpoint, so that
`{"method": "draft_model", "quantization": "int4"}` drafts a float32 target with its own weights in int4).
`adaptive` (paceline's, default on) lets each step pick k per request from 0 to num_speculative_tokens
(core/spec_adaptive.py); false verifies every proposal the limits allow, as vLLM does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
DRAFT_QUANTIZATIONS = (None, "none", "int4")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: the most tokens proposed for one request in one step
    prompt_lookup_max: int = 4  # the longest suffix n-gram looked up in the request's own tokens
    prompt_lookup_min: int = 1  # the shortest; below it nothing is proposed
    adaptive: bool = True  # pick k per request per step from acceptance and the step-time model; False: always k
    model: str | None = None  # draft_model: the draft checkpoint (None: the target's own)
    quantization: str | None = None  # draft_model: "int4" holds the draft's layers as 4-bit codes (bfloat16)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"draft quantization must be none or int4, got {self.quantization!r}")
        if self.method != "draft_model" and (self.model is not None or self.quantization is not None):
            raise ValueError("model and quantization apply to method 'draft_model' only")

    @classmethod
    def parse(cls, text: str | dict | None) -> SpeculativeConfig | None:
        """From the flag's JSON (or an already parsed dict); None or empty: no speculation."""
        if text is None or text == "" or text == {}:
            return None
        if isinstance(text, str):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        else:
            data = dict(text)
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown speculative-config keys: {', '.join(unknown)}")
        if "model" in data and "method" not in data:  # vLLM infers the method from a draft model
            data["method"] = "draft_model"
        return cls(**data)
