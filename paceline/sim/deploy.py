"""From names and numbers to a ready Simulator: cost model, KV blocks sized for the simulated device."""
from __future__ import annotations

from dataclasses import dataclass

from paceline.config import CacheConfig, SchedulerConfig
from paceline.sim.cost_model import ProfiledCostModel, RooflineCostModel, roofline_from_names
from paceline.sim.hardware import GiB
from paceline.sim.simulator import Simulator
from paceline.spec_config import SpeculativeConfig


@dataclass
class Deployment:
    cost_model: RooflineCostModel | ProfiledCostModel
    scheduler: SchedulerConfig
    cache: CacheConfig
    num_replicas: int = 1
    router: str = "round-robin"
    gpu_memory_utilization: float = 0.9
    pipeline_microbatches: int | None = None  # None: as many as pipeline stages (1 without pipeline parallelism)
    speculative: SpeculativeConfig | None = None
    router_options: dict | None = None  # the prefix router's settings, as the Ray Serve ingress takes them

    def num_blocks(self) -> int:
        if self.cache.num_blocks:
            return self.cache.num_blocks
        cm = self.cost_model
        if isinstance(cm, RooflineCostModel):
            return max(1, cm.kv_capacity_tokens(self.gpu_memory_utilization) // self.cache.block_size)
        # profiled: the same sizing the real engine does, from the bytes one block takes on this model
        per_token = cm.meta.get("kv_bytes_per_token")
        if not per_token:
            raise ValueError("profile has no kv_bytes_per_token; pass num_blocks")
        return max(1, int(self.cache.kv_cache_memory_gb * GiB // (per_token * self.cache.block_size)))

    def num_host_blocks(self) -> int:
        cm = self.cost_model
        per_token = cm.kv_bytes_per_token() if isinstance(cm, RooflineCostModel) else cm.meta.get("kv_bytes_per_token", 0)
        return int(self.cache.swap_space_gb * GiB // (per_token * self.cache.block_size)) if per_token else 0

    def simulator(self) -> Simulator:
        micro = self.pipeline_microbatches
        if micro is None:
            micro = getattr(self.cost_model, "pp", 1) if hasattr(self.cost_model, "stage_times") else 1
        return Simulator(self.cost_model, self.scheduler, self.cache, self.num_blocks(), self.num_host_blocks(),
                         num_replicas=self.num_replicas, router=self.router, pipeline_microbatches=micro,
                         speculative=self.speculative, router_options=self.router_options)


def cost_model_from_spec(spec: str, model: str = "mistral-7b", gpu: str = "a100", tp: int = 1, pp: int = 1,
                         **roofline_kw) -> RooflineCostModel | ProfiledCostModel:
    """'roofline' or a profile JSON path."""
    if spec == "roofline":
        return roofline_from_names(model, gpu, tp, pp, **roofline_kw)
    return ProfiledCostModel.load(spec)
