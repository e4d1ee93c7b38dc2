"""Settings for cache, scheduler and engine. Every default lives here, once."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

# batch-building policies (core/policies.py), named for what they do
SCHEDULERS = ("stall-free", "prefill-first", "orca", "static")
# the names they had before, still accepted (with a warning) so that old commands and scripts keep working
OLD_SCHEDULER_NAMES = {"sarathi": "stall-free", "vllm": "prefill-first"}
STALL_FACTOR = 5.0  # a TBT gap longer than this many median decode steps is a stall (benchmark, simulator, /metrics)
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
PREEMPTION_MODES = ("recompute", "swap", "auto")

# The serving default's TBT goal and the step-time target derived from it. A token gap is one step plus the
# engine's and HTTP's own work per token, and the engine tracks the 98th percentile of measured / predicted step
# time, so the target leaves the rest of the goal as headroom (see benchmarks/summaries/vs_vllm.md). 160 ms since
# 2026-11-24: with the KV prefault paced, chat at 0.5 req/s held p99 TBT 98-101 ms at 160 against 121-127 ms at
# 200 in two alternating rounds, p50 TTFT +13 % (benchmarks/summaries/vs_vllm.md, 09:10-09:30 UTC). Not 100 ms:
# that goal cut the 32-stream probe to 0.44x and raised chat's TTFT (docs/scheduling.md, 2026-11-23)
DEFAULT_TBT_GOAL_MS = 160.0
STEP_TARGET_FRACTION = 0.75
# The shorter target a step holds to when its prompt chunk is worth less than the decode time it costs (a long
# prompt with little output beside running streams; Scheduler.step_target_ms), as a fraction of max_step_ms: 42 ms
# under the 120 ms default (52.5 under the 150 ms one the figures below were measured at). Issue 13's stall probe wants a stream's gap <= 0.10 s; its step log (2026-11-24) showed
# that gap is a step near this target plus what the host adds (one step ran +49 ms over its neighbours). At 0.45
# (67.5 ms) the engine's part of the gap was 59-101 ms in six runs, at 0.35 50-61 ms in four; prompts that pay for
# the time keep the full target, so the 32-stream probe ran the same steps at both (docs/scheduling.md)
SHORT_STEP_FRACTION = 0.35
# The target a step holds to when its prompt chunk is worth a full step but no other prompt waits behind it
# (Scheduler.step_target_ms), as a fraction of max_step_ms: 72 ms under the 120 ms default. A full-target step buys
# the prompts queued behind it their turn sooner; with none queued it buys only this prompt a few tens of ms of TTFT
# and every running stream pays for them in its token gap (docs/scheduling.md, "A calm target")
CALM_STEP_FRACTION = 0.6
LONE_PREFILL_TOKENS = 2048  # SchedulerConfig.lone_prefill_tokens under a step-time target derived from the TBT goal
# The offline API's step budget (LLM() without a TBT goal and without max_num_batched_tokens): no stream reads tokens
# as they come, so a step may be as long as makes the tokens cheapest. Measured on the Intel Xeon with AMX (2 threads,
# `LLM().generate`, 2026-11-25 12:00-12:10 UTC, two processes a budget, alternating): 64 prompts of 300 tokens + 64
# out each 8.46-8.86 s at 512, 8.33-8.62 at 1,024, 7.58-8.31 at 2,048, 7.74-7.90 at 4,096; a lone 1,500-token
# prompt 382-421 ms at 512 (three chunks), 307-357 ms at 2,048 (whole)
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048


# `--max-num-seqs auto` / `--max-num-batched-tokens auto` (core/auto_batch.py): chosen before every step from the
# step-time model and max_step_ms, up to these
AUTO = "auto"
AUTO_MAX_NUM_SEQS = 256
AUTO_MAX_NUM_BATCHED_TOKENS = 8192


def int_or_auto(value: str) -> int | str:
    """A flag's type for counts that may be `auto`."""
    return AUTO if value == AUTO else int(value)


