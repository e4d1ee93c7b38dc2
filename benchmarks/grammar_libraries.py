"""Side-by-side cost of token masks from grammar libraries, on this machine, with the bundled model's vocabulary.

For each of the ten schemas in tests/entrypoints/json_schemas.py: compile the schema, then walk the token path of a
valid instance with a batch of B matchers in lockstep (the decode steps of B constrained requests), timing each
step's mask fill for the whole batch plus the token accepts. Prints per library: compile time, mean batch-step
mask time, and per token.

    flock -x /tmp/paceline-cpu.lock .venv/bin/python benchmarks/grammar_libraries.py --batch 32

Only ratios between libraries from one run mean anything (shared host, drifts ~2x day to day).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "entrypoints"))
from json_schemas import SCHEMAS  # noqa: E402

from paceline.model.loader import load_checkpoint  # noqa: E402


def run_xgrammar(tok, vocab: int, schema: dict, path: list[int], batch: int) -> tuple[float, list[float]]:
    import xgrammar as xgr

    info = run_xgrammar.info  # type: ignore[attr-defined]
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    batcher = xgr.BatchGrammarMatcher(max_threads="auto")
    steps = []
    for t in path:
        t0 = time.perf_counter()
        batcher.batch_fill_next_token_bitmask(matchers, bitmask)
        ok = batcher.batch_accept_token(matchers, [t] * batch)
        steps.append(time.perf_counter() - t0)
        assert all(ok), "xgrammar rejected a token of a valid instance"
    return compile_s, steps


def run_llguidance(tok, vocab: int, schema: dict, path: list[int], batch: int) -> tuple[float, list[float]]:
    import llguidance as llg
    import llguidance.torch as lt

    lltok = run_llguidance.tokenizer  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    matchers = [llg.LLMatcher(lltok, grammar) for _ in range(batch)]
    compile_s = time.perf_counter() - t0
    bitmask = lt.allocate_token_bitmask(batch, vocab)
    executor = run_llguidance.executor  # type: ignore[attr-defined]
    steps = []
    for t in path:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        for m in matchers:
            m.consume_token(t)
        steps.append(time.perf_counter() - t0)
        assert not any(m.is_error() for m in matchers), matchers[0].get_error()
    return compile_s, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--libraries", nargs="+", default=["xgrammar", "llguidance"])
    args = parser.parse_args()
    tok = load_checkpoint(None, "float32").tokenizer
    vocab = tok.vocab_size
    if "xgrammar" in args.libraries:
        import xgrammar as xgr
        special = set(tok.all_special_ids)
        encoded = ["" if i in special else tok.backend.id_to_token(i) for i in range(vocab)]
        run_xgrammar.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,  # type: ignore
                                              stop_token_ids=[tok.eos_token_id])
    if "llguidance" in args.libraries:
        import llguidance as llg
        run_llguidance.tokenizer = llg.LLTokenizer(tok.backend.to_str(), n_vocab=vocab,  # type: ignore
                                                   eos_token=tok.eos_token_id)
        run_llguidance.executor = llg.LLExecutor()  # type: ignore
    runners = {"xgrammar": run_xgrammar, "llguidance": run_llguidance}
    print(f"batch {args.batch}, vocabulary {vocab}, torch threads {torch.get_num_threads()}")
    for lib in args.libraries:
        compiles, steps = [], []
        for schema, instance in SCHEMAS.values():
            path = tok.encode(json.dumps(instance), add_special_tokens=False)
            path.append(tok.eos_token_id)
            c, s = runners[lib](tok, vocab, schema, path, args.batch)
            compiles.append(c)
            steps.extend(s[1:])  # the first fill of a fresh matcher is its own (cold) cost
        print(f"{lib:11s} compile median {1e3 * statistics.median(compiles):7.2f} ms   "
              f"batch-{args.batch} step mean {1e3 * statistics.mean(steps):6.3f} ms  "
              f"p90 {1e3 * sorted(steps)[int(0.9 * len(steps))]:6.3f} ms  "
              f"per token {1e6 * statistics.mean(steps) / args.batch:6.1f} us  ({len(steps)} steps)")


if __name__ == "__main__":
    main()
