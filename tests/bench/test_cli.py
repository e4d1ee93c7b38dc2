import argparse
import json

import pytest
from fake_server import FakeServer

from paceline.bench.cli import add_parser
from paceline.bench.compare import capacity_table


def parse(argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_bench_serve_writes_table_json_and_plots(tmp_path, capsys, monkeypatch):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens,priority\n0,20,5,0\n0.1,30,4,10\n0.2,10,6,10\n")
    with FakeServer(ttft=0.05, gap=0.02) as server:
        args = parse(["serve", "--url", server.url, "--workload", str(trace), "--tokenizer", "unused",
                      "--output-dir", str(tmp_path / "out"), "--no-progress", "--tbt-slo", "500", "--label", "fake"])
        # the tokenizer is only needed to cut prompts: use a stand-in so the test needs no model
        import paceline.bench.prompts as prompts

        class Words:
            def encode(self, text, add_special_tokens=False):
                return [len(w) for w in text.split()]

            def decode(self, ids, skip_special_tokens=True):
                return " ".join("x" * i for i in ids)

        monkeypatch.setattr(prompts, "load_tokenizer", lambda path=None: Words())
        assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "| fake |" in out and "3/3" in out
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    (run,) = data["runs"]
    assert run["summary"]["completed"] == 3 and run["summary"]["total_output_tokens"] == 15
    assert run["summary"]["goodput"] > 0
    assert set(run["summary"]["per_priority"]) == {"0", "10"}
    assert [len(r["token_times"]) for r in run["requests"]] == [5, 4, 6]
    assert data["environment"]["cpus"] >= 1
    for png in ("tbt_cdf.png", "tokens_over_time.png", "step_composition.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000
    assert server.seen[0]["prompt"] and len(server.seen[0]["prompt"]) == 20  # token ids, exact length


def test_subcommands_are_wired():
    assert parse(["compare", "--workload", "long-prompt", "--systems", "paceline-sarathi"]).func.__name__ == "cmd_compare"
    assert parse(["capacity", "--url", "http://x"]).func.__name__ == "cmd_capacity"


def test_skipped_systems_stay_in_the_capacity_table():
    verdicts = [{"rate": 1.0, "delay_source": "scheduling"}, {"rate": 2.0, "delay_source": "scheduling"}]
    caps = [{"system": "a", "slo": "strict", "capacity": 1.5, "verdicts": verdicts, "prefill_rate": 790.4},
            {"system": "b", "slo": "strict", "capacity": None, "skipped": "no binary"}]
    t = capacity_table(caps)
    assert "| a | 1.500 (2 rates tried) | scheduling | 790 |" in t and "| b | skipped: no binary | – | – |" in t


def test_compare_report_from_runs(tmp_path):
    """Bench.write on hand-made runs: the table, the capacity table with a skipped peer, and the plots."""
    from paceline.bench.compare import Bench
    from paceline.bench.prompts import PromptSource
    from paceline.bench.workload import load_workload

    class Words:
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join("x" * i for i in ids)

    args = parse(["compare", "--workload", "chat", "--slo", "200", "--probe-requests", "4"])
    bench = Bench(args, load_workload("chat"), PromptSource(Words(), "a bb ccc dddd"))
    bench.slos = [("200ms", 0.2)]

    def run(system, rate, gap):
        reqs = [{"index": i, "prompt_tokens": 5, "output_tokens": 3, "priority": 0, "scheduled_s": i / rate,
                 "sent_s": i / rate, "token_times": [i / rate + 0.1 + k * gap for k in range(3)],
                 "end_s": i / rate + 0.1 + 2 * gap, "usage_prompt_tokens": None, "usage_completion_tokens": None,
                 "error": None} for i in range(4)]
        from paceline.bench.metrics import RequestRecord, summarize
        return {"system": system, "workload": "chat", "rate": rate, "probe": True, "step_composition": [],
                "summary": summarize([RequestRecord(**r) for r in reqs]), "requests": reqs}

    bench.runs = [run("a", 1.0, 0.05), run("a", 2.0, 0.3), run("b", 1.0, 0.1)]
    bench.capacities = [{"system": "a", "slo": "200ms", "tbt_slo_s": 0.2, "capacity": 1.0,
                         "verdicts": [{"rate": 1.0, "delay_source": "scheduling"}]}]
    bench.skip("c", "no binary")
    assert [(r["system"], r["rate"]) for r in bench.featured_runs()] == [("a", 1.0), ("b", 1.0)]
    text = bench.write(tmp_path, "benchmarks/compare.py --workload chat")
    assert "| c | skipped: no binary |" in text and "| a | 1.000 (1 rates tried) |" in text
    for png in ("tbt_cdf.png", "tokens_over_time.png", "latency_vs_rate.png"):
        assert (tmp_path / png).exists()
    assert json.loads((tmp_path / "results.json").read_text())["command"] == "benchmarks/compare.py --workload chat"


def test_probe_seconds_makes_probes_sustained_and_every_system_gets_the_same_requests():
    from paceline.bench.compare import Bench
    from paceline.bench.prompts import PromptSource
    from paceline.bench.workload import load_workload

    class Words:
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

    args = parse(["compare", "--workload", "chat", "--probe-requests", "16", "--probe-seconds", "90"])
    bench = Bench(args, load_workload("chat"), PromptSource(Words(), "a bb ccc dddd"))
    assert [bench.probe_size(r) for r in (0.1, 0.25, 0.5, 1.0)] == [16, 23, 45, 90]
    first, again = bench.requests(0.5, 45), bench.requests(0.5, 45)
    assert len(first) == 45 and first == again
    assert 80 < first[-1].arrival_s < 100  # ~90 s of arrivals at 0.5 req/s, not a burst
    assert bench.requests(1.0, 16) == bench.base[:16]  # short probes: the base workload, as before
    off = Bench(parse(["compare", "--workload", "chat", "--probe-requests", "16"]), load_workload("chat"),
                PromptSource(Words(), "a bb ccc dddd"))
    assert off.probe_size(8.0) == 16


def test_capacity_judges_every_probe_and_keeps_each_search(monkeypatch):
    """Strict searched first stops at 0.5 (1.0 fails the 2 s rule); the relaxed search then probes 0.75-0.94, which
    meet the strict TBT SLO too, so the reported strict capacity is 0.94 and the search's own 0.5 is kept."""
    from paceline.bench.compare import Bench
    from paceline.bench.prompts import PromptSource
    from paceline.bench.workload import load_workload

    class Words:
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

    args = parse(["compare", "--workload", "chat", "--max-probes", "3", "--start-rate", "0.25", "--delay-rule", "ttft"])
    bench = Bench(args, load_workload("chat"), PromptSource(Words(), "a bb ccc dddd"))
    bench.slos = [("strict", 0.19), ("relaxed", 0.95)]
    probed = []

    def run_at(system, ep, rate, num_requests, probe):
        probed.append(rate)
        return {"summary": {"failed": 0, "tbt": {"p99": 0.1 + 0.05 * rate}, "ttft": {"p50": 5.0 if rate >= 1 else 0.5}}}
    monkeypatch.setattr(bench, "run_at", run_at)
    strict, relaxed = bench.capacity("a", None)
    assert probed == [0.25, 0.5, 1.0, 0.75, 0.875, 0.9375]
    assert (strict.capacity, relaxed.capacity) == (0.9375, 0.9375)
    assert [c["searched_capacity"] for c in bench.capacities] == [0.5, 0.9375]
    assert ("| a | 0.938 (its own search 0.500; fails at 1.000; 6 rates tried) | 0.938 (fails at 1.000; 6 rates tried) |"
            in capacity_table(bench.capacities))


def test_probe_rates_replace_the_search_and_a_capacity_below_every_probe_is_shown_as_a_bound(monkeypatch):
    """--probe-rates: exactly the rates given, once each, judged under every SLO; a system that failed them all
    has capacity 0, shown as "< the lowest failing rate" (the upper end of its bracket, what a ratio needs)."""
    from paceline.bench.compare import Bench
    from paceline.bench.prompts import PromptSource
    from paceline.bench.workload import load_workload

    class Words:
        def encode(self, text, add_special_tokens=False):
            return [len(w) for w in text.split()]

    args = parse(["compare", "--workload", "chat", "--probe-rates", "0.75,1.0", "--delay-rule", "ttft"])
    bench = Bench(args, load_workload("chat"), PromptSource(Words(), "a bb ccc dddd"))
    bench.slos = [("strict", 0.19), ("relaxed", 0.95)]
    probed = []

    def run_at(system, ep, rate, num_requests, probe):
        probed.append((system, rate))
        p99 = 0.15 if system == "ours" else 0.5  # the peer fails strict at every rate, passes relaxed
        return {"summary": {"failed": 0, "tbt": {"p99": p99}, "ttft": {"p50": 0.5}}}
    monkeypatch.setattr(bench, "run_at", run_at)
    ours = bench.capacity("ours", None)
    peer = bench.capacity("peer", None)
    assert probed == [("ours", 0.75), ("ours", 1.0), ("peer", 0.75), ("peer", 1.0)]
    assert [c.capacity for c in ours] == [1.0, 1.0] and [c.capacity for c in peer] == [0.0, 1.0]
    assert [c["searched_capacity"] for c in bench.capacities] == [None] * 4
    table = capacity_table(bench.capacities)
    assert "| ours | ≥ 1.000 (2 rates tried) | ≥ 1.000 (2 rates tried) |" in table
    assert "| peer | < 0.750 (fails at 0.750; 2 rates tried) | ≥ 1.000 (2 rates tried) |" in table
    with pytest.raises(ValueError, match="must be > 0"):
        Bench(parse(["compare", "--probe-rates", "0"]), load_workload("chat"),
              PromptSource(Words(), "a b")).capacity("x", None)


def test_vllm_budgets_make_one_system_each(monkeypatch, tmp_path):
    from paceline.bench.compare import systems_for
    from paceline.bench.workload import load_workload
    exe = tmp_path / "python"
    exe.write_text("")
    monkeypatch.setenv("PACELINE_VLLM_PYTHON", str(exe))
    folder = tmp_path / "hf"
    folder.mkdir()
    args = parse(["compare", "--systems", "vllm-cpu-fp32", "--vllm-budgets", "256,512,2048", "--threads", "2"])
    systems = systems_for(args, load_workload("chat"), str(folder))
    assert [s.name for s in systems] == ["vllm-cpu-fp32-256", "vllm-cpu-fp32-512", "vllm-cpu-fp32-2048"]
    assert [s.argv[s.argv.index("--max-num-batched-tokens") + 1] for s in systems] == ["256", "512", "2048"]
    one = systems_for(parse(["compare", "--systems", "vllm-cpu", "--budget", "64"]), load_workload("chat"), str(folder))
    assert [s.name for s in one] == ["vllm-cpu-64"]  # without --vllm-budgets: --budget, as before


def test_stall_free_budget_items_set_a_step_limit_or_a_tbt_goal(tmp_path):
    from paceline.bench.compare import systems_for
    from paceline.bench.workload import load_workload
    folder = tmp_path / "hf"
    folder.mkdir()
    args = parse(["compare", "--systems", "paceline-stall-free", "--stall-free-budgets", "256,512:150,512:g190"])
    systems = systems_for(args, load_workload("chat"), str(folder))
    assert [s.name for s in systems] == ["paceline-stall-free-256", "paceline-stall-free-512-150ms",
                                         "paceline-stall-free-512-goal190ms"]
    plain, limit, goal = (s.argv for s in systems)
    assert "--max-step-ms" not in plain and "--tbt-goal-ms" not in plain
    assert limit[limit.index("--max-step-ms") + 1] == "150" and "--tbt-goal-ms" not in limit
    # a goal lets the server derive its own step targets from it, as a user with that SLO would set it
    assert goal[goal.index("--tbt-goal-ms") + 1] == "190" and "--max-step-ms" not in goal
