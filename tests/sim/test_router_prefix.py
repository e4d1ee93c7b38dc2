"""The simulator's router is the Ray Serve ingress's: the same policies and parameters, the same picks on the same
requests, and per-replica prefix caches (each replica's real scheduler) that reward keeping a conversation on one."""
from __future__ import annotations

import argparse
import random

import pytest

from paceline.config import CacheConfig, SchedulerConfig
from paceline.parallel.routing import Router as IngressRouter
from paceline.sim.router import ROUTERS
from paceline.sim.simulator import Simulator
from paceline.sim.workloads import SimRequest

BLOCK = 16


class ConstantCost:
    def step_time(self, s) -> float:
        return 0.01


def conversations(n: int, turns: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of `n` chats of `turns` turns, interleaved at random (each chat's turns in order): a shared
    8-token system prompt, then per turn a 40-token question; a 60-token reply sits between turns, so turn k+1's
    prompt starts with all of turn k's."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        prompt, turns_of_c = [1] * 8, []
        for _ in range(turns):
            prompt = prompt + [rng.randrange(100, 30000) for _ in range(40)]
            turns_of_c.append(prompt)
            prompt = prompt + [rng.randrange(100, 30000) for _ in range(60)]
        chats.append(turns_of_c)
    order = [c for c in range(n) for _ in range(turns)]
    rng.shuffle(order)
    nxt = [0] * n
    out = []
    for c in order:
        out.append(chats[c][nxt[c]])
        nxt[c] += 1
    return out


def simulate(prompts: list[list[int]], policy: str, gap_s: float, out_tokens, num_blocks: int = 256, **options):
    reqs = [SimRequest(i, gap_s * i, len(p), out_tokens(i), prompt=p) for i, p in enumerate(prompts)]
    sim = Simulator(ConstantCost(), SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096),
                    CacheConfig(block_size=BLOCK, num_blocks=num_blocks), num_blocks, num_replicas=2, router=policy,
                    router_options=options)
    return sim.run(reqs)


@pytest.mark.parametrize("policy", ["round_robin", "least_outstanding", "prefix"])
def test_the_simulator_picks_the_replica_the_ingress_router_picks(policy: str) -> None:
    # requests overlap (arrivals every 50 ms, 3..24 tokens out at 10 ms a step), so load matters to the choice
    prompts = conversations(8, 4)
    result = simulate(prompts, policy, 0.05, lambda i: 3 + (7 * i) % 22)
    assert all(r.ok for r in result.requests)
    # the same requests in the same order through the ingress's Router, as Ray Serve bodies with token-id prompts,
    # with the outstanding counts read off the simulated timeline (a request counts until it has finished)
    ingress = IngressRouter(2, policy)
    picks, busiest = [], 0
    for rec in result.requests:
        for r in range(2):
            ingress.outstanding[r] = sum(1 for o in result.requests[:rec.index]
                                         if o.replica == r and o.end_s > rec.sent_s)
        busiest = max(busiest, *ingress.outstanding)
        picks.append(ingress.order({"prompt": prompts[rec.index]})[0])
    assert picks == [r.replica for r in result.requests]
    assert busiest >= 2  # several in flight at once: the load-aware choices were exercised
    if policy != "round_robin":  # the policy changed something: not round-robin by another name
        assert picks != [i % 2 for i in range(len(picks))]


def test_prefix_routing_keeps_conversations_on_one_replica_and_hits_more() -> None:
    prompts = conversations(8, 4, seed=1)
    one_at_a_time = dict(gap_s=10.0, out_tokens=lambda i: 1)
    rates = {p: simulate(prompts, p, **one_at_a_time).prefix_cache_hit_rate for p in ROUTERS}
    prefix = simulate(prompts, "prefix", **one_at_a_time)
    home: dict[int, int] = {}
    for rec, p in zip(prefix.requests, prompts):
        assert home.setdefault(p[8], rec.replica) == rec.replica  # p[8]: the chat's first question token
    assert sorted(home.values()).count(0) == 4  # the 8 chats were spread 4 / 4
    assert rates["prefix"] > 1.3 * rates["round-robin"]
    assert rates["least-outstanding"] == rates["round-robin"]  # one at a time: every tie goes to the one given fewer


def test_min_match_fraction_reaches_the_simulated_router() -> None:
    # a chat's first turn is 48 of its second turn's 148 tokens (a third): followed at 0.3, not at 0.5, so at 0.5
    # some second turns land on the other replica and miss
    prompts = conversations(8, 2, seed=2)
    kw = dict(gap_s=10.0, out_tokens=lambda i: 1)
    followed = simulate(prompts, "prefix", min_match_fraction=0.3, **kw).prefix_cache_hits
    strict = simulate(prompts, "prefix", min_match_fraction=0.5, **kw).prefix_cache_hits
    assert followed == sum(BLOCK * 3 for _ in range(8))  # every second turn: the first turn's 3 full blocks
    assert strict < followed


def test_bad_router_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown router"):
        simulate(conversations(1, 1), "random", 1.0, lambda i: 1)
    with pytest.raises(ValueError, match="min_match_fraction"):
        simulate(conversations(1, 1), "prefix", 1.0, lambda i: 1, min_match_fraction=1.5)
    with pytest.raises(ValueError, match="prompt_len"):
        SimRequest(0, 0.0, 5, 1, prompt=[1, 2, 3])
    assert ROUTERS == ("round-robin", "least-outstanding", "prefix")
    simulate(conversations(2, 1), "least_outstanding", 1.0, lambda i: 1)  # the ingress's spelling works too


def test_cli_routes_by_prefix_and_reports_the_hit_rate(capsys) -> None:
    from paceline.sim.cli import add_parsers

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", "--workload", "chat", "--rate", "4", "--num-requests", "20", "--replicas", "2",
                              "--router", "prefix", "--router-min-match-fraction", "0.4", "--no-plots"])
    args.func(args)
    text = capsys.readouterr().out
    assert "20/20 requests finished" in text and "prefix-cache hit rate 0.0000" in text  # no prompt shares a block
