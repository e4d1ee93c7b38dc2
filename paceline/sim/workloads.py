"""Synthetic request streams for the simulator: arrivals, prompt/output lengths, priorities.

Lengths only (no text): the simulator never tokenizes. The CPU-sized workloads mirror the benchmark's
`chat`, `long-prompt` and `bursty-priority` (issue 5); `sharegpt` and `arxiv` are the datacenter shapes.

Datacenter shapes, from Table 3 of the Sarathi-Serve paper (Agrawal et al., OSDI 2024), the traces Vidur also
ships (openchat_sharegpt4 and arxiv_summarization), as quoted in that table:
  openchat_sharegpt4: prompt median 1730, p90 5696; output median 415, p90 834
  arxiv_summarization: prompt median 7059, p90 12985; output median 208, p90 371
Each is drawn as a lognormal through (median, p90), clipped to [min, max]; the clip at the context length
trims the long tail the real traces were also filtered at.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

Z90 = 1.2815515655446004  # standard normal 90th percentile


@dataclass
class Lengths:
    median: float
    p90: float
    min: int = 1
    max: int = 1 << 30

    def sample(self, rng: random.Random) -> int:
        sigma = math.log(self.p90 / self.median) / Z90 if self.p90 > self.median else 0.0
        x = rng.lognormvariate(math.log(self.median), sigma)
        return int(min(max(round(x), self.min), self.max))


@dataclass
class PriorityClass:
    weight: float
    priority: int
    prompt: Lengths | None = None  # None: the workload's
    output: Lengths | None = None


@dataclass
class SimWorkload:
    name: str
    prompt: Lengths
    output: Lengths
    arrival: str = "poisson"  # poisson | gamma | all-at-once
    cv: float = 1.0  # gamma: coefficient of variation of inter-arrival gaps (1 = Poisson)
    priorities: list[PriorityClass] = field(default_factory=list)
    max_model_len: int | None = None  # prompt + output are clipped to this
    shared_prefix_tokens: int = 0  # tokens every prompt starts with (exercises the prefix cache)


@dataclass
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    priority: int = 0


WORKLOADS: dict[str, SimWorkload] = {
    # issue 5's CPU-sized shapes: chat prompts median ~300 (<=1500), outputs median ~100 (<=400)
    "chat": SimWorkload("chat", Lengths(300, 700, 16, 1500), Lengths(100, 220, 8, 400)),
    # long-prompt: prompts ~1000-3000, outputs ~50-150
    "long-prompt": SimWorkload("long-prompt", Lengths(1800, 2700, 1000, 3000), Lengths(100, 140, 50, 150)),
    # bursty-priority: gamma cv 3; 20 % interactive priority 0 short, 80 % batch priority 10 long
    "bursty-priority": SimWorkload(
        "bursty-priority", Lengths(300, 700, 16, 1500), Lengths(100, 220, 8, 400), arrival="gamma", cv=3.0,
        priorities=[PriorityClass(0.2, 0, Lengths(100, 250, 16, 500), Lengths(50, 100, 8, 200)),
                    PriorityClass(0.8, 10, Lengths(800, 1500, 100, 3000), Lengths(200, 350, 50, 400))]),
    "sharegpt": SimWorkload("sharegpt", Lengths(1730, 5696, 16, 16384), Lengths(415, 834, 8, 4096), max_model_len=16384),
    "arxiv": SimWorkload("arxiv", Lengths(7059, 12985, 256, 16384), Lengths(208, 371, 8, 2048), max_model_len=16384),
}


def load_workload(name_or_path: str) -> SimWorkload:
    if name_or_path in WORKLOADS:
        return WORKLOADS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown workload {name_or_path!r}; choose one of {', '.join(WORKLOADS)} or give a .yaml path")
    import yaml
    d = yaml.safe_load(path.read_text()) or {}
    try:
        prios = [PriorityClass(p["weight"], p["priority"], Lengths(**p["prompt"]) if "prompt" in p else None,
                               Lengths(**p["output"]) if "output" in p else None) for p in d.get("priorities", [])]
        return SimWorkload(d.get("name", path.stem), Lengths(**d["prompt"]), Lengths(**d["output"]),
                           arrival=d.get("arrival", "poisson"), cv=float(d.get("cv", 1.0)), priorities=prios,
                           max_model_len=d.get("max_model_len"), shared_prefix_tokens=int(d.get("shared_prefix_tokens", 0)))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: bad workload ({e}); need prompt: {{median, p90, min, max}} and output: {{...}}") from None


def generate(workload: SimWorkload, rate: float, num_requests: int, seed: int = 0) -> list[SimRequest]:
    """Requests sorted by arrival. rate is requests per second (ignored by all-at-once)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if workload.arrival != "all-at-once" and not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    # separate streams, so changing the rate moves arrivals but keeps every request's lengths
    len_rng = random.Random(seed * 1_000_003 + 1)
    out: list[SimRequest] = []
    t = 0.0
    weights = [p.weight for p in workload.priorities]
    for i in range(num_requests):
        if workload.arrival == "poisson":
            t += rng.expovariate(rate)
        elif workload.arrival == "gamma":
            shape = 1.0 / workload.cv**2
            t += rng.gammavariate(shape, 1.0 / (shape * rate))
        elif workload.arrival != "all-at-once":
            raise ValueError(f"unknown arrival process {workload.arrival!r}; choose poisson, gamma or all-at-once")
        prompt_d, output_d, prio = workload.prompt, workload.output, 0
        if workload.priorities:
            cls = len_rng.choices(workload.priorities, weights)[0]
            prompt_d, output_d, prio = cls.prompt or prompt_d, cls.output or output_d, cls.priority
        p, o = prompt_d.sample(len_rng), output_d.sample(len_rng)
        if workload.max_model_len and p + o > workload.max_model_len:
            p = max(1, workload.max_model_len - o)
        out.append(SimRequest(i, t, p, o, prio))
    return out


def with_max_model_len(workload: SimWorkload, max_model_len: int) -> SimWorkload:
    return replace(workload, max_model_len=max_model_len)
