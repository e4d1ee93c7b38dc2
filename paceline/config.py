"""Settings for cache, scheduler and engine. Every default lives here, once."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

# batch-building policies (core/policies.py), named for what they do
SCHEDULERS = ("stall-free", "prefill-first", "orca", "static")
# the names they had before, still accepted (with a warning) so that old commands and scripts keep working
OLD_SCHEDULER_NAMES = {"sarathi": "stall-free", "vllm": "prefill-first"}
STALL_FACTOR = 5.0  # a TBT gap longer than this many median decode steps is a stall (benchmark, simulator, /metrics)
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap", "auto")


def scheduler_name(name: str) -> str:
    """A scheduler's current name: an old one is mapped, with a warning; any other comes back as it is (the
    caller checks it: SchedulerConfig, or argparse's choices when this is a flag's type)."""
    if name in OLD_SCHEDULER_NAMES:
        new = OLD_SCHEDULER_NAMES[name]
        warnings.warn(f"scheduler {name!r} is now called {new!r}; the old name will go", FutureWarning, stacklevel=3)
        return new
    return name


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gb and the model's shapes
    kv_cache_memory_gb: float = 2.0
    swap_space_gb: float = 1.0  # host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # fraction of blocks admissions may not take, so running decodes keep room

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass
class SchedulerConfig:
    policy: str = "stall-free"  # one of SCHEDULERS
    scheduling_policy: str = "fcfs"  # one of SCHEDULING_POLICIES
    max_num_batched_tokens: int = 512  # the token budget of one step
    max_num_seqs: int = 128  # the most requests in one step
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 0  # 0: off; else the most tokens one prompt may take per step
    max_num_partial_prefills: int = 0  # 0: unlimited; else how many prompts may be mid-prefill at once
    preemption_mode: str = "recompute"  # one of PREEMPTION_MODES
    priority_aging_s: float = 0.0  # 0: off; else a waiting request gains one priority level per this many seconds
    max_batch_wait_ms: float = 0.0  # static policy: how long to wait for a batch to fill
    max_waiting_requests: int = 0  # 0: unlimited; the server answers 503 beyond it
    # 0: off; else sarathi cuts prompt chunks so the predicted step time stays under it (needs a step-time model)
    max_step_ms: float = 0.0

    def __post_init__(self) -> None:
        self.policy = scheduler_name(self.policy)
        if self.policy not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.policy!r}; choose one of {', '.join(SCHEDULERS)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}; choose one of {', '.join(SCHEDULING_POLICIES)}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption mode {self.preemption_mode!r}; choose one of {', '.join(PREEMPTION_MODES)}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_step_ms < 0:
            raise ValueError(f"max_step_ms must be >= 0, got {self.max_step_ms}")
        if self.max_step_ms > 0 and self.policy != "stall-free":
            # the other policies run whole prompts (or fixed batches): there is no chunk for the limit to cut
            raise ValueError(f"max_step_ms applies to the stall-free scheduler only, not {self.policy!r}")


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF path, Hugging Face folder, or None for the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto (float32; bfloat16 under int4) | float32 | bfloat16 | float16
    quantization: str = "none"  # none | int4: the layers' linear weights as 4-bit codes (CPU, bfloat16)
    device: str = "auto"  # auto: cuda when present, else cpu
    served_model_name: str | None = None
    seed: int = 0  # seed of the generator used by requests that give none
    # step-time profile (`paceline profile`) for scheduler.max_step_ms; None: a quick profile at start-up
    step_profile: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.quantization not in ("none", "int4"):
            raise ValueError(f"quantization must be none or int4, got {self.quantization!r}")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.quantization == "int4" else "float32"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization == "int4" and self.dtype != "bfloat16":
            raise ValueError(f"int4 quantization computes in bfloat16; use dtype bfloat16 (or auto), not {self.dtype}")
