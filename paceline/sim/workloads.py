"""Requests for the simulator, from the benchmark's own workloads (paceline.bench.workload), so a simulated
run and a measured one see the same arrivals and lengths for the same name, rate and seed. The datacenter
shapes (`sharegpt`, `arxiv`) sit with the others in paceline/bench/data/workloads/.
"""
from __future__ import annotations

from dataclasses import dataclass

from paceline.bench.workload import WorkloadSpec, generate as bench_generate, load_workload as bench_load


@dataclass
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    priority: int = 0
    client: str = ""
    acceptance: float = 0.0  # the chance a proposed token is accepted (speculative decoding; the workload's)
    # the prompt's token ids where the workload says what requests share (conversations, system prompts): the
    # prefix cache and the prefix router then see real prefixes; None: ids of its own (the workload's lengths only)
    prompt: list[int] | None = None

    def __post_init__(self) -> None:
        if self.prompt is not None and len(self.prompt) != self.prompt_len:
            raise ValueError(f"request {self.index}: prompt_len {self.prompt_len} but {len(self.prompt)} prompt ids")


def load_workload(name_or_path: str, max_model_len: int | None = None) -> WorkloadSpec:
    """A named workload (chat, long-prompt, bursty-priority, sharegpt, arxiv) or a YAML/CSV path."""
    return bench_load(name_or_path, max_model_len=max_model_len)


def generate(spec: WorkloadSpec, rate: float | None, num_requests: int, seed: int = 0) -> list[SimRequest]:
    reqs = bench_generate(spec, rate=rate, num_requests=num_requests, seed=seed)
    return [SimRequest(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens, r.priority, r.client,
                       spec.spec_acceptance) for r in reqs]


def requests_for(name_or_path: str, rate: float | None, num_requests: int, seed: int = 0,
                 max_model_len: int | None = None) -> list[SimRequest]:
    return generate(load_workload(name_or_path, max_model_len), rate, num_requests, seed)
