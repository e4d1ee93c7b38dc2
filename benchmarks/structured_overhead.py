"""Decode-step time of the bundled model at batch B with every request under a JSON-schema constraint, against the
same batch unconstrained (one process, interleaved rounds). The difference is the grammar's cost per step (mask fill
for the batch + applying it in the sampler). Also prints what the step-time model charges for it: the start-up
profile's per-masked-row term (model/structured.py mask_time_per_row) times the batch, timed in the same process.

    flock -x /tmp/paceline-cpu.lock .venv/bin/python benchmarks/structured_overhead.py --batch 32
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "entrypoints"))
from json_schemas import SCHEMAS  # noqa: E402

from paceline import LLM, SamplingParams  # noqa: E402
from paceline.model.structured import GrammarCompiler, mask_time_per_row  # noqa: E402
from paceline.sampling import StructuredOutputs  # noqa: E402


def decode_steps(llm: LLM, params: list[SamplingParams], steps: int) -> list[float]:
    """Durations of the first `steps` steps that decode the whole batch (the requests are aborted after them)."""
    engine = llm.engine
    ids = [f"r{i}-{id(p)}" for i, p in enumerate(params)]
    for rid, p in zip(ids, params):
        engine.add_request(rid, "Give me a JSON record:", p)
    times: list[float] = []
    while engine.has_unfinished() and len(times) < steps:
        engine.step()
        s = engine.last_step
        if s is not None and s.num_prefill_tokens == 0 and s.num_decode_tokens == len(params):
            times.append(s.duration)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="each request's budget (default --tokens: the whole run is within the budget closer's "
                             "reach, the worst case; a larger one shows the mask alone)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    budget = args.max_tokens or args.tokens
    llm = LLM(kv_cache_memory_gb=0.5)
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.arch.vocab_size)
    names = list(SCHEMAS)

    def params(constrained: bool) -> list[SamplingParams]:
        out = []
        for i in range(args.batch):
            so = None
            if constrained:
                so = StructuredOutputs(json=json.dumps(SCHEMAS[names[i % len(names)]][0]))
                so.compiled = compiler.compile(so)
            out.append(SamplingParams(temperature=1.0, seed=i, max_tokens=budget, ignore_eos=True, structured=so))
        return out

    free, con, per_row = [], [], []
    for _ in range(args.rounds):
        free += decode_steps(llm, params(False), args.tokens)
        con += decode_steps(llm, params(True), args.tokens)
        per_row.append(mask_time_per_row(llm.engine.tokenizer, llm.engine.arch.vocab_size, rows=args.batch))
    f, c, m = statistics.median(free), statistics.median(con), statistics.median(per_row)
    print(f"batch {args.batch}: decode step median unconstrained {1e3 * f:.2f} ms ({len(free)} steps), "
          f"JSON-schema constrained {1e3 * c:.2f} ms ({len(con)} steps): overhead {100 * (c - f) / f:+.1f} %")
    print(f"step-time model's mask term: {1e3 * m:.3f} ms per masked row x {args.batch} = {1e3 * m * args.batch:.2f} ms "
          f"predicted extra, measured {1e3 * (c - f):.2f} ms")


if __name__ == "__main__":
    main()
