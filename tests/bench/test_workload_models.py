"""A workload that gives each request a model, and the client sending each to its model (and its server)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # fake_server

import pytest
from fake_server import FakeServer

from paceline.bench.client import Endpoint, run
from paceline.bench.workload import generate, spec_from_dict

MIX = {"arrival": {"kind": "poisson"}, "prompt_tokens": {"kind": "fixed", "value": 4},
       "output_tokens": {"kind": "fixed", "value": 3},
       "models": [{"name": "a", "fraction": 0.75}, {"name": "b", "fraction": 0.25}]}


def test_a_model_mix_is_drawn_apart_from_arrivals_and_lengths():
    mixed = generate(spec_from_dict(MIX), rate=5.0, num_requests=400, seed=3)
    plain = generate(spec_from_dict({k: v for k, v in MIX.items() if k != "models"}), rate=5.0, num_requests=400,
                     seed=3)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in mixed] == \
           [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in plain]
    assert {r.model for r in plain} == {None}
    share_a = sum(r.model == "a" for r in mixed) / len(mixed)
    assert 0.68 < share_a < 0.82
    assert [r.model for r in mixed] == [r.model for r in generate(spec_from_dict(MIX), rate=5.0, num_requests=400,
                                                                  seed=3)]
    with pytest.raises(ValueError, match="sum to 1"):
        spec_from_dict({**MIX, "models": [{"name": "a", "fraction": 0.5}]})


def test_each_request_goes_to_its_model_and_its_server():
    with FakeServer(ttft=0.01, gap=0.01) as one, FakeServer(ttft=0.01, gap=0.01) as other:
        reqs = generate(spec_from_dict(MIX), rate=50.0, num_requests=12, seed=1)
        res = run(Endpoint(one.url, model_urls={"b": other.url}), reqs, [[1] * 4] * len(reqs), progress=False,
                  scrape_interval=None)
        assert all(r.ok for r in res.records) and [r.model for r in res.records] == [r.model for r in reqs]
        assert sorted(b["model"] for b in one.seen) == sorted(r.model for r in reqs if r.model == "a")
        assert [b["model"] for b in other.seen] == [r.model for r in reqs if r.model == "b"]
