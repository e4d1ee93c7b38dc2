"""The replica router's policies, without Ray."""
from __future__ import annotations

import pytest

from paceline.parallel.routing import (Router, agent_rounds, chunk_keys, common_preamble_chats, multi_turn_chats,
                                       prompt_of)


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
    assert router.order(body) == [1 - home, home]  # the survivor takes it, and now caches it
    router.mark_up(home)
    assert router.order(body)[0] == 1 - home  # the restarted replica's cache (and index) is empty
    assert router.matched_chunks(home, chunk_keys(body["prompt"], router.chunk_chars)) == 0


def test_a_match_is_a_prefix_not_a_shared_chunk_elsewhere() -> None:
    router = Router(2, "prefix")
    a = "A" * 64 + "B" * 64
    router._remember(0, chunk_keys(a, 64))
    assert router.matched_chunks(0, chunk_keys(a + "C" * 64, 64)) == 2
    assert router.matched_chunks(0, chunk_keys("B" * 64 + "A" * 64, 64)) == 0  # same chunks, other order
    assert router.matched_chunks(0, chunk_keys("X" + a, 64)) == 0  # shifted by one character
    assert chunk_keys("A" * 63, 64) == []  # shorter than a chunk: nothing to follow


def test_longest_match_wins_and_an_overloaded_home_hands_over_to_the_next_match() -> None:
    router = Router(3, "prefix", max_imbalance=1)
    long = system("chess") + "Q?"
    short = long[:128] + "other"  # 2 of the 3 chunks of `long + " more"`: enough of the prompt to follow
    router._remember(0, chunk_keys(long, 64))
    router._remember(1, chunk_keys(short, 64))
    assert router.order({"prompt": long + " more"})[0] == 0
    router.outstanding[:] = [2, 0, 0]
    assert router.order({"prompt": long + " more"})[0] == 1  # the replica with a shorter match, not a stranger


def test_the_index_is_bounded_and_forgets_tails_first() -> None:
    router = Router(1, "prefix", capacity_chunks=4)
    first = chunk_keys("a" * 64 * 3, 64)
    router._remember(0, first)
    router._remember(0, chunk_keys("b" * 64 * 2, 64))
    assert len(router.index[0]) == 4
    assert router.matched_chunks(0, first) == 2  # its third chunk went, its start stayed


def test_new_prefixes_go_to_the_emptier_index() -> None:
    router = Router(2, "prefix")
    router._remember(0, chunk_keys("z" * 64 * 10, 64))
    assert router.order({"prompt": system("sailing")})[0] == 1
    assert Router(2, "round-robin").policy == "round_robin"  # the simulator's spelling


def test_a_preamble_every_prompt_shares_is_no_reason_to_follow() -> None:
    # every chat starts with the same JSON and system prompt (a whole 64-character chunk): following that match sent
    # every new conversation, sent one at a time, to the replica that saw the first one
    router = Router(2, "prefix")
    chats = common_preamble_chats(6, 2)
    homes: dict[str, int] = {}
    for chat in chats:
        first = router.order({"messages": chat})[0]
        assert homes.setdefault(chat[1]["content"][:40], first) == first  # a document's questions stay together
    assert sorted(homes.values()) == [0, 0, 0, 1, 1, 1]
    assert router.routed == [6, 6]


def test_unknown_policy_and_bad_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router(2, "random")
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="min_match_fraction"):
            Router(2, "prefix", min_match_fraction=bad)


def test_token_id_prompts_are_matched_by_kv_block() -> None:
    assert prompt_of({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_of({"prompt": [[5, 6], [7]]}) == "[[5, 6], [7]]"  # a batch of prompts: matched as text
    assert prompt_of({"prompt": "hi"}) == "hi"
    router = Router(2, "prefix")
    doc = list(range(100, 164))  # 4 blocks of 16
    home = router.order({"prompt": doc + [1, 2]})[0]
    assert router.order({"prompt": doc + [3] * 20})[0] == home  # 4 of 5 blocks match
    assert router.order({"prompt": [9] * 16 + doc})[0] != home  # shifted by a block: a new prefix, the other replica
    assert chunk_keys(doc, 16) == chunk_keys(doc + [1] * 15, 16) and len(chunk_keys(doc, 16)) == 4


def test_a_conversation_stays_on_one_replica_turn_after_turn() -> None:
    turns = multi_turn_chats(6, 4, seed=3)
    assert [c for c, _ in turns] != sorted(c for c, _ in turns)  # the chats interleave
    last: dict[int, list[dict]] = {}
    for c, messages in turns:  # each turn carries the chat so far: the last turn, its reply, a new question
        if c in last:
            assert messages[:len(last[c])] == last[c] and messages[len(last[c])]["role"] == "assistant"
        last[c] = messages
    assert sorted(map(str, multi_turn_chats(6, 4, seed=4))) == sorted(map(str, turns))  # another order, the same text
    moves = {}
    for fraction in (0.3, 0.5):
        router, where, turn_no, moved = Router(2, "prefix", min_match_fraction=fraction), {}, {}, []
        for c, messages in turns:
            r = router.order({"messages": messages})[0]
            turn_no[c] = turn_no.get(c, -1) + 1
            if c in where and where[c] != r:
                moved.append(turn_no[c])
            where[c] = r
        moves[fraction] = moved
    # from the third turn on the chat so far is most of the prompt: always followed. The second turn holds a short
    # first question and a long reply (the router indexes prompts, not replies): at 0.5 it often moves
    assert moves[0.3] == [1] and moves[0.5] == [1, 1, 1, 1]


def test_agent_rounds_send_every_prompt_once_a_round_in_a_fresh_order() -> None:
    prompts = agent_rounds(5, 3, seed=1)
    rounds = [prompts[i:i + 5] for i in range(0, 15, 5)]
    desks = [[p.split("(desk ")[1].split(")")[0] for p in r] for r in rounds]
    assert all(sorted(d) == ["0", "1", "2", "3", "4"] for d in desks)  # each agent once per round
    assert len({tuple(d) for d in desks}) > 1  # the order is drawn again each round
    assert all(p.endswith(f"Question {k}: name one fact.") for k, r in enumerate(rounds) for p in r)