def step_target_ms(tbt_goal_ms: float) -> float:
    return tbt_goal_ms * STEP_TARGET_FRACTION


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
    max_num_batched_tokens: int | str = 512  # the token budget of one step; "auto": core/auto_batch.py
    max_num_seqs: int | str = 128  # the most requests in one step; "auto": core/auto_batch.py
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 0  # 0: off; else the most tokens one prompt may take per step
    # the token budget of a stall-free step with no decode and nothing swapped out while a step-time target is on
    # (no stream waits on it): a lone prompt runs in chunks this big (0: off, max_num_batched_tokens bounds every
    # step). None: not given; a scheduler alone takes 0, an EngineConfig that derives max_step_ms from its
    # tbt_goal_ms derives LONE_PREFILL_TOKENS (never below the step budget). Why: a 1,500-token prompt alone took
    # 488 ms of compute in 512-token chunks against 352 ms whole (attention over a gathered prefix costs more than
    # causal attention within one chunk; Intel Xeon with AMX, profile_step.py, 2026-11-25 07:09 UTC)
    lone_prefill_tokens: int | None = None
    lone_prefill_tokens_given: bool = field(init=False, default=False, repr=False)
    max_num_partial_prefills: int = 0  # 0: unlimited; else how many prompts may be mid-prefill at once
    preemption_mode: str = "recompute"  # one of PREEMPTION_MODES
    priority_aging_s: float = 0.0  # 0: off; else a waiting request gains one priority level per this many seconds
    max_batch_wait_ms: float = 0.0  # static policy: how long to wait for a batch to fill
    max_waiting_requests: int = 0  # 0: unlimited; the server answers 503 beyond it
    # time slices (0: off): a decoding request that ran this many output tokens (or ms) since it was last admitted,
    # while queued work it does not outrank waits for its seat, is preempted and demoted one level; level L's slice
    # is 2**L times the first, so a long generation is preempted O(log length) times
    time_slice_tokens: int = 0
    time_slice_ms: float = 0.0
    max_queue_delay_s: float = 0.0  # 0: off; else 503 at arrival for a request predicted to wait longer (an admitted request is served)
    # 0: off; else the stall-free scheduler cuts prompt chunks so the predicted step time stays under it (needs a step-time model).
    # None: not given; a scheduler alone takes 0, an EngineConfig derives it from its tbt_goal_ms (stall-free only)
    max_step_ms: float | None = None
    max_step_ms_given: bool = field(init=False, default=False, repr=False)
    # the step target for a chunk whose prompt is worth less than the decode time it costs (Scheduler.step_target_ms);
    # 0: off (every chunk may fill max_step_ms). None: not given; a scheduler alone takes 0, an EngineConfig that
    # derives max_step_ms from its tbt_goal_ms derives this too (SHORT_STEP_FRACTION x max_step_ms)
    short_step_ms: float | None = None
    short_step_ms_given: bool = field(init=False, default=False, repr=False)
    # the step target for a chunk worth a full step when no other prompt is queued behind it (waiting, swapped or
    # mid-prefill); 0: off. None: not given; derived like short_step_ms (CALM_STEP_FRACTION x max_step_ms)
    calm_step_ms: float | None = None
    calm_step_ms_given: bool = field(init=False, default=False, repr=False)
    # 0: off; else a step whose decodes alone fill its step-time target gives a prompt that arrived less than this
    # long ago no chunk (no one-block floor): it waits for a step with room. Set per step by several models' loop
    # (engine/multi.py, SLICE_DEFER) while another model streams; a scheduler alone keeps every prompt progressing
    defer_prompt_s: float = 0.0
    # True: a step that has decodes gives no prompt a chunk (prompts run in steps without decodes only). Set per step
    # by several models' loop while another model loads or waits for its first token (engine/multi.py, HOLD_PROMPTS)
    hold_prompts: bool = False
    # time slices: a request demoted to level L queues as if it had arrived L * level_aging_s after its demotion,
    # so fresh work passes it only for a while (0: strict levels, which can starve it under sustained load)
    level_aging_s: float = 5.0
    # max_num_seqs / max_num_batched_tokens given as "auto": the fields then hold the search's upper end, and the
    # scheduler sets them (on its own copy) before every step
    auto_max_num_seqs: bool = field(init=False, default=False)
    auto_max_num_batched_tokens: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.policy = scheduler_name(self.policy)
        self.max_step_ms_given = self.max_step_ms is not None
        if self.max_num_seqs == AUTO:
            self.auto_max_num_seqs, self.max_num_seqs = True, AUTO_MAX_NUM_SEQS
        if self.max_num_batched_tokens == AUTO:
            self.auto_max_num_batched_tokens, self.max_num_batched_tokens = True, AUTO_MAX_NUM_BATCHED_TOKENS
        if self.max_step_ms is None:
            self.max_step_ms = 0.0
        self.short_step_ms_given = self.short_step_ms is not None
        if self.short_step_ms is None:
            self.short_step_ms = 0.0
        self.lone_prefill_tokens_given = self.lone_prefill_tokens is not None
        if self.lone_prefill_tokens is None:
            self.lone_prefill_tokens = 0
        self.calm_step_ms_given = self.calm_step_ms is not None
        if self.calm_step_ms is None:
            self.calm_step_ms = 0.0
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
        if self.lone_prefill_tokens < 0:
            raise ValueError(f"lone_prefill_tokens must be >= 0, got {self.lone_prefill_tokens}")
        if self.max_queue_delay_s < 0:
            raise ValueError(f"max_queue_delay_s must be >= 0, got {self.max_queue_delay_s}")
        if self.max_step_ms < 0:
            raise ValueError(f"max_step_ms must be >= 0, got {self.max_step_ms}")
        if self.short_step_ms < 0:
            raise ValueError(f"short_step_ms must be >= 0, got {self.short_step_ms}")
        if self.calm_step_ms < 0:
            raise ValueError(f"calm_step_ms must be >= 0, got {self.calm_step_ms}")
        if self.time_slice_tokens < 0:
            raise ValueError(f"time_slice_tokens must be >= 0, got {self.time_slice_tokens}")
        if self.time_slice_ms < 0:
            raise ValueError(f"time_slice_ms must be >= 0, got {self.time_slice_ms}")
        if self.level_aging_s < 0:
            raise ValueError(f"level_aging_s must be >= 0, got {self.level_aging_s}")
        if (self.auto_max_num_seqs or self.auto_max_num_batched_tokens) and self.policy != "stall-free":
            raise ValueError("auto batch settings follow the step-time target, which only the stall-free scheduler has")
        if (self.time_slice_tokens or self.time_slice_ms) and self.policy == "static":
            # a static batch runs its members to the end by definition: there is no seat to hand over
            raise ValueError("time slices do not apply to the static scheduler")
        if self.max_step_ms > 0 and self.policy != "stall-free":
            # the other policies run whole prompts (or fixed batches): there is no chunk for the limit to cut
            raise ValueError(f"max_step_ms applies to the stall-free scheduler only, not {self.policy!r}")


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF path, Hugging Face folder, or None for the bundled SmolLM2-135M-Instruct
    # auto: the engine picks by device and file (see engine.numeric_mode): bfloat16, int4 on CPU for a 4-bit GGUF
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (bfloat16 under int4)
    quantization: str = "auto"  # auto | none | int4: the layers' linear weights as 4-bit codes (CPU, bfloat16)
    # what the wide steps' linears run (a bfloat16/int4 model on a CPU without native bf16 math runs steps of more
    # than 8 tokens in float32): fp32 copies of the weights, or int8 (per-channel weights, per-row dynamic
    # activations, where torch has the x86 quantized engine); auto: paceline.model.llama.AUTO_WIDE_LINEARS, chosen
    # by quality and speed (benchmarks/summaries/int8_wide.md)
    wide_linears: str = "auto"  # auto | fp32 | int8
    device: str = "auto"  # auto: cuda when present, else cpu
    served_model_name: str | None = None
    seed: int = 0  # seed of the generator used by requests that give none
    # step-time profile (`paceline profile`) for scheduler.max_step_ms; None: a quick profile at start-up
    step_profile: str | None = None
    # the gap between two tokens a stream should not exceed; the stall-free step-time target (scheduler.max_step_ms, when
    # not given) derives from it and the start-up profile predicts steps against it. 0: no goal, no target
    tbt_goal_ms: float = DEFAULT_TBT_GOAL_MS
    # speculative decoding as vLLM spells it, a JSON string or dict: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m}; None: off. Parsed (and checked) by the engine.
    speculative_config: str | dict | None = None
    # several processes for one model (vLLM's names): worker ranks spawned by the engine, gloo on CPU, NCCL on CUDA
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # a bad JSON is a plain error here, before any model loads
            from paceline.spec_config import SpeculativeConfig
            SpeculativeConfig.parse(self.speculative_config)
        if self.quantization not in ("auto", "none", "int4"):
            raise ValueError(f"quantization must be auto, none or int4, got {self.quantization!r}")
        if self.wide_linears not in ("auto", "fp32", "int8"):
            raise ValueError(f"wide_linears must be auto, fp32 or int8, got {self.wide_linears!r}")
        if self.dtype == "auto" and self.quantization == "int4":
            self.dtype = "bfloat16"
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization == "auto" and self.dtype not in ("auto", "bfloat16"):
            self.quantization = "none"  # a dtype asked for by name: int4 computes in bfloat16 only
        if self.quantization == "int4" and self.dtype != "bfloat16":
            raise ValueError(f"int4 quantization computes in bfloat16; use dtype bfloat16 (or auto), not {self.dtype}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("tensor and pipeline parallelism together are not supported yet: set one of them to 1")
        if self.tbt_goal_ms < 0:
            raise ValueError(f"tbt_goal_ms must be >= 0, got {self.tbt_goal_ms}")
        s = self.scheduler
        if not s.max_step_ms_given and s.policy == "stall-free" and self.tbt_goal_ms > 0:
            # a target derived from the goal is the scheduler's to apply: the full one, or the short one for chunks
            # not worth it; one named by --max-step-ms bounds every chunk alike, as it always did
            s.max_step_ms = step_target_ms(self.tbt_goal_ms)
            if not s.short_step_ms_given:
                s.short_step_ms = s.max_step_ms * SHORT_STEP_FRACTION
            if not s.calm_step_ms_given:
                s.calm_step_ms = s.max_step_ms * CALM_STEP_FRACTION
            if not s.lone_prefill_tokens_given and not s.auto_max_num_batched_tokens:
                s.lone_prefill_tokens = max(LONE_PREFILL_TOKENS, s.max_num_batched_tokens)
