"""defer_prompt_s (set by several models' loop while another model streams): a step whose decodes alone fill the
step-time target gives a young prompt no chunk instead of the one-block floor; an older one gets its block.
hold_prompts (set while another model loads or debuts): no prompt gets a chunk beside decodes, whatever its age."""
from __future__ import annotations

from sched_util import make_request, make_scheduler, step

from paceline.core.batch_shape import BatchShape


def linear_model(s: BatchShape) -> float:
    """10 ms a step, 1 ms a prompt token, 2 ms a decode."""
    return 0.010 + 0.001 * s.num_prefill_tokens + 0.002 * s.num_decodes


def prompt_chunks(defer_prompt_s: float, steps: int = 4, max_step_ms: float = 20, hold: bool = False) -> list[int]:
    # 6 decodes predict 22 ms against a 20 ms target: no prompt token fits beside them
    sched = make_scheduler("stall-free", budget=512, step_time=linear_model, max_step_ms=max_step_ms,
                           defer_prompt_s=defer_prompt_s, hold_prompts=hold)
    for i in range(6):
        sched.add_request(make_request(f"d{i}", 8, max_tokens=400))
    t = 1.0
    while sched.num_waiting or not all(r.is_decoding for r in sched.running):
        t += 1
        step(sched, t)
    sched.add_request(make_request("p", 200, max_tokens=8, arrival=t))
    got = []
    for _ in range(steps):
        t += 1  # one second a step
        v = step(sched, t)
        assert sum(1 for d in v.decodes if d) == 6  # the streams run every step either way
        got.append(dict(v.batch).get("p", 0))
    return got


def test_a_prompt_gets_one_block_when_the_decodes_fill_the_target() -> None:
    assert prompt_chunks(0.0) == [16, 16, 16, 16]


def test_a_young_prompt_waits_for_room_then_gets_its_block() -> None:
    # 1 s and 2 s after its arrival it waits; from 3 s (past 2.5) it progresses as without the rule
    assert prompt_chunks(2.5) == [0, 0, 16, 16]


def test_a_young_prompt_takes_no_sliver_either() -> None:
    # a 27 ms target leaves 5 ms: 5 tokens fit. Without the rule the floor makes them a block; deferred, a chunk
    # under a block waits as none does (it would lengthen the streams' step for little)
    assert prompt_chunks(0.0, max_step_ms=27) == [16, 16, 16, 16]
    assert prompt_chunks(2.5, max_step_ms=27) == [0, 0, 16, 16]
    # room for a block or more: the young prompt takes it
    assert prompt_chunks(2.5, max_step_ms=42)[0] == 20


def test_held_prompts_get_no_chunk_beside_decodes_of_any_size_or_age() -> None:
    assert prompt_chunks(0.0, max_step_ms=200, hold=True) == [0, 0, 0, 0]  # room for 178 tokens: none taken
    assert prompt_chunks(0.0, steps=1, max_step_ms=200) == [178]  # unheld, it takes them


def test_held_prompts_run_in_steps_without_decodes() -> None:
    sched = make_scheduler("stall-free", budget=64, step_time=linear_model, max_step_ms=20, hold_prompts=True)
    sched.add_request(make_request("p", 100, max_tokens=4))
    assert dict(step(sched, 1.0).batch) == {"p": 64}  # no stream waits on the step: the token budget bounds it
