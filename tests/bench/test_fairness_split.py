"""benchmarks/fairness.py's split of decode throughput: a host that slows one run must land in the speed factor,
not in the order's own cost, and an order that runs more prompt-chunk steps must show in the shape."""
import random

import pytest


@pytest.fixture(scope="module")
def fairness(load_benchmark):
    return load_benchmark("fairness")


COST_MS = {"fixed": 20.0, "decode": 4.0, "token": 2.0, "chunk": 15.0}


def steps(n: int, chunk_every: int, chunk: int, speed: float, seed: int, decodes: int = 8) -> list[dict]:
    """n back-to-back steps of `decodes` decodes, every chunk_every-th with a prompt chunk, each taking the known
    cost x speed (x a little noise, as a real host adds)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        prefill = chunk if i % chunk_every == 0 else 0
        ms = (COST_MS["fixed"] + COST_MS["decode"] * decodes + COST_MS["token"] * prefill
              + (COST_MS["chunk"] if prefill else 0.0))
        dur = ms / 1e3 * speed * rng.uniform(0.97, 1.03)
        out.append({"t": t, "dur": dur, "pred": dur, "decode": decodes - (i % 3 == 0), "prefill": prefill,
                    "running": 8, "waiting": 2, "preempted": 0})
        t += dur
    return out


def run(system: str, round_: int, records: list[dict]) -> dict:
    return {"system": system, "round": round_, "steps": {"records": records}}


def test_a_slow_host_goes_to_the_speed_not_to_the_order(fairness):
    # the same schedule twice, the second on a host 1.6x slower: measured 0.62x, the order's own cost 1.0x
    fcfs = steps(400, 8, 40, 1.0, seed=1)
    fair = steps(400, 8, 40, 1.6, seed=2)
    table = fairness.split_table([run("paceline-fcfs", 1, fcfs), run("paceline-fair-slice", 1, fair)], 1e9)
    row = next(line for line in table.splitlines() if line.startswith("| paceline-fair-slice"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    speed, measured, at_fcfs_speed = float(cells[9]), float(cells[12].rstrip("x")), float(cells[14].rstrip("x"))
    assert speed == pytest.approx(1.6, rel=0.03)
    assert measured == pytest.approx(1 / 1.6, rel=0.03)
    assert at_fcfs_speed == pytest.approx(1.0, abs=0.02)


def test_more_prompt_chunk_steps_show_in_the_shape(fairness):
    # fair runs the same prompt tokens in twice as many, half-size chunks at the same speed: each extra chunk
    # step pays the chunk's fixed cost, so the shape grows and the decode rate falls by as much
    fcfs = steps(600, 8, 40, 1.0, seed=3)
    fair = steps(600, 4, 20, 1.0, seed=4)
    windows = [fairness.window_steps(r, 1e9) for r in (fcfs, fair)]
    coef = fairness.shape_model(windows)
    assert coef[3] * 1e3 == pytest.approx(COST_MS["chunk"], abs=3.0)
    base, x = (fairness.step_split(w, coef) for w in windows)
    assert x["prompt_step_share"] == pytest.approx(2 * base["prompt_step_share"], rel=0.01)
    assert x["prefill_per_step"] == pytest.approx(base["prefill_per_step"], rel=0.01)
    expected = (COST_MS["fixed"] + 8 * COST_MS["decode"] + 5 + COST_MS["chunk"] / 4) / \
        (COST_MS["fixed"] + 8 * COST_MS["decode"] + 5 + COST_MS["chunk"] / 8)
    assert x["shape_ms"] / base["shape_ms"] == pytest.approx(expected, rel=0.01)
    assert x["speed"] / base["speed"] == pytest.approx(1.0, abs=0.02)


def test_the_window_keeps_only_steps_that_started_in_it(fairness):
    records = [{"t": t, "dur": 0.1} for t in (100.0, 100.5, 159.9, 160.0, 170.0)]
    assert [s["t"] for s in fairness.window_steps(records, 60.0)] == [100.0, 100.5, 159.9]
    assert fairness.window_steps([], 60.0) == []


def test_round_order_puts_each_system_first_middle_and_last_alike(fairness):
    names = ["fcfs", "fair", "fair-slice"]
    orders = [fairness.round_order(names, r) for r in range(6)]
    assert orders[0] == names and orders[3] == ["fair-slice", "fair", "fcfs"]
    for name in names:  # six rounds: every system twice in every place
        assert sorted(o.index(name) for o in orders) == [0, 0, 1, 1, 2, 2]
    assert [fairness.round_order(["a", "b"], r) for r in range(4)] == [["a", "b"], ["b", "a"], ["b", "a"], ["a", "b"]]


def _served(system: str, round_: int, token_times_by_client: dict[str, list[float]], last_send: float) -> dict:
    reqs = [{"sent_s": 0.0, "token_times": [], "client": "heavy"}, {"sent_s": last_send, "token_times": [], "client": "heavy"}]
    reqs += [{"sent_s": 0.0, "token_times": ts, "client": c} for c, ts in token_times_by_client.items()]
    total = sum(1 for ts in token_times_by_client.values() for t in ts if t <= last_send)
    return {"system": system, "round": round_, "requests": reqs,
            "summary": {"fairness": {"tokens_per_s": {"all": total / last_send}}}}


def test_steady_window_counts_only_tokens_after_the_skip(fairness):
    r = _served("paceline-fcfs", 1, {"heavy": [1.0, 5.0, 12.0, 19.0], "light": [15.0, 21.0]}, 20.0)
    assert fairness.steady_tokens_per_s(r, 10.0) == pytest.approx(3 / 10.0)  # 12, 15, 19; 21 is past the window


def test_rounds_table_reports_every_round_and_the_median_ratio(fairness):
    runs = []
    for round_, fair_tokens in ((1, 90), (2, 100), (3, 30)):  # round 3: a host stall in the fair run
        runs.append(_served("paceline-fcfs", round_, {"heavy": [float(i) / 10 for i in range(100)]}, 20.0))
        runs.append(_served("paceline-fair", round_, {"heavy": [float(i) / 10 for i in range(fair_tokens)]}, 20.0))
    text = fairness.rounds_table(runs, 0.0)
    assert "0.300x" in text and "0.900x" in text  # every round is in the table, the stalled one too
    median_row = text.strip().splitlines()[-1]
    assert median_row.startswith("| paceline-fair | 3 | 0.900x | 0.300-1.000 |") and median_row.endswith("| 1/3 |")

