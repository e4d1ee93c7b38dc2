"""One stream on a prompt whose answer repeats its input: decode tok/s with and without n-gram speculation, in one
process, interleaved (A, B, A, B, ...) so the ratio holds on a drifting machine. Also the acceptance rate.

    python benchmarks/spec_speed.py --modes float32,default --k 4 --tokens 96 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.engine import Engine
from paceline.sampling import SamplingParams
from paceline.spec_config import SpeculativeConfig

CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}  # step {i}\n" for i in range(12))
# a small model follows "the same code, copied:" where it ignores an instruction to copy
PROMPT = f"{CODE}\n# the same code, copied:\n{CODE.splitlines()[0]}\n"


def engine(mode: str, spec: SpeculativeConfig | None) -> Engine:
    dtype = "float32" if mode == "float32" else "auto"
    config = EngineConfig(dtype=dtype, cache=CacheConfig(kv_cache_memory_gb=0.1),
                          scheduler=SchedulerConfig(max_step_ms=0))  # one stream: no step target to plan for
    return Engine(config, speculative_config=spec)


def decode_rate(eng: Engine, tokens: int, rid: str) -> tuple[float, int]:
    req = eng.add_request(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    eng.step()  # the prefill (and first token) is not decode
    start, first = time.perf_counter(), len(req.output_token_ids)
    while eng.has_unfinished():
        eng.step()
    return (len(req.output_token_ids) - first) / (time.perf_counter() - start), len(req.output_token_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="float32,default")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=3, prompt_lookup_min=1)
    print("| mode | plain decode tok/s | n-gram k=%d tok/s | speed-up | acceptance |" % args.k)
    print("|---|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        plain, specd = engine(mode, None), engine(mode, spec)
        a, b = [], []
        for i in range(args.repeats):
            a.append(decode_rate(plain, args.tokens, f"p{i}")[0])
            b.append(decode_rate(specd, args.tokens, f"s{i}")[0])
        st = specd.stats()
        acc = st.spec_decode_num_accepted_tokens / max(st.spec_decode_num_draft_tokens, 1)
        ra, rb = statistics.median(a), statistics.median(b)
        print(f"| {mode} | {ra:.1f} | {rb:.1f} | {rb / ra:.2f}x | {acc:.0%} |")


if __name__ == "__main__":
    main()
