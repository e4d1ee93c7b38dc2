"""JSON-schema outputs on the bundled model: validity of N sampled completions (temperature 1) over the ten schemas
in tests/entrypoints/json_schemas.py, and the throughput cost of the constraint against the same requests
unconstrained (one process, run back to back).

    flock -x /tmp/paceline-cpu.lock .venv/bin/python benchmarks/structured.py --requests 200 --max-tokens 256
    ... --no-budget-close   # the same without closing before max_tokens

Counts a completion valid when json.loads parses it and it validates against its schema (jsonschema_rs); reports
how many ended by the model's EOS (finish_reason stop) and how many were closed by the budget (finish_reason length:
the sampler forced the grammar's shortest way to finish as max_tokens came near). Only ratios from one run mean
anything (shared host, drifts ~2x day to day).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema_rs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "entrypoints"))
from json_schemas import SCHEMAS  # noqa: E402

from paceline import LLM, SamplingParams  # noqa: E402
from paceline.model.structured import GrammarCompiler  # noqa: E402
from paceline.sampling import StructuredOutputs  # noqa: E402


def prompts_for(tok, n: int) -> tuple[list[list[int]], list[str]]:
    names = list(SCHEMAS)
    prompts, which = [], []
    for i in range(n):
        name = names[i % len(names)]
        msg = f"Give me a JSON {name.replace('_', ' ')} record matching this schema: {json.dumps(SCHEMAS[name][0])}"
        text = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
        which.append(name)
    return prompts, which


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--no-budget-close", action="store_true",
                        help="never force the grammar to close before max_tokens (the behaviour before it existed)")
    args = parser.parse_args()
    if args.no_budget_close:
        import paceline.model.structured as structured
        structured.CLOSE_WINDOW = structured.CLOSE_SLACK = -10**6  # closing_plan then never searches
    llm = LLM(kv_cache_memory_gb=1.0)
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.arch.vocab_size)
    prompts, names = prompts_for(llm.tokenizer, args.requests)

    def params(constrained: bool) -> list[SamplingParams]:
        out = []
        for i, name in enumerate(names):
            so = None
            if constrained:
                so = StructuredOutputs(json=json.dumps(SCHEMAS[name][0]))
                so.compiled = compiler.compile(so)
            out.append(SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.max_tokens, structured=so))
        return out

    for constrained in (False, True):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params(constrained))
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        valid, reasons, bad = 0, {}, []
        for name, o in zip(names, outs):
            c = o.outputs[0]
            reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
            try:
                jsonschema_rs.validate(SCHEMAS[name][0], json.loads(c.text))
                valid += 1
            except (ValueError, jsonschema_rs.ValidationError) as e:
                bad.append(f"  {name} ({c.finish_reason}, {len(c.token_ids)} tokens): {str(e)[:80]} | {c.text[-60:]!r}")
        label = "json_schema " if constrained else "unconstrained"
        print(f"{label}: {valid}/{len(outs)} valid, finish {reasons}, {tokens} output tokens in {wall:.1f} s = "
              f"{tokens / wall:.1f} tok/s, {wall / tokens * 1e3:.2f} ms per output token", flush=True)
        if constrained:
            print("\n".join(bad[:20]))


if __name__ == "__main__":
    main()
