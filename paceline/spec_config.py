"""SpeculativeConfig: `--speculative-config` as vLLM spells it, validated once.

Only the n-gram (prompt lookup) method is implemented; "draft_model" is recognised and refused with a plain message.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram",)


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: the most tokens proposed for one request in one step
    prompt_lookup_max: int = 4  # the longest suffix n-gram looked up in the request's own tokens
    prompt_lookup_min: int = 1  # the shortest; below it nothing is proposed

    def __post_init__(self) -> None:
        if self.method == "draft_model":
            raise ValueError("speculative method 'draft_model' is not implemented yet; use 'ngram'")
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

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
        unknown = sorted(set(data) - known - {"model"})
        if unknown:
            raise ValueError(f"unknown speculative-config keys: {', '.join(unknown)}")
        if data.get("method") == "draft_model" or "model" in data:
            raise ValueError("speculative method 'draft_model' is not implemented yet; use 'ngram'")
        return cls(**data)
