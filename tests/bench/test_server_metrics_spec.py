"""The benchmark report's speculation figures, from /metrics counters under paceline's or vLLM's prefix."""
from __future__ import annotations

from paceline.bench.server_metrics import parse_prometheus, speculation


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
