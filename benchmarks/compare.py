"""Side-by-side benchmark: paceline's schedulers, llama.cpp's llama-server and `transformers serve`.

    python benchmarks/compare.py --workload chat
    python benchmarks/compare.py --workload long-prompt --systems paceline-stall-free,paceline-prefill-first --no-capacity --rates 0.2,0.4

Same as `paceline bench compare ...`; see `--help` for the knobs (probe sizes, budgets, SLOs).

Each system is started on 127.0.0.1 on a free port, warmed up with one request, measured, and stopped; a system
that cannot run here is listed as "skipped: <reason>". The strict/relaxed SLOs are 5x/25x the median decode-only
step at batch 16, measured once on the first system and then fixed. Each run gets fresh prompts (prefix caches
must not make later probes cheaper). Run it on a quiet machine: every number is CPU time shared with whatever
else runs. llama-server comes from benchmarks/build_llama_server.sh (cached in ~/.cache/paceline/peers/).
Results: bench-results/<workload>-<time>/results.{md,json}, *.png, logs/<system>.log.
"""
import argparse
import sys

from paceline.bench.compare import add_compare_args

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/compare.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_compare_args(parser)
    args = parser.parse_args()
    sys.exit(args.func(args))
