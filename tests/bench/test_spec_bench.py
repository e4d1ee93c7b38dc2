"""The speculation workload (quote prompts) and the report's speculation figures, from /metrics counters under
paceline's or vLLM's prefix."""
from __future__ import annotations

from paceline.bench.prompts import QUOTE_RESTART, PromptSource, build_prompts
from paceline.bench.server_metrics import parse_prometheus, speculation
from paceline.bench.workload import generate, load_workload


class _Chars:  # a tokenizer of one token per character
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def test_quote_prompts_end_with_the_start_of_their_own_passage() -> None:
    spec = load_workload("quote")
    assert spec.prompt_style == "quote" and 0 < spec.spec_acceptance <= 1
    reqs = generate(spec, rate=1.0, num_requests=5, seed=1)
    source = PromptSource(_Chars(), "".join(chr(97 + i % 26) + str(i) for i in range(3000)))
    for r, ids in zip(reqs, build_prompts(source, reqs, 1, as_text=False, style="quote")):
        assert len(ids) == r.prompt_tokens
        passage = ids[:r.prompt_tokens - QUOTE_RESTART - 2]
        assert ids[-QUOTE_RESTART - 2:] == [10, 10] + passage[:QUOTE_RESTART]
    plain = build_prompts(source, reqs, 1, as_text=False)
    assert [len(p) for p in plain] == [r.prompt_tokens for r in reqs]


def test_acceptance_and_mean_length_from_either_prefix() -> None:
    for prefix in ("paceline:", "vllm:"):
        before = parse_prometheus(f'{prefix}spec_decode_num_drafts_total{{model_name="m"}} 2\n'
                                  f'{prefix}spec_decode_num_draft_tokens_total{{model_name="m"}} 8\n'
                                  f'{prefix}spec_decode_num_accepted_tokens_total{{model_name="m"}} 4\n')
        after = parse_prometheus(f'{prefix}spec_decode_num_drafts_total{{model_name="m"}} 12\n'
                                 f'{prefix}spec_decode_num_draft_tokens_total{{model_name="m"}} 48\n'
                                 f'{prefix}spec_decode_num_accepted_tokens_total{{model_name="m"}} 34\n')
        s = speculation(before, after)
        assert s == {"draft_tokens": 40, "accepted_tokens": 30, "acceptance_rate": 0.75, "mean_accepted_length": 3.0}
    assert speculation({}, {}) is None
