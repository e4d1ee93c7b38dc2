"""The replica router's policies, without Ray."""
from __future__ import annotations

import pytest

from paceline.parallel.routing import Router


def system(topic: str) -> str:
    return f"You are a careful assistant who answers questions about {topic}. " * 3


def test_round_robin_and_least_outstanding() -> None:
    rr = Router(3, "round_robin")
    assert [rr.order({})[0] for _ in range(4)] == [0, 1, 2, 0]
    lo = Router(3, "least_outstanding")
    lo.outstanding[:] = [2, 0, 1]
    assert lo.order({}) == [1, 2, 0]


def test_prefix_policy_keeps_a_shared_prefix_on_one_replica() -> None:
    router = Router(2, "prefix")
    homes = {}
    for i in range(12):
        topic = ["chess", "tax law", "gardening"][i % 3]
        first = router.order({"prompt": system(topic) + f"Question {i}?"})[0]
        router.outstanding[first] += 1  # requests stay in flight: new prefixes go to the less busy replica
        assert homes.setdefault(topic, first) == first
    assert len(set(homes.values())) == 2  # the prefixes were spread, not all sent to one replica
    chat = {"messages": [{"role": "system", "content": system("chess")}, {"role": "user", "content": "a"}]}
    assert router.order(chat)[0] == router.order({**chat, "messages": chat["messages"][:1] + [
        {"role": "user", "content": "b"}]})[0]


def test_requests_sent_one_at_a_time_are_spread() -> None:
    lo = Router(2, "least_outstanding")
    assert [lo.order({})[0] for _ in range(4)] == [0, 1, 0, 1]
    router = Router(2, "prefix")
    homes = {topic: router.order({"prompt": system(topic) + "?"})[0] for topic in ("chess", "tax law", "poetry")}
    assert sorted(homes.values()) == [0, 0, 1]  # new prefixes alternate even with nothing in flight
    assert all(router.order({"prompt": system(t) + "again?"})[0] == home for t, home in homes.items())


def test_load_beats_affinity_and_dead_replicas_go_last() -> None:
    router = Router(2, "prefix", max_imbalance=2)
    body = {"prompt": system("poetry") + "?"}
    home = router.order(body)[0]
    router.outstanding[home] = 3
    assert router.order(body)[0] != home
    router.outstanding[home] = 0
    router.mark_down(home)
    assert router.order(body) == [1 - home, home]
    router.mark_up(home)
    assert router.order(body)[0] == home


def test_unknown_policy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router(2, "random")
