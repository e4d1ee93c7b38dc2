"""One stream: decode tok/s without speculation, with n-gram speculation at a fixed k and with adaptive k, and (in
float32) with the model's own int4 copy as a draft model; on a prompt whose answer repeats its input and on one
the model answers freely. One process, runs interleaved (A, B, C, ... A, B, C) so the ratios hold on a drifting
machine; acceptance from the engines' counters.

    python benchmarks/spec_speed.py --modes float32,default --k 4 --tokens 96 --repeats 3
    python benchmarks/spec_speed.py --modes default-torch-int4,default   # torch's int4 op vs paceline's
    python benchmarks/spec_speed.py --modes default,default-onednn-logits --k 4,7   # few-row logits op vs oneDNN's

"quote workload" is the `quote` benchmark workload's own prompt shape (paceline/bench/prompts.py: a 300-token corpus
passage, a blank line, its first 16 tokens again), four prompts (seed 1, requests 0-3), their tokens and times summed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from paceline.bench.prompts import PromptSource, build_prompts
from paceline.bench.workload import RequestSpec
from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.engine import Engine
from paceline.sampling import SamplingParams
from paceline.spec_config import SpeculativeConfig

CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}  # step {i}\n" for i in range(12))
# a small model follows "the same code, copied:" where it ignores an instruction to copy
PROMPTS: dict[str, str | list] = {
    "copies its prompt": f"{CODE}\n# the same code, copied:\n{CODE.splitlines()[0]}\n",
    "quote workload": [],  # filled in main() with the engine's tokenizer
    "free answer": "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n"}
QUOTE_PROMPTS, QUOTE_TOKENS = 4, 300


def engine(mode: str, spec: SpeculativeConfig | None) -> Engine:
    """mode: float32, default (int4), default-torch-int4 (int4 through torch's op instead of paceline's C++ one) or
    default-onednn-logits (the LM head of few rows through oneDNN's bf16 matmul instead of paceline's op).
    The start-up profile's cache key does not see these switches: the first engine of a setup takes it for all."""
    dtype = "float32" if mode == "float32" else "auto"
    # one stream: no step target to plan for (adaptive k still prices proposals with the start-up profile)
    config = EngineConfig(dtype=dtype, cache=CacheConfig(kv_cache_memory_gb=0.2), scheduler=SchedulerConfig(max_step_ms=0))
    switch = {"default-torch-int4": "PACELINE_INT4_KERNEL", "default-onednn-logits": "PACELINE_LOGITS_KERNEL"}.get(mode)
    if switch:
        os.environ[switch] = "0"  # read when the model is built
    try:
        return Engine(config, speculative_config=spec)
    finally:
        if switch:
            os.environ.pop(switch, None)


def decode_rate(eng: Engine, prompts: list, tokens: int, rid: str) -> float:
    """Decode tokens per second over the prompts, one after the other (tokens and decode times summed)."""
    n, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        req = eng.add_request(f"{rid}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        eng.step()  # the prefill (and first token) is not decode
        start, first = time.perf_counter(), len(req.output_token_ids)
        while eng.has_unfinished():
            eng.step()
        n, seconds = n + len(req.output_token_ids) - first, seconds + time.perf_counter() - start
    return n / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="float32,default")
    p.add_argument("--k", default="4", help="num_speculative_tokens; a list (4,7) runs each")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lookup-max", type=int, default=3, help="n-gram prompt_lookup_max")
    p.add_argument("--prompts", default=",".join(PROMPTS), help="prompts whose names this string contains")
    p.add_argument("--configs", default=None, help="configurations to run besides plain: those whose names this string contains (default: all)")
    p.add_argument("--wide-above", type=int, default=None,
                   help="experiment: run steps of more rows than this in float32 (the model's wide_above; "
                        "default mode's is 8, so a verification of k <= 7 proposals runs in bfloat16/int4)")
    args = p.parse_args()
    ks, n = [int(k) for k in args.k.split(",")], args.lookup_max
    print("| mode | prompt | configuration | decode tok/s | vs plain | acceptance | mean accepted / verify |")
    print("|---|---|---|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        configs: dict[str, SpeculativeConfig | None] = {"plain": None}
        for k in ks:
            configs[f"n-gram, fixed k={k}"] = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=n,
                                                                adaptive=False)
            configs[f"n-gram, adaptive k<={k}"] = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=n)
        k = ks[0]
        if mode == "float32":
            configs[f"int4 draft, fixed k={k}"] = SpeculativeConfig("draft_model", num_speculative_tokens=k,
                                                                    quantization="int4", adaptive=False)
            configs[f"int4 draft, adaptive k<={k}"] = SpeculativeConfig("draft_model", num_speculative_tokens=k,
                                                                        quantization="int4")
        if args.configs:
            configs = {name: c for name, c in configs.items() if name == "plain" or name in args.configs}
        engines = {name: engine(mode, spec) for name, spec in configs.items()}
        if args.wide_above is not None:
            for e in engines.values():
                if e.runner.model.wide_above is not None:
                    e.runner.model.wide_above = args.wide_above
        if not PROMPTS["quote workload"]:
            source = PromptSource(next(iter(engines.values())).tokenizer)
            specs = [RequestSpec(i, 0.0, QUOTE_TOKENS, args.tokens) for i in range(QUOTE_PROMPTS)]
            PROMPTS["quote workload"] = build_prompts(source, specs, seed=1, as_text=False, style="quote")
        for label, prompt in PROMPTS.items():
            if label not in args.prompts:
                continue
            prompts = prompt if label == "quote workload" else [prompt]
            rates: dict[str, list[float]] = {name: [] for name in engines}
            before = {name: e.stats() for name, e in engines.items()}
            for i in range(args.repeats):
                for name, e in engines.items():
                    rates[name].append(decode_rate(e, prompts, args.tokens, f"{label}{i}"))
            plain = statistics.median(rates["plain"])
            for name, e in engines.items():
                st, b = e.stats(), before[name]
                drafts = st.spec_decode_num_draft_tokens - b.spec_decode_num_draft_tokens
                acc = st.spec_decode_num_accepted_tokens - b.spec_decode_num_accepted_tokens
                verifies = st.spec_decode_num_drafts - b.spec_decode_num_drafts
                r = statistics.median(rates[name])
                print(f"| {mode} | {label} | {name} | {r:.1f} | {r / plain:.2f}x | "
                      f"{f'{acc / drafts:.0%}' if drafts else '-'} | {f'{acc / verifies:.2f}' if verifies else '-'} |",
                      flush=True)


if __name__ == "__main__":
    main()
