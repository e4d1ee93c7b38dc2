import argparse

import pytest

from paceline.bench.probe_plan import ProbePlan, add_probe_plan_args, bench_for, parse_probe_plan
from paceline.bench.prompts import PromptSource


class Words:
    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]


def test_parse_probe_plan():
    assert parse_probe_plan("chat:190:16:0.75,1.0") == ProbePlan("chat", 190.0, 16, [0.75, 1.0])
    assert parse_probe_plan("C:/traces/t.csv:171:8:0.1").workload == "C:/traces/t.csv"  # the path keeps its ':'
    for bad in ("chat:190:16", "chat:190:x:0.5", "chat:0:16:0.5", "chat:190:0:0.5", "chat:190:16:", "chat:190:16:-1",
                ":190:16:0.5"):
        with pytest.raises(ValueError, match="a probe"):
            parse_probe_plan(bad)


def test_each_workload_gets_its_own_fixed_strict_slo_and_rates():
    p = argparse.ArgumentParser()
    add_probe_plan_args(p)
    args = p.parse_args(["--probe", "chat:190:16:0.75", "--probe", "long-prompt:171:8:0.1,0.15"])
    source = PromptSource(Words(), "a bb ccc dddd")
    chat, long = (bench_for(args, plan, source) for plan in args.probe)
    assert chat.slos == [("strict", pytest.approx(0.19))] and long.slos == [("strict", pytest.approx(0.171))]
    assert long.args.probe_rates == "0.1,0.15" and long.args.probe_requests == 8 and chat.args.probe_requests == 16
    assert args.workload == "chat" and long.spec.name == "long-prompt"  # the shared args are not changed
    with pytest.raises(SystemExit):  # a bad probe is a usage error, not a crash
        p.parse_args(["--probe", "chat:190"])
