"""Requests for the simulator, from the benchmark's own workloads (paceline.bench.workload), so a simulated
run and a measured one see the same arrivals and lengths for the same name, rate and seed.

Besides the benchmark's named workloads (chat, long-prompt, bursty-priority) and YAML paths, the simulator
adds two datacenter shapes in paceline/sim/configs/workloads/: `sharegpt` and `arxiv` (numbers and sources
in those files).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paceline.bench.workload import WorkloadSpec, generate as bench_generate, load_workload as bench_load

SIM_WORKLOADS_DIR = Path(__file__).parent / "configs" / "workloads"


@dataclass
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    priority: int = 0


def sim_workload_names() -> list[str]:
    return sorted(p.stem for p in SIM_WORKLOADS_DIR.glob("*.yaml"))


def load_workload(name_or_path: str, max_model_len: int | None = None) -> WorkloadSpec:
    """A simulator workload (sharegpt, arxiv), a benchmark workload (chat, long-prompt, ...) or a YAML/CSV path."""
    own = SIM_WORKLOADS_DIR / f"{name_or_path}.yaml"
    return bench_load(str(own) if own.is_file() else name_or_path, max_model_len=max_model_len)


def generate(spec: WorkloadSpec, rate: float | None, num_requests: int, seed: int = 0) -> list[SimRequest]:
    reqs = bench_generate(spec, rate=rate, num_requests=num_requests, seed=seed)
    return [SimRequest(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens, r.priority) for r in reqs]


def requests_for(name_or_path: str, rate: float | None, num_requests: int, seed: int = 0,
                 max_model_len: int | None = None) -> list[SimRequest]:
    return generate(load_workload(name_or_path, max_model_len), rate, num_requests, seed)
